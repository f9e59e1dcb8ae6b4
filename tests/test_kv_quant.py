"""Quantized KV cache (``pallas_kernels/ragged_paged_attention/quant.py``).

Layers, as elsewhere: the int8/fp8 round trip of ``write_kv``; every
attention lowering (XLA, the Pallas GPU kernel and the Pallas TPU kernel,
both interpreted) on quantized pages vs the reference on the same pages,
with everything no sequence owns NaN (int8 has no NaN: there the scales
are NaN, which poisons the dequantized values the same way); page
accounting; the fp8 backend check; the engine on a tiny random model (int8
close to f32 KV, prefix-cached vs cold identical, preemption); and SmolLM2
135M's greedy tokens with int8 vs f32 KV.
"""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.runner import ModelRunner
from pallas_kernels.ragged_paged_attention import kernel as rpa_kernel
from pallas_kernels.ragged_paged_attention import kernel_xla
from pallas_kernels.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.quant import (KVPages, check_kv_cache_dtype,
                                                         fp8_kv_supported, quantize)
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention

QUANT = [jnp.int8, jnp.float8_e4m3fn]


# ---- write_kv round trip -------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANT)
def test_write_kv_round_trip(dtype):
    """write_kv quantizes per (token, kv head); int8 errs by <= scale / 2 per
    element, fp8 by <= 2^-4 relative (3 mantissa bits) or half its smallest
    subnormal step; dropped (padding) writes leave the pages alone."""
    P, L, K, H, T = 6, 4, 3, 64, 9
    rng = np.random.default_rng(0)
    x_TKH = rng.standard_normal((T, K, H)).astype(np.float32) \
        * rng.choice([1e-3, 1.0, 30.0, 1e3], (T, K, 1))
    x_TKH[2, 1] = 0.0  # an all-zero row: scale 0
    pages = KVPages(jnp.zeros((P, L, K, H), dtype), jnp.zeros((P, L, K), jnp.float32))
    slot_pages = np.array([0, 0, 1, 3, 3, 3, 5, P, P], np.int32)  # two padding tokens
    slot_offsets = np.array([0, 1, 2, 0, 1, 3, 2, 0, 1], np.int32)
    k, v = jax.jit(rpa_kernel.write_kv)(pages, pages, jnp.asarray(x_TKH), jnp.asarray(-x_TKH),
                                         slot_pages, slot_offsets)
    assert k.dtype == dtype and k.scales_PLK.dtype == jnp.float32
    real = slot_pages < P
    for cache, x in ((k, x_TKH), (v, -x_TKH)):
        q_TKH = np.asarray(cache.pages_PLKH[slot_pages[real], slot_offsets[real]], np.float32)
        s_TK = np.asarray(cache.scales_PLK[slot_pages[real], slot_offsets[real]])
        np.testing.assert_allclose(s_TK, np.abs(x[real]).max(-1) / (127 if dtype == jnp.int8
                                                                   else 448), rtol=1e-6)
        err = np.abs(q_TKH * s_TK[..., None] - x[real])
        if dtype == jnp.int8:
            bound = s_TK[..., None] / 2 * (1 + 1e-5) + 1e-30
        else:  # e4m3fn: 2^-4 relative; below 2^-6 the subnormal step is 2^-9
            bound = np.maximum(np.abs(x[real]) * 2.0 ** -4, s_TK[..., None] * 2.0 ** -10) \
                * (1 + 1e-5) + 1e-30
        assert (err <= bound).all(), float((err / bound).max())
        worst = float((err / np.maximum(s_TK[..., None], 1e-30)).max())
        print(f"{jnp.dtype(dtype).name}: max |err| / scale = {worst:.3f}")
        assert np.asarray(cache.pages_PLKH[2]).astype(np.float32).max() == 0  # untouched page
        assert (q_TKH[2, 1] == 0).all() and s_TK[2, 1] == 0


