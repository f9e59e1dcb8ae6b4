"""The static plan of a ``kernel_gpu`` call: q blocks, kv splits, addressing.

Dimension letters as ``kernel_gpu``'s. Everything here is decided from
shapes (``_num_blocks``, ``choose_kv_splits``, ``check_addressing``) or
computed by plain jnp before the kernel runs (``_schedule``); the reasoning
behind each choice is in ``kernel_gpu``'s module docstring.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

_MIN_MMA_ROWS = 16          # Triton's smallest dot tile (m, n and k)
_TARGET_PROGRAMS = 512      # ~4 programs per SM of an H100/H200 (132 SMs)
_MAX_KV_SPLITS = 16         # JAX decode_attention.py's default k_splits
_MIN_KV_PER_SPLIT = 256     # kv positions: a split walks at least a few kv blocks


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _num_blocks(T: int, block_q: int, max_seqs: int) -> int:
    """Static bound on the q blocks of any batch: sum_i cdiv(q_len_i, block_q)
    <= T / block_q + (sequences with q_len > 0), and each block holds >= 1 row."""
    return max(1, min(T, pl.cdiv(T, block_q) + max_seqs))


def choose_kv_splits(num_blocks: int, num_kv_heads: int, max_kv_len: int) -> int:
    """The static number of kv splits Z of a pass (flash-decoding).

    ``num_blocks * num_kv_heads`` programs at most are live without splits;
    splits bring them up towards ``_TARGET_PROGRAMS``, at most
    ``_MAX_KV_SPLITS`` and at most one per ``_MIN_KV_PER_SPLIT`` positions of
    ``max_kv_len`` (the longest context the page table can hold,
    ``pages_per_seq * L``). Returns an int >= 1.
    """
    by_work = pl.cdiv(_TARGET_PROGRAMS, max(1, num_blocks * num_kv_heads))
    by_len = pl.cdiv(max_kv_len, _MIN_KV_PER_SPLIT)
    return max(1, min(_MAX_KV_SPLITS, by_work, by_len))


def check_addressing(pages_PLKH) -> None:
    """Refuse a cache the Triton lowering would address with wrapping offsets.

    JAX's Triton lowering uses i32 element offsets for arrays of at most
    2^32 bytes (i64 above), and ``tt.addptr`` sign-extends them, so an array
    of more than 2^31 elements but at most 2^32 bytes (only 1-byte dtypes:
    int8, float8_e4m3fn) would read wrong addresses.

    Raises:
      ValueError: naming the shape, dtype, element count and bytes, and the
        largest page count that fits.
    """
    shape, dtype = tuple(pages_PLKH.shape), jnp.dtype(pages_PLKH.dtype)
    n = 1
    for d in shape:
        n *= int(d)
    if n > 2**31 and n * dtype.itemsize <= 2**32:
        per_page = n // max(1, shape[0])
        raise ValueError(
            f"ragged_paged_attention_gpu: the {dtype} cache of shape {shape} has {n} elements "
            f"({n * dtype.itemsize} bytes): over 2^31 elements but not over 2^32 bytes, where "
            f"the Triton lowering addresses it with 32-bit offsets that wrap; use at most "
            f"{2**31 // per_page} pages of {per_page} elements (or more than "
            f"{2**32 // (per_page * dtype.itemsize)}), or the XLA attention")


def _schedule(cu_q_lens_S1, num_seqs, *, block_q: int, num_blocks: int, min_q_len: int = 1,
              max_q_len: int | None = None):
    """Cut the query rows of each sequence with ``min_q_len <= q_len <=
    max_q_len`` (None: no upper bound) into blocks of ``block_q`` tokens.

    Returns:
      block_seq: i32[num_blocks] sequence of each block, -1 past the last one.
      block_q_start: i32[num_blocks] first packed query row of each block.
    """
    max_seqs = cu_q_lens_S1.shape[0] - 1
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    q_lens_S = jnp.where(jnp.arange(max_seqs) < n, cu_q_lens_S1[1:] - cu_q_lens_S1[:-1], 0)
    chosen_S = q_lens_S >= max(1, min_q_len)
    if max_q_len is not None:
        chosen_S &= q_lens_S <= max_q_len
    nb_S = jnp.where(chosen_S, (q_lens_S + block_q - 1) // block_q, 0)
    cum_S = jnp.cumsum(nb_S)                                   # inclusive
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq_B = jnp.minimum(jnp.searchsorted(cum_S, b, side="right"), max_seqs - 1)
    start_B = cu_q_lens_S1[seq_B] + (b - (cum_S[seq_B] - nb_S[seq_B])) * block_q
    block_seq = jnp.where(b < cum_S[-1], seq_B, -1).astype(jnp.int32)
    return block_seq, start_B.astype(jnp.int32)
