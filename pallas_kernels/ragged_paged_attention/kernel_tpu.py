"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Modeled on JAX's ``jax/experimental/pallas/ops/tpu/ragged_paged_attention/
kernel.py`` (the q-block grid, the K/V pages left in HBM and copied page by
page into a double buffer, online softmax with lane-replicated statistics)
and on tpu-inference's ``kernels/ragged_paged_attention/v4/schedule.py`` (a
work schedule computed outside the kernel, fully masked kv blocks skipped).
Semantics are those of ``reference.ref_ragged_paged_attention``.

Dimension letters: T packed query tokens, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim, P pages, L page size.

Design
------
Grid ``(K // kb, cdiv(T, bq))``: kv-head block ``hb`` (kb kv heads, their
kb * G query heads) by q block ``b`` (bq consecutive packed query rows). The q
block and the output block come through ordinary BlockSpecs, so Pallas
pipelines them. A q block may hold rows of several sequences (many decodes)
or part of one (a long prefill), so inside a grid step the kernel walks a
list of *items* ``(sequence, kv block)``:

* The wrapper computes, with jnp, the sequences that own at least one row
  (``num_seqs`` and q_len > 0) in order (``seq_ids``) and, per q block, the
  range ``[blk_lo[b], blk_hi[b])`` of that list whose rows meet the block.
* For one such sequence the kernel needs the kv blocks (bkv = bp * L
  positions, bp pages) from the one holding the lowest visible position
  (0, or ``pos - W + 1`` with a sliding window) to the one holding the highest
  query position; blocks wholly in the future or out of the window are never
  fetched.

Double buffering: K and V scratch ``[2, bp, L, kb, H]``; item n computes on
slot n % 2 while item n + 1 is fetched into the other slot. The chain runs
across grid steps too: the last item of a step starts the copy of the next
step's first item, and the slot it used is carried in an SMEM scratch word,
which is why both grid axes are "arbitrary" (sequential). Each page is one
``make_async_copy`` of ``[L, kb, H]`` from HBM; K and V of a slot signal the
same DMA semaphore and are waited on one copy at a time. Pages of a kv block
past the sequence's last page copy its first page instead (as JAX does), so
no page-table entry beyond ``cdiv(kv_len, L)`` is ever read; positions
``>= kv_len`` are masked, and their V rows zeroed, so NaN there cannot leak.

Quantized pages (int8 / float8_e4m3fn, ``quant``): the f32[P, L, K] scales
stay in HBM too; each page copy brings its ``[L, kb]`` scales into a
double buffer ``[2, bp, L, kb]`` on the same semaphore, and ``attend``
dequantizes each kv head's ``[bkv, H]`` block in f32 before the dots (cast
to q's dtype). Tested in the TPU interpreter only; on a chip the narrow
``[L, kb]`` scale tiles are a layout Mosaic may pad or refuse.

Online softmax: per kv head, statistics m, l ``[bq * G, 128]`` f32 (value
repeated over 128 lanes, as JAX does for Mosaic) and an f32 accumulator
``[bq * G, H]``; query row r of the block is token ``r // G``, head
``r % G``. Updates are written only to the rows of the current sequence, so
the rows of each sequence in a block start from the state set when the grid
step begins. Rows owned by no sequence keep ``l == 0`` and come out 0.

