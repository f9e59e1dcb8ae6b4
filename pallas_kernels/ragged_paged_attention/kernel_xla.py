"""Ragged paged attention for XLA:CPU: loops over page blocks, online softmax.

The CPU lowering of the one ragged batch a step runs (the GPU and TPU ones
are the Pallas kernels beside this file); the semantics are
``reference.ref_ragged_paged_attention``'s, which tests compare against.

Dimension letters: T packed query tokens, S rows (sequences) of the step,
N query heads, K kv heads, G = N // K, H head dim, P pages, L page size,
R rows of a decode block, Q query tokens of a prefill block, C kv positions
of a page block (``pages_per_block * L``).

Layout of a step (``AttentionMetadata``): rows ``0 .. num_decode - 1`` are
decode rows, one query token each, at token index = row index; rows
``num_decode .. num_seqs - 1`` are prefill sequences (or chunks) packed
ragged after them by ``cu_q_lens``. ``num_decode`` and ``num_seqs`` are
device values, so one compiled program serves every mix of decode and
prefill rows that fits its static T and S, and the work follows the real
rows and kv lengths, not the padded shape:

* **decode rows** go in blocks of ``R = min(8, S, T)`` rows, a
  ``while_loop`` over ``ceil(num_decode / R)`` blocks; each block loops over
  page blocks from the first one any of its rows can see (sliding window)
  to the last one any of them holds, gathering ``[R, C, K * H]`` K and V per
  iteration and merging it into a running max / sum / accumulator (the
  online softmax of Milakov & Gimelshein 2018, as flash-decoding splits the
  keys: Dao et al. 2023). Rows past ``num_decode`` and pages past a block's
  longest row are never read; nothing of size rows x pages x page size
  exists. Rows of one block whose kv lengths differ are masked. The block is
  used as gathered, one [C, K * H] matrix per row: scores against
  block-diagonal queries [K * H, K * G] (zeros outside each query head's own
  kv head) and values as ``p^T @ v`` -> [K * G, K * H], whose diagonal
  blocks are the output: K times the flops of per-head products, but two
  plain batched matmuls with no transpose of the block (measured below).
* **prefill sequences** go one at a time (a ``while_loop`` over the real
  ones); each in query blocks of ``Q`` tokens (``q_block``, clamped to T),
  and each query block over the page blocks its queries can see: causal
  (up to the block's last query position) and windowed (from the first
  query's window start), as FlashAttention tiles the causal triangle
  (Dao et al. 2022). Pages a chunk does not attend to are not touched.

On XLA:CPU with f32 or int8 pages the decode rows and the prefill rows go to
``kernel_cpu`` instead (C++ FFI kernels reading the pages in place, where
they are built and ``JAXSERVE_CPU_KERNELS`` is not ``0``, outside a
multi-device mesh): the decode kernel's output (0 in prefill rows) plus the
prefill kernel's (0 in decode rows; not called with ``decode_only``). The
prefill kernel takes 1.5-3x less time than ``_prefill_seqs`` below on
SmolLM2's heads (its table is in ``kernel_cpu``'s docstring); the XLA paths
here stay for fp8 / bf16 pages, meshes and builds without the library.

Every score, softmax and accumulation is f32 (``soft_cap`` applied to the
scaled score before the mask); K and V outside a row's visible range are
masked before they are used, so garbage (NaN) in pages a row does not own
cannot leak into its output. Rows owned by no sequence come out 0.

Quantized pages (int8 / float8_e4m3fn with f32[P, L, K] scales, ``quant``)
are dequantized in the gather of each page block (``q * scale`` in f32), the
same place the unquantized pages are cast to f32; NaN scales of pages a row
does not own are masked like NaN pages.

Prefill tiles are computed kv-head-major, ``[K, Q * G, H]`` queries against
``[K, C, H]`` keys, so each product is K plain matmuls: twice as fast on
XLA:CPU as the token-major einsum (measured below).

Block sizes are static: ``pages_per_block`` (default 16: 256 kv positions at
L = 16), ``q_block`` (default 256, clamped to T) and ``rows_per_block``
(default 8). Pages are gathered as rows of a 2-D [P, L * K * H] view of the
cache: XLA:CPU copies each page as one run, ~2x the 4-D gather's rate
(8-11 against 4-5 GB/s of gathered bytes on the Xeon below).

Prefill, measured on the 2-core AMD EPYC dev machine (AVX-512 F/BW/VL/VNNI/
BF16) with SmolLM2's heads (N 9, K 3, H 64, L 16), one layer, jax 0.10.2:
one 940-token sequence (T 1024) took 14.8 ms with (Q 256, 16 pages), 15.6
(128, 16), 19.4 (128, 8), 22.0 (256, 32); the token-major einsum tiles took
26.5 ms at best and the dense gather-everything XLA path before this one
~20 ms. (The 2-D gather left it unchanged within noise on the Xeon: 41.9 ms
before, 42.1 after, medians of 10 alternated pairs on the loaded box.)

Decode (``python -m pallas_kernels.bench --decode-cpu`` times the current
code; before and after were alternated in one process, 15 pairs per case):
an Intel Xeon (AVX-512 F/BW/VL/VNNI/BF16/FP16, AMX), 2 cores, loaded by
other jobs (load average ~10), where a large f32 matvec ([8192, 8192] @
[8192]) read 6.7-8.4 GB/s of wall time in the same process and ~14 GB/s per
CPU second. GB/s of K/V bytes read (int8 counts its f32 scales) per wall
second and per process CPU second (steadier on a loaded box), per-head
batched dots (before) -> block-diagonal matmuls and the 2-D gather (after):

  ====  ====  ====  ===============  ===============  ===========
  KV    rows  ctx   wall before/aft  CPU before/after  CPU speedup
  ====  ====  ====  ===============  ===============  ===========
  f32   1     256   2.4 / 2.9        2.4 / 2.9        1.22
  f32   1     1024  2.1 / 0.9        2.1 / 2.3        1.09
  f32   1     4096  2.7 / 3.1        3.0 / 3.4        1.13
  f32   8     256   2.4 / 3.3        2.1 / 2.5        1.20
  f32   8     1024  1.5 / 2.0        2.8 / 3.9        1.41
  f32   8     4096  1.4 / 2.1        2.2 / 3.2        1.46
  f32   32    256   1.2 / 1.6        2.3 / 3.1        1.33
  f32   32    1024  1.1 / 1.8        2.4 / 3.5        1.48
  f32   32    4096  1.2 / 1.7        2.3 / 3.3        1.43
  int8  1     256   0.6 / 0.6        0.5 / 0.4        0.80
  int8  1     1024  0.9 / 1.1        0.8 / 0.9        1.16
  int8  1     4096  1.2 / 1.2        1.1 / 1.0        0.92
  int8  8     256   0.9 / 0.9        0.7 / 0.7        1.08
  int8  8     1024  1.1 / 1.2        1.0 / 1.1        1.12
  int8  8     4096  0.5 / 0.6        1.0 / 1.2        1.15
  int8  32    256   1.0 / 1.1        0.9 / 1.0        1.14
  int8  32    1024  0.5 / 0.6        1.0 / 1.1        1.16
  int8  32    4096  0.6 / 0.7        1.0 / 1.1        1.10
  ====  ====  ====  ===============  ===============  ===========

The bench's own runs: before, f32 2.2-3.1 GB/s and int8 0.7-1.4 with the
matvec at 13.9 then 9.2 GB/s; after, on a quieter box (matvec 14.8), f32
2.6-4.2 (17-29% of it) and int8 0.9-1.4 (6-10%).

f32 takes 1.1-1.5x less CPU time (two earlier wall-time runs: 1.03-3.0x in
34 of 36 alternated pairs), int8 about 1.1x (0.8-0.9x at one row of 256 and
4,096 positions), and both stay far below the matvec: in CPU time every f32
block size tried (4-64 pages x 1-8 rows) reads ~3 GB/s per CPU second
against the matvec's ~14, and the parts add up to that: out of
cache the 2-D page gather copies ~5.5 GB/s, the [C, K * H] x [K * H, K * G]
scores read 7.2 GB/s and the ``p^T @ v`` product 10.9 GB/s, where a plain
sum reads 20: the floor of a gather-then-matmul on XLA:CPU, short of a
kernel that reads pages in place. Tried and not kept (no gain beyond noise
on the loaded box, or a loss): 64- or 256-page decode blocks, one row per
block, K-head-major [R * K, G, H] x [R * K, H, C] batched dots with the
block transposed in the gather (12-35% more CPU time than block-diagonal),
scores computed [X, C] so that the values product is an NN matmul (both
dots then XNNPACK fusions; 3-11% more CPU time), int8 pages left int8 in
the gather with their scales applied to the scores and probabilities
instead (the same CPU time: XLA fuses the convert into the gather either
way), and split-K (the page range's two halves as independent loops,
merged: wall time equals CPU time, so XLA:CPU ran the halves one after the
other, as it runs the matvec on one thread; no gain on a quiet box either).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import kernel_cpu
from pallas_kernels.ragged_paged_attention.quant import dequantize
from pallas_kernels.ragged_paged_attention.reference import _MASK_VALUE, validate_inputs

DEFAULT_PAGES_PER_BLOCK = 16
DEFAULT_Q_BLOCK = 256
DECODE_ROWS_PER_BLOCK = 8


def _cdiv(a, b):
    return (a + b - 1) // b


def _online_update_kmajor(carry, s_KXC, mask_XC, v_KCH):
    """``_online_update`` for a prefill tile in kv-head-major layout: X = Q * G
    query rows per kv head; carry (m [K, X], l [K, X], acc [K, X, H]); s
    [K, X, C]; mask [X, C]; v [K, C, H] (zero where no row may see it)."""
    m_old, l_old, acc_old = carry
    s_KXC = jnp.where(mask_XC[None], s_KXC, _MASK_VALUE)
    m_new = jnp.maximum(m_old, s_KXC.max(axis=-1))
    p_KXC = jnp.where(mask_XC[None], jnp.exp(s_KXC - m_new[..., None]), 0.0)
    alpha = jnp.exp(m_old - m_new)
    pv_KXH = jax.lax.dot_general(p_KXC, v_KCH, (((2,), (1,)), ((0,), (0,))))
    return m_new, alpha * l_old + p_KXC.sum(axis=-1), alpha[..., None] * acc_old + pv_KXH


def _cap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _finish(l, acc):
    """acc / l (acc has one more trailing axis, H), with 0 for rows that saw no key."""
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _gather_block(pages_PLKH, page_ids_XB, scales_PLK=None):
    """[X, B] page ids -> [X, B * L, K, H] f32 (one block of pages per row),
    dequantized by ``scales_PLK`` f32[P, L, K] when given."""
    X, B = page_ids_XB.shape
    P, L, K, H = pages_PLKH.shape
    # Whole pages as rows of a 2-D [P, L * K * H] array: XLA:CPU copies each
    # page as one contiguous run, twice as fast as the 4-D gather (measured).
    scales = None if scales_PLK is None else \
        scales_PLK.reshape(P, L * K)[page_ids_XB].reshape(X, B, L, K)
    pages_XBLKH = pages_PLKH.reshape(P, L * K * H)[page_ids_XB].reshape(X, B, L, K, H)
    return dequantize(pages_XBLKH, scales).reshape(X, B * L, K, H)


def _decode_rows(out_TKGH, q_TKGH, k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK,
                 kv_lens_S, page_indices_SP, num_decode, *, sm_scale, sliding_window, soft_cap,
                 pages_per_block, rows_per_block):
    """Attend rows 0 .. num_decode - 1 (one query token each) into ``out``.

    Each row's page block is one [C, K * H] matrix (D = K * H), used as
    gathered: scores are ``k_RCD @ qbd_RDX`` against block-diagonal queries
    [D, X = K * G] (query head (k, g) has row k's H entries, zeros elsewhere),
    and values ``p_RCX^T @ v_RCD`` -> [X, D], whose diagonal blocks are the
    output. K times the flops of per-head products, but plain batched
    matmuls over the pages as laid out, no transpose or M = G batched dots."""
    T, K, G, H = q_TKGH.shape
    S, maxp = page_indices_SP.shape
    L = k_pages_PLKH.shape[1]
    R = min(rows_per_block, S, T)
    ppb = min(pages_per_block, maxp)
    C, D, X = ppb * L, K * H, K * G
    pad = _cdiv(maxp, ppb) * ppb - maxp  # so every block's slice stays in range
    page_indices_SP = jnp.pad(page_indices_SP, ((0, 0), (0, pad)))
    eye_KK = jnp.eye(K, dtype=jnp.float32)

    def row_block(c, out_TKGH):
        start = jnp.minimum(c * R, min(S, T) - R)
        rows_R = start + jnp.arange(R)
        own_R = (rows_R >= c * R) & (rows_R < num_decode)
        kv_len_R = jnp.where(own_R, jax.lax.dynamic_slice(kv_lens_S, (start,), (R,)), 0)
        q_RKGH = jax.lax.dynamic_slice(q_TKGH, (start, 0, 0, 0), (R, K, G, H)).astype(
            jnp.float32) * sm_scale
        qbd_RDX = jnp.einsum("rkgh,kj->rkhjg", q_RKGH, eye_KK).reshape(R, D, X)
        pages_RP = jax.lax.dynamic_slice(page_indices_SP, (start, 0), (R, page_indices_SP.shape[1]))
        q_pos_R = kv_len_R - 1
        lo_R = jnp.zeros_like(kv_len_R) if sliding_window is None else \
            jnp.maximum(q_pos_R - sliding_window + 1, 0)
        hi = jnp.max(kv_len_R)  # positions < hi are read
        lo = jnp.min(jnp.where(own_R, lo_R, hi))
        first_blk, last_blk = lo // C, _cdiv(hi, C)

        def kv_block(state):
            b, (m_RX, l_RX, acc_RXD) = state
            ids_RB = jax.lax.dynamic_slice(pages_RP, (0, b * ppb), (R, ppb))
            kv_pos_C = b * C + jnp.arange(C)
            mask_RC1 = ((kv_pos_C[None, :] < kv_len_R[:, None])
                        & (kv_pos_C[None, :] >= lo_R[:, None]))[:, :, None]
            k_RCD = _gather_block(k_pages_PLKH, ids_RB, k_scales_PLK).reshape(R, C, D)
            v_RCD = jnp.where(mask_RC1, _gather_block(v_pages_PLKH, ids_RB, v_scales_PLK)
                              .reshape(R, C, D), 0.0)
            s_RCX = jax.lax.dot_general(k_RCD, qbd_RDX, (((2,), (1,)), ((0,), (0,))))
            s_RCX = jnp.where(mask_RC1, _cap(s_RCX, soft_cap), _MASK_VALUE)
            m_new = jnp.maximum(m_RX, s_RCX.max(axis=1))
            p_RCX = jnp.where(mask_RC1, jnp.exp(s_RCX - m_new[:, None, :]), 0.0)
            alpha = jnp.exp(m_RX - m_new)
            pv_RXD = jax.lax.dot_general(p_RCX, v_RCD, (((1,), (1,)), ((0,), (0,))))
            return b + 1, (m_new, alpha * l_RX + p_RCX.sum(axis=1),
                           alpha[..., None] * acc_RXD + pv_RXD)

        init = (jnp.full((R, X), _MASK_VALUE, jnp.float32), jnp.zeros((R, X), jnp.float32),
                jnp.zeros((R, X, D), jnp.float32))
        _, (_, l_RX, acc_RXD) = jax.lax.while_loop(
            lambda st: st[0] < last_blk, kv_block, (first_blk, init))
        acc_RKGH = jnp.einsum("rkgjh,kj->rkgh", acc_RXD.reshape(R, K, G, K, H), eye_KK)
        o_RKGH = _finish(l_RX.reshape(R, K, G), acc_RKGH)
        old_RKGH = jax.lax.dynamic_slice(out_TKGH, (start, 0, 0, 0), (R, K, G, H))
        new_RKGH = jnp.where(own_R[:, None, None, None], o_RKGH, old_RKGH)
        return jax.lax.dynamic_update_slice(out_TKGH, new_RKGH, (start, 0, 0, 0))

    if min(S, T) <= R:  # one block holds every row: no loop over row blocks
        # Not a lax.cond on num_decode > 0: a conditional's operands (the
        # whole cache, stacked over layers) are copied on XLA:CPU. With no
        # decode row the block owns nothing and reads no page.
        return row_block(0, out_TKGH)
    return jax.lax.fori_loop(0, _cdiv(num_decode, R), row_block, out_TKGH)


def _cpu_kernel_allowed(k_pages_PLKH, k_scales_PLK) -> bool:
    """The decode rows may go to ``kernel_cpu`` (the C++ kernel reading pages in
    place): CPU backend, f32 pages or int8 ones with scales, outside a mesh of
    several devices (a custom call does not split over a mesh), and the kernel
    built and enabled."""
    mesh = jax.sharding.get_abstract_mesh()
    dtype_ok = (k_pages_PLKH.dtype == jnp.float32 and k_scales_PLK is None) or (
        k_pages_PLKH.dtype == jnp.int8 and k_scales_PLK is not None)
    return (jax.default_backend() == "cpu" and dtype_ok and (mesh.empty or mesh.size == 1)
            and kernel_cpu.available())


def _prefill_seqs(out_TKGH, q_TKGH, k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK,
                  kv_lens_S, page_indices_SP, cu_q_lens_S1, first_seq, num_seqs, *, sm_scale,
                  sliding_window, soft_cap, pages_per_block, q_block):
    """Attend sequences first_seq .. num_seqs - 1 (ragged query lengths) into ``out``."""
    T, K, G, H = q_TKGH.shape
    S, maxp = page_indices_SP.shape
    L = k_pages_PLKH.shape[1]
    Q = min(q_block, T)
    ppb = min(pages_per_block, maxp)
    C = ppb * L
    pad = _cdiv(maxp, ppb) * ppb - maxp
    page_indices_SP = jnp.pad(page_indices_SP, ((0, 0), (0, pad)))

    def seq(i, out_TKGH):
        q_start = cu_q_lens_S1[i]
        q_len = cu_q_lens_S1[i + 1] - q_start
        kv_len = kv_lens_S[i]
        pages_P = page_indices_SP[i]

        def q_blk(j, out_TKGH):
            blk_start = q_start + j * Q  # this block's first own token
            start = jnp.minimum(blk_start, T - Q)
            row_Q = start + jnp.arange(Q) - q_start  # index within the sequence's queries
            own_Q = (row_Q >= j * Q) & (row_Q < jnp.minimum(q_len, (j + 1) * Q))
            q_pos_Q = kv_len - q_len + row_Q
            q_QKGH = jax.lax.dynamic_slice(q_TKGH, (start, 0, 0, 0), (Q, K, G, H))
            # kv-head-major [K, Q*G, H]: each kv head's G query heads and Q
            # tokens are one matrix, so both products are K plain matmuls.
            q_KXH = (jnp.transpose(q_QKGH, (1, 0, 2, 3)).reshape(K, Q * G, H)
                     .astype(jnp.float32) * sm_scale)
            first_pos = kv_len - q_len + j * Q  # own query positions span [first_pos, last_pos]
            last_pos = jnp.minimum(kv_len - q_len + (j + 1) * Q, kv_len) - 1
            lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)

            def kv_block(state):
                b, carry = state
                ids_B = jax.lax.dynamic_slice(pages_P, (b * ppb,), (ppb,))
                k_KCH = jnp.transpose(_gather_block(k_pages_PLKH, ids_B[None], k_scales_PLK)[0],
                                      (1, 0, 2))
                v_CKH = _gather_block(v_pages_PLKH, ids_B[None], v_scales_PLK)[0]
                kv_pos_C = b * C + jnp.arange(C)
                mask_QC = own_Q[:, None] & (kv_pos_C[None, :] <= q_pos_Q[:, None]) \
                    & (kv_pos_C[None, :] < kv_len)
                if sliding_window is not None:
                    mask_QC &= kv_pos_C[None, :] > q_pos_Q[:, None] - sliding_window
                mask_XC = jnp.broadcast_to(mask_QC[:, None, :], (Q, G, C)).reshape(Q * G, C)
                visible_C = (kv_pos_C < kv_len) & (kv_pos_C >= lo)
                v_KCH = jnp.transpose(jnp.where(visible_C[:, None, None], v_CKH, 0.0), (1, 0, 2))
                s_KXC = _cap(jax.lax.dot_general(q_KXH, k_KCH, (((2,), (2,)), ((0,), (0,)))),
                             soft_cap)
                return b + 1, _online_update_kmajor(carry, s_KXC, mask_XC, v_KCH)

            init = (jnp.full((K, Q * G), _MASK_VALUE, jnp.float32),
                    jnp.zeros((K, Q * G), jnp.float32), jnp.zeros((K, Q * G, H), jnp.float32))
            _, (_, l_KX, acc_KXH) = jax.lax.while_loop(
                lambda st: st[0] < _cdiv(last_pos + 1, C), kv_block, (lo // C, init))
            o_QKGH = jnp.transpose(_finish(l_KX, acc_KXH).reshape(K, Q, G, H), (1, 0, 2, 3))
            old_QKGH = jax.lax.dynamic_slice(out_TKGH, (start, 0, 0, 0), (Q, K, G, H))
            new_QKGH = jnp.where(own_Q[:, None, None, None], o_QKGH, old_QKGH)
            return jax.lax.dynamic_update_slice(out_TKGH, new_QKGH, (start, 0, 0, 0))

        return jax.lax.fori_loop(0, _cdiv(q_len, Q), q_blk, out_TKGH)

    return jax.lax.fori_loop(first_seq, num_seqs, seq, out_TKGH)


def ragged_paged_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                           cu_q_lens_S1, num_seqs, num_decode=0, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
                           q_block: int = DEFAULT_Q_BLOCK,
                           rows_per_block: int = DECODE_ROWS_PER_BLOCK,
                           k_scales_PLK=None, v_scales_PLK=None, decode_only: bool = False):
    """Ragged paged attention of a step's packed batch on XLA (the module
    docstring has the algorithm).

    Args:
      q_TNH: [T, N, H] queries of every row, packed (decode rows first).
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache, this
        step's K/V already written.
      kv_lens_S: i32[S] kv length per row, new tokens included.
      page_indices_SP: i32[S, pages_per_seq] page table rows.
      cu_q_lens_S1: i32[S + 1] prefix sums of query lengths; rows below
        ``num_decode`` must have query length 1 (``cu_q_lens[i] == i``).
      num_seqs: i32 scalar or [1], rows in use.
      num_decode: i32 scalar or [1] (or a Python int), leading decode rows;
        0 sends every row through the prefill path (always correct, slower
        for one-token rows).
      sm_scale: softmax scale, usually H ** -0.5.
      sliding_window, soft_cap: as in ``reference``; the window may also be
        an i32 scalar (a scanned layer's), a huge value meaning none.
      pages_per_block: pages per kv block (static).
      q_block: query tokens per prefill block (static).
      rows_per_block: decode rows per block (static).
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages
        (``quant``), or None for unquantized pages.
      decode_only: static; every real row is a decode row (the caller
        guarantees ``num_decode == num_seqs``), so the prefill path is not
        compiled at all (a ``decode_step`` program).

    Returns:
      o_TNH: [T, N, H] in q's dtype; rows owned by no sequence are 0.

    Raises:
      ValueError: bad shapes or options (``reference.validate_inputs``), or
        block sizes below 1.
    """
    validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1,
                    num_seqs, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    if min(pages_per_block, q_block, rows_per_block) < 1:
        raise ValueError(f"pages_per_block, q_block and rows_per_block must be >= 1, got "
                         f"{pages_per_block}, {q_block} and {rows_per_block}")
    k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1 = map(
        jnp.asarray, (k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1))
    k_scales_PLK, v_scales_PLK = (None if a is None else jnp.asarray(a)
                                  for a in (k_scales_PLK, v_scales_PLK))
    T, N, H = q_TNH.shape
    K = k_pages_PLKH.shape[2]
    G = N // K
    q_TKGH = q_TNH.reshape(T, K, G, H)
    n = jnp.reshape(jnp.asarray(num_seqs, jnp.int32), ())
    nd = jnp.minimum(jnp.reshape(jnp.asarray(num_decode, jnp.int32), ()), n)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              pages_per_block=pages_per_block)
    kv = (k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK)
    if _cpu_kernel_allowed(k_pages_PLKH, k_scales_PLK):
        out = kernel_cpu.decode_attention(
            q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, nd,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK).reshape(T, K, G, H)
    else:
        out = _decode_rows(jnp.zeros((T, K, G, H), jnp.float32), q_TKGH, *kv, kv_lens_S,
                           page_indices_SP, nd, rows_per_block=rows_per_block, **kw)
    if not decode_only and _cpu_kernel_allowed(k_pages_PLKH, k_scales_PLK):
        out = out + kernel_cpu.prefill_attention(
            q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1, n, nd,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK).reshape(T, K, G, H)
    elif not decode_only:
        out = _prefill_seqs(out, q_TKGH, *kv, kv_lens_S, page_indices_SP, cu_q_lens_S1, nd, n,
                            q_block=q_block, **kw)
    return out.reshape(T, N, H).astype(q_TNH.dtype)
