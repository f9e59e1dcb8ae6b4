"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Modeled on JAX's ``jax/experimental/pallas/ops/tpu/ragged_paged_attention/
kernel.py`` (the q-block grid, K/V pages left in HBM and copied into a double
buffer, online softmax with lane-replicated statistics, odd G folded in f32)
and on tpu-inference's ragged paged attention (a work schedule computed
outside the kernel, fully masked kv blocks never fetched). Semantics are those
of ``reference.ref_ragged_paged_attention``. Block sizes, tiling rules and the
schedule live in ``kernel_tpu_schedule``.

Dimension letters: T packed query tokens, N query heads, K kv heads,
G = N // K query heads per kv head, H head dim, P pages, L page size.

Design
------
Grid ``(K // kb, cdiv(T, bq))``: kv-head block ``hb`` (kb kv heads, their
kb * G query heads) by q block ``b`` (bq packed query rows, q padded to a
multiple of bq). q and o blocks come through BlockSpecs. Inside a grid step the
kernel walks *items* ``(sequence, kv block)``: the sequences meeting the q
block (``seq_ids[blk_lo[b]:blk_hi[b]]``) and, for each, the kv blocks of bkv =
bp * L positions from the one holding its lowest visible position to the one
holding its highest query position.

K/V per head, head-major. Each item copies, per page and kv head, the
[L, H] slab ``pages.at[page, :, h, :]`` into a VMEM buffer [2, kb, bp, L, H],
so kv head h's block is the plain load ``buf[slot, h]`` -> [bp, L, H] and the
reshape to [bkv, H] only merges leading dims (done in f32 when L is not a
multiple of the dtype's sublane tile). Nothing selects one row of a packed
sublane tile; the price is 2 * bp * kb DMAs per item instead of bp (JAX's
kernel copies whole pages and de-interleaves heads with strided loads, which
needs K to be a multiple of the packing; ours takes any K, e.g. K = 1 or 3).

Quantized pages (int8 / float8_e4m3fn): the f32[P, L, K] scales (layout of
``quant.KVPages``, untouched) come per page as ``[L, kb]`` into
[2, bp, L, kb]; kv head h's scales are the lane slice ``[:, :, h:h+1]``,
[bp, L, 1] -> [bkv, 1], kv positions on sublanes as in the K/V rows, so
dequantizing is a lane broadcast (no lane -> sublane shape cast). K and V are
dequantized in f32 and cast to q's dtype for the dots.

Odd G (JAX's ``fold_on_2nd_minor``): q heads of one kv head are loaded as
[bs, G, H] and folded to [bs * G, H] in f32 when G is not a multiple of the q
dtype's packing; the accumulator is f32 [bq, kb * G, H] (JAX's layout), and o
is written once per grid step as a whole block, so no packed store lands at
an odd sublane offset.

Work per item (``kernel_tpu_schedule``): a sequence with at most 8 rows in
the q block (decode) computes tiles of 8 // gcd(G, 8) tokens (lcm(G, 8)
rows: one decode of G = 8 computes exactly its 8 rows), not all bq * G rows;
longer runs use tiles of ``bs_large`` tokens (about 256 rows). The default q
block of 128 tokens makes a prefill re-read its KV once per 128 tokens.

Page table in HBM. ``page_indices`` is not scalar-prefetched (at 128k context
and 256 rows it is 8 MiB against ~1 MiB of SMEM): before each item's page
copies start, the bp page ids of its kv block are copied (synchronously,
from ``page_indices.at[seq, pl.ds(start, bp)]``, start clamped so the window
stays inside the row) into an SMEM buffer i32[2, bp], one row per buffer
slot. SMEM use is bounded by 2 * bp whatever the context. Pages of a kv block
past the sequence's last page copy the block's first page instead, so no
page-table entry beyond ``cdiv(kv_len, L)`` is ever used; positions
``>= kv_len`` are masked and their K/V rows zeroed, so NaN there cannot leak.

