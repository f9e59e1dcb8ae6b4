"""Ragged paged attention (the reference and the engine's XLA path) vs a
dense numpy attention, over random ragged batches. Pages no sequence owns are filled with NaN, so any read
outside a sequence's page table poisons the output (JAX tests/pallas style)."""

import numpy as np
import jax.numpy as jnp
from hypothesis import example, given, settings, strategies as st

from pallas_kernels.ragged_paged_attention import kernel_xla, reference as rpa


def dense_attention(q_NH, k_SKH, v_SKH, q_pos, scale, window=None, cap=None):
    """Causal GQA attention of queries at positions q_pos over unpaged k/v
    [S, K, H], in float64: a query at position p sees kv positions
    max(0, p - window + 1) .. p; scores are soft-capped as cap * tanh(s / cap)."""
    N, K = q_NH.shape[1], k_SKH.shape[1]
    G = N // K
    out = np.zeros_like(q_NH, dtype=np.float64)
    for t, pos in enumerate(q_pos):
        lo = 0 if window is None else max(0, pos - window + 1)
        for n in range(N):
            k, v = k_SKH[lo:pos + 1, n // G].astype(np.float64), v_SKH[lo:pos + 1, n // G]
            s = k @ q_NH[t, n].astype(np.float64) * scale
            if cap is not None:
                s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            out[t, n] = (p / p.sum()) @ v
    return out


# Fixed padded shapes, so hypothesis examples share compilations.
NUM_PAGES, WIDTH, T_PAD, MAX_SEQS, MAX_Q = 200, 32, 48, 5, 16


def make_batch(rng, q_lens, ctx_lens, page_size, K, H, num_pages=NUM_PAGES):
    """Random pages for sequences whose kv_len = ctx + q; returns the cache,
    page table [len, WIDTH] and the dense K/V of each sequence."""
    kv_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [-(-n // page_size) for n in kv_lens]
    perm = rng.permutation(num_pages)
    k_pages = np.full((num_pages, page_size, K, H), np.nan, np.float32)
    v_pages = np.full((num_pages, page_size, K, H), np.nan, np.float32)
    width = WIDTH
    page_indices = np.zeros((len(q_lens), width), np.int32)
    dense, used = [], 0
    for i, (n, p) in enumerate(zip(kv_lens, need)):
        pages = perm[used:used + p]
        used += p
        page_indices[i, :p] = pages
        page_indices[i, p:] = pages[0]  # padding entries point at an owned page
        k = rng.standard_normal((p * page_size, K, H)).astype(np.float32)
        v = rng.standard_normal((p * page_size, K, H)).astype(np.float32)
        k_pages[pages] = k.reshape(p, page_size, K, H)
        v_pages[pages] = v.reshape(p, page_size, K, H)
        dense.append((k[:n], v[:n]))
    return k_pages, v_pages, np.asarray(kv_lens, np.int32), page_indices, dense


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       q_lens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       ctx=st.lists(st.integers(0, 20), min_size=4, max_size=4),
       page_size=st.sampled_from([1, 4, 8]),
       gqa=st.sampled_from([(4, 4), (4, 2), (6, 2)]))
# The last sequence ends at row T with q_len < max_q_len: its window is clamped.
@example(seed=1, q_lens=[12, 12, 12, 12], ctx=[0, 5, 20, 3], page_size=4, gqa=(4, 2))
@example(seed=2, q_lens=[3, 12, 1], ctx=[7, 0, 19, 0], page_size=1, gqa=(6, 2))
def test_ragged_prefill_matches_dense(seed, q_lens, ctx, page_size, gqa):
    rng = np.random.default_rng(seed)
    N, K = gqa
    H = 8
    ctx = ctx[:len(q_lens)]
    k_pages, v_pages, kv_lens, page_indices, dense = make_batch(
        rng, q_lens, ctx, page_size, K, H)
    T = T_PAD  # padding rows after the real ones
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    max_seqs = MAX_SEQS  # padding sequence slots after the real ones
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    kv = np.zeros(max_seqs, np.int32)
    kv[:len(q_lens)] = kv_lens
    pi = np.zeros((max_seqs, page_indices.shape[1]), np.int32)
    pi[:len(q_lens)] = page_indices
    out = np.asarray(kernel_xla.ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv),
        jnp.asarray(pi), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32),
        sm_scale=H ** -0.5, q_block=MAX_Q, pages_per_block=4))
    assert np.isfinite(out).all()
    for i, ql in enumerate(q_lens):
        k, v = dense[i]
        q_pos = np.arange(kv_lens[i] - ql, kv_lens[i])
        ref = dense_attention(q[cu[i]:cu[i + 1]], k, v, q_pos, H ** -0.5)
        np.testing.assert_allclose(out[cu[i]:cu[i + 1]], ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[cu[len(q_lens)]:], 0.0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       ctx=st.lists(st.integers(0, 30), min_size=1, max_size=6),
       page_size=st.sampled_from([1, 4, 16]),
       gqa=st.sampled_from([(4, 4), (6, 2), (8, 1)]))
