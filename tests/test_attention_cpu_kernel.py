"""The CPU attention kernels (``ragged_paged_attention/kernel_cpu``): the
decode rows and the prefill rows against ``ref_ragged_paged_attention`` at
every instruction set level, a mixed decode + prefill batch through
``kernel_xla`` (both kinds of rows by the kernels) inside jit and scan,
``JAXSERVE_CPU_KERNELS=0`` against the kernels, and a tiny engine whose greedy
tokens are the same either way. Skipped where the library was not built (no
compiler).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_xla, quant
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention
from tests.test_quant import _greedy, _llm

needs_kernel = pytest.mark.skipif(not kernel_cpu.available(), reason="kernel_cpu not built")


def _case(K, G, H, kv_lens, q_lens=None, L=4, pages_per_seq=9, seed=0):
    """Random q, pages (NaN in every page no row owns) and a shuffled page
    table; ``q_lens`` (default all 1) packs the rows' queries."""
    rng = np.random.default_rng(seed)
    S = len(kv_lens)
    q_lens = [1] * S if q_lens is None else q_lens
    T = sum(q_lens) + 2  # two padding tokens owned by no row
    P = S * pages_per_seq + 3
    ids = rng.permutation(P)[:S * pages_per_seq].reshape(S, pages_per_seq).astype(np.int32)
    k = rng.standard_normal((P, L, K, H)).astype(np.float32)
    v = rng.standard_normal((P, L, K, H)).astype(np.float32)
    for s in range(S):  # pages past a row's kv length hold garbage
        used = -(-kv_lens[s] // L)
        k[ids[s, used:]] = np.nan
        v[ids[s, used:]] = np.nan
    q = rng.standard_normal((T, K * G, H)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, k, v, np.asarray(kv_lens, np.int32), ids, cu


def _int8(k, v):
    """int8 pages and f32[P, L, K] scales (``quant``); NaN pages get NaN scales."""
    out = []
    for x in (k, v):
        P, L, K, H = x.shape
        qx, sx = quant.quantize(jnp.asarray(np.nan_to_num(x)).reshape(P * L, K, H), jnp.int8)
        sx = np.array(sx).reshape(P, L, K)
        sx[np.isnan(x).any(-1)] = np.nan
        out += [np.asarray(qx).reshape(P, L, K, H), sx]
    return out


def _ref(q, k, v, kv, ids, cu, n, **kw):
    return np.array(ref_ragged_paged_attention(
        jnp.asarray(q), k, v, kv, ids, cu, jnp.int32(n), **kw))


CASES = [  # K, G, H, window, soft_cap
    (2, 1, 64, None, None),
    (3, 3, 64, 7, None),
    (1, 3, 128, None, 5.0),
    (2, 3, 128, 13, 2.0),
    (1, 2, 24, 5, None),  # H no vector width divides: scalar
    (1, 9, 32, 6, None),  # G above the kernel's unrolled 1..8
]


@needs_kernel
@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("K,G,H,window,cap", CASES)
def test_decode_rows_match_reference(K, G, H, window, cap, isa, dtype):
    """Ragged kv lens incl. 0, exact page multiples (8, 36) and one past; rows
    past num_decode are 0; NaN pages (int8: NaN scales) no row owns never leak."""
    kv_lens = [5, 0, 8, 36, 1, 17, 9]
    q, k, v, kv, ids, cu = _case(K, G, H, kv_lens)
    nd = 6
    kw = dict(sm_scale=H ** -0.5, sliding_window=window, soft_cap=cap)
    if dtype == "int8":
        k, ks, v, vs = _int8(k, v)
        kw |= dict(k_scales_PLK=ks, v_scales_PLK=vs)
    got = np.asarray(kernel_cpu.decode_attention(q, k, v, kv, ids, nd, isa=isa, **kw))
    ref = _ref(q, k, v, kv, ids, cu, nd, **kw)
    ref[nd:] = 0
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5)
    assert not got[1].any() and not got[nd:].any()  # kv_len 0, and rows past num_decode


@needs_kernel
@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_rows_split_over_threads(threads, dtype):
    """Few rows and long ones (page size 16: AVX-512 reduces 16 positions'
    scores at once): positions split over the pool (flash-decoding merge),
    with a traced window; the same as the reference."""
    q, k, v, kv, ids, cu = _case(1, 3, 64, [700, 413], L=16, pages_per_seq=48, seed=2)
    sc = {}
    if dtype == "int8":
        k, ks, v, vs = _int8(k, v)
        sc = dict(k_scales_PLK=ks, v_scales_PLK=vs)
    for window in (None, 300):
        kw = dict(sm_scale=0.125, soft_cap=None, **sc)
        got = np.asarray(jax.jit(lambda w: kernel_cpu.decode_attention(
            q, k, v, kv, ids, 2, sliding_window=w, threads=threads, **kw))(
            jnp.int32(kernel_cpu.NO_WINDOW if window is None else window)))
        ref = _ref(q, k, v, kv, ids, cu, 2, sliding_window=window, **kw)
        ref[2:] = 0
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5)


PREFILL_CASES = CASES + [  # K, G, H, window, soft_cap
    (1, 8, 64, 3, 4.0),
    (2, 8, 20, None, None),  # H not a multiple of 8: scalar
]