Interpret mode: ``interpret=True`` (or a ``pltpu.InterpretParams``) runs the
kernel in JAX's TPU interpreter on CPU, which simulates scalar prefetch, the
DMAs and semaphores (it does not support ``Ref.reshape``, so K/V are sliced
per head as values). Block on its result before dispatching other JAX work:
the interpreter's callbacks run jnp ops and can deadlock against concurrent
dispatch from the main thread (seen with jax 0.10.2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.reference import validate_inputs

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128  # statistics are kept lane-replicated, like JAX's kernel


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,       # i32[max_seqs]
    page_indices_ref,  # i32[max_seqs, pages_per_seq]
    cu_q_lens_ref,     # i32[max_seqs + 1]
    seq_ids_ref,       # i32[max_seqs] sequences owning rows, in order, then padding
    blk_lo_ref,        # i32[num_q_blks] first index into seq_ids meeting q block b
    blk_hi_ref,        # i32[num_q_blks] one past the last
    # Inputs.
    q_ref,             # [bq, kb * G, H] VMEM block of q
    k_hbm_ref,         # [P, L, K, H] left in HBM
    v_hbm_ref,         # [P, L, K, H] left in HBM
    ks_hbm_ref,        # f32[P, L, K] K scales in HBM (int8/fp8 pages), or None
    vs_hbm_ref,        # f32[P, L, K] V scales in HBM, or None
    # Output.
    o_ref,             # [bq, kb * G, H] VMEM block of the output
    # Scratch.
    k_buf,             # [2, bp, L, kb, H] double buffer of K pages
    v_buf,             # [2, bp, L, kb, H] double buffer of V pages
    ks_buf,            # f32[2, bp, L, kb] double buffer of K scales, or None
    vs_buf,            # f32[2, bp, L, kb] double buffer of V scales, or None
    sems,              # DMA semaphores [2], one per buffer slot
    m_ref,             # f32[kb, bq * G, 128] running max
    l_ref,             # f32[kb, bq * G, 128] running sum of exp
    acc_ref,           # f32[kb, bq * G, H] running unnormalized output
    slot_ref,          # i32[1] SMEM: slot holding this grid step's first item
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    hb, b = pl.program_id(0), pl.program_id(1)
    num_hb, num_qb = pl.num_programs(0), pl.num_programs(1)
    bq = q_ref.shape[0]
    _, bp, L, kb, H = k_buf.shape
    G = q_ref.shape[1] // kb
    R = bq * G            # rows of one kv head's q block: (token, head in group)
    bkv = bp * L          # kv positions per kv block
    max_seqs, pages_per_seq = page_indices_ref.shape
    f32 = q_ref.dtype == jnp.float32
    precision = lax.Precision.HIGHEST if f32 else lax.Precision.DEFAULT

    def seq_info(a):
        """(seq id, q_start, q_end, kv_len) of entry a of seq_ids."""
        i = seq_ids_ref[jnp.minimum(a, max_seqs - 1)]
        return i, cu_q_lens_ref[i], cu_q_lens_ref[i + 1], kv_lens_ref[i]

    def kv_blocks(a, blk):
        """[lo, hi) kv blocks sequence a needs for its rows in q block blk."""
        _, q_start, q_end, kv_len = seq_info(a)
        row_lo = jnp.maximum(q_start, blk * bq)
        row_hi = jnp.minimum(q_end, (blk + 1) * bq)
        first_kv = 0
        if sliding_window is not None:  # query at position p sees (p - W, p]
            first_kv = jnp.maximum(kv_len - q_end + row_lo - sliding_window + 1, 0)
        last_pos = kv_len - q_end + row_hi - 1
        lo = first_kv // bkv
        return lo, jnp.maximum(last_pos // bkv + 1, lo + 1)  # >= 1 item, even on bad input

    def copies(head_blk, a, j, slot):
        """The 2 * bp page copies of item (a, j) into buffer slot ``slot``."""
        i, _, _, kv_len = seq_info(a)
        num_pages = jnp.minimum(pl.cdiv(kv_len, L), pages_per_seq)
        heads = pl.ds(head_blk * kb, kb)
        out = []
        for p in range(bp):
            page = j * bp + p
            page = jnp.where(page < num_pages, page, 0)  # past the end: re-read page 0
            page_id = page_indices_ref[i, page]
            for hbm, buf in ((k_hbm_ref, k_buf), (v_hbm_ref, v_buf)):
                out.append(pltpu.make_async_copy(
                    hbm.at[page_id, :, heads, :], buf.at[slot, p], sems.at[slot]))
            if ks_buf is not None:
                for hbm, buf in ((ks_hbm_ref, ks_buf), (vs_hbm_ref, vs_buf)):
                    out.append(pltpu.make_async_copy(
                        hbm.at[page_id, :, heads], buf.at[slot, p], sems.at[slot]))
        return out

    def first_item(blk):
        a = blk_lo_ref[blk]
        return a, kv_blocks(a, blk)[0]

    def has_items(blk):
        blk = jnp.minimum(blk, num_qb - 1)
        return blk_lo_ref[blk] < blk_hi_ref[blk]

    @pl.when((hb == 0) & (b == 0) & has_items(0))
    def _prefetch_very_first_item():
        slot_ref[0] = 0
        for c in copies(0, *first_item(0), 0):
            c.start()

    a_lo, a_hi = blk_lo_ref[b], blk_hi_ref[b]

    def attend(a, j, slot):
        """Fold kv block j of sequence a (in ``slot``) into the rows it owns."""
        _, q_start, q_end, kv_len = seq_info(a)
        token = b * bq + lax.broadcasted_iota(jnp.int32, (R, bkv), 0) // G
        q_pos = kv_len - q_end + token                      # absolute query position
        kv_pos = j * bkv + lax.broadcasted_iota(jnp.int32, (R, bkv), 1)
        mask = (kv_pos <= q_pos) & (kv_pos < kv_len)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        own = (token >= q_start) & (token < q_end)           # rows of this sequence
        own_R1 = own[:, :1]
        kv_valid = (j * bkv + lax.broadcasted_iota(jnp.int32, (bkv, H), 0)) < kv_len
        for h in range(kb):
            q = q_ref[:, h * G:(h + 1) * G, :].reshape(R, H)
            k = k_buf[slot, :, :, h, :].reshape(bkv, H)
            v = v_buf[slot, :, :, h, :].reshape(bkv, H)
            if ks_buf is not None:  # dequantize in f32, dots in q's dtype
                k = (k.astype(jnp.float32) * ks_buf[slot, :, :, h].reshape(bkv, 1)).astype(q.dtype)
                v = (v.astype(jnp.float32) * vs_buf[slot, :, :, h].reshape(bkv, 1)).astype(q.dtype)
            v = jnp.where(kv_valid, v, jnp.zeros_like(v))    # NaN past kv_len would poison p @ v
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, _MASK_VALUE)
            m_prev, l_prev = m_ref[h], l_ref[h]                # [R, 128]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)   # [R, bkv]
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            acc_next = alpha[:, :1] * acc_ref[h] + pv
            m_ref[h] = jnp.where(own_R1, m_next, m_prev)
            l_ref[h] = jnp.where(own_R1, l_next, l_prev)
            acc_ref[h] = jnp.where(own_R1, acc_next, acc_ref[h])

    @pl.when(a_lo < a_hi)
    def _run_block():
        m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        # The first item of the next grid step with any work: (hb, b + 1) or (hb + 1, 0).
        same_hb = (b + 1 < num_qb) & has_items(b + 1)
        step_hb = jnp.where(same_hb, hb, hb + 1)
        step_b = jnp.where(same_hb, b + 1, 0)
        step_a, step_j = first_item(jnp.minimum(step_b, num_qb - 1))
        step_exists = step_hb < num_hb

        def seq_body(a, slot):
            j_lo, j_hi = kv_blocks(a, b)
            next_seq_j = kv_blocks(a + 1, b)[0]

            def kv_body(j, slot):
                # Item after (a, j): (a, j + 1), (a + 1, first block) or the next step's first.
                more_kv = j + 1 < j_hi
                more_seq = a + 1 < a_hi
                in_step = more_kv | more_seq
                next_hb = jnp.where(in_step, hb, step_hb)
                next_a = jnp.where(more_kv, a, jnp.where(more_seq, a + 1, step_a))
                next_j = jnp.where(more_kv, j + 1, jnp.where(more_seq, next_seq_j, step_j))

                @pl.when(in_step | step_exists)
                def _prefetch_next():
                    for c in copies(next_hb, next_a, next_j, 1 - slot):
                        c.start()

                for c in copies(hb, a, j, slot):
                    c.wait()
                attend(a, j, slot)
                return 1 - slot

            return lax.fori_loop(j_lo, j_hi, kv_body, slot)

        slot_ref[0] = lax.fori_loop(a_lo, a_hi, seq_body, slot_ref[0])
        for h in range(kb):
            l = l_ref[h][:, :1]
            o = acc_ref[h] / jnp.where(l == 0.0, 1.0, l)
            o_ref[:, h * G:(h + 1) * G, :] = o.reshape(bq, G, H).astype(o_ref.dtype)

    @pl.when(a_lo >= a_hi)
    def _empty_block():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _schedule(cu_q_lens_S1, num_seqs, num_q_blks: int, bq: int):
    """Which sequences meet which q block (see the module docstring).

    Returns:
      seq_ids: i32[max_seqs] ids of the sequences owning rows (i < num_seqs,
        q_len > 0) in order, the others after them.
      blk_lo, blk_hi: i32[num_q_blks] the range of seq_ids whose rows meet
        rows [b * bq, (b + 1) * bq).
    """
    max_seqs = cu_q_lens_S1.shape[0] - 1
    starts_S, ends_S = cu_q_lens_S1[:-1], cu_q_lens_S1[1:]
    active_S = (jnp.arange(max_seqs) < jnp.reshape(num_seqs, ())) & (ends_S > starts_S)
    seq_ids = jnp.argsort(~active_S, stable=True).astype(jnp.int32)
    listed_S = jnp.arange(max_seqs) < jnp.sum(active_S)
    row0_B = jnp.arange(num_q_blks)[:, None] * bq
    blk_lo = jnp.sum(listed_S & (ends_S[seq_ids] <= row0_B), axis=1)
    blk_hi = jnp.sum(listed_S & (starts_S[seq_ids] < row0_B + bq), axis=1)
    return seq_ids, blk_lo.astype(jnp.int32), blk_hi.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "num_queries_per_block",
    "num_kv_pages_per_block", "num_kv_heads_per_block", "vmem_limit_bytes"))