Double buffering: item n computes on slot n % 2 while item n + 1 is fetched
into the other; the chain crosses grid steps (the last item of a step starts
the next step's first), its slot carried in SMEM, so both grid axes are
"arbitrary". Online softmax statistics m, l are f32 [kb, bq * G, 128]
(lane-replicated, as JAX does for Mosaic); rows owned by no sequence keep
l == 0 and come out 0.

Lowering (``lower_for_tpu``) on a CPU runs the Pallas -> Mosaic lowering
only; Mosaic's own compilation (libtpu: layout inference, DMA checks) runs on
a TPU, so some failures, e.g. a DMA of one kv head's rows out of a tiled HBM
page, can only show on a chip. Interpret mode (``interpret=True`` or a
``pltpu.InterpretParams``) runs the kernel in JAX's TPU interpreter on CPU,
which simulates the DMAs and semaphores; block on its result before
dispatching other JAX work (its callbacks run jnp ops and can deadlock
against concurrent dispatch, seen with jax 0.10.2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.kernel_tpu_schedule import (
    SHORT_RUN, choose_blocks, round_up, schedule, sublane_tile)
from pallas_kernels.ragged_paged_attention.reference import validate_inputs

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128  # statistics are kept lane-replicated, like JAX's kernel


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,       # i32[max_seqs]
    cu_q_lens_ref,     # i32[max_seqs + 1]
    seq_ids_ref,       # i32[max_seqs] sequences owning rows, in order, then padding
    blk_lo_ref,        # i32[num_q_blks] first index into seq_ids meeting q block b
    blk_hi_ref,        # i32[num_q_blks] one past the last
    # Inputs.
    q_ref,             # [bq, kb * G, H] VMEM block of q
    page_indices_hbm,  # i32[max_seqs, pages_per_seq] left in HBM
    k_hbm_ref,         # [P, L, K, H] left in HBM
    v_hbm_ref,         # [P, L, K, H] left in HBM
    ks_hbm_ref,        # f32[P, L, K] K scales in HBM (int8/fp8 pages), or None
    vs_hbm_ref,        # f32[P, L, K] V scales in HBM, or None
    # Output.
    o_ref,             # [bq, kb * G, H] VMEM block of the output
    # Scratch.
    page_buf,          # i32[2, bp] SMEM: page ids of the item in each slot
    k_buf,             # [2, kb, bp, L, H] double buffer of K, head-major
    v_buf,             # [2, kb, bp, L, H] double buffer of V, head-major
    ks_buf,            # f32[2, bp, L, kb] double buffer of K scales, or None
    vs_buf,            # f32[2, bp, L, kb] double buffer of V scales, or None
    sems,              # DMA semaphores [2], one per buffer slot
    page_sem,          # DMA semaphore [1] for page-id copies
    m_ref,             # f32[kb, bq * G, 128] running max
    l_ref,             # f32[kb, bq * G, 128] running sum of exp
    acc_ref,           # f32[bq, kb * G, H] running unnormalized output
    slot_ref,          # i32[1] SMEM: slot holding this grid step's first item
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    bs_small: int,
    bs_large: int,
):
    hb, b = pl.program_id(0), pl.program_id(1)
    num_hb, num_qb = pl.num_programs(0), pl.num_programs(1)
    bq = q_ref.shape[0]
    _, kb, bp, L, H = k_buf.shape
    G = q_ref.shape[1] // kb
    bkv = bp * L          # kv positions per kv block
    max_seqs, pages_per_seq = page_indices_hbm.shape
    cdt = q_ref.dtype     # dtype of the dots' operands
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else lax.Precision.DEFAULT
    iota = lax.broadcasted_iota

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

    def kv_copies(head_blk, a, j, slot):
        """The page copies of item (a, j) into ``slot`` (page ids in page_buf[slot])."""
        _, _, _, kv_len = seq_info(a)
        num_pages = jnp.minimum(pl.cdiv(kv_len, L), pages_per_seq)
        first = j * bp
        off = jnp.maximum(first - (pages_per_seq - bp), 0)  # where page `first` sits in page_buf
        out = []
        for p in range(bp):
            page_id = page_buf[slot, jnp.where(first + p < num_pages, off + p, off)]
            for h in range(kb):
                for hbm, buf in ((k_hbm_ref, k_buf), (v_hbm_ref, v_buf)):
                    out.append(pltpu.make_async_copy(
                        hbm.at[page_id, :, head_blk * kb + h, :], buf.at[slot, h, p],
                        sems.at[slot]))
            if ks_buf is not None:
                heads = pl.ds(head_blk * kb, kb)
                for hbm, buf in ((ks_hbm_ref, ks_buf), (vs_hbm_ref, vs_buf)):
                    out.append(pltpu.make_async_copy(
                        hbm.at[page_id, :, heads], buf.at[slot, p], sems.at[slot]))
        return out

    def start_item(head_blk, a, j, slot):
        """Copy item (a, j)'s page ids into SMEM, then start its page copies."""
        i = seq_info(a)[0]
        start = jnp.minimum(j * bp, pages_per_seq - bp)
        ids = pltpu.make_async_copy(page_indices_hbm.at[i, pl.ds(start, bp)],
                                    page_buf.at[slot], page_sem.at[0])
        ids.start()
        ids.wait()
        for c in kv_copies(head_blk, a, j, slot):
            c.start()

    def first_item(blk):
        a = blk_lo_ref[blk]
        return a, kv_blocks(a, blk)[0]

    def has_items(blk):
        blk = jnp.minimum(blk, num_qb - 1)
        return blk_lo_ref[blk] < blk_hi_ref[blk]

    @pl.when((hb == 0) & (b == 0) & has_items(0))
    def _prefetch_very_first_item():
        slot_ref[0] = 0
        start_item(0, *first_item(0), 0)

    a_lo, a_hi = blk_lo_ref[b], blk_hi_ref[b]

    def load_kv(buf, scale_buf, slot, h, kv_valid):
        """kv head h's [bkv, H] block of ``slot``, dequantized, rows >= kv_len zeroed."""
        x = buf[slot, h]                                   # [bp, L, H]
        if scale_buf is None and L % sublane_tile(x.dtype) == 0:
            x = x.reshape(bkv, H).astype(jnp.float32)     # merges whole tiles
        else:
            x = x.astype(jnp.float32).reshape(bkv, H)
        if scale_buf is not None:
            x = x * scale_buf[slot, :, :, h:h + 1].reshape(bkv, 1)
        return jnp.where(kv_valid, x, 0.0).astype(cdt)     # NaN past kv_len would poison p @ v

    def fold(x):
        """[bs, G, H] -> [bs * G, H]; via f32 when G splits a packed sublane pair."""
        if G % (4 // jnp.dtype(x.dtype).itemsize):
            x = x.astype(jnp.float32)
        return x.reshape(-1, x.shape[-1])

    def attend(a, j, slot):
        """Fold kv block j of sequence a (in ``slot``) into the rows it owns."""
        _, q_start, q_end, kv_len = seq_info(a)
        row0 = b * bq
        lo = jnp.maximum(q_start, row0) - row0            # its rows in this block: [lo, hi)
        hi = jnp.minimum(q_end, row0 + bq) - row0
        kv_valid = (j * bkv + iota(jnp.int32, (bkv, H), 0)) < kv_len
        for h in range(kb):
            k = load_kv(k_buf, ks_buf, slot, h, kv_valid)
            v = load_kv(v_buf, vs_buf, slot, h, kv_valid)

            def tiles(bs, h=h, k=k, v=v):
                R = bs * G

                def body(t, carry):
                    r0 = t * bs
                    heads = pl.ds(h * G, G)
                    q = fold(q_ref[pl.ds(r0, bs), heads, :]).astype(cdt)
                    token = row0 + r0 + iota(jnp.int32, (R, bkv), 0) // G
                    q_pos = kv_len - q_end + token                  # absolute query position
                    kv_pos = j * bkv + iota(jnp.int32, (R, bkv), 1)
                    mask = (kv_pos <= q_pos) & (kv_pos < kv_len)
                    if sliding_window is not None:
                        mask &= kv_pos > q_pos - sliding_window
                    own = ((token >= q_start) & (token < q_end))[:, :1]
                    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                        preferred_element_type=jnp.float32) * sm_scale
                    if soft_cap is not None:
                        s = soft_cap * jnp.tanh(s / soft_cap)
                    s = jnp.where(mask, s, _MASK_VALUE)
                    rows = pl.ds(r0 * G, R)
                    m_prev, l_prev = m_ref[h, rows, :], l_ref[h, rows, :]   # [R, 128]
                    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                    p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)   # [R, bkv]
                    alpha = jnp.exp(m_prev - m_next)
                    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
                    pv = lax.dot_general(p.astype(cdt), v, (((1,), (0,)), ((), ())),
                                         precision=precision,
                                         preferred_element_type=jnp.float32)
                    acc_prev = acc_ref[pl.ds(r0, bs), heads, :].reshape(R, H)
                    acc_next = alpha[:, :1] * acc_prev + pv
                    m_ref[h, rows, :] = jnp.where(own, m_next, m_prev)
                    l_ref[h, rows, :] = jnp.where(own, l_next, l_prev)
                    acc_ref[pl.ds(r0, bs), heads, :] = jnp.where(
                        own, acc_next, acc_prev).reshape(bs, G, H)
                    return carry

                lax.fori_loop(lo // bs, pl.cdiv(hi, bs), body, 0)

            if bs_large == bs_small:
                tiles(bs_small)
            else:
                short = hi - lo <= SHORT_RUN
                pl.when(short)(lambda: tiles(bs_small))
                pl.when(jnp.logical_not(short))(lambda: tiles(bs_large))

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
                    start_item(next_hb, next_a, next_j, 1 - slot)

                for c in kv_copies(hb, a, j, slot):
                    c.wait()
                attend(a, j, slot)
                return 1 - slot

            return lax.fori_loop(j_lo, j_hi, kv_body, slot)

        slot_ref[0] = lax.fori_loop(a_lo, a_hi, seq_body, slot_ref[0])
        for h in range(kb):
            heads = slice(h * G, (h + 1) * G)
            l = l_ref[h][:, :1]
            o = acc_ref[:, heads, :].reshape(bq * G, H) / jnp.where(l == 0.0, 1.0, l)
            acc_ref[:, heads, :] = o.reshape(bq, G, H)
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    @pl.when(a_lo >= a_hi)
    def _empty_block():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "num_queries_per_block",
    "num_kv_pages_per_block", "num_kv_heads_per_block", "vmem_limit_bytes", "check_tiling"))
