"""The Pallas/Triton ragged paged attention kernel (``kernel_gpu``) vs
``reference.ref_ragged_paged_attention``, run in the Pallas interpreter on CPU.

Random ragged batches mix prefill chunks (q_len up to 64), decodes (q_len 1)
and idle sequences (q_len 0) over contexts of 1..600 positions. Everything a
sequence does not own is NaN: unused pages, the positions past kv_len in a
sequence's last page, query rows past cu_q_lens[num_seqs], so a read outside
the sequence's own range poisons the output (JAX tests/pallas style). Without
a GPU, the Triton lowering itself is checked by lowering for ``cuda`` on CPU
(JAX builds the Triton IR in Python; only PTX compilation needs the device).

Interpret mode compiles each shape in ~2-3 s and runs in well under a
second, so the examples are few and mostly small.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.ragged_paged_attention import kernel_gpu, quant
from pallas_kernels.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention

MAX_KV = 600
_ref = jax.jit(ref_ragged_paged_attention, static_argnames=("sm_scale", "sliding_window",
                                                            "soft_cap"))


def make_batch(rng, q_lens, kv_lens, *, page_size, K, G, H, dtype, extra_seqs=0, extra_rows=0):
    """A ragged batch with NaN wherever no sequence owns the data.

    Returns the kernel's positional arguments (numpy) and num_seqs.
    """
    n, L = len(q_lens), page_size
    max_seqs = n + extra_seqs
    need = [-(-kv // L) for kv in kv_lens]
    pages_per_seq = max(need) + 1
    num_pages = sum(need) + 2                    # two pages nobody owns
    perm = rng.permutation(num_pages)
    nan_page = perm[-1]
    k_pages = np.full((num_pages, L, K, H), np.nan, np.float32)
    v_pages = np.full((num_pages, L, K, H), np.nan, np.float32)
    page_indices = rng.integers(0, num_pages, (max_seqs, pages_per_seq)).astype(np.int32)
    used = 0
    for i, (kv, p) in enumerate(zip(kv_lens, need)):
        pages = perm[used:used + p]
        used += p
        page_indices[i, :p] = pages
        page_indices[i, p:] = nan_page           # table padding points at a NaN page
        k = np.full((p * L, K, H), np.nan, np.float32)
        v = np.full((p * L, K, H), np.nan, np.float32)
        k[:kv] = rng.standard_normal((kv, K, H))
        v[:kv] = rng.standard_normal((kv, K, H))
        k_pages[pages] = k.reshape(p, L, K, H)
        v_pages[pages] = v.reshape(p, L, K, H)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    T = max(1, int(cu[n]) + extra_rows)
    q = np.full((T, K * G, H), np.nan, np.float32)
    q[:cu[n]] = rng.standard_normal((int(cu[n]), K * G, H))
    kv_lens_S = rng.integers(1, MAX_KV, max_seqs).astype(np.int32)  # garbage past n
    kv_lens_S[:n] = kv_lens
    cast = lambda a: jnp.asarray(a, dtype)
    args = (cast(q), cast(k_pages), cast(v_pages), jnp.asarray(kv_lens_S),
            jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray([n], jnp.int32))
    return args, int(cu[n])


def check(args, owned, *, tol, **kw):
    """Kernel (interpreted) vs the f32 reference on the same values."""
    sm_scale = args[0].shape[-1] ** -0.5
    out = np.asarray(ragged_paged_attention_gpu(*args, sm_scale=sm_scale, interpret=True, **kw)
                     .astype(jnp.float32))
    ref_kw = {k: kw[k] for k in ("sliding_window", "soft_cap") if k in kw}
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    ref = np.asarray(_ref(*f32, sm_scale=sm_scale, **ref_kw))
    assert out.shape == args[0].shape
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:owned], ref[:owned], atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[owned:], 0.0)


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@st.composite
def ragged_batches(draw):
    """Mostly small batches; now and then a context of up to MAX_KV positions."""
    n = draw(st.integers(1, 4))
    q_lens, kv_lens = [], []
    for _ in range(n):
        q = draw(st.one_of(st.just(1), st.just(0), st.integers(0, 64)))
        ctx = draw(st.one_of(st.integers(0, 40), st.integers(0, MAX_KV - q)))
        q_lens.append(q)
        kv_lens.append(max(1, q + ctx))
    G = draw(st.sampled_from([1, 2, 4]))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), q_lens=q_lens, kv_lens=kv_lens,
        page_size=draw(st.sampled_from([8, 16, 32])), K=draw(st.integers(1, 4)), G=G,
        H=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from([jnp.float32, jnp.bfloat16])),
        extra_seqs=draw(st.integers(0, 2)), extra_rows=draw(st.integers(0, 8)),
        kw=dict(sliding_window=draw(st.one_of(st.none(), st.integers(1, 80))),
                soft_cap=draw(st.sampled_from([None, 1.5, 20.0])),
                block_q=draw(st.sampled_from([16 // G, 32 // G, None])),
                block_kv=draw(st.sampled_from([16, 32, 64]))))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=ragged_batches())
def test_matches_reference(b):
    rng = np.random.default_rng(b["seed"])
    args, owned = make_batch(rng, b["q_lens"], b["kv_lens"], page_size=b["page_size"],
                             K=b["K"], G=b["G"], H=b["H"], dtype=b["dtype"],
                             extra_seqs=b["extra_seqs"], extra_rows=b["extra_rows"])
    check(args, owned, tol=TOL[b["dtype"]], **b["kw"])


# Bigger fixed batches: (q_lens, kv_lens, page_size, K, G, H, dtype, kwargs).
FIXED = {
    "prefill_and_decodes_window_cap_bf16": (
        [64, 1, 1, 37], [600, 1, 599, 300], 16, 2, 4, 128, jnp.bfloat16,
        dict(sliding_window=100, soft_cap=2.0)),
    # G and H not powers of 2 (padded in the kernel). The decode at kv_len 87
    # sees positions 63..86: its first kv block (block_kv 64) holds one of them.
    "gqa3_head_dim_80_f32": (
        [17, 1, 0, 5, 1], [200, 50, 3, 5, 87], 8, 2, 3, 80, jnp.float32,
        dict(sliding_window=24, soft_cap=1.5, block_kv=64)),
    "decodes_only_long_f32": (
        [1] * 8, [600, 1, 17, 256, 257, 9, 599, 64], 32, 4, 1, 64, jnp.float32,
        dict(block_q=16, block_kv=64)),
}


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_batches(name):
    q_lens, kv_lens, L, K, G, H, dtype, kw = FIXED[name]
    args, owned = make_batch(np.random.default_rng(0), q_lens, kv_lens, page_size=L, K=K, G=G,
                             H=H, dtype=dtype, extra_seqs=2, extra_rows=5)
    check(args, owned, tol=TOL[dtype], **kw)


def test_block_order_does_not_matter():
    """On a GPU the programs run in any order; the interpreter runs them in
    grid order. Reversing the schedule would expose a block that writes rows of
    the next sequence (the next sequence's blocks would no longer overwrite them)."""
    args, owned = make_batch(np.random.default_rng(1), [5, 1, 12, 0, 3], [40, 9, 12, 4, 70],
                             page_size=8, K=1, G=2, H=64, dtype=jnp.float32, extra_rows=3)
    kw = dict(sm_scale=0.125, sliding_window=None, soft_cap=None, block_q=8, block_kv=16,
              num_warps=4, num_stages=2, interpret=True)
    num_blocks = kernel_gpu._num_blocks(args[0].shape[0], 8, len(args[3]))
    seq, start = kernel_gpu._schedule(args[5], args[6], block_q=8, num_blocks=num_blocks)
    assert (np.asarray(seq) >= 0).sum() >= 4
    fwd = kernel_gpu._run(*args, seq, start, **kw)
    rev = kernel_gpu._run(*args, seq[::-1], start[::-1], **kw)
    np.testing.assert_array_equal(np.asarray(rev), np.asarray(fwd))
    np.testing.assert_allclose(np.asarray(fwd)[:owned], np.asarray(
        _ref(*args, sm_scale=0.125))[:owned], atol=1e-5, rtol=1e-5)


_schedule = jax.jit(kernel_gpu._schedule, static_argnames=("block_q", "num_blocks"))


@settings(max_examples=30, deadline=None)
@given(q_lens=st.lists(st.integers(0, 70), min_size=1, max_size=6),
       tight=st.booleans(), block_q=st.sampled_from([1, 4, 16, 64]))
def test_schedule_covers_each_owned_row_once(q_lens, tight, block_q):
    """Each owned row lies in exactly one block of its own sequence, also when
    T is exactly the owned rows (the num_blocks bound is tight then)."""
    n, max_seqs = len(q_lens), 8
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    T = max(1, int(cu[n])) if tight else 6 * 70 + 20
    num_blocks = kernel_gpu._num_blocks(T, block_q, max_seqs)
    seq, start = map(np.asarray, _schedule(jnp.asarray(cu), jnp.asarray([n], jnp.int32),
                                           block_q=block_q, num_blocks=num_blocks))
    covered = np.zeros(T, np.int32)
    for s, q0 in zip(seq, start):
        if s >= 0:
            assert cu[s] <= q0 < cu[s + 1]
            covered[q0:min(q0 + block_q, cu[s + 1])] += 1
    np.testing.assert_array_equal(covered, (np.arange(T) < cu[n]).astype(np.int32))


def _specs(T=32, N=4, K=2, H=64, P=40, L=16, S=5, W=10, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return (sds((T, N, H), dtype), sds((P, L, K, H), dtype), sds((P, L, K, H), dtype),
            sds((S,), jnp.int32), sds((S, W), jnp.int32), sds((S + 1,), jnp.int32),
            sds((1,), jnp.int32))


@pytest.mark.parametrize("shape,kw", [
    (dict(), dict()),
    (dict(dtype=jnp.float32, N=6, K=2, H=80, L=8), dict(sliding_window=8, soft_cap=30.0)),
    (dict(N=32, K=4, H=128, L=32), dict(block_q=4, block_kv=128, num_warps=8, num_stages=3)),
    (dict(N=1, K=1, H=256, L=1), dict(block_q=16, block_kv=16)),
])
def test_lowers_to_triton(shape, kw):
    """The kernel lowers to a Triton module (checks power-of-2 shapes, dot
    sizes and supported ops) without a GPU: JAX falls back to sm_90."""
    f = functools.partial(ragged_paged_attention_gpu, sm_scale=0.1, **kw)
    text = jax.jit(f).trace(*_specs(**shape)).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("change,match", [
    (dict(q=(32, 4)), "q must be"),
    (dict(q=(32, 5, 64)), "multiple of kv heads"),
    (dict(q=(32, 4, 32)), "head_dim"),
    (dict(cu=(5,)), "cu_q_lens must be"),
    (dict(kv_dtype=jnp.float32), "kv_lens must be int32"),
    (dict(q_dtype=jnp.float32), "must share a dtype"),
    (dict(kw=dict(block_q=3)), "block_q=3 must be a power of 2"),
    (dict(kw=dict(block_q=4)), "block_q=4 must be a power of 2 with"),   # 4 * G'=2 < 16
    (dict(kw=dict(block_kv=8)), "block_kv=8 must be a power of 2 >= 16"),
    (dict(kw=dict(num_kv_splits=0)), "num_kv_splits=0"),
    (dict(kw=dict(sliding_window=0)), "sliding_window"),
    (dict(kw=dict(soft_cap=-1.0)), "soft_cap"),
])
def test_invalid_inputs_raise_value_error(change, match):
    T, N, K, H, P, L, S = 32, 4, 2, 64, 40, 16, 5
    q = jnp.zeros(change.get("q", (T, N, H)), change.get("q_dtype", jnp.bfloat16))
    pages = jnp.zeros((P, L, K, H), jnp.bfloat16)
    kv_lens = jnp.ones((S,), change.get("kv_dtype", jnp.int32))
    cu = jnp.zeros(change.get("cu", (S + 1,)), jnp.int32)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_gpu(q, pages, pages, kv_lens, jnp.zeros((S, 4), jnp.int32), cu,
                                   jnp.ones((1,), jnp.int32), sm_scale=0.1, interpret=True,
                                   **change.get("kw", {}))


# ---------------------------------------------------------------------------
# Issue 32: kv splits (flash-decoding), decode blocks sized to G, quantized
# KV, the addressing check, and lowering for CUDA.

def quantize_pages(args, kv_dtype):
    """The batch with its K/V pages quantized (``quant.quantize``) to
    ``kv_dtype``: returns (args, k_scales, v_scales). NaN positions get NaN
    scales, so they still poison a read."""
    args = list(args)
    scales = []
    for i in (1, 2):
        pages = args[i].astype(jnp.float32)
        P, L, K, H = pages.shape
        q_XKH, s_XK = quant.quantize(pages.reshape(P * L, K, H), kv_dtype)
        nan_XK = jnp.isnan(pages.reshape(P * L, K, H)).any(axis=-1)
        args[i] = q_XKH.reshape(P, L, K, H)
        scales.append(jnp.where(nan_XK, jnp.nan, s_XK).reshape(P, L, K))
    return tuple(args), scales[0], scales[1]


def check_any(args, owned, *, tol, kv_dtype=None, **kw):
    """Kernel (interpreted) vs the reference on the same values, quantized
    pages included (the reference dequantizes them)."""
    sm_scale = args[0].shape[-1] ** -0.5
    scales = {}
    if kv_dtype is not None:
        args, ks, vs = quantize_pages(args, kv_dtype)
        scales = dict(k_scales_PLK=ks, v_scales_PLK=vs)
    out = np.asarray(ragged_paged_attention_gpu(*args, sm_scale=sm_scale, interpret=True,
                                                **scales, **kw).astype(jnp.float32))
    ref_kw = {k: kw[k] for k in ("sliding_window", "soft_cap") if k in kw}
    q32 = args[0].astype(jnp.float32)
    ref = np.asarray(_ref_q(q32, *args[1:], sm_scale=sm_scale, **scales, **ref_kw))
    assert out.shape == args[0].shape
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:owned], ref[:owned], atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[owned:], 0.0)