@needs_kernel
@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("K,G,H,window,cap", PREFILL_CASES)
def test_prefill_rows_match_reference(K, G, H, window, cap, isa, dtype):
    """Two decode rows (0 out of this kernel), then prefill rows: chunked (q_len
    < kv_len), whole, q_len 1, kv_len 0 with no query, exact page multiples;
    two padding tokens and rows past num_seqs are 0; NaN pages (int8: NaN
    scales) no row owns never leak."""
    kv_lens = [6, 1, 9, 3, 12, 0, 20, 8, 5]
    q_lens = [1, 1, 5, 1, 12, 0, 7, 8, 2]
    q, k, v, kv, ids, cu = _case(K, G, H, kv_lens, q_lens=q_lens, seed=3)
    kw = dict(sm_scale=H ** -0.5, sliding_window=window, soft_cap=cap)
    if dtype == "int8":
        k, ks, v, vs = _int8(k, v)
        kw |= dict(k_scales_PLK=ks, v_scales_PLK=vs)
    got = np.asarray(kernel_cpu.prefill_attention(q, k, v, kv, ids, cu, 8, 2, isa=isa, **kw))
    ref = _ref(q, k, v, kv, ids, cu, 8, **kw)
    ref[:2] = 0
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5)
    assert not got[:2].any() and not got[cu[8]:].any()  # decode rows, row 8, padding


@needs_kernel
@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_prefill_over_threads(threads, dtype):
    """Page size 16, sequences long enough for several query blocks and key
    tiles a unit (a chunk of 150 after 250 cached, a whole 230), traced window
    or none, over one or two threads; the same as the reference."""
    q, k, v, kv, ids, cu = _case(3, 3, 64, [400, 230], q_lens=[150, 230], L=16,
                                 pages_per_seq=26, seed=4)
    sc = {}
    if dtype == "int8":
        k, ks, v, vs = _int8(k, v)
        sc = dict(k_scales_PLK=ks, v_scales_PLK=vs)
    for window in (None, 100):
        kw = dict(sm_scale=0.125, soft_cap=None, **sc)
        got = np.asarray(jax.jit(lambda w: kernel_cpu.prefill_attention(
            q, k, v, kv, ids, cu, 2, 0, sliding_window=w, threads=threads, **kw))(
            jnp.int32(kernel_cpu.NO_WINDOW if window is None else window)))
        ref = _ref(q, k, v, kv, ids, cu, 2, sliding_window=window, **kw)
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5)


def _mixed():
    # 3 decode rows (kv 6, 16 = 4 pages exactly, 1), then prefills of 5 and 3 tokens.
    return _case(2, 3, 64, [6, 16, 1, 9, 3], q_lens=[1, 1, 1, 5, 3], seed=1)


@needs_kernel
@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_mixed_batch_in_jit_and_scan(monkeypatch, dtype):
    """kernel_xla with the kernels: decode and prefill rows by them, under jit
    and scanned over two layers (a traced window each); equal to the
    reference, and to the XLA path with ``JAXSERVE_CPU_KERNELS=0``."""
    q, k, v, kv, ids, cu = _mixed()
    scales = [None, None]
    if dtype == "int8":
        k, ks, v, vs = _int8(k, v)
        scales = [np.stack([ks, ks[::-1]]), np.stack([vs, vs[::-1]])]
    k2, v2 = np.stack([k, k[::-1]]), np.stack([v, v[::-1]])
    ids2 = np.stack([ids, k.shape[0] - 1 - ids])
    windows = jnp.asarray([kernel_cpu.NO_WINDOW, 4], jnp.int32)
    kw = dict(sm_scale=0.125, soft_cap=3.0)

    def run():
        def layer(c, xs):
            kl, vl, il, w, ksl, vsl = xs
            return c, kernel_xla.ragged_paged_attention(
                jnp.asarray(q), kl, vl, kv, il, cu, jnp.int32(5), jnp.int32(3),
                sliding_window=w, k_scales_PLK=ksl, v_scales_PLK=vsl, **kw)
        fn = jax.jit(lambda: jax.lax.scan(layer, 0, (k2, v2, ids2, windows, *scales))[1])
        return np.asarray(fn()), fn.lower().as_text()

    on, text = run()
    assert f"jaxserve_rpa_decode_{dtype}" in text and f"jaxserve_rpa_prefill_{dtype}" in text
    for i, w in enumerate((None, 4)):
        sc = {} if dtype == "f32" else dict(k_scales_PLK=scales[0][i], v_scales_PLK=scales[1][i])
        ref = _ref(q, k2[i], v2[i], kv, ids2[i], cu, 5, sliding_window=w, **kw, **sc)
        np.testing.assert_allclose(on[i], ref, atol=2e-6, rtol=1e-5)
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "0")
    off, text = run()
    assert "jaxserve_rpa_decode" not in text and "jaxserve_rpa_prefill" not in text
    np.testing.assert_allclose(off, on, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kv", [None, "int8"])
def test_engine_greedy_tokens_same_with_kernel_and_fallback(monkeypatch, kv):
    """A tiny engine (H 16, G 2; f32 or int8 KV cache): the same greedy tokens
    with the decode and prefill kernels traced into its steps and with the XLA
    paths."""
    kw = {} if kv is None else dict(kv_cache_dtype=kv)
    calls = []

    def tracer(name):
        real = getattr(kernel_cpu, name)

        def traced(*a, **kw):
            calls.append((name, jnp.dtype(a[1].dtype).name))
            return real(*a, **kw)
        return traced
    for name in ("decode_attention", "prefill_attention"):
        monkeypatch.setattr(kernel_cpu, name, tracer(name))
    with_kernel = _greedy(_llm(**kw))
    # the cache's pages went to both kernels
    assert set(calls) == {(n, kv or "float32") for n in ("decode_attention", "prefill_attention")}
    calls.clear()
    monkeypatch.setattr(kernel_cpu, "available", lambda: False)
    fallback = _greedy(_llm(**kw))
    assert not calls
    assert with_kernel == fallback