def test_paged_decode_matches_dense(seed, ctx, page_size, gqa):
    rng = np.random.default_rng(seed)
    N, K = gqa
    H = 8
    B = len(ctx)
    k_pages, v_pages, kv_lens, page_indices, dense = make_batch(
        rng, [1] * B, ctx, page_size, K, H)
    q = rng.standard_normal((B, N, H)).astype(np.float32)
    out = np.asarray(kernel_xla.ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv_lens),
        jnp.asarray(page_indices), jnp.arange(B + 1, dtype=jnp.int32), jnp.asarray([B]),
        jnp.asarray([B]), sm_scale=H ** -0.5, pages_per_block=4))
    for b in range(B):
        k, v = dense[b]
        ref = dense_attention(q[b:b + 1], k, v, [kv_lens[b] - 1], H ** -0.5)
        np.testing.assert_allclose(out[b:b + 1], ref, atol=2e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       q_lens=st.lists(st.integers(0, 12), min_size=1, max_size=4),
       ctx=st.lists(st.integers(0, 40), min_size=4, max_size=4),
       page_size=st.sampled_from([1, 4, 8]),
       gqa=st.sampled_from([(4, 4), (4, 2), (8, 2), (4, 1)]),
       window=st.sampled_from([None, 1, 5, 17]),
       cap=st.sampled_from([None, 0.5, 30.0]))
# A sequence with no new tokens (q_len 0) between two that have some.
@example(seed=3, q_lens=[5, 0, 1], ctx=[9, 30, 40, 0], page_size=4, gqa=(8, 2),
         window=5, cap=0.5)
def test_reference_matches_dense_unpaged(seed, q_lens, ctx, page_size, gqa, window, cap):
    """``ref_ragged_paged_attention`` (the definition the Pallas kernels are
    tested against) and the engine's XLA path both equal dense causal
    attention computed from each sequence's unpaged K/V, with sliding windows
    and soft caps; unused pages hold NaN and padded rows come back 0."""
    rng = np.random.default_rng(seed)
    N, K = gqa
    H = 8
    # 1 <= kv_len <= the page table's width.
    ctx = [min(max(c, 1 - q), WIDTH * page_size - q) for c, q in zip(ctx, q_lens)]
    k_pages, v_pages, kv_lens, page_indices, dense = make_batch(
        rng, q_lens, ctx, page_size, K, H)
    T = T_PAD
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    cu = np.zeros(MAX_SEQS + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    kv = np.zeros(MAX_SEQS, np.int32)
    kv[:len(q_lens)] = kv_lens
    pi = np.zeros((MAX_SEQS, page_indices.shape[1]), np.int32)
    pi[:len(q_lens)] = page_indices
    args = (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv),
            jnp.asarray(pi), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32))
    opts = dict(sm_scale=H ** -0.5, sliding_window=window, soft_cap=cap)
    ref = np.asarray(rpa.ref_ragged_paged_attention(*args, **opts))
    xla = np.asarray(kernel_xla.ragged_paged_attention(*args, q_block=MAX_Q, **opts))
    assert np.isfinite(ref).all() and np.isfinite(xla).all()
    for i, ql in enumerate(q_lens):
        k, v = dense[i]
        q_pos = np.arange(kv_lens[i] - ql, kv_lens[i])
        want = dense_attention(q[cu[i]:cu[i + 1]], k, v, q_pos, H ** -0.5, window, cap)
        np.testing.assert_allclose(ref[cu[i]:cu[i + 1]], want, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(xla[cu[i]:cu[i + 1]], want, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(ref[cu[len(q_lens)]:], 0.0)
    np.testing.assert_array_equal(xla[cu[len(q_lens)]:], 0.0)
