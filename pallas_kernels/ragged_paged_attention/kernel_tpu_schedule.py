"""Work schedule, block sizes and tiling rules of the TPU kernel (``kernel_tpu``).

Dimension letters as in ``kernel_tpu``: T packed query tokens, N query heads,
K kv heads, G = N // K, H head dim, P pages, L page size.

TPU tiling. Mosaic (and XLA, for arrays in HBM) lays the two minor dims of
an array out in tiles of ``(8 * packing, 128)`` elements, packing = 4 //
itemsize (f32 1, bf16 2, int8 / fp8 4): 8, 16 or 32 rows by 128 lanes. A
page [L, K, H] therefore occupies ``L * round_up(K, 8 * packing) *
round_up(H, 128)`` elements in HBM under that default tiling
(``tpu_kv_page_bytes``); a block shape whose two minor dims are neither
multiples of the tile nor the whole array does not lower.

Block sizes (``choose_blocks``), per item kind:

* q block ``bq`` (tokens per grid step): 128 by default (capped at T rounded
  up to 8; halved, down to 32, where no kv-head block fits the budget). A prefill chunk re-reads its KV once per q block, so 128 reads it
  4x less often than the 32 of JAX's default; decodes share a q block
  without cost, since each computes only its own tile (below).
* compute tiles inside a q block: a sequence with at most 8 rows in the
  block (``SHORT_RUN``: decode, short chunks) computes tiles of ``bs_small =
  8 // gcd(G, 8)`` tokens, the fewest whose bs * G rows fill whole f32
  sublane tiles (G = 8: 1 token, 8 rows, no waste; G = 4: 2; G = 1, 3, 7:
  8), instead of all bq * G rows of the q block; longer runs use tiles of
  ``bs_large`` tokens, the largest power of two <= max(8, 256 // G) dividing
  bq, so the score matmul has about 256 rows.
* kv block ``bp`` pages (bkv = bp * L positions): 256 // L pages by default.
* kv heads per grid step ``kb``: the largest divisor of K whose q block
  ``[bq, kb * G, H]`` tiles (kb * G a multiple of the q dtype's 8 * packing,
  or kb = K) and whose VMEM estimate (``vmem_bytes``) fits 12 MiB. The
  wrapper asks Mosaic for twice the estimate, at least 32 MiB and at most
  64 MiB (v7x's VMEM; v5e / v6e have 128 MiB), unless given a limit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

_LANES = 128
SHORT_RUN = 8              # rows of a sequence in a q block computed with small tiles
VMEM_BUDGET = 12 * 2**20   # default-size search budget; Mosaic's scoped limit is 16-32 MiB


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def sublane_tile(dtype) -> int:
    """Rows of one TPU (sublane) tile: 8 for 32-bit, 16 for bf16, 32 for int8/fp8."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def tpu_kv_page_bytes(page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Padded HBM bytes of one page of K (or of V) on TPU.

    A page is [L, K, H]; under XLA's default TPU tiling of the two minor dims
    (K, H) in tiles of (8 * packing, 128), K rounds up to 8 (f32), 16 (bf16)
    or 32 (int8, fp8) and H to 128. So SmolLM2's K = 3, H = 64 bf16 page
    holds 16 * 128 / (3 * 64) = 10.7x its data. XLA may choose a smaller
    tiling for a small second-minor dim, so this is an upper bound; the
    engine's memory accounting should use it instead of L * K * H * itemsize.
    Quantized pages carry scales besides (``tpu_kv_scale_page_bytes``).

    Args:
      page_size: L, tokens per page.
      num_kv_heads: K.
      head_dim: H.
      dtype: the page dtype (float32, bfloat16, int8, float8_e4m3fn).

    Returns:
      bytes (int).
    """
    dt = jnp.dtype(dtype)
    return page_size * round_up(num_kv_heads, sublane_tile(dt)) * round_up(head_dim, _LANES) \
        * dt.itemsize


def tpu_kv_scale_page_bytes(page_size: int, num_kv_heads: int) -> int:
    """Padded HBM bytes of one page of f32[P, L, K] scales (``quant.KVPages``):
    the minor dims (L, K) tile as (8, 128), so K <= 128 heads cost 128 lanes."""
    return round_up(page_size, 8) * round_up(num_kv_heads, _LANES) * 4


def schedule(cu_q_lens_S1, num_seqs, num_q_blks: int, bq: int):
    """Which sequences meet which q block (jnp, computed before the kernel).

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