def ragged_paged_attention_tpu(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                               cu_q_lens_S1, num_seqs, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None,
                               interpret: bool | pltpu.InterpretParams = False,
                               num_queries_per_block: int | None = None,
                               num_kv_pages_per_block: int | None = None,
                               num_kv_heads_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None,
                               k_scales_PLK=None, v_scales_PLK=None,
                               check_tiling: bool = True):
    """Causal GQA attention of a packed ragged batch over a paged KV cache.

    Args:
      q_TNH: [T, N, H] f32 or bf16 queries of all sequences, packed in order.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache, this step's
        K/V already written; q's dtype, or int8 / float8_e4m3fn with scales.
      kv_lens_S: i32[max_seqs] context length per sequence, new tokens included.
      page_indices_SP: i32[max_seqs, pages_per_seq] page ids of each sequence;
        stays in HBM (module docstring), so its width is not bounded by SMEM.
      cu_q_lens_S1: i32[max_seqs + 1] prefix sums of query lengths (0 allowed).
      num_seqs: i32[1] (or scalar) sequences in use.
      sm_scale: softmax scale, usually H ** -0.5.
      sliding_window, soft_cap: as in ``reference`` (window of W positions
        including the query's own; scores become ``c * tanh(s / c)``).
      interpret: run in JAX's TPU interpreter (True or ``pltpu.InterpretParams``).
      num_queries_per_block: bq, query tokens per grid step, a multiple of 8;
        default 128 (capped at T rounded up to 8). q is padded to a multiple.
      num_kv_pages_per_block: bp, pages per kv block; default ``256 // L``
        capped at pages_per_seq. Also the SMEM page-id window per item.
      num_kv_heads_per_block: kb, kv heads per grid step; default from
        ``kernel_tpu_schedule.choose_blocks`` (tiling and VMEM).
      vmem_limit_bytes: passed to Mosaic; default twice the kernel's estimate,
        clamped to [32, 64] MiB.
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8/fp8 pages
        (``quant``), or None.
      check_tiling: when compiling (not interpreting), refuse block shapes
        Mosaic cannot tile with a ValueError; False lets them reach the
        lowering (for tests that the lowering check can fail).

    Returns:
      o_TNH: [T, N, H] in q's dtype; rows owned by no sequence are 0.

    Raises:
      ValueError: bad shapes or dtypes (``reference.validate_inputs``), block
        sizes, or a page size / head dim / kv-head block that does not tile.
    """
    validate_inputs(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                    cu_q_lens_S1, num_seqs, sliding_window=sliding_window, soft_cap=soft_cap,
                    k_scales_PLK=k_scales_PLK, v_scales_PLK=v_scales_PLK)
    T, N, H = q_TNH.shape
    _, L, K, _ = k_pages_PLKH.shape
    quantized = k_scales_PLK is not None
    if q_TNH.dtype not in (jnp.float32, jnp.bfloat16) or not quantized and (
            k_pages_PLKH.dtype != q_TNH.dtype or v_pages_PLKH.dtype != q_TNH.dtype):
        raise ValueError(f"ragged_paged_attention_tpu: q, k_pages and v_pages must all be f32 "
                         f"or all bf16 (or the pages int8/fp8 with scales), got {q_TNH.dtype}, "
                         f"{k_pages_PLKH.dtype}, {v_pages_PLKH.dtype}")
    if interpret is True:
        interpret = pltpu.InterpretParams()
    bq, bp, kb, bs_small, bs_large, vmem_est = choose_blocks(
        T=T, N=N, K=K, H=H, L=L, pages_per_seq=page_indices_SP.shape[1], q_dtype=q_TNH.dtype,
        kv_dtype=k_pages_PLKH.dtype, quantized=quantized,
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_kv_heads_per_block=num_kv_heads_per_block,
        check_tiling=check_tiling and interpret is False)
    G = N // K
    T_pad = round_up(T, bq)
    q_pad = q_TNH if T_pad == T else jnp.pad(q_TNH, ((0, T_pad - T), (0, 0), (0, 0)))
    num_q_blks = T_pad // bq
    seq_ids, blk_lo, blk_hi = schedule(cu_q_lens_S1.astype(jnp.int32), num_seqs, num_q_blks, bq)

    qo_spec = pl.BlockSpec((bq, kb * G, H), lambda hb, b, *_: (b, hb, 0))
    kv_buf = pltpu.VMEM((2, kb, bp, L, H), k_pages_PLKH.dtype)
    scale_buf = pltpu.VMEM((2, bp, L, kb), jnp.float32) if quantized else None
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    stats = pltpu.VMEM((kb, bq * G, _LANES), jnp.float32)
    scalars = (kv_lens_S.astype(jnp.int32), cu_q_lens_S1.astype(jnp.int32), seq_ids, blk_lo,
               blk_hi)
    kernel = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, bs_small=bs_small, bs_large=bs_large),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(K // kb, num_q_blks),
            in_specs=[qo_spec, hbm, hbm, hbm] + [hbm if quantized else None] * 2,
            out_specs=qo_spec,
            scratch_shapes=[pltpu.SMEM((2, bp), jnp.int32), kv_buf, kv_buf, scale_buf,
                            scale_buf, pltpu.SemaphoreType.DMA((2,)),
                            pltpu.SemaphoreType.DMA((1,)), stats, stats,
                            pltpu.VMEM((bq, kb * G, H), jnp.float32),
                            pltpu.SMEM((1,), jnp.int32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),  # DMA chain crosses steps
            vmem_limit_bytes=vmem_limit_bytes or min(max(2 * vmem_est, 32 << 20), 64 << 20)),
        out_shape=jax.ShapeDtypeStruct(q_pad.shape, q_TNH.dtype),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )
    o_TNH = kernel(*scalars, q_pad, page_indices_SP.astype(jnp.int32), k_pages_PLKH,
                   v_pages_PLKH, k_scales_PLK, v_scales_PLK)
    return o_TNH[:T]


