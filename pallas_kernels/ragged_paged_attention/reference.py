"""Ragged paged attention's definition: the reference every kernel is tested against.

Dimension letters: T packed query tokens, B sequences (decode), S kv positions
of one sequence, N query heads, K kv heads, G = N // K query heads per kv head,
H head dim, P pages, L page size.

Semantics follow JAX's ``pallas/ops/tpu/ragged_paged_attention`` reference
(``ref_ragged_paged_attention``): the new tokens' K/V are written into the
pages *before* attention, ``kv_lens`` counts them, and query token ``j`` of
sequence ``i`` sits at absolute position ``kv_lens[i] - q_len_i + j`` and sees
kv positions ``<=`` its own (causal). Softmax and accumulation are in f32.

Options (Gemma 2/3 need both): ``sliding_window=W`` lets a query at position
``i`` see only kv positions ``j`` with ``i - W < j <= i`` (HF/Mistral
convention: W tokens including itself); ``soft_cap=c`` replaces each score
``s`` (after ``sm_scale``) by ``c * tanh(s / c)`` before the softmax.

``ref_ragged_paged_attention`` is the plain, slow definition (one dense
masked softmax per query token over its sequence's gathered pages). The
kernels: ``kernel_xla`` (XLA:CPU, the engine's CPU path), ``kernel_gpu`` and
``kernel_tpu`` (Pallas), behind ``kernel.ragged_paged_attention``.

Quantized pages (``quant``): int8 or float8_e4m3fn pages come with
``k_scales_PLK`` / ``v_scales_PLK`` f32[P, L, K], and attention sees
``pages * scales`` in f32 (every lowering dequantizes the block it reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.quant import dequantize, is_quantized

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _window_mask(q_pos, kv_pos, sliding_window):
    """True where kv position ``kv_pos`` is visible from query position ``q_pos``."""
    visible = kv_pos <= q_pos
    if sliding_window is not None:
        visible &= kv_pos > q_pos - sliding_window
    return visible


def _cap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def ref_ragged_paged_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                               cu_q_lens_S1, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None, k_scales_PLK=None,
                               v_scales_PLK=None):
    """The definition kernels are tested against: each query token gets one
    dense masked softmax over its sequence's gathered pages (O(T * S) memory).

    Args:
      q_TNH: [T, N, H] packed queries of all sequences.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache, this step's
        K/V already written.
      kv_lens_S: i32[max_seqs] context length per sequence, new tokens included.
      page_indices_SP: i32[max_seqs, pages_per_seq].
      cu_q_lens_S1: i32[max_seqs + 1] prefix sums of query lengths (0 allowed).
      num_seqs: i32[1] (or scalar) sequences in use.
      sm_scale, sliding_window, soft_cap: see the module docstring.
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages, or None.

    Returns:
      [T, N, H] in q's dtype; rows owned by no sequence are 0.
    """
    T, N, H = q_TNH.shape
    _, L, K, _ = k_pages_PLKH.shape
    G = N // K
    n = jnp.reshape(num_seqs, ())
    t = jnp.arange(T)
    seq_T = jnp.searchsorted(cu_q_lens_S1, t, side="right") - 1
    owned_T = (t < cu_q_lens_S1[n]) & (seq_T < n)
    seq_T = jnp.clip(seq_T, 0, page_indices_SP.shape[0] - 1)
    q_len_T = cu_q_lens_S1[seq_T + 1] - cu_q_lens_S1[seq_T]
    kv_len_T = kv_lens_S[seq_T]
    q_pos_T = kv_len_T - q_len_T + (t - cu_q_lens_S1[seq_T])
    ids_TP = page_indices_SP[seq_T]
    gather = lambda pages, scales: dequantize(  # noqa: E731
        pages[ids_TP], None if scales is None else scales[ids_TP]).reshape(T, -1, K, H)
    k_TSKH = gather(k_pages_PLKH, k_scales_PLK)
    v_TSKH = gather(v_pages_PLKH, v_scales_PLK)
    S = k_TSKH.shape[1]
    kv_pos = jnp.arange(S)[None, :]
    mask_TS = _window_mask(q_pos_T[:, None], kv_pos, sliding_window) \
        & (kv_pos < kv_len_T[:, None]) & owned_T[:, None]
    q_TKGH = q_TNH.reshape(T, K, G, H).astype(jnp.float32)
    s_TKGS = _cap(jnp.einsum("tkgh,tskh->tkgs", q_TKGH, k_TSKH) * sm_scale, soft_cap)
    s_TKGS = jnp.where(mask_TS[:, None, None, :], s_TKGS, -jnp.inf)
    p_TKGS = jax.nn.softmax(s_TKGS, axis=-1)
    p_TKGS = jnp.where(mask_TS[:, None, None, :], p_TKGS, 0.0)
    o_TKGH = jnp.einsum("tkgs,tskh->tkgh", p_TKGS, jnp.where(
        mask_TS[:, :, None, None], v_TSKH, 0.0))
    o_TKGH = jnp.where(owned_T[:, None, None, None], o_TKGH, 0.0)
    return o_TKGH.reshape(T, N, H).astype(q_TNH.dtype)


def validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, *, sliding_window=None, soft_cap=None,
                    k_scales_PLK=None, v_scales_PLK=None) -> None:
    """Check shapes and dtypes of a ragged paged attention call (static checks
    only: values live on device).

    Raises:
      ValueError: naming the offending argument and its shape or value.
    """
    def bad(msg):
        raise ValueError(f"ragged_paged_attention: {msg}")

    if q_TNH.ndim != 3:
        bad(f"q must be [T, N, H], got shape {q_TNH.shape}")
    if k_pages_PLKH.ndim != 4 or k_pages_PLKH.shape != v_pages_PLKH.shape:
        bad(f"k_pages and v_pages must both be [P, L, K, H], got {k_pages_PLKH.shape} "
            f"and {v_pages_PLKH.shape}")
    T, N, H = q_TNH.shape
    P, L, K, Hk = k_pages_PLKH.shape
    if Hk != H:
        bad(f"head_dim of q ({H}) != head_dim of the pages ({Hk})")
    if N % K:
        bad(f"query heads {N} must be a multiple of kv heads {K}")
    if kv_lens_S.ndim != 1 or page_indices_SP.ndim != 2 \
            or page_indices_SP.shape[0] != kv_lens_S.shape[0]:
        bad(f"kv_lens must be [max_seqs] and page_indices [max_seqs, pages_per_seq], got "
            f"{kv_lens_S.shape} and {page_indices_SP.shape}")
    if cu_q_lens_S1.shape != (kv_lens_S.shape[0] + 1,):
        bad(f"cu_q_lens must be [max_seqs + 1] = [{kv_lens_S.shape[0] + 1}], "
            f"got {cu_q_lens_S1.shape}")
    if jnp.size(num_seqs) != 1:
        bad(f"num_seqs must hold one value, got shape {jnp.shape(num_seqs)}")
    for name, a in (("kv_lens", kv_lens_S), ("page_indices", page_indices_SP),
                    ("cu_q_lens", cu_q_lens_S1), ("num_seqs", num_seqs)):
        if not jnp.issubdtype(jnp.asarray(a).dtype, jnp.integer):
            bad(f"{name} must be int32, got {jnp.asarray(a).dtype}")
    if isinstance(sliding_window, jax.Array) and sliding_window.ndim == 0 \
            and jnp.issubdtype(sliding_window.dtype, jnp.integer):
        pass  # a traced window (a scanned layer's): checked where it is built
    elif sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        bad(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        bad(f"soft_cap must be None or > 0, got {soft_cap!r}")
    quantized = is_quantized(k_pages_PLKH.dtype)
    for name, pages, scales in (("k", k_pages_PLKH, k_scales_PLK),
                                ("v", v_pages_PLKH, v_scales_PLK)):
        if is_quantized(pages.dtype) != quantized:
            bad(f"k_pages ({k_pages_PLKH.dtype}) and v_pages ({v_pages_PLKH.dtype}) must both "
                f"be quantized or neither")
        if quantized and scales is None:
            bad(f"{name}_pages of dtype {pages.dtype} need {name}_scales f32[P, L, K]")
        if not quantized and scales is not None:
            bad(f"{name}_scales given for unquantized {name}_pages of dtype {pages.dtype}")
        if scales is not None and (scales.shape != pages.shape[:3]
                                   or scales.dtype != jnp.float32):
            bad(f"{name}_scales must be f32{list(pages.shape[:3])} (P, L, K of the pages), got "
                f"{scales.dtype}{list(scales.shape)}")
