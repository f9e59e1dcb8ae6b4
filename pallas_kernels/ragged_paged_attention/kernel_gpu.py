"""Ragged paged attention on GPU: Pallas lowered through Triton.

Dimension letters: T packed query tokens, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim, P pages, L page size,
R = block_q * G' rows of one program (G' = G rounded up to a power of 2),
Z kv splits.

Modelled on JAX's own Triton-lowered kernels in
``jax/experimental/pallas/ops/gpu/``: ``paged_attention.py`` (gathering pages
with ``k_pages_ref[block_tables]``, ``plgpu.CompilerParams``),
``attention.py`` (the flash-attention loop, causal masking, masked
``plgpu.store``) and ``decode_attention.py`` (flash-decoding: a grid axis
over kv splits, each program writing its partial ``(o, l, m)``, merged
afterwards with the log-sum-exp rule; a ``fori_loop`` with a dynamic trip
count over kv blocks).

Design. The wrapper (plain jnp, static shapes, jit-friendly) cuts each
sequence's query rows into blocks and lists them in ``block_seq`` /
``block_q_start`` (``_schedule``; unused entries hold sequence -1 and exit at
once). The grid is ``(num_blocks, K, Z)``: one program takes ``block_q``
tokens times all G query heads of one kv head, ``R = block_q * G'`` rows for
the dots, and walks its share (split ``z`` of Z) of its sequence's kv range
in blocks of ``block_kv`` positions, skipping kv blocks wholly outside the
causal/sliding-window range. Each kv block gathers its K and V rows one
position at a time (page id from ``page_indices``, offset inside the page),
so any page size works and a block may span several pages or part of one.
Online softmax with f32 statistics, dot operands in the input dtype with f32
accumulation.

Two passes, so that a decode does not pay for a prefill's block (finding:
64-row blocks with G real rows waste 16x of the MMA at G = 4):

* decode pass: sequences with ``q_len <= block_q_decode = max(1, 16 // G')``
  (decodes, short verify chunks), one block each, ``R = max(16, G')`` rows
  (16 is the smallest MMA Triton emits), so a decode of G = 4, 8 or 16
  query heads fills 1/4, 1/2 or all of its rows instead of 1/16, 1/8, 1/4;
* prefill pass: longer sequences, ``block_q`` tokens per block (default 64
  rows' worth) so a kv block is read once per 64 query rows.

Each pass picks its number of kv splits Z statically (``kernel_gpu_plan.choose_kv_splits``):
the static block count times K is the most programs the pass can have
live; Z = cdiv(``_TARGET_PROGRAMS``, blocks * K), at most
``_MAX_KV_SPLITS`` (16, JAX ``decode_attention``'s ``k_splits``) and at
most one split per ``_MIN_KV_PER_SPLIT`` positions of the longest context
(``pages_per_seq * L``). A decode batch of 1 at K = 8 gets 16 splits (128
programs instead of 8); a pass whose blocks fill the GPU, or short contexts,
get Z = 1 and no merge. With Z > 1 each program's split is an even share of
that sequence's own kv blocks (``cdiv(num_kb, Z)``), so ragged lengths all
spread over every split; programs write unnormalized ``o`` and ``(m, l)`` in
f32 to ``[Z, T + block_q, K, G', ...]`` scratch outputs (empty splits write
``o = 0, l = 0, m = finfo.min``), and ``_merge`` combines them (jnp):
``m = max_z m_z``, ``o = sum_z exp(m_z - m) o_z / sum_z exp(m_z - m) l_z``.
The scratch holds at most about ``_TARGET_PROGRAMS * 2 * R * H' * 4`` bytes
(tens of MiB), since Z * blocks * K stays near ``_TARGET_PROGRAMS``.

Addressing (finding: 32-bit offsets). The Triton lowering
(``jax/_src/pallas/triton/lowering.py``, ``_compute_offsets_from_indices``)
computes a load's element offsets in i64 when the whole array is over 2^32
bytes, else in i32, and ``tt.addptr`` sign-extends i32 offsets. A bf16/f32
cache therefore always addresses correctly (over 2^31 elements it is over
2^32 bytes), and so does an int8/fp8 cache over 2^32 elements; only a
1-byte cache of 2^31 < P*L*K*H <= 2^32 elements would wrap to negative
offsets, and the wrapper refuses it with a ValueError naming the sizes
(``kernel_gpu_plan.check_addressing``). The engine passes the stacked cache of all layers
(``jaxserve.models.stack.layer_pages``), so this size is the whole cache's.
The kernel's own index arithmetic stays in i32 on values below 2^31 (page
ids, positions inside a sequence).

Triton constraints respected: every loaded, stored and computed array has
power-of-2 dims (``block_q``, ``block_kv``, G' and H' = H rounded up to a
power of 2; padded heads and head-dim columns are clamped on load and masked
on store); dots are at least 16 x 16 x 16 (``R >= 16``, ``block_kv >= 16``,
H' >= 16); shapes are static (dynamic only the loop trip count and the
``pl.when`` early exit); no scalar prefetch (the schedule is read from
ordinary i32 refs). Rows of one block that belong to the next sequence are
masked out of the store, so programs never write the same element; the
outputs are padded by ``block_q`` rows (and to G', H') so that masked rows
have in-bounds addresses, and the wrapper slices them back.

Quantized pages (int8 / float8_e4m3fn, ``quant``): the f32[P, L, K]
scales are loaded beside each gathered K/V row and the block is
dequantized in f32, then cast to q's dtype for the dots, inside the kernel;
the cache is never dequantized in HBM.

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

from pallas_kernels.ragged_paged_attention.kernel_gpu_plan import (  # noqa: F401
    _MIN_MMA_ROWS, _next_pow2, _num_blocks, _schedule, check_addressing,
    choose_kv_splits)
from pallas_kernels.ragged_paged_attention.reference import validate_inputs

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_F32_MIN = float(jnp.finfo(jnp.float32).min)


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
    # outputs: Z == 1: o [T + block_q, K, G', H'] in q's dtype, normalized;
    # Z > 1: o f32[Z, T + block_q, K, G', H'] unnormalized, m, l f32[Z, T + block_q, K, G']
    *out_refs,
    sm_scale: float, sliding_window: int | None, soft_cap: float | None,
    block_q: int, block_kv: int, num_splits: int, precision,
):
    T, _, G, H = q_ref.shape
    P, L, _, _ = k_pages_ref.shape
    pages_per_seq = page_indices_ref.shape[1]
    g_pad, h_pad = out_refs[0].shape[-2:]
    R = block_q * g_pad
    b, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
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
        if num_splits > 1:  # this program's even share of the kv blocks
            per_split = pl.cdiv(num_kb, num_splits)
            kb_first = kb_lo + split * per_split
            num_it = jnp.clip(num_kb - split * per_split, 0, per_split)
        else:
            kb_first, num_it = kb_lo, num_kb

        def body(i, carry):
            o_RH, m_R, l_R = carry
            kv_pos_B = (kb_first + i) * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
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
        m_R = jnp.full((R,), _F32_MIN, jnp.float32)
        l_R = jnp.zeros((R,), jnp.float32)
        o_RH, m_R, l_R = lax.fori_loop(0, num_it, body, (o_RH, m_R, l_R))

        if num_splits == 1:
            # Every owned row sees its own position, so l > 0 where it is stored.
            o_ref, = out_refs
            o_RH = o_RH / jnp.where(l_R > 0, l_R, 1.0)[:, None]
            plgpu.store(o_ref.at[tok_R[:, None], kh, g_R[:, None], h_H[None, :]],
                        o_RH.astype(o_ref.dtype), mask=row_ok_R[:, None])
        else:
            o_ref, m_ref, l_ref = out_refs
            plgpu.store(o_ref.at[split, tok_R[:, None], kh, g_R[:, None], h_H[None, :]],
                        o_RH, mask=row_ok_R[:, None])
            plgpu.store(m_ref.at[split, tok_R, kh, g_R], m_R, mask=row_ok_R)
            plgpu.store(l_ref.at[split, tok_R, kh, g_R], l_R, mask=row_ok_R)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_kv",
    "num_warps", "num_stages", "num_kv_splits", "decode_only"))
def ragged_paged_attention_gpu(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                               cu_q_lens_S1, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret: bool = False,
                               block_q: int | None = None, block_kv: int = 64,
                               num_warps: int | None = None, num_stages: int = 2,
                               k_scales_PLK=None, v_scales_PLK=None,
                               num_kv_splits: int | None = None, decode_only: bool = False):
    """Causal ragged paged attention (Pallas, Triton lowering; flash-decoding
    kv splits after JAX's ``pallas/ops/gpu/decode_attention.py``).

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
      block_q: query tokens per prefill-pass program (power of 2, block_q * G'
        >= 16); default 64 // G' tokens, at least 16 // G'. Sequences of at most
        ``max(1, 16 // G')`` tokens go to the decode pass (module docstring).
      block_kv: kv positions per inner iteration (power of 2, >= 16).
      num_warps, num_stages: Triton launch parameters (default warps: 4 if
        H <= 64 or the program has 16 rows, else 8, as in JAX's ``attention.py``).
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages, or None.
      num_kv_splits: kv splits Z of both passes; None: chosen per pass from
        the shapes (``kernel_gpu_plan.choose_kv_splits``).
      decode_only: the caller promises every sequence has q_len <= 1 (the
        engine's decode step, ``AttentionMetadata.decode_only``): only the
        decode pass runs (no empty prefill programs, scratch or merge).

    Returns:
      [T, N, H] in q's dtype; rows owned by no sequence are 0.

    Raises:
      ValueError: bad shapes or dtypes (``validate_inputs``), q and unquantized
        pages of different dtypes, bad block sizes or split count, or a cache
        the lowering cannot address (``kernel_gpu_plan.check_addressing``).
    """
    validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    T, N, H = q_TNH.shape
    _, L, K, _ = k_pages_PLKH.shape
    g_pad = _next_pow2(N // K)
    block_q_decode = max(1, _MIN_MMA_ROWS // g_pad)
    if k_scales_PLK is None and (q_TNH.dtype != k_pages_PLKH.dtype
                                 or q_TNH.dtype != v_pages_PLKH.dtype):
        raise ValueError(f"ragged_paged_attention_gpu: q ({q_TNH.dtype}) and the pages "
                         f"({k_pages_PLKH.dtype}, {v_pages_PLKH.dtype}) must share a dtype")
    if block_q is None:
        block_q = max(block_q_decode, 64 // g_pad)
    if block_q < 1 or block_q & (block_q - 1) or block_q * g_pad < _MIN_MMA_ROWS:
        raise ValueError(f"ragged_paged_attention_gpu: block_q={block_q} must be a power of 2 "
                         f"with block_q * {g_pad} (query heads per kv head, rounded up to a "
                         f"power of 2) >= 16")
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"ragged_paged_attention_gpu: block_kv={block_kv} must be a power "
                         f"of 2 >= 16")
    if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
        raise ValueError(f"ragged_paged_attention_gpu: num_kv_splits={num_kv_splits!r} must be "
                         f"None or an int >= 1")
    check_addressing(k_pages_PLKH)
    if T == 0:
        return q_TNH

    max_seqs = kv_lens_S.shape[0]
    max_kv_len = page_indices_SP.shape[1] * L
    cu_q_lens_S1 = jnp.asarray(cu_q_lens_S1).astype(jnp.int32)
    # (block_q, min_q_len, max_q_len, num_blocks) of each pass.
    if decode_only:
        passes = [(block_q_decode, 1, None, max(1, min(T, max_seqs)))]
    elif block_q == block_q_decode:
        passes = [(block_q, 1, None, _num_blocks(T, block_q, max_seqs))]
    else:
        passes = [(block_q_decode, 1, block_q_decode, max(1, min(T, max_seqs))),
                  (block_q, block_q_decode + 1, None,
                   _num_blocks(T, block_q, min(max_seqs, T // (block_q_decode + 1))))]
    args = (q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1,
            num_seqs)
    outs = []
    for bq, lo, hi, nb in passes:
        block_seq, block_q_start = _schedule(cu_q_lens_S1, num_seqs, block_q=bq, num_blocks=nb,
                                             min_q_len=lo, max_q_len=hi)
        warps = num_warps or (4 if H <= 64 or bq * g_pad <= _MIN_MMA_ROWS else 8)
        outs.append(_attend(
            *args, block_seq, block_q_start, k_scales_PLK, v_scales_PLK, sm_scale=sm_scale,
            sliding_window=sliding_window, soft_cap=soft_cap, block_q=bq, block_kv=block_kv,
            num_warps=warps, num_stages=num_stages, interpret=interpret,
            num_splits=num_kv_splits or choose_kv_splits(nb, K, max_kv_len)))
    o_TNH = outs[0]
    if len(outs) == 2:  # each pass wrote only its own sequences' rows
        t = jnp.arange(T)
        seq_T = jnp.clip(jnp.searchsorted(cu_q_lens_S1, t, side="right") - 1, 0, max_seqs - 1)
        decode_T = cu_q_lens_S1[seq_T + 1] - cu_q_lens_S1[seq_T] <= block_q_decode
        o_TNH = jnp.where(decode_T[:, None, None], outs[0], outs[1])
    return _owned_only(o_TNH, cu_q_lens_S1, num_seqs)


def _owned_only(o_TNH, cu_q_lens_S1, num_seqs):
    """Rows past cu_q_lens[num_seqs] set to 0 (the kernel leaves them uninitialized)."""
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    owned_T = jnp.arange(o_TNH.shape[0]) < jnp.asarray(cu_q_lens_S1).astype(jnp.int32)[n]
    return jnp.where(owned_T[:, None, None], o_TNH, 0).astype(o_TNH.dtype)


def _run(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1, num_seqs,
         block_seq, block_q_start, k_scales_PLK=None, v_scales_PLK=None, **kw):
    """One pass over a given schedule (any order of its blocks), unowned rows
    zeroed; ``kw`` as ``_attend``'s (``num_splits`` defaults to 1)."""
    o_TNH = _attend(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, block_seq, block_q_start, k_scales_PLK,
                    v_scales_PLK, **kw)
    return _owned_only(o_TNH, cu_q_lens_S1, num_seqs)


def _merge(o_ZRH, m_ZR, l_ZR):
    """Combine Z partial softmaxes (log-sum-exp rule, as JAX's
    ``decode_attention.py``): f32 unnormalized o [Z, ..., H'] and its max m
    and sum l [Z, ...] -> normalized o [..., H']."""
    m_R = m_ZR.max(axis=0)
    w_ZR = jnp.exp(m_ZR - m_R[None])
    l_R = (w_ZR * l_ZR).sum(axis=0)
    o_RH = (w_ZR[..., None] * o_ZRH).sum(axis=0)
    return o_RH / jnp.where(l_R > 0, l_R, 1.0)[..., None]


def _attend(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1,
            num_seqs, block_seq, block_q_start, k_scales_PLK=None, v_scales_PLK=None, *,
            sm_scale, sliding_window, soft_cap, block_q, block_kv, num_warps, num_stages,
            interpret, num_splits: int = 1):
    """The pallas_call of one pass, its merge when split, and the slicing of
    its padded output back to [T, N, H] (rows it does not own: garbage)."""
    del num_seqs
    T, N, H = q_TNH.shape
    _, _, K, _ = k_pages_PLKH.shape
    G = N // K
    g_pad, h_pad = _next_pow2(G), max(16, _next_pow2(H))
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    # f32 dots in full precision (Triton's default would be tf32); bf16 unaffected.
    kernel = functools.partial(
        _rpa_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=block_q, block_kv=block_kv, num_splits=num_splits,
        precision=lax.Precision.HIGHEST)
    rows = (T + block_q, K, g_pad)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((*rows, h_pad), q_TNH.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, *rows, h_pad), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, *rows), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, *rows), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(block_seq.shape[0], K, num_splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{block_q=}_{block_kv=}_{num_splits=}",
    )(i32(block_seq), i32(block_q_start), i32(cu_q_lens_S1), i32(kv_lens_S),
      i32(page_indices_SP), q_TNH.reshape(T, K, G, H), k_pages_PLKH, v_pages_PLKH,
      k_scales_PLK, v_scales_PLK)
    if num_splits > 1:
        out = _merge(*out)
    return out[:T, :, :G, :H].reshape(T, N, H).astype(q_TNH.dtype)


_KV_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def lower_for_cuda(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype,
                   page_size: int, *, sliding_window: int | None = None,
                   soft_cap: float | None = None, num_tokens: int = 64, max_seqs: int = 8,
                   max_context: int = 8192, q_dtype=jnp.bfloat16, **kernel_kw):
    """Lower ``ragged_paged_attention_gpu`` for CUDA (Triton) on any machine
    (no GPU needed: only abstract shapes; JAX assumes sm_90 without a device).

    Args:
      num_q_heads, num_kv_heads, head_dim: N, K, H of the model.
      kv_dtype: the cache dtype: bfloat16 / int8 / float8_e4m3fn (or the
        names "bf16", "fp8", "fp8_e4m3"); int8/fp8 get f32 scales.
      page_size: L.
      sliding_window, soft_cap: as the kernel's.
      num_tokens, max_seqs, max_context: T, max_seqs and pages_per_seq * L of
        the abstract batch (the defaults take both passes and split kv).
      q_dtype: q's dtype (and an unquantized cache's).
      kernel_kw: more keywords for the kernel (block_q, block_kv, ...).

    Unless ``kernel_kw`` sets ``num_kv_splits``, one program lowers the call
    twice, with the splits chosen from the shapes and with none, so both
    stores (partial f32 and normalized) are checked: up to four Triton kernels.

    Returns:
      The ``jax.stages.Lowered``.

    Raises:
      ValueError: bad arguments (the kernel's checks); any lowering error
        (Triton's, as raised by JAX) propagates.
    """
    kv_dtype = jnp.dtype(_KV_DTYPES.get(str(kv_dtype), kv_dtype))
    quantized = kv_dtype in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    if not quantized:
        q_dtype = kv_dtype
    pages_per_seq = pl.cdiv(max_context, page_size)
    P = max_seqs * pages_per_seq + 1
    sds = jax.ShapeDtypeStruct
    pages = sds((P, page_size, num_kv_heads, head_dim), kv_dtype)
    scales = sds((P, page_size, num_kv_heads), jnp.float32) if quantized else None
    args = (sds((num_tokens, num_q_heads, head_dim), q_dtype), pages, pages,
            sds((max_seqs,), jnp.int32), sds((max_seqs, pages_per_seq), jnp.int32),
            sds((max_seqs + 1,), jnp.int32), sds((1,), jnp.int32))
    call = functools.partial(ragged_paged_attention_gpu, sm_scale=head_dim ** -0.5,
                             sliding_window=sliding_window, soft_cap=soft_cap, **kernel_kw)

    def f(*a, **kw):
        if "num_kv_splits" in kernel_kw:
            return call(*a, **kw)
        return call(*a, **kw), call(*a, **kw, num_kv_splits=1)
    return jax.jit(f).trace(*args, k_scales_PLK=scales, v_scales_PLK=scales).lower(
        lowering_platforms=("cuda",))