def vmem_bytes(*, bq, kb, G, H, bp, L, q_dtype, kv_dtype, quantized, bs_large) -> int:
    """Estimated VMEM of one grid step: q and o blocks (double-buffered by
    Pallas), the f32 accumulator and statistics, the K/V double buffers and
    the largest score tile's temporaries."""
    Hp = round_up(H, _LANES)
    qo = 2 * 2 * bq * round_up(kb * G, sublane_tile(q_dtype)) * Hp * jnp.dtype(q_dtype).itemsize
    acc = bq * round_up(kb * G, 8) * Hp * 4
    stats = 2 * kb * bq * G * _LANES * 4
    kv = 2 * 2 * kb * bp * round_up(L, sublane_tile(kv_dtype)) * Hp * jnp.dtype(kv_dtype).itemsize
    scales = 2 * 2 * bp * round_up(L, 8) * round_up(kb, _LANES) * 4 if quantized else 0
    temps = 4 * bs_large * G * round_up(bp * L, _LANES) * 4 + 4 * bp * L * Hp * 4
    return qo + acc + stats + kv + scales + temps


def large_tile(bq: int, G: int) -> int:
    """bs_large (module docstring)."""
    bs = 8
    while bs * 2 <= max(8, 256 // G) and bq % (bs * 2) == 0:
        bs *= 2
    return bs


def choose_blocks(*, T, N, K, H, L, pages_per_seq, q_dtype, kv_dtype, quantized,
                  num_queries_per_block, num_kv_pages_per_block, num_kv_heads_per_block,
                  check_tiling: bool):
    """(bq, bp, kb, bs_small, bs_large, vmem estimate in bytes) for a call
    (module docstring).

    Raises:
      ValueError: naming the block size or dimension that does not fit; with
        ``check_tiling`` (compiling for TPU, not interpreting) also a kv-head
        block whose q block [bq, kb * G, H] does not tile.
    """
    G = N // K
    where = "ragged_paged_attention_tpu"
    if num_queries_per_block is not None and (num_queries_per_block < 8
                                              or num_queries_per_block % 8):
        raise ValueError(f"{where}: num_queries_per_block must be a positive multiple of 8, "
                         f"got {num_queries_per_block}")
    if num_kv_pages_per_block is not None and num_kv_pages_per_block < 1:
        raise ValueError(f"{where}: num_kv_pages_per_block must be >= 1, "
                         f"got {num_kv_pages_per_block}")
    if num_kv_heads_per_block is not None and (num_kv_heads_per_block < 1
                                               or K % num_kv_heads_per_block):
        raise ValueError(f"{where}: num_kv_heads_per_block must divide the kv heads K={K}, "
                         f"got {num_kv_heads_per_block}")
    if L % 8:
        raise ValueError(f"{where}: page_size must be a multiple of 8 (sublanes), got {L}")
    if check_tiling and H % 64:
        raise ValueError(f"{where}: head_dim must be a multiple of 64 on TPU (128 lanes, "
                         f"or 64 half-filled), got {H}")
    bp = min(num_kv_pages_per_block or max(1, 256 // L), pages_per_seq)
    q_tile = sublane_tile(q_dtype)

    def tiles(kb):
        return kb == K or (kb * G) % q_tile == 0

    def vmem(bq, kb):
        return vmem_bytes(bq=bq, kb=kb, G=G, H=H, bp=bp, L=L, q_dtype=q_dtype,
                          kv_dtype=kv_dtype, quantized=quantized, bs_large=large_tile(bq, G))

    if num_kv_heads_per_block is not None:
        kb = num_kv_heads_per_block
        if check_tiling and not tiles(kb):
            raise ValueError(
                f"{where}: num_kv_heads_per_block={kb} gives q blocks of {kb} * {G} = {kb * G} "
                f"heads, neither all {N} heads nor a multiple of {q_tile} ({jnp.dtype(q_dtype)} "
                f"sublane tile); Mosaic cannot tile that block")
        bq = min(num_queries_per_block or 128, round_up(T, 8))
    else:
        fits = [d for d in range(1, K + 1) if K % d == 0 and tiles(d)]
        # Largest kv-head block within budget; halve a default q block (to 32) if none is.
        for bq in [num_queries_per_block] if num_queries_per_block else (128, 64, 32):
            bq = min(bq, round_up(T, 8))
            small = [d for d in fits if vmem(bq, d) <= VMEM_BUDGET]
            if small:
                break
        kb = max(small) if small else min(fits)
    return bq, bp, kb, 8 // math.gcd(G, 8), large_tile(bq, G), vmem(bq, kb)
