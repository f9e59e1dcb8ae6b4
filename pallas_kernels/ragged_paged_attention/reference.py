"""Pure-XLA ragged paged attention: the CPU path and the reference for kernels.

Dimension letters: T packed query tokens, B sequences (decode), S kv positions
of one sequence, N query heads, K kv heads, G = N // K query heads per kv head,
H head dim, P pages, L page size.

Semantics follow JAX's ``pallas/ops/tpu/ragged_paged_attention`` reference
(``ref_ragged_paged_attention``): the new tokens' K/V are written into the
pages *before* attention, ``kv_lens`` counts them, and query token ``j`` of
sequence ``i`` sits at absolute position ``kv_lens[i] - q_len_i + j`` and sees
kv positions ``<=`` its own (causal). Softmax and accumulation are in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _attend(q_QKGH, k_SKH, v_SKH, mask_QS, sm_scale):
    """Masked GQA attention of one block; f32 softmax. Returns o [Q, K, G, H] f32."""
    s_KGQS = jnp.einsum("qkgh,skh->kgqs", q_QKGH.astype(jnp.float32),
                        k_SKH.astype(jnp.float32)) * sm_scale
    s_KGQS = jnp.where(mask_QS[None, None], s_KGQS, _MASK_VALUE)
    p_KGQS = jax.nn.softmax(s_KGQS, axis=-1)
    return jnp.einsum("kgqs,skh->qkgh", p_KGQS, v_SKH.astype(jnp.float32))


def paged_decode_attention(q_BNH, k_pages_PLKH, v_pages_PLKH, kv_lens_B,
                           page_indices_BP, *, sm_scale: float):
    """Attention of one new token per sequence over its pages.

    Args:
      q_BNH: [B, N, H] queries, one token per sequence.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] the cache of one layer.
      kv_lens_B: i32[B] kv length of each sequence, the new token included;
        0 for padding rows (their output is garbage and must be ignored).
      page_indices_BP: i32[B, pages_per_seq] page ids of each sequence in order.
      sm_scale: softmax scale, usually H ** -0.5.

    Returns:
      o_BNH: [B, N, H] in q's dtype.
    """
    B, N, H = q_BNH.shape
    _, L, K, _ = k_pages_PLKH.shape
    G = N // K
    k_BSKH = k_pages_PLKH[page_indices_BP].reshape(B, -1, K, H)
    v_BSKH = v_pages_PLKH[page_indices_BP].reshape(B, -1, K, H)
    S = k_BSKH.shape[1]
    q_BKGH = q_BNH.reshape(B, K, G, H).astype(jnp.float32)
    s_BKGS = jnp.einsum("bkgh,bskh->bkgs", q_BKGH, k_BSKH.astype(jnp.float32)) * sm_scale
    mask_BS = jnp.arange(S)[None, :] < kv_lens_B[:, None]
    s_BKGS = jnp.where(mask_BS[:, None, None, :], s_BKGS, _MASK_VALUE)
    p_BKGS = jax.nn.softmax(s_BKGS, axis=-1)
    o_BKGH = jnp.einsum("bkgs,bskh->bkgh", p_BKGS, v_BSKH.astype(jnp.float32))
    return o_BKGH.reshape(B, N, H).astype(q_BNH.dtype)


def ragged_paged_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                           cu_q_lens_S1, num_seqs, *, max_q_len: int, sm_scale: float):
    """Causal attention for a packed ragged batch (prefill or chunked prefill).

    Sequences are processed one after another in a ``fori_loop``; each reads a
    fixed window of ``max_q_len`` query rows that covers its own rows (the
    window start is clamped so it stays inside T) and merges only its own rows
    back, so the work is ``num_seqs * max_q_len * S``: the scheduler keeps
    ``num_seqs * max_q_len`` near the token budget.

    Args:
      q_TNH: [T, N, H] queries of all sequences, packed in order.
      k_pages_PLKH, v_pages_PLKH: [P, L, K, H] one layer's cache, already
        holding this step's K/V.
      kv_lens_S: i32[max_seqs] kv length per sequence, new tokens included.
      page_indices_SP: i32[max_seqs, pages_per_seq].
      cu_q_lens_S1: i32[max_seqs + 1] prefix sums of query lengths.
      num_seqs: i32 scalar (or shape [1]) count of real sequences.
      max_q_len: static bound on any sequence's query length (<= T).
      sm_scale: softmax scale.

    Returns:
      o_TNH: [T, N, H] in q's dtype; rows past ``cu_q_lens[num_seqs]`` are 0.
    """
    T, N, H = q_TNH.shape
    _, L, K, _ = k_pages_PLKH.shape
    G = N // K
    Q = min(max_q_len, T)
    q_TKGH = q_TNH.reshape(T, K, G, H)
    S = page_indices_SP.shape[1] * L

    def body(i, out_TKGH):
        q_start = cu_q_lens_S1[i]
        q_len = cu_q_lens_S1[i + 1] - q_start
        kv_len = kv_lens_S[i]
        start = jnp.minimum(q_start, T - Q)
        row_Q = jnp.arange(Q) - (q_start - start)  # index within this sequence's queries
        own_Q = (row_Q >= 0) & (row_Q < q_len)
        q_QKGH = jax.lax.dynamic_slice(q_TKGH, (start, 0, 0, 0), (Q, K, G, H))
        k_SKH = k_pages_PLKH[page_indices_SP[i]].reshape(S, K, H)
        v_SKH = v_pages_PLKH[page_indices_SP[i]].reshape(S, K, H)
        q_pos_Q = kv_len - q_len + row_Q
        kv_pos_S = jnp.arange(S)
        mask_QS = own_Q[:, None] & (kv_pos_S[None, :] <= q_pos_Q[:, None]) \
            & (kv_pos_S[None, :] < kv_len)
        o_QKGH = _attend(q_QKGH, k_SKH, v_SKH, mask_QS, sm_scale)
        old_QKGH = jax.lax.dynamic_slice(out_TKGH, (start, 0, 0, 0), (Q, K, G, H))
        new_QKGH = jnp.where(own_Q[:, None, None, None], o_QKGH, old_QKGH)
        return jax.lax.dynamic_update_slice(out_TKGH, new_QKGH, (start, 0, 0, 0))

    out = jax.lax.fori_loop(0, jnp.reshape(num_seqs, ()), body,
                            jnp.zeros((T, K, G, H), jnp.float32))
    return out.reshape(T, N, H).astype(q_TNH.dtype)