_ref_q = jax.jit(ref_ragged_paged_attention, static_argnames=("sm_scale", "sliding_window",
                                                              "soft_cap"))

# Mixed batches: decodes, a 3-token verify chunk, a prefill chunk, an idle row.
MIXED_Q, MIXED_KV = [1, 3, 37, 1, 0, 1], [300, 90, 200, 1, 5, 600]

# (G, H, q dtype, kv dtype or None, kwargs): the G, head_dim, KV dtype, window
# and soft-cap acceptance of issue 32, in the interpreter.
ACCEPT = {
    "G1_H64_f32_window": (1, 64, jnp.float32, None, dict(sliding_window=50)),
    "G3_H128_bf16_cap": (3, 128, jnp.bfloat16, None, dict(soft_cap=20.0)),
    "G4_H256_int8_window_cap": (4, 256, jnp.float32, jnp.int8,
                                dict(sliding_window=70, soft_cap=2.0)),
    "G7_H64_fp8_cap": (7, 64, jnp.float32, jnp.float8_e4m3fn, dict(soft_cap=1.5)),
    "G8_H128_int8_bf16": (8, 128, jnp.bfloat16, jnp.int8, dict()),
    "G4_H64_f32_forced_splits_window": (4, 64, jnp.float32, None,
                                        dict(sliding_window=40, num_kv_splits=3)),
    "G7_H256_bf16_forced_splits": (7, 256, jnp.bfloat16, None, dict(num_kv_splits=4)),
    "G1_H128_fp8_forced_splits_window_cap": (1, 128, jnp.float32, jnp.float8_e4m3fn,
                                             dict(num_kv_splits=5, sliding_window=120,
                                                  soft_cap=30.0)),
}


