"""The XLA:CPU ragged paged attention (``kernel_xla``) equals the definition,
``ref_ragged_paged_attention``, within 1e-5 in f32, over random mixed
batches: decode rows then prefill chunks, padded rows and tokens, kv length
0 and 1, rows sharing their first pages (a prefix-cache hit), sliding
windows, soft caps, and NaN in every page slot no row owns (unowned pages
and the tail of each row's last page), so any read outside a row's visible
keys poisons its output."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given, settings, strategies as st

from pallas_kernels.ragged_paged_attention import kernel_xla, reference as rpa

# Fixed padded shapes so hypothesis examples share compilations.
NUM_PAGES, WIDTH, T_PAD, S_PAD = 160, 16, 40, 8


def make_step(rng, dec_ctx, prefill, page_size, K, H, share):
    """A step of decode rows (kv_len = ctx + 1) then prefill rows
    (q_len, ctx): pages drawn at random, row i > 0 sharing row 0's first
    ``share`` full pages when both have them; NaN wherever no row has a key."""
    rows = [(1, c) for c in dec_ctx] + list(prefill)
    kv_lens = [c + q for q, c in rows]
    k_pages = np.full((NUM_PAGES, page_size, K, H), np.nan, np.float32)
    v_pages = np.full((NUM_PAGES, page_size, K, H), np.nan, np.float32)
    pi = np.zeros((S_PAD, WIDTH), np.int32)
    free = list(rng.permutation(NUM_PAGES))
    for i, n in enumerate(kv_lens):
        need = -(-n // page_size)
        shared = min(share, need - 1, kv_lens[0] // page_size) if i and share else 0
        shared = max(shared, 0)
        pages = list(pi[0, :shared]) + [free.pop() for _ in range(need - shared)]
        pi[i, :need] = pages
        for j, p in enumerate(pages[shared:], start=shared):
            m = min(page_size, n - j * page_size)  # keys held in this page
            k_pages[p, :m] = rng.standard_normal((m, K, H))
            v_pages[p, :m] = rng.standard_normal((m, K, H))
    cu = np.zeros(S_PAD + 1, np.int32)
    cu[1:len(rows) + 1] = np.cumsum([q for q, _ in rows])
    cu[len(rows) + 1:] = cu[len(rows)]
    kv = np.zeros(S_PAD, np.int32)
    kv[:len(rows)] = kv_lens
    return k_pages, v_pages, kv, pi, cu, len(rows)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       dec_ctx=st.lists(st.integers(0, 60), max_size=4),
       prefill=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 50)), max_size=3),
       page_size=st.sampled_from([1, 4, 8]),
       gqa=st.sampled_from([(4, 4), (6, 2), (4, 1)]),
       window=st.sampled_from([None, 1, 5, 17]),
       cap=st.sampled_from([None, 0.5, 30.0]),
       blocks=st.sampled_from([(1, 4), (2, 16), (8, 128)]),
       share=st.integers(0, 3))
# kv length 0 (a row with no keys and no queries) and 1, between padded rows.
@example(seed=1, dec_ctx=[0, 0], prefill=[(0, 0), (1, 0), (12, 30)], page_size=4,
         gqa=(6, 2), window=None, cap=None, blocks=(2, 16), share=0)
# Every row shares row 0's pages; a window shorter than one page block.
@example(seed=2, dec_ctx=[40, 45, 50, 60], prefill=[(12, 40)], page_size=8, gqa=(4, 1),
         window=5, cap=0.5, blocks=(1, 4), share=3)
def test_xla_attention_equals_reference(seed, dec_ctx, prefill, page_size, gqa, window, cap,
                                        blocks, share):
    rng = np.random.default_rng(seed)
    N, K = gqa
    H = 8
    # Keep every row inside the page table.
    prefill = [(q, min(c, WIDTH * page_size - q)) for q, c in prefill]
    dec_ctx = [min(c, WIDTH * page_size - 1) for c in dec_ctx]
    if not dec_ctx and not prefill:
        dec_ctx = [0]
    k_pages, v_pages, kv, pi, cu, n = make_step(rng, dec_ctx, prefill, page_size, K, H, share)
    if cu[n] > T_PAD:
        return
    q = rng.standard_normal((T_PAD, N, H)).astype(np.float32)
    args = tuple(jnp.asarray(a) for a in (q, k_pages, v_pages, kv, pi, cu)) + (
        jnp.asarray([n], jnp.int32),)
    opts = dict(sm_scale=H ** -0.5, sliding_window=window, soft_cap=cap)
    want = np.asarray(rpa.ref_ragged_paged_attention(*args, **opts))
    ppb, qb = blocks
    for nd in (len(dec_ctx), 0):  # decode rows by the decode path, then all as prefill
        got = np.asarray(kernel_xla.ragged_paged_attention(
            *args, jnp.asarray([nd], jnp.int32), pages_per_block=ppb, q_block=qb, **opts))
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(got[cu[n]:], 0.0)  # padded tokens


def test_padding_rows_are_ignored():
    """Rows past ``num_seqs`` are padding whatever their kv_lens and page
    table entries say: one real row of 64, then the padding rows rewritten
    to claim every page of the cache, gives the same output bit for bit and
    zeros outside the real row. (That they cost nothing is a benchmark's
    business: ``pallas_kernels/bench.py``.)"""
    rng = np.random.default_rng(0)
    K, H, L = 2, 8, 4
    k_pages = jnp.asarray(rng.standard_normal((64, L, K, H)), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal((64, L, K, H)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((64, 4, H)), jnp.float32)
    pi = np.zeros((64, 16), np.int32)
    pi[0, :3] = [5, 9, 2]
    kv = np.zeros(64, np.int32)
    kv[0] = 10
    cu = np.minimum(np.arange(65), 1).astype(np.int32)
    f = jax.jit(lambda kv, pi: kernel_xla.ragged_paged_attention(
        q, k_pages, v_pages, kv, pi, jnp.asarray(cu), jnp.asarray([1]), jnp.asarray([1]),
        sm_scale=0.3))
    a = np.asarray(f(jnp.asarray(kv), jnp.asarray(pi)))
    kv2, pi2 = kv.copy(), pi.copy()
    kv2[1:] = 64 * L  # padding rows claiming the whole cache
    pi2[1:] = rng.integers(0, 64, size=(63, 16))
    b = np.asarray(f(jnp.asarray(kv2), jnp.asarray(pi2)))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a[0]).sum() > 0 and not np.abs(a[1:]).any()


def test_bad_block_sizes():
    q = jnp.zeros((4, 2, 8))
    pages = jnp.zeros((4, 4, 1, 8))
    args = (q, pages, pages, jnp.zeros(2, jnp.int32), jnp.zeros((2, 2), jnp.int32),
            jnp.zeros(3, jnp.int32), jnp.asarray([0]))
    with pytest.raises(ValueError, match="pages_per_block"):
        kernel_xla.ragged_paged_attention(*args, sm_scale=1.0, pages_per_block=0)
    with pytest.raises(ValueError, match="q must be"):
        kernel_xla.ragged_paged_attention(q[0], pages, pages, *args[3:], sm_scale=1.0)