def test_fp8_conversion_on_this_backend():
    """XLA:CPU's f8e4m3fn conversion (software) matches ml_dtypes' on every
    rounding case: normals, subnormals, ties to even, the 448 edge."""
    x = np.concatenate([np.linspace(-460, 460, 20001), 2.0 ** -np.arange(0, 12, 0.25),
                        [2.0 ** -9 * 0.5, 2.0 ** -9 * 1.5, 0.0, -0.0]]).astype(np.float32)
    x = x[np.abs(x) <= 448]
    got = np.asarray(jax.jit(lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.float32))(x))
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


# ---- attention lowerings on quantized pages ------------------------------------


def make_quant_batch(seed, q_lens, kv_lens, *, L, K, G, H, dtype, extra_seqs=1, extra_rows=3):
    """A ragged batch with quantized pages; NaN scales (int8) or NaN pages and
    scales (fp8) wherever no sequence owns the data, table padding pointing at
    a NaN page. Returns (args, scales kwargs, owned rows)."""
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    max_seqs = n + extra_seqs
    need = [-(-kv // L) for kv in kv_lens]
    pages_per_seq = max(need) + 1
    num_pages = sum(need) + 2
    perm = rng.permutation(num_pages)
    table = rng.integers(0, num_pages, (max_seqs, pages_per_seq)).astype(np.int32)
    pages = {}
    for name in "kv":
        x = np.full((num_pages, L, K, H), np.nan, np.float32)
        used = 0
        for i, (kv, p) in enumerate(zip(kv_lens, need)):
            ids = perm[used:used + p]
            used += p
            table[i, :p] = ids
            table[i, p:] = perm[-1]  # a page nobody owns
            dense = np.full((p * L, K, H), np.nan, np.float32)
            dense[:kv] = rng.standard_normal((kv, K, H)) * rng.choice([0.1, 1.0, 8.0], (kv, K, 1))
            x[ids] = dense.reshape(p, L, K, H)
        q_NKH, s_NK = quantize(jnp.asarray(np.nan_to_num(x.reshape(-1, K, H))), dtype)
        unowned_NK = np.isnan(x.reshape(-1, K, H)).any(-1)
        s_NK = jnp.where(unowned_NK, jnp.nan, s_NK)
        if dtype != jnp.int8:  # fp8 has NaN: poison the pages too
            q_NKH = jnp.where(unowned_NK[..., None], jnp.nan, q_NKH.astype(jnp.float32)
                              ).astype(dtype)
        pages[name] = (q_NKH.reshape(num_pages, L, K, H), s_NK.reshape(num_pages, L, K))
    assert np.isnan(np.asarray(pages["k"][1])).any()
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    T = int(cu[n]) + extra_rows
    q = np.full((T, K * G, H), np.nan, np.float32)
    q[:cu[n]] = rng.standard_normal((int(cu[n]), K * G, H))
    kv_S = rng.integers(1, 400, max_seqs).astype(np.int32)
    kv_S[:n] = kv_lens
    args = (jnp.asarray(q), pages["k"][0], pages["v"][0], jnp.asarray(kv_S), jnp.asarray(table),
            jnp.asarray(cu), jnp.asarray([n], jnp.int32))
    return args, dict(k_scales_PLK=pages["k"][1], v_scales_PLK=pages["v"][1]), int(cu[n])


BATCHES = {  # (q_lens, kv_lens, L, K, G, H, sliding_window)
    "mixed": ([1, 1, 17, 0, 40], [33, 1, 17, 5, 120], 8, 2, 2, 64, None),
    "decodes_window": ([1, 1, 1], [200, 9, 64], 16, 1, 4, 64, 24),
}


def _lowerings():
    def xla(*a, **kw):
        return kernel_xla.ragged_paged_attention(*a, num_decode=0, **kw)

    def xla_decode_rows(*a, **kw):  # leading one-token rows through the decode path
        q_lens = np.diff(np.asarray(a[5]))
        nd = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else len(q_lens)
        return kernel_xla.ragged_paged_attention(*a, num_decode=min(nd, int(a[6][0])),
                                                 pages_per_block=2, **kw)

    def gpu(*a, **kw):
        return ragged_paged_attention_gpu(*a, interpret=True, **kw)

    def tpu(*a, **kw):
        out = ragged_paged_attention_tpu(*a, interpret=pltpu.InterpretParams(), **kw)
        return jax.block_until_ready(out)  # the interpreter's callbacks vs dispatch

    return dict(xla=xla, xla_decode_rows=xla_decode_rows, pallas_gpu=gpu, pallas_tpu=tpu)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("impl", list(_lowerings()))
def test_attention_on_quantized_pages_matches_reference(impl, batch, dtype):
    q_lens, kv_lens, L, K, G, H, window = BATCHES[batch]
    args, scales, owned = make_quant_batch(1, q_lens, kv_lens, L=L, K=K, G=G, H=H, dtype=dtype)
    kw = dict(sm_scale=H ** -0.5, sliding_window=window)
    out = np.asarray(_lowerings()[impl](*args, **kw, **scales))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(ref_ragged_paged_attention(*args, **kw, **scales))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:owned], ref[:owned], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[owned:], 0.0)