@pytest.mark.parametrize("name", list(ACCEPT))
def test_mixed_batches_all_head_shapes(name):
    G, H, dtype, kv_dtype, kw = ACCEPT[name]
    args, owned = make_batch(np.random.default_rng(3), MIXED_Q, MIXED_KV, page_size=16, K=2,
                             G=G, H=H, dtype=dtype, extra_seqs=1, extra_rows=3)
    tol = TOL[dtype] if kv_dtype is None else (2e-2 if dtype == jnp.bfloat16 else 1e-4)
    check_any(args, owned, tol=tol, kv_dtype=kv_dtype, **kw)


def test_32k_context_takes_the_split_path():
    """A decode over 32k positions beside short rows: the decode pass gets
    16 kv splits from the shapes alone, and matches the reference."""
    q_lens, kv_lens, L, K, G, H = [1, 1, 5], [32768, 100, 40], 64, 1, 2, 64
    args, owned = make_batch(np.random.default_rng(4), q_lens, kv_lens, page_size=L, K=K,
                             G=G, H=H, dtype=jnp.float32, extra_rows=1)
    T, max_seqs, pages_per_seq = args[0].shape[0], args[3].shape[0], args[4].shape[1]
    assert kernel_gpu.choose_kv_splits(min(T, max_seqs), K, pages_per_seq * L) == 16
    check_any(args, owned, tol=1e-5)


