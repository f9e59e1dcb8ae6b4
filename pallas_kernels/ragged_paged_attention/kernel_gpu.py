"""Ragged paged attention on GPU: Pallas lowered through Triton.

Dimension letters: T packed query tokens, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim, P pages, L page size,
R = block_q * G' rows of one program (G' = G rounded up to a power of 2).

Modelled on JAX's own Triton-lowered kernels in
``jax/experimental/pallas/ops/gpu/``: ``paged_attention.py`` (gathering pages
with ``k_pages_ref[block_tables]``, ``plgpu.CompilerParams``),
``attention.py`` (the flash-attention loop, causal masking, masked
``plgpu.store``) and ``decode_attention.py`` (a ``fori_loop`` with a dynamic
trip count over kv blocks).

Design. The wrapper (plain jnp, static shapes, jit-friendly) cuts each
sequence's query rows into blocks of ``block_q`` tokens and lists them in
``block_seq`` / ``block_q_start`` (static length ``min(T, cdiv(T, block_q) +
max_seqs)``, which bounds the count; unused entries hold sequence -1 and exit
at once). The grid is ``(num_blocks, K)``: one program takes ``block_q``
tokens times all G query heads of one kv head, ``R = block_q * G'`` rows for
the dots, and walks its sequence's kv range in blocks of ``block_kv``
positions, skipping kv blocks wholly outside the causal/sliding-window range.
Each kv block gathers its K and V rows one position at a time (page id from
``page_indices``, offset inside the page), so any page size works and a block
may span several pages or part of one. Online softmax with f32 statistics,
dot operands in the input dtype with f32 accumulation.

Triton constraints respected: every loaded, stored and computed array has
power-of-2 dims (``block_q``, ``block_kv``, G' and H' = H rounded up to a
power of 2; padded heads and head-dim columns are clamped on load and masked
on store); dots are at least 16 x 16 x 16 (``R >= 16``, ``block_kv >= 16``,
H' >= 16); shapes are static (dynamic only the loop trip count and the
``pl.when`` early exit); no scalar prefetch (the schedule is read from
ordinary i32 refs). Rows of one block that belong to the next sequence are
masked out of the store, so programs never write the same element; the
output is padded by ``block_q`` rows (and to G', H') so that masked rows
have in-bounds addresses, and the wrapper slices it back.

Quantized pages (int8 / float8_e4m3fn, ``quant``): the f32[P, L, K]
scales are loaded beside each gathered K/V row and the block is
dequantized in f32, then cast to q's dtype for the dots, inside the kernel;
the cache is never dequantized in HBM. ``None`` scale refs (unquantized
pages) leave the kernel as it was.

Interpreter (``interpret=True``) notes: ``plgpu.store`` with a mask only
discharges when every index is a slice or every index is an array, so the
store indexes the head dim with an explicit iota; plain ``ref[...]`` loads
take mixed indices. Unique store addresses matter there too (a masked
scatter with duplicate indices may keep the masked copy). The interpreter
runs programs one after another in grid order, which would hide a block
writing rows it does not own; the tests also run the schedule reversed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.reference import validate_inputs

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rpa_kernel(
    # inputs
    block_seq_ref,      # i32[num_blocks] sequence of each q block; -1: unused
    block_q_start_ref,  # i32[num_blocks] first packed q row of each block
    cu_q_lens_ref,      # i32[max_seqs + 1]
    kv_lens_ref,        # i32[max_seqs]
    page_indices_ref,   # i32[max_seqs, pages_per_seq]
    q_ref,              # [T, K, G, H]
    k_pages_ref,        # [P, L, K, H]
    v_pages_ref,        # [P, L, K, H]
    k_scales_ref,       # f32[P, L, K] (int8/fp8 pages) or None
    v_scales_ref,       # f32[P, L, K] (int8/fp8 pages) or None
    # outputs
    o_ref,              # [T + block_q, K, G', H']
    *, sm_scale: float, sliding_window: int | None, soft_cap: float | None,
    block_q: int, block_kv: int, precision,
):
    T, _, G, H = q_ref.shape
    P, L, _, _ = k_pages_ref.shape
    pages_per_seq = page_indices_ref.shape[1]
    _, _, g_pad, h_pad = o_ref.shape
    R = block_q * g_pad
    b, kh = pl.program_id(0), pl.program_id(1)
    seq = block_seq_ref[b]

    # Head-dim columns: a plain slice when H is a power of 2 (contiguous loads),
    # else a clamped index of width H' whose extra columns are zeroed in q.
    h_H = jnp.arange(h_pad, dtype=jnp.int32)
    if h_pad == H:
        h_idx, col = slice(None), (lambda x: x)
    else:
        h_idx, col = jnp.minimum(h_H, H - 1)[None, :], (lambda x: x[:, None])

    @pl.when(seq >= 0)
    def _():
        q_start = block_q_start_ref[b]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        r_R = jnp.arange(R, dtype=jnp.int32)
        tok_R = q_start + r_R // g_pad        # row r = (token, head in group)
        g_R = r_R % g_pad
        row_ok_R = (tok_R < q_end) & (tok_R < T) & (g_R < G)
        q_pos_R = kv_len - q_end + tok_R     # kv_len - q_len + (index in sequence)

        q_RH = q_ref[col(jnp.minimum(tok_R, T - 1)), kh, col(jnp.minimum(g_R, G - 1)), h_idx]
        if h_pad != H:
            q_RH = jnp.where(h_H[None, :] < H, q_RH, 0).astype(q_RH.dtype)

        # kv range seen by the block's rows: [first row's window start, last row's position].
        last_tok = jnp.minimum(q_start + block_q, q_end) - 1
        kv_hi = kv_len - q_end + last_tok + 1
        kv_lo = 0 if sliding_window is None else jnp.maximum(
            0, kv_len - q_end + q_start - sliding_window + 1)
        kb_lo = kv_lo // block_kv
        num_kb = jnp.maximum(pl.cdiv(kv_hi, block_kv) - kb_lo, 0)

        def body(i, carry):
            o_RH, m_R, l_R = carry
            kv_pos_B = (kb_lo + i) * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            kv_ok_B = kv_pos_B < kv_len
            slot_B = jnp.minimum(kv_pos_B // L, pages_per_seq - 1)
            # Table entries past kv_len may be garbage: clip them to a real page.
            page_B = jnp.clip(page_indices_ref[seq, slot_B], 0, P - 1)
            off_B = kv_pos_B % L
            k_BH = k_pages_ref[col(page_B), col(off_B), kh, h_idx]
            v_BH = v_pages_ref[col(page_B), col(off_B), kh, h_idx]
            if k_scales_ref is not None:  # dequantize in f32, dots in q's dtype
                k_BH = (k_BH.astype(jnp.float32) * k_scales_ref[page_B, off_B, kh][:, None]
                        ).astype(q_RH.dtype)
                v_BH = (v_BH.astype(jnp.float32) * v_scales_ref[page_B, off_B, kh][:, None]
                        ).astype(q_RH.dtype)
            # Positions past kv_len may hold anything (NaN included): p is 0 there,
            # but 0 * NaN is NaN, so zero them in v.
            v_BH = jnp.where(kv_ok_B[:, None], v_BH, 0).astype(v_BH.dtype)

            s_RB = pl.dot(q_RH, k_BH, trans_b=True, precision=precision) * sm_scale
            if soft_cap is not None:
                s_RB = soft_cap * jnp.tanh(s_RB / soft_cap)
            mask_RB = (row_ok_R[:, None] & kv_ok_B[None, :]
                       & (kv_pos_B[None, :] <= q_pos_R[:, None]))
            if sliding_window is not None:
                mask_RB &= kv_pos_B[None, :] > q_pos_R[:, None] - sliding_window
            s_RB = jnp.where(mask_RB, s_RB, _MASK_VALUE)

            m_next_R = jnp.maximum(m_R, s_RB.max(axis=1))
            alpha_R = jnp.exp(m_R - m_next_R)
            p_RB = jnp.where(mask_RB, jnp.exp(s_RB - m_next_R[:, None]), 0.0)
            l_next_R = alpha_R * l_R + p_RB.sum(axis=1)
            pv_RH = pl.dot(p_RB.astype(v_BH.dtype), v_BH, precision=precision)
            return alpha_R[:, None] * o_RH + pv_RH, m_next_R, l_next_R

        o_RH = jnp.zeros((R, h_pad), jnp.float32)
        m_R = jnp.full((R,), jnp.finfo(jnp.float32).min, jnp.float32)
        l_R = jnp.zeros((R,), jnp.float32)
        o_RH, m_R, l_R = lax.fori_loop(0, num_kb, body, (o_RH, m_R, l_R))

        # Every owned row sees its own position, so l > 0 where it is stored.
        o_RH = o_RH / jnp.where(l_R > 0, l_R, 1.0)[:, None]
        plgpu.store(o_ref.at[tok_R[:, None], kh, g_R[:, None], h_H[None, :]],
                    o_RH.astype(o_ref.dtype), mask=row_ok_R[:, None])


def _num_blocks(T: int, block_q: int, max_seqs: int) -> int:
    """Static bound on the q blocks of any batch: sum_i cdiv(q_len_i, block_q)
    <= T / block_q + (sequences with q_len > 0), and each block holds >= 1 row."""
    return max(1, min(T, pl.cdiv(T, block_q) + max_seqs))


def _schedule(cu_q_lens_S1, num_seqs, *, block_q: int, num_blocks: int):
    """Cut each sequence's query rows into blocks of ``block_q`` tokens.

    Returns:
      block_seq: i32[num_blocks] sequence of each block, -1 past the last one.
      block_q_start: i32[num_blocks] first packed query row of each block.
    """
    max_seqs = cu_q_lens_S1.shape[0] - 1
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    q_lens_S = jnp.where(jnp.arange(max_seqs) < n, cu_q_lens_S1[1:] - cu_q_lens_S1[:-1], 0)
    nb_S = (jnp.maximum(q_lens_S, 0) + block_q - 1) // block_q
    cum_S = jnp.cumsum(nb_S)                                   # inclusive
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq_B = jnp.minimum(jnp.searchsorted(cum_S, b, side="right"), max_seqs - 1)
    start_B = cu_q_lens_S1[seq_B] + (b - (cum_S[seq_B] - nb_S[seq_B])) * block_q
    block_seq = jnp.where(b < cum_S[-1], seq_B, -1).astype(jnp.int32)
    return block_seq, start_B.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_kv",
    "num_warps", "num_stages"))
def ragged_paged_attention_gpu(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                               cu_q_lens_S1, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: bool = False,
                               block_q: int | None = None, block_kv: int = 64,
                               num_warps: int | None = None, num_stages: int = 2,
                               k_scales_PLK=None, v_scales_PLK=None):
    """Causal ragged paged attention (Pallas, Triton lowering).

    Args:
      q_TNH: [T, N, H] f32 or bf16 query tokens of all sequences, packed.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache in q's dtype
        (or int8 / float8_e4m3fn with scales), this step's K/V already written.
      kv_lens_S: i32[max_seqs] context length per sequence, new tokens included.
      page_indices_SP: i32[max_seqs, pages_per_seq] page ids of each sequence.
      cu_q_lens_S1: i32[max_seqs + 1] prefix sums of the query lengths (0 allowed).
      num_seqs: i32[1] sequences in use.
      sm_scale: softmax scale (usually H ** -0.5).
      sliding_window: None, or W: a query at position i sees kv positions (i - W, i].
      soft_cap: None, or c: scores become c * tanh(s / c).
      interpret: run in the Pallas interpreter (CPU tests).
      block_q: query tokens per program (power of 2, block_q * G' >= 16);
        default 64 // G' rows' worth of tokens, at least 1.
      block_kv: kv positions per inner iteration (power of 2, >= 16).
      num_warps, num_stages: Triton launch parameters (default warps: 4 if
        H <= 64 else 8, as in JAX's ``attention.py``).
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages, or None.

    Returns:
      [T, N, H] in q's dtype; rows owned by no sequence are 0.

    Raises:
      ValueError: bad shapes or dtypes (``validate_inputs``), q and unquantized
        pages of different dtypes, or bad block sizes.
    """
    validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    T, N, H = q_TNH.shape
    K = k_pages_PLKH.shape[2]
    g_pad = _next_pow2(N // K)
    if k_scales_PLK is None and (q_TNH.dtype != k_pages_PLKH.dtype
                                 or q_TNH.dtype != v_pages_PLKH.dtype):
        raise ValueError(f"ragged_paged_attention_gpu: q ({q_TNH.dtype}) and the pages "
                         f"({k_pages_PLKH.dtype}, {v_pages_PLKH.dtype}) must share a dtype")
    if block_q is None:
        block_q = max(1, 64 // g_pad)
    if block_q < 1 or block_q & (block_q - 1) or block_q * g_pad < 16:
        raise ValueError(f"ragged_paged_attention_gpu: block_q={block_q} must be a power of 2 "
                         f"with block_q * {g_pad} (query heads per kv head, rounded up to a "
                         f"power of 2) >= 16")
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"ragged_paged_attention_gpu: block_kv={block_kv} must be a power "
                         f"of 2 >= 16")
    if num_warps is None:
        num_warps = 4 if H <= 64 else 8
    if T == 0:
        return q_TNH

    cu_q_lens_S1 = jnp.asarray(cu_q_lens_S1).astype(jnp.int32)
    block_seq, block_q_start = _schedule(
        cu_q_lens_S1, num_seqs, block_q=block_q,
        num_blocks=_num_blocks(T, block_q, kv_lens_S.shape[0]))
    return _run(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1,
                num_seqs, block_seq, block_q_start, k_scales_PLK, v_scales_PLK, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, block_q=block_q,
                block_kv=block_kv, num_warps=num_warps, num_stages=num_stages,
                interpret=interpret)


def _run(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1, num_seqs,
         block_seq, block_q_start, k_scales_PLK=None, v_scales_PLK=None, *, sm_scale, sliding_window, soft_cap, block_q, block_kv,
         num_warps, num_stages, interpret):
    """The pallas_call over a given schedule (any order of its blocks), and the
    slicing of its padded output back to [T, N, H]."""
    T, N, H = q_TNH.shape
    _, _, K, _ = k_pages_PLKH.shape
    G = N // K
    g_pad, h_pad = _next_pow2(G), max(16, _next_pow2(H))
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)
    # f32 dots in full precision (Triton's default would be tf32); bf16 unaffected.
    kernel = functools.partial(
        _rpa_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=block_q, block_kv=block_kv, precision=lax.Precision.HIGHEST)
    out = pl.pallas_call(
        kernel,
        grid=(block_seq.shape[0], K),
        out_shape=jax.ShapeDtypeStruct((T + block_q, K, g_pad, h_pad), q_TNH.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{block_q=}_{block_kv=}",
    )(i32(block_seq), i32(block_q_start), i32(cu_q_lens_S1), i32(kv_lens_S),
      i32(page_indices_SP), q_TNH.reshape(T, K, G, H), k_pages_PLKH, v_pages_PLKH,
      k_scales_PLK, v_scales_PLK)

    # The kernel writes only owned rows: the rest of its output is uninitialized.
    owned_T = jnp.arange(T) < i32(cu_q_lens_S1)[jnp.reshape(num_seqs, ()).astype(jnp.int32)]
    o_TNH = out[:T, :, :G, :H].reshape(T, N, H)
    return jnp.where(owned_T[:, None, None], o_TNH, 0).astype(q_TNH.dtype)