_FP8_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8": "float8_e4m3fn"}


def lower_for_tpu(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype, page_size: int,
                  *, sliding_window: int | None = None, soft_cap: float | None = None,
                  q_dtype=jnp.bfloat16, num_tokens: int = 256, max_seqs: int = 64,
                  context: int = 131072, num_pages: int = 4096,
                  device_kind: str = "TPU v6 lite", **block_kw) -> str:
    """Lower the kernel for TPU (Mosaic) on any host and return the module text.

    Runs ``jax.jit(...).trace(ShapeDtypeStructs).lower(lowering_platforms=
    ("tpu",))``: Pallas' Mosaic lowering rules and the block-shape checks run,
    Mosaic's own compilation (libtpu) does not (module docstring).

    Args:
      num_q_heads, num_kv_heads, head_dim: N, K, H.
      kv_dtype: page dtype: a dtype or name ("bfloat16", "int8",
        "float8_e4m3fn", or "fp8" / "fp8_e4m3"); int8/fp8 get f32 scales.
      page_size: L.
      sliding_window, soft_cap: as in ``ragged_paged_attention_tpu``.
      q_dtype: q's dtype (f32 or bf16); unquantized pages share it.
      num_tokens, max_seqs, context, num_pages: T, rows of the page table,
        its width in tokens (pages_per_seq = context / L), P.
      device_kind: the TPU generation the lowering rules are told of.
      **block_kw: keywords for ``ragged_paged_attention_tpu`` (block sizes,
        ``check_tiling``).

    Returns:
      the lowered StableHLO text (holds the ``tpu_custom_call``).

    Raises:
      RuntimeError: naming the shape, chained to the lowering's own error.
    """
    kv_dtype = jnp.dtype(_FP8_NAMES.get(str(kv_dtype), kv_dtype))
    quantized = kv_dtype in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    sd = jax.ShapeDtypeStruct
    pages = sd((num_pages, page_size, num_kv_heads, head_dim), kv_dtype)
    scales = sd((num_pages, page_size, num_kv_heads), jnp.float32) if quantized else None
    args = (sd((num_tokens, num_q_heads, head_dim), q_dtype), pages, pages,
            sd((max_seqs,), jnp.int32), sd((max_seqs, -(-context // page_size)), jnp.int32),
            sd((max_seqs + 1,), jnp.int32), sd((1,), jnp.int32))
    def fn(*a):
        return ragged_paged_attention_tpu(
            *a[:7], sm_scale=head_dim ** -0.5, sliding_window=sliding_window,
            soft_cap=soft_cap, k_scales_PLK=a[7], v_scales_PLK=a[8], **block_kw)

    # Some lowering rules ask for the TPU generation: name one with an abstract mesh.
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(device_kind, 1, "tpu"))
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = jax.jit(fn).trace(*args, scales, scales).lower(
                lowering_platforms=("tpu",))
        return lowered.as_text()
    except Exception as e:  # noqa: BLE001 - named and re-raised
        raise RuntimeError(
            f"TPU lowering failed for N={num_q_heads} K={num_kv_heads} H={head_dim} "
            f"kv_dtype={kv_dtype.name} L={page_size} window={sliding_window} "
            f"soft_cap={soft_cap}: {type(e).__name__}: {e}") from e