def test_split_count_from_shapes():
    # batch 1, K = 8, a 32k table: 16 splits (JAX decode_attention's k_splits)
    assert kernel_gpu.choose_kv_splits(1, 8, 32768) == 16
    # the blocks already fill the GPU: no split
    assert kernel_gpu.choose_kv_splits(256, 8, 32768) == 1
    # short contexts: at most one split per 256 positions
    assert kernel_gpu.choose_kv_splits(1, 1, 600) == 3
    assert kernel_gpu.choose_kv_splits(1, 1, 200) == 1


@pytest.mark.parametrize("splits", [1, 3])
def test_block_order_does_not_matter_split(splits):
    """As test_block_order_does_not_matter, with kv splits merged."""
    args, owned = make_batch(np.random.default_rng(2), [5, 1, 12, 0, 3], [140, 9, 72, 4, 70],
                             page_size=8, K=2, G=2, H=64, dtype=jnp.float32, extra_rows=3)
    kw = dict(sm_scale=0.125, sliding_window=None, soft_cap=None, block_q=8, block_kv=16,
              num_warps=4, num_stages=2, interpret=True, num_splits=splits)
    num_blocks = kernel_gpu._num_blocks(args[0].shape[0], 8, len(args[3]))
    seq, start = kernel_gpu._schedule(args[5], args[6], block_q=8, num_blocks=num_blocks)
    fwd = kernel_gpu._run(*args, seq, start, **kw)
    rev = kernel_gpu._run(*args, seq[::-1], start[::-1], **kw)
    np.testing.assert_array_equal(np.asarray(rev), np.asarray(fwd))
    np.testing.assert_allclose(np.asarray(fwd)[:owned], np.asarray(
        _ref(*args, sm_scale=0.125))[:owned], atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(q_lens=st.lists(st.integers(0, 20), min_size=1, max_size=6),
       g_pad=st.sampled_from([1, 2, 4, 8, 16]))
def test_decode_and_prefill_passes_split_the_rows(q_lens, g_pad):
    """The decode pass (q_len <= 16 // G', one block of 16 // G' tokens each)
    and the prefill pass (longer rows) together cover each owned row once."""
    n, max_seqs = len(q_lens), 8
    bq_d, bq_p = max(1, 16 // g_pad), max(1, 64 // g_pad)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    T = max(1, int(cu[n]))
    covered = np.zeros(T, np.int32)
    passes = [(bq_d, 1, bq_d, max(1, min(T, max_seqs))),
              (bq_p, bq_d + 1, None, kernel_gpu._num_blocks(T, bq_p, min(max_seqs,
                                                                         T // (bq_d + 1))))]
    for bq, lo, hi, nb in passes:
        seq, start = map(np.asarray, kernel_gpu._schedule(
            jnp.asarray(cu), jnp.asarray([n], jnp.int32), block_q=bq, num_blocks=nb,
            min_q_len=lo, max_q_len=hi))
        for s, q0 in zip(seq, start):
            if s >= 0:
                assert lo <= cu[s + 1] - cu[s] <= (hi or T)
                covered[q0:min(q0 + bq, cu[s + 1])] += 1
    np.testing.assert_array_equal(covered, (np.arange(T) < cu[n]).astype(np.int32))


# (N, K, H) of the models the project claims (issue 32's list).
MODEL_HEADS = {
    "SmolLM2": (9, 3, 64), "Gemma3-270M": (4, 1, 256), "Gemma3-4B": (8, 4, 256),
    "Gemma3-12B": (16, 8, 256), "Gemma3-27B": (32, 16, 128), "Llama-3-8B": (32, 8, 128),
    "Llama-3-70B": (64, 8, 128), "Qwen2.5-7B": (28, 4, 128), "Qwen2.5-14B": (40, 8, 128),
    "Mixtral": (32, 8, 128), "MHA": (32, 32, 128),
}
# A representative subset: every G' (1, 2, 4, 8) and head_dim, every KV
# dtype, both page sizes, windows and soft caps, split and unsplit passes.
LOWER_CASES = [
    ("SmolLM2", "int8", 16, dict(sliding_window=2048)),
    ("Gemma3-270M", "bfloat16", 64, dict(sliding_window=512, soft_cap=50.0)),
    ("Gemma3-27B", "fp8_e4m3", 16, dict(sliding_window=1024)),
    ("Llama-3-70B", "fp8_e4m3", 64, dict()),
    ("Qwen2.5-7B", "bfloat16", 16, dict(soft_cap=30.0)),
    ("MHA", "int8", 64, dict(num_tokens=2048, max_seqs=256)),   # no kv split
]


@pytest.mark.parametrize("model,kv_dtype,page_size,kw", LOWER_CASES,
                         ids=[f"{m}-{d}-L{p}" for m, d, p, _ in LOWER_CASES])
def test_lower_for_cuda_model_shapes(model, kv_dtype, page_size, kw):
    N, K, H = MODEL_HEADS[model]
    text = kernel_gpu.lower_for_cuda(N, K, H, kv_dtype, page_size, **kw).as_text()
    # both passes, each with the shapes' splits and unsplit (named in the kernels)
    assert text.count("__gpu$xla.gpu.triton") == 4
    assert re.search(r"ragged_paged_attention_block_q_\d+_block_kv_64_num_splits_1\b", text)


def test_decode_only_runs_one_pass():
    """``decode_only`` (the engine's decode step) lowers one Triton kernel
    instead of two, and gives the reference's values on a decode batch."""
    count = lambda **kw: kernel_gpu.lower_for_cuda(  # noqa: E731
        32, 8, 128, "bfloat16", 16, num_tokens=8, max_seqs=8, num_kv_splits=2,
        **kw).as_text().count(
        "__gpu$xla.gpu.triton")
    assert (count(), count(decode_only=True)) == (2, 1)
    args, owned = make_batch(np.random.default_rng(5), [1, 1, 0, 1], [300, 7, 4, 64],
                             page_size=16, K=2, G=4, H=64, dtype=jnp.float32, extra_rows=2)
    check_any(args, owned, tol=1e-5, decode_only=True, sliding_window=100)


def _lower_one_pass(block_q, block_kv):
    """Lower one pass of the kernel (``_run``) for CUDA, past the wrapper's checks."""
    T, N, K, H, P, L, S, W = 32, 4, 2, 64, 40, 16, 5, 10
    sds = jax.ShapeDtypeStruct
    args = (sds((T, N, H), jnp.bfloat16), sds((P, L, K, H), jnp.bfloat16),
            sds((P, L, K, H), jnp.bfloat16), sds((S,), jnp.int32), sds((S, W), jnp.int32),
            sds((S + 1,), jnp.int32), sds((1,), jnp.int32), sds((8,), jnp.int32),
            sds((8,), jnp.int32))
    f = functools.partial(kernel_gpu._run, sm_scale=0.1, sliding_window=None, soft_cap=None,
                          block_q=block_q, block_kv=block_kv, num_warps=4, num_stages=2,
                          interpret=False, num_splits=2)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def test_broken_block_shape_fails_to_lower():
    """The lowering check can fail: a kv block of 24 positions (not a power of
    2) is rejected by the Triton lowering, while 32 lowers."""
    assert "__gpu$xla.gpu.triton" in _lower_one_pass(8, 32).as_text()
    with pytest.raises(Exception, match="(?i)power of 2|power-of-2|pow"):
        _lower_one_pass(8, 24)


def test_addressing_check_when_lowering_a_huge_cache():
    """Finding 3 (32-bit offsets): a 1-byte cache of more than 2^31 elements
    but at most 2^32 bytes is refused with the sizes named; bf16 of the same
    shape (over 2^32 bytes: JAX's Triton lowering uses i64 offsets) and an
    int8 cache over 2^32 elements lower. Abstract shapes only: no memory."""
    L, K, H = 16, 8, 128                      # 2^14 elements per page
    with pytest.raises(ValueError, match=r"2147500032 elements .*32-bit offsets.*131072 pages"):
        kernel_gpu.lower_for_cuda(32, K, H, "int8", L, max_seqs=1, max_context=2**17 * L)
    with pytest.raises(ValueError, match="32-bit offsets"):
        kernel_gpu.lower_for_cuda(32, K, H, "fp8_e4m3", L, max_seqs=1,
                                  max_context=2**17 * L)
    for kv_dtype, pages in (("bfloat16", 2**17), ("int8", 2**18)):
        text = kernel_gpu.lower_for_cuda(32, K, H, kv_dtype, L, max_seqs=1,
                                         max_context=pages * L).as_text()
        assert "__gpu$xla.gpu.triton" in text
    kernel_gpu.check_addressing(jax.ShapeDtypeStruct((2**17, L, K, H), jnp.int8))  # 2^31: ok