def test_scales_are_validated():
    args, scales, _ = make_quant_batch(0, [3], [9], L=8, K=1, G=1, H=64, dtype=jnp.int8)
    with pytest.raises(ValueError, match="need k_scales"):
        kernel_xla.ragged_paged_attention(*args, sm_scale=1.0)
    with pytest.raises(ValueError, match="v_scales must be f32"):
        kernel_xla.ragged_paged_attention(*args, sm_scale=1.0, k_scales_PLK=scales["k_scales_PLK"],
                                          v_scales_PLK=scales["v_scales_PLK"][:, :4])
    f32 = (args[0], args[1].astype(jnp.float32), args[2].astype(jnp.float32)) + args[3:]
    with pytest.raises(ValueError, match="k_scales given for unquantized"):
        kernel_xla.ragged_paged_attention(*f32, sm_scale=1.0, **scales)


# ---- page accounting -----------------------------------------------------------

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64)


def test_kv_bytes_count_scales_and_smollm2_pages_per_gib():
    """Per token per layer at K 3, H 64: f32 2*3*256 = 1,536 bytes, bf16 768,
    int8/fp8 2*3*(64 + 4) = 408; pages of 16 tokens in 1 GiB: 1,456 / 2,912 /
    5,482 / 5,482 (int8 = 256/68 = 3.76x f32, 128/68 = 1.88x bf16)."""
    per_page = {d: ModelRunner.kv_bytes_per_page(SMOLLM2, 16, d)
                for d in ("float32", "bfloat16", "int8", "float8_e4m3fn")}
    assert per_page == {"float32": 737_280, "bfloat16": 368_640, "int8": 195_840,
                        "float8_e4m3fn": 195_840}
    pages = {d: (1 << 30) // b for d, b in per_page.items()}
    print("SmolLM2 pages at 1 GiB:", pages)
    assert pages == {"float32": 1456, "bfloat16": 2912, "int8": 5482, "float8_e4m3fn": 5482}
    assert per_page["float32"] / per_page["int8"] == 256 / 68


def test_kv_bytes_on_tpu_count_the_padded_tiles():
    """On TPU a page [L, K, H] is laid out in (sublane x 128-lane) tiles of
    its minor dims: SmolLM2's K 3 rounds up to 16 (bf16) or 32 (int8) rows
    and H 64 to 128 lanes, and the f32 [L, K] scales to 128 lanes. So a bf16
    page costs 16 * 128 / (3 * 64) = 10.67x its data, and a budget buys that
    many times fewer pages than the unpadded count would overrun HBM with."""
    bf16 = ModelRunner.kv_bytes_per_page(SMOLLM2, 16, "bfloat16", "tpu")
    assert bf16 == 2 * 30 * 16 * 16 * 128 * 2
    assert bf16 / ModelRunner.kv_bytes_per_page(SMOLLM2, 16, "bfloat16") == 16 * 128 / (3 * 64)
    int8 = ModelRunner.kv_bytes_per_page(SMOLLM2, 16, "int8", "tpu")
    assert int8 == 2 * 30 * (16 * 32 * 128 * 1 + 16 * 128 * 4)
    assert ModelRunner.kv_bytes_per_page(SMOLLM2, 16, "bfloat16", "gpu") == 368_640


def test_engine_sizes_the_cache_by_its_bytes(make_tiny_llm):
    """The same budget holds ~3.5x the pages for int8 as for f32 at the tiny
    model's H = 16 (f32 64 bytes per head row, int8 16 + 4); the int8 cache is
    a KVPages with f32 scales, sharded over kv heads like its pages."""
    f32 = make_tiny_llm(num_pages=None, kv_cache_memory_bytes=1 << 20).engine
    i8 = make_tiny_llm(num_pages=None, kv_cache_memory_bytes=1 << 20, kv_cache_dtype="int8").engine
    cfg = f32.model_config
    assert f32.num_pages == (1 << 20) // ModelRunner.kv_bytes_per_page(cfg, 8, "float32")
    assert i8.num_pages == (1 << 20) // ModelRunner.kv_bytes_per_page(cfg, 8, "int8")
    H = cfg.head_dim
    assert i8.num_pages // f32.num_pages == (4 * H) // (H + 4)
    cache = i8.runner.k_cache[0]
    assert isinstance(cache, KVPages) and cache.dtype == jnp.int8
    assert cache.scales_PLK.shape == cache.shape[:3] and cache.scales_PLK.dtype == jnp.float32
    assert tuple(cache.scales_PLK.sharding.spec) == tuple(cache.pages_PLKH.sharding.spec)[:3]
    assert f32.runner.k_cache[0].scales_PLK is None


# ---- fp8 support ---------------------------------------------------------------


@pytest.mark.parametrize("backend, kind, cc, ok", [
    ("cpu", "cpu", None, True),
    ("gpu", "NVIDIA H100 80GB HBM3", "9.0", True),
    ("gpu", "NVIDIA L4", "8.9", True),
    ("cuda", "NVIDIA B200", "10.0", True),
    ("gpu", "NVIDIA A100-SXM4-80GB", "8.0", False),
    ("gpu", "NVIDIA A10G", "8.6", False),
    ("gpu", "Tesla T4", "7.5", False),
    ("gpu", "NVIDIA H100", None, False),  # no compute capability: cannot tell
    ("rocm", "AMD Instinct MI300X", None, False),
    ("tpu", "TPU v2", None, False),
    ("tpu", "TPU v3", None, False),
    ("tpu", "TPU v4", None, False),
    ("tpu", "TPU v5 lite", None, False),  # v5e
    ("tpu", "TPU v5e", None, False),
    ("tpu", "TPU v5", None, True),  # v5p
    ("tpu", "TPU v5p", None, True),
    ("tpu", "TPU v6 lite", None, True),  # v6e
    ("tpu", "TPU7x", None, True),
    ("metal", "Apple M2", None, False),
])
def test_fp8_kv_supported(backend, kind, cc, ok):
    assert fp8_kv_supported(backend, kind, cc) is ok


def test_fp8_cache_refused_before_weights_load(monkeypatch):
    """On a device without fp8 (a T4, faked) the engine raises before it
    reads the checkpoint: the model path does not even exist."""
    from pallas_kernels.ragged_paged_attention import quant
    monkeypatch.setattr(quant, "fp8_kv_supported", lambda *a: fp8_kv_supported("gpu", "T4", "7.5"))
    config = EngineConfig(model="/nonexistent/model.gguf",
                          cache=CacheConfig(dtype="float8_e4m3fn", num_pages=8))
    with pytest.raises(ValueError, match="kv_cache_dtype 'float8_e4m3fn' needs fp8"):
        Engine(config)
    check_kv_cache_dtype(jnp.int8, jax.devices()[0])  # int8 and fp8 on CPU are fine
    monkeypatch.undo()
    check_kv_cache_dtype(jnp.float8_e4m3fn, jax.devices()[0])


# ---- the engine on the tiny random model ---------------------------------------

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], [200], list(range(10, 60)), [42] * 19,
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 3]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def agreement(a, b):
    """Position-wise agreement of two token lists (every position counts, so
    tokens after a first divergence count when they still agree)."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def _tokens(llm, prompts, n):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n))]


def _run(llm):
    """(16 greedy tokens per prompt, the prompts' own logprobs f32[sum of lengths - 1])."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                prompt_logprobs=0))
    plp = np.array([d[t].logprob for o in outs
                    for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
    return [o.outputs[0].token_ids for o in outs], plp


@pytest.fixture(scope="module")
def f32_run(tiny_parts):
    from jaxserve import LLM
    from conftest import XLA_CACHE
    return _run(LLM(num_pages=128, page_size=8, compilation_cache_dir=XLA_CACHE, **tiny_parts))


@pytest.mark.parametrize("kv, max_dlogprob", [("int8", 0.1), ("fp8_e4m3", 0.4)])
def test_quantized_kv_close_to_f32(make_tiny_llm, f32_run, kv, max_dlogprob):
    """The prompts' logprobs (each prefill reads its own K/V back from the
    quantized pages) stay close to f32 KV's; greedy tokens start the same.
    The tiny random model is chaotic (near-tied logits), so later tokens may
    drift: the agreement is printed, and asserted only loosely for int8."""
    tokens, plp = _run(make_tiny_llm(kv_cache_dtype=kv))
    f32_tokens, f32_plp = f32_run
    agree = [agreement(a, b) for a, b in zip(tokens, f32_tokens)]
    dlp = float(np.abs(plp - f32_plp).max())
    print(f"{kv} vs f32 KV: max |d prompt logprob| {dlp:.4f}; greedy agreement per prompt "
          f"{agree}")
    assert dlp <= max_dlogprob
    assert all(a[0] == b[0] for a, b in zip(tokens, f32_tokens))  # the prefill's token
    if kv == "int8":
        assert np.mean(agree) >= 0.6


def test_int8_prefix_cached_equals_cold(make_tiny_llm):
    """K/V are quantized once when written: a request whose first 3 pages come
    from the prefix cache gets the tokens it gets cold."""
    shared = list(range(100, 124))  # 3 full pages of 8
    a, b = shared + [7, 8, 9], shared + [40, 41]
    cold = _tokens(make_tiny_llm(kv_cache_dtype="int8"), [b], 12)
    warm_llm = make_tiny_llm(kv_cache_dtype="int8")
    _tokens(warm_llm, [a], 4)
    out = warm_llm.generate([b], greedy(12))[0]
    assert out.num_cached_tokens == 24
    assert out.outputs[0].token_ids == cold[0]


def test_int8_preemption_keeps_greedy_exact(make_tiny_llm):
    """With 14 pages the five requests preempt each other; each one's tokens
    equal its run with ample pages."""
    n = 32
    ample = _tokens(make_tiny_llm(kv_cache_dtype="int8"), PROMPTS, n)
    engine = make_tiny_llm(kv_cache_dtype="int8", page_size=8, num_pages=14).engine
    rids = [engine.add_request(None, p, greedy(n)) for p in PROMPTS]
    reqs = [engine.get_sequences(r)[0] for r in rids]
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sum(r.num_preemptions for r in reqs) > 0
    for rid, want in zip(rids, ample):
        assert final[rid].outputs[0].token_ids == want
    assert engine.num_free_pages == engine.num_pages


# ---- SmolLM2 135M ---------------------------------------------------------------


# SmolLM2 with an int8 KV cache against f32 KV: tests/test_quant_real.py.