def ragged_paged_attention_tpu(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                               cu_q_lens_S1, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None,
                               interpret: bool | pltpu.InterpretParams = False,
                               num_queries_per_block: int = 32,
                               num_kv_pages_per_block: int | None = None,
                               num_kv_heads_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None,
                               k_scales_PLK=None, v_scales_PLK=None):
    """Causal GQA attention of a packed ragged batch over a paged KV cache.

    Args:
      q_TNH: [T, N, H] f32 or bf16 queries of all sequences, packed in order.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache, this step's
        K/V already written.
      kv_lens_S: i32[max_seqs] context length per sequence, new tokens included.
      page_indices_SP: i32[max_seqs, pages_per_seq] page ids of each sequence.
      cu_q_lens_S1: i32[max_seqs + 1] prefix sums of query lengths (0 allowed).
      num_seqs: i32[1] (or scalar) sequences in use.
      sm_scale: softmax scale, usually H ** -0.5.
      sliding_window, soft_cap: as in ``reference`` (window of W positions
        including the query's own; scores become ``c * tanh(s / c)``).
      interpret: run in JAX's TPU interpreter (True or ``pltpu.InterpretParams``).
      num_queries_per_block: bq, packed query rows per grid step (capped at T).
      num_kv_pages_per_block: bp, pages per kv block; default ``256 // L``
        capped at pages_per_seq.
      num_kv_heads_per_block: kb, kv heads per grid step; default K. On TPU
        kb == K or kb * G a multiple of 8 keeps the blocks tile-aligned.
      vmem_limit_bytes: passed to Mosaic.
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages
        (``quant``), or None.

    Returns:
      o_TNH: [T, N, H] in q's dtype; rows owned by no sequence are 0.
    """
    validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    T, N, H = q_TNH.shape
    _, L, K, _ = k_pages_PLKH.shape
    quantized = k_scales_PLK is not None
    pages_per_seq = page_indices_SP.shape[1]
    G = N // K
    bq = min(num_queries_per_block, T)
    bp = min(num_kv_pages_per_block or max(1, 256 // L), pages_per_seq)
    kb = num_kv_heads_per_block or K
    if bq < 1 or bp < 1 or K % kb:
        raise ValueError(
            f"ragged_paged_attention_tpu: need num_queries_per_block >= 1, "
            f"num_kv_pages_per_block >= 1 and num_kv_heads_per_block dividing K={K}; got "
            f"{num_queries_per_block}, {num_kv_pages_per_block}, {num_kv_heads_per_block}")
    if q_TNH.dtype not in (jnp.float32, jnp.bfloat16) or not quantized and (
            k_pages_PLKH.dtype != q_TNH.dtype or v_pages_PLKH.dtype != q_TNH.dtype):
        raise ValueError(f"ragged_paged_attention_tpu: q, k_pages and v_pages must all be f32 "
                         f"or all bf16 (or the pages int8/fp8 with scales), got {q_TNH.dtype}, "
                         f"{k_pages_PLKH.dtype}, {v_pages_PLKH.dtype}")
    if interpret is True:
        interpret = pltpu.InterpretParams()
    num_q_blks = pl.cdiv(T, bq)
    seq_ids, blk_lo, blk_hi = _schedule(cu_q_lens_S1.astype(jnp.int32), num_seqs, num_q_blks, bq)

    qo_spec = pl.BlockSpec((bq, kb * G, H), lambda hb, b, *_: (b, hb, 0))
    kv_buf = pltpu.VMEM((2, bp, L, kb, H), k_pages_PLKH.dtype)
    scale_buf = pltpu.VMEM((2, bp, L, kb), jnp.float32) if quantized else None
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    stats = pltpu.VMEM((kb, bq * G, _LANES), jnp.float32)
    scalars = (kv_lens_S.astype(jnp.int32), page_indices_SP.astype(jnp.int32),
               cu_q_lens_S1.astype(jnp.int32), seq_ids, blk_lo, blk_hi)
    kernel = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(K // kb, num_q_blks),
            in_specs=[qo_spec, hbm, hbm] + [hbm if quantized else None] * 2,
            out_specs=qo_spec,
            scratch_shapes=[kv_buf, kv_buf, scale_buf, scale_buf,
                            pltpu.SemaphoreType.DMA((2,)), stats, stats,
                            pltpu.VMEM((kb, bq * G, H), jnp.float32),
                            pltpu.SMEM((1,), jnp.int32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),  # DMA chain crosses steps
            vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct(q_TNH.shape, q_TNH.dtype),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )
    return kernel(*scalars, q_TNH, k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK)
