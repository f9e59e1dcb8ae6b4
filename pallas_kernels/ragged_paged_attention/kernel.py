"""Ragged paged attention: the public entry point and the KV write beside it.

``ragged_paged_attention`` picks the Pallas lowering for the device:

* TPU: ``kernel_tpu`` (Mosaic; the schedule scalar-prefetched, the page
  table left in HBM and read a window at a time into SMEM, K/V pages copied
  HBM -> VMEM per kv head by double-buffered DMAs);
* GPU: ``kernel_gpu`` (Pallas on Triton; KV-length splits merged by
  log-sum-exp at small batch, decode blocks sized to the query group);
* CPU: no lowering; pass ``interpret=True`` (the GPU kernel under the Pallas
  interpreter) or ``interpret=pltpu.InterpretParams()`` (the TPU kernel under
  JAX's TPU interpreter, which simulates scalar prefetch, DMAs and semaphores).

Semantics are those of ``reference.ref_ragged_paged_attention`` (the tests
hold every lowering to it). Every query row owned by a sequence must see at
least one kv position (true whenever ``kv_len >= q_len >= 1``).

Tensor parallelism (``mesh``, ``kv_heads_axis``): the kernels are
independent per kv head (a kv head and its G query heads), so with the cache
split over kv heads on a mesh axis the call runs under ``jax.shard_map``
over that axis, each device attending its own K / tp kv heads and N / tp
query heads with its own shard of the pages (and scales); the metadata is
replicated. Without it XLA, seeing an opaque custom call, gathers the
sharded cache onto every device around the call (the pattern of
jax-llm-examples' and tpu-inference's attention wrappers, which keep
``shard_map`` at the kernel boundary and out of the model code).

A layer's cache is a ``quant.KVPages`` (pages, and f32 scales for int8 /
fp8 pages); ``write_kv`` quantizes a step's K/V as it writes them, and the
attention lowerings take the scales as ``k_scales_PLK`` / ``v_scales_PLK``.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from pallas_kernels.ragged_paged_attention.quant import KVPages, quantize
from pallas_kernels.ragged_paged_attention.reference import validate_inputs


def ragged_paged_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                           cu_q_lens_S1, num_seqs, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           interpret=False, k_scales_PLK=None, v_scales_PLK=None,
                           mesh=None, kv_heads_axis: str | None = None,
                           decode_only: bool = False):
    """Causal attention of a packed ragged batch over a paged KV cache.

    Args:
      q_TNH: [T, N, H] f32 or bf16 query tokens of all sequences, packed; a
        sequence may have 0, 1 (decode) or many (prefill chunk) new tokens.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache, this step's
        K/V already written (``write_kv``); N must be a multiple of K (GQA/MQA).
      kv_lens_S: i32[max_seqs] context length of each sequence, new tokens included.
      page_indices_SP: i32[max_seqs, pages_per_seq] page ids of each sequence.
      cu_q_lens_S1: i32[max_seqs + 1] prefix sums of the query lengths.
      num_seqs: i32[1] sequences in use.
      sm_scale: softmax scale (usually H ** -0.5).
      sliding_window: None, or W: a query at position i sees kv positions (i - W, i].
      soft_cap: None, or c: scores become c * tanh(s / c) (Gemma 2).
      interpret: False (compile for the device), True (GPU kernel in the Pallas
        interpreter) or a ``pltpu.InterpretParams`` (TPU kernel, TPU interpreter).
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages, or None.
      mesh: None, or the (concrete or abstract) mesh the caller's arrays are
        sharded on; with ``kv_heads_axis`` the call runs per device under
        ``jax.shard_map`` (module docstring).
      kv_heads_axis: the mesh axis splitting the kv heads (dim 2 of the pages
        and scales) and with them the query heads (dim 1 of q), or None.
      decode_only: every sequence has q_len <= 1 (the engine's decode step);
        the GPU kernel then runs its decode pass only (TPU: ignored).

    Returns:
      [T, N, H] in q's dtype; softmax statistics in f32. Rows owned by no sequence are 0.
      Under ``shard_map`` the result is split over the query heads on
      ``kv_heads_axis``.

    Raises:
      ValueError: inconsistent shapes or dtypes, no Pallas lowering for this
        backend (CPU without ``interpret``), ``kv_heads_axis`` not on the
        mesh, or its size not dividing both N and K.
    """
    validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    args = (q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1,
            num_seqs)
    if mesh is not None and kv_heads_axis is not None:
        return _shard_over_kv_heads(args, kw, interpret, mesh, kv_heads_axis, decode_only)
    return _call_kernel(args, kw, interpret, decode_only)


def _call_kernel(args, kw, interpret, decode_only=False):
    """The Pallas lowering for the backend (or the interpreter asked for)."""
    use_tpu = interpret is not False and interpret is not True  # InterpretParams
    if interpret is False:
        backend = jax.default_backend()
        if backend not in ("gpu", "tpu"):
            raise ValueError(f"ragged_paged_attention: no Pallas lowering for backend "
                             f"{backend!r}; pass interpret=True or use the XLA path")
        use_tpu = backend == "tpu"
    if use_tpu:
        from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu(*args, interpret=interpret, **kw)
    from pallas_kernels.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
    return ragged_paged_attention_gpu(*args, interpret=bool(interpret), decode_only=decode_only,
                                      **kw)


def _shard_over_kv_heads(args, kw, interpret, mesh, axis: str, decode_only=False):
    """``_call_kernel`` under ``jax.shard_map`` over mesh axis ``axis``: q
    split on N, pages on K, scales on K, metadata replicated; out split on N."""
    if axis not in dict(mesh.shape):
        raise ValueError(f"ragged_paged_attention: kv_heads_axis {axis!r} is not an axis of "
                         f"the mesh {dict(mesh.shape)}")
    tp = dict(mesh.shape)[axis]
    if tp == 1:
        return _call_kernel(args, kw, interpret, decode_only)
    N, K = args[0].shape[1], args[1].shape[2]
    if N % tp or K % tp:
        raise ValueError(f"ragged_paged_attention: mesh axis {axis!r} of size {tp} must divide "
                         f"both query heads N={N} and kv heads K={K} to split the kernel")
    P, rep = PartitionSpec, PartitionSpec()
    scales = {k: kw.pop(k) for k in ("k_scales_PLK", "v_scales_PLK")}
    scales = {k: v for k, v in scales.items() if v is not None}

    def local(args, scales):
        return _call_kernel(args, {**kw, **scales}, interpret, decode_only)

    pages_spec = P(None, None, axis, None)
    in_specs = ((P(None, axis, None), pages_spec, pages_spec, rep, rep, rep, rep),
                {k: P(None, None, axis) for k in scales})
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(None, axis, None),
                         check_vma=False)(args, scales)


def write_kv(k_cache: KVPages, v_cache: KVPages, k_TKH, v_TKH, slot_pages_T, slot_offsets_T):
    """Write a step's new K and V into their pages, in place when the caches
    are donated (XLA turns the scatter into an in-place update). Quantized
    caches (scales present) get each token's K/V quantized per kv head
    (``quant.quantize``) and its scales written beside it.

    Args:
      k_cache, v_cache: one layer's ``KVPages``: [P, L, K, H] pages, and
        f32[P, L, K] scales for int8/fp8 pages.
      k_TKH, v_TKH: [T, K, H] this step's keys and values (cast to, or
        quantized to, the cache dtype).
      slot_pages_T: i32[T] page of each token; P (out of range) for padding,
        whose writes are dropped.
      slot_offsets_T: i32[T] offset of each token inside its page.

    Returns:
      (k_cache, v_cache) updated.
    """
    def put(cache: KVPages, x_TKH) -> KVPages:
        if cache.scales_PLK is None:
            return KVPages(cache.pages_PLKH.at[slot_pages_T, slot_offsets_T].set(
                x_TKH.astype(cache.dtype), mode="drop"))
        q_TKH, scales_TK = quantize(x_TKH, cache.dtype)
        return KVPages(
            cache.pages_PLKH.at[slot_pages_T, slot_offsets_T].set(q_TKH, mode="drop"),
            cache.scales_PLK.at[slot_pages_T, slot_offsets_T].set(scales_TK, mode="drop"))

    return put(k_cache, k_TKH), put(v_cache, v_TKH)
