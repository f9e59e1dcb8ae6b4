"""Pallas TPU ragged paged attention (``kernel_tpu``) vs the jnp definition
``ref_ragged_paged_attention``, run in JAX's TPU interpreter on CPU (it
simulates scalar prefetch, the HBM->VMEM DMAs and their semaphores).

Every batch is poisoned the way JAX's ``tpu_ragged_paged_attention_test``
does it: pages no sequence owns, the tail of each sequence's last page past
kv_len and query rows owned by no sequence are NaN, and page-table entries
past a sequence's pages name NaN pages or no page at all, so any read the
kernel should not make shows up in the output (or as an out-of-bounds DMA,
which the interpreter raises).

Interpret mode compiles slowly (~5 s per shape), so the property tests draw
their static shapes from a short list (the jit cache is shared by examples
of one entry) and let hypothesis vary the ragged batch itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.kernel_tpu import (lower_for_tpu,
                                                              ragged_paged_attention_tpu)
from pallas_kernels.ragged_paged_attention.kernel_tpu_schedule import (choose_blocks,
                                                                       tpu_kv_page_bytes,
                                                                       tpu_kv_scale_page_bytes)
from pallas_kernels.ragged_paged_attention.quant import quantize
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention

MAX_KV = 600        # longest context drawn
T_PAD = 96          # packed query rows of the property tests
MAX_SEQS = 6        # sequence slots of the property tests


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """An exception inside the interpreter leaves its global state behind."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


def make_batch(seed, q_lens, kv_lens, *, L, K, N, H, dtype, T, max_seqs, num_pages=None,
               pages_per_seq=None):
    """A packed batch in the kernel's layout, poisoned with NaN (module docstring).

    Returns (args, num_rows): the 7 positional arguments and cu_q_lens[num_seqs].
    """
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    pages_per_seq = pages_per_seq or -(-MAX_KV // L)
    num_pages = num_pages or max_seqs * pages_per_seq + 16
    need = [-(-kv // L) for kv in kv_lens]
    assert sum(need) <= num_pages and max(need, default=0) <= pages_per_seq
    k_PLKH = np.full((num_pages, L, K, H), np.nan, np.float32)
    v_PLKH = np.full((num_pages, L, K, H), np.nan, np.float32)
    # Unused table entries (and whole padding rows) name random pages, mostly NaN
    # ones, or no page at all (a DMA from there fails in the interpreter).
    table_SP = np.where(rng.random((max_seqs, pages_per_seq)) < 0.5,
                        rng.integers(0, num_pages, (max_seqs, pages_per_seq)),
                        rng.integers(-10**6, 10**6, (max_seqs, pages_per_seq))).astype(np.int32)
    perm = rng.permutation(num_pages)
    used = 0
    for i, (kv, p) in enumerate(zip(kv_lens, need)):
        pages = perm[used:used + p]
        used += p
        table_SP[i, :p] = pages
        for src in (k_PLKH, v_PLKH):
            dense = np.full((p * L, K, H), np.nan, np.float32)
            dense[:kv] = rng.standard_normal((kv, K, H))
            src[pages] = dense.reshape(p, L, K, H)
    kv_S = rng.integers(-5, 10 * MAX_KV, max_seqs).astype(np.int32)  # garbage past num_seqs
    kv_S[:n] = kv_lens
    cu_S1 = np.zeros(max_seqs + 1, np.int32)
    cu_S1[1:n + 1] = np.cumsum(q_lens)
    cu_S1[n + 1:] = cu_S1[n]
    rows = int(cu_S1[n])
    assert rows <= T
    q_TNH = np.full((T, N, H), np.nan, np.float32)
    q_TNH[:rows] = 2.0 * rng.standard_normal((rows, N, H))  # large enough for soft_cap to bite
    args = (jnp.asarray(q_TNH, dtype), jnp.asarray(k_PLKH, dtype), jnp.asarray(v_PLKH, dtype),
            jnp.asarray(kv_S), jnp.asarray(table_SP), jnp.asarray(cu_S1),
            jnp.asarray([n], jnp.int32))
    return args, rows


def check(args, rows, *, tol, interpret=None, **kw):
    """Kernel vs reference on owned rows; rows owned by no sequence must be 0."""
    H = args[0].shape[-1]
    opts = dict(sm_scale=H ** -0.5, sliding_window=kw.pop("sliding_window", None),
                soft_cap=kw.pop("soft_cap", None))
    scales = dict(k_scales_PLK=kw.pop("k_scales_PLK", None),
                  v_scales_PLK=kw.pop("v_scales_PLK", None))
    out = ragged_paged_attention_tpu(*args, **opts, **kw, **scales,
                                     interpret=interpret or pltpu.InterpretParams())
    # Wait before dispatching anything else: the interpreter's callbacks run jnp
    # ops, which can deadlock against concurrent dispatch (seen with jax 0.10.2).
    out = jax.block_until_ready(out)
    with jax.default_matmul_precision("highest"):
        ref = ref_ragged_paged_attention(*args, **opts, **scales)
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output"
    np.testing.assert_allclose(out[:rows], ref[:rows], atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[rows:], 0.0)


def ragged_batches(max_rows):
    """(seed, q_lens, kv_lens) with q lengths 0..64 or 1 (decode), kv 1..600,
    small contexts more often than long ones; total q rows <= max_rows."""
    seq = st.tuples(st.one_of(st.just(1), st.integers(0, 64)),
                    st.one_of(st.integers(0, 40), st.integers(0, MAX_KV)))

    def fit(seqs):
        q_lens, kv_lens, rows = [], [], 0
        for q, ctx in seqs:
            q = min(q, max_rows - rows)
            rows += q
            q_lens.append(q)
            kv_lens.append(max(1, min(ctx + q, MAX_KV)))
        return q_lens, kv_lens

    return st.tuples(st.integers(0, 2**31 - 1),
                     st.lists(seq, min_size=1, max_size=MAX_SEQS).map(fit))


# Static shapes of the property tests: page size L, kv heads K, query heads per
# kv head G, head dim H, optional sliding window / soft cap, and block sizes
# (bq query rows, bp pages, kb kv heads; absent means the wrapper's default).
F32_CONFIGS = [
    dict(L=8, K=1, G=4, H=64, bq=16, bp=4),
    dict(L=16, K=2, G=2, H=128, sliding_window=32, bq=32, bp=2, kb=1),
    dict(L=32, K=4, G=1, H=64, soft_cap=3.0),
    dict(L=8, K=3, G=2, H=128, sliding_window=100, soft_cap=5.0, bq=8, bp=8),
    dict(L=16, K=4, G=4, H=64, sliding_window=5, bq=16, bp=8, kb=2),
]
BF16_CONFIGS = [
    dict(L=16, K=2, G=2, H=128),
    dict(L=8, K=4, G=1, H=64, sliding_window=64, bq=16, bp=4, kb=1),
    dict(L=32, K=1, G=4, H=128, soft_cap=4.0, bq=32, bp=2),
    dict(L=16, K=3, G=2, H=64, sliding_window=16, soft_cap=10.0, bq=8, bp=4),
]


def run_property(config, batch, dtype, tol):
    c = config
    seed, (q_lens, kv_lens) = batch
    args, rows = make_batch(seed, q_lens, kv_lens, L=c["L"], K=c["K"], N=c["K"] * c["G"],
                            H=c["H"], dtype=dtype, T=T_PAD, max_seqs=MAX_SEQS)
    check(args, rows, tol=tol, sliding_window=c.get("sliding_window"),
          soft_cap=c.get("soft_cap"), num_queries_per_block=c.get("bq", 32),
          num_kv_pages_per_block=c.get("bp"), num_kv_heads_per_block=c.get("kb"))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(F32_CONFIGS), batch=ragged_batches(T_PAD - 8))
def test_matches_reference_f32(config, batch):
    run_property(config, batch, jnp.float32, 1e-5)


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(BF16_CONFIGS), batch=ragged_batches(T_PAD))
def test_matches_reference_bf16(config, batch):
    run_property(config, batch, jnp.bfloat16, 2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixed_f32", "prefill_bf16"])
def test_bigger_batches(name):
    """A long prefill chunk among many decodes; several prefills with window and cap."""
    if name == "mixed_f32":
        rng = np.random.default_rng(7)
        q_lens = [100, 0] + [1] * 20
        kv_lens = [500, 37] + rng.integers(1, MAX_KV + 1, 20).tolist()
        args, rows = make_batch(0, q_lens, kv_lens, L=16, K=2, N=8, H=128,
                                dtype=jnp.float32, T=136, max_seqs=24)
        check(args, rows, tol=1e-5)
    else:
        q_lens, kv_lens = [64, 60, 1, 64], [64, 300, 599, 128]
        args, rows = make_batch(1, q_lens, kv_lens, L=32, K=4, N=4, H=64,
                                dtype=jnp.bfloat16, T=200, max_seqs=5)
        check(args, rows, tol=2e-2, sliding_window=48, soft_cap=20.0,
              num_queries_per_block=32, num_kv_pages_per_block=2)


@pytest.mark.parametrize("q_lens", [[], [0, 0, 0]])
def test_no_rows_gives_zeros(q_lens):
    """num_seqs = 0, or sequences that all have q_len 0: every row is 0."""
    args, rows = make_batch(3, q_lens, [5, 17, 1][:len(q_lens)], L=8, K=1, N=4, H=64,
                            dtype=jnp.float32, T=T_PAD, max_seqs=MAX_SEQS)
    assert rows == 0
    check(args, rows, tol=1e-5, num_queries_per_block=16, num_kv_pages_per_block=4)


def test_double_buffering_has_no_dma_races():
    """The interpreter's happens-before race detector sees every VMEM read of a
    K/V slot ordered after the wait on its copies (and no copy into a slot in
    use), across q blocks and kv-head blocks."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret
    args, rows = make_batch(4, [10, 1, 20, 0, 1], [40, 100, 20, 9, 1], L=8, K=2, N=4, H=64,
                            dtype=jnp.float32, T=40, max_seqs=5, pages_per_seq=16)
    check(args, rows, tol=1e-5, interpret=pltpu.InterpretParams(detect_races=True),
          num_queries_per_block=8, num_kv_pages_per_block=2, num_kv_heads_per_block=1)
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic(dtype):
    """The kernel lowers to a Mosaic TPU custom call (Pallas' lowering rules run
    here; Mosaic's own layout passes need a TPU and do not)."""
    sd = jax.ShapeDtypeStruct
    T, N, K, H, P, L, S, W = 64, 16, 8, 128, 64, 16, 8, 8
    shapes = (sd((T, N, H), dtype), sd((P, L, K, H), dtype), sd((P, L, K, H), dtype),
              sd((S,), jnp.int32), sd((S, W), jnp.int32), sd((S + 1,), jnp.int32),
              sd((1,), jnp.int32))
    fn = jax.jit(functools.partial(ragged_paged_attention_tpu, sm_scale=0.1,
                                   sliding_window=64, soft_cap=30.0))
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), abstract_device=jax.sharding.AbstractDevice("TPU v6 lite", 1, "tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        module = jax.export.export(fn, platforms=["tpu"])(*shapes).mlir_module()
    assert "tpu_custom_call" in module and "ragged_paged_attention_tpu" in module


def _good_args():
    T, N, K, H, P, L, S, W = 8, 4, 2, 64, 8, 8, 2, 4
    return dict(q=jnp.zeros((T, N, H)), k=jnp.zeros((P, L, K, H)), v=jnp.zeros((P, L, K, H)),
                kv_lens=jnp.zeros((S,), jnp.int32), table=jnp.zeros((S, W), jnp.int32),
                cu=jnp.zeros((S + 1,), jnp.int32), n=jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("change, kw, match", [
    (dict(q=jnp.zeros((8, 256))), {}, "q must be"),
    (dict(q=jnp.zeros((8, 3, 64))), {}, "multiple of kv heads"),
    (dict(q=jnp.zeros((8, 4, 32))), {}, "head_dim"),
    (dict(v=jnp.zeros((8, 8, 2, 32))), {}, "k_pages and v_pages"),
    (dict(cu=jnp.zeros((2,), jnp.int32)), {}, "cu_q_lens"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), {}, "kv_lens"),
    (dict(table=jnp.zeros((2, 4))), {}, "page_indices must be int32"),
    (dict(n=jnp.zeros((2,), jnp.int32)), {}, "num_seqs"),
    ({}, dict(sliding_window=0), "sliding_window"),
    ({}, dict(soft_cap=-1.0), "soft_cap"),
    ({}, dict(num_kv_heads_per_block=3), "num_kv_heads_per_block"),
    ({}, dict(num_queries_per_block=0), "num_queries_per_block"),
    (dict(k=jnp.zeros((8, 8, 2, 64), jnp.bfloat16), v=jnp.zeros((8, 8, 2, 64), jnp.bfloat16)),
     {}, "must all be f32 or all bf16"),
])
def test_bad_inputs_raise_value_error(change, kw, match):
    a = _good_args() | change
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_tpu(a["q"], a["k"], a["v"], a["kv_lens"], a["table"], a["cu"],
                                   a["n"], sm_scale=1.0, interpret=True, **kw)


# --- issue 32: head shapes, quantized KV, the HBM page table, block sizes, lowering ---


def quantized(args, dtype):
    """args with int8 / fp8 pages and their f32 scales (``quant.quantize``);
    NaN poison survives as NaN scales."""
    q, k, v = args[:3]
    out, scales = [], []
    for x in (k, v):
        P, L, K, H = x.shape
        x_q, s = quantize(x.reshape(P * L, K, H), dtype)
        out.append(x_q.reshape(P, L, K, H))
        scales.append(s.reshape(P, L, K))
    return (q, *out, *args[3:]), dict(k_scales_PLK=scales[0], v_scales_PLK=scales[1])


# Mixed decode + prefill batches over the head shapes of the models the project
# claims: G = 1, 3, 4, 7, 8; H = 64, 128, 256; bf16, int8 and fp8 pages (q bf16 or
# f32); windows and soft caps; default block sizes unless given.
HEAD_CASES = [
    dict(K=3, G=3, H=64, L=16, kv="bfloat16"),                            # SmolLM2
    dict(K=1, G=4, H=256, L=16, kv="bfloat16", sliding_window=40, soft_cap=8.0),  # Gemma3 270M
    dict(K=4, G=7, H=128, L=16, kv="float8_e4m3fn"),                      # Qwen2.5-7B
    dict(K=2, G=8, H=128, L=8, kv="int8", soft_cap=6.0),                  # Llama 3
    dict(K=4, G=1, H=256, L=16, kv="int8", sliding_window=33),            # MHA-like
    dict(K=1, G=3, H=128, L=8, kv="float8_e4m3fn", sliding_window=20, q="float32"),
    dict(K=2, G=7, H=64, L=32, kv="bfloat16", soft_cap=5.0, bq=16, bp=2),
    dict(K=2, G=1, H=128, L=16, kv="int8", q="float32", bq=32, bp=1),
]


@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()))
def test_head_shapes_and_kv_dtypes(case):
    # Decodes around prefill chunks: 37 and 20 rows take the large tiles, 5 rows
    # (across an 8-row boundary) and the decodes the small ones.
    q_lens = [1, 37, 1, 0, 5, 20, 1]
    kv_lens = [90, 37, 1, 12, 70, 150, 300]
    dtype = jnp.dtype(case.get("q", "bfloat16"))
    kv = jnp.dtype(case["kv"])
    args, rows = make_batch(11, q_lens, kv_lens, L=case["L"], K=case["K"],
                            N=case["K"] * case["G"], H=case["H"], dtype=dtype, T=72,
                            max_seqs=8)
    kw = {}
    if kv != dtype:
        args, kw = quantized(args, kv)
    f32 = dtype == jnp.float32
    tol = (1e-4 if kv == dtype else 2e-3) if f32 else 3e-2
    check(args, rows, tol=tol, sliding_window=case.get("sliding_window"),
          soft_cap=case.get("soft_cap"), num_queries_per_block=case.get("bq"),
          num_kv_pages_per_block=case.get("bp"), **kw)


def test_page_table_wider_than_the_smem_window():
    """The page table stays in HBM; each item copies only its bp page ids into
    SMEM. A 512-page-wide table read through a 2-page window, with contexts
    that end in a window clamped at the table's last column (pages_per_seq is
    not a multiple of bp)."""
    L, pps = 8, 75                                     # 600 tokens, 75 % 2 != 0
    args, rows = make_batch(5, [1, 30, 1, 3], [600, 230, 599, 17], L=L, K=2, N=6, H=64,
                            dtype=jnp.float32, T=40, max_seqs=4, pages_per_seq=pps)
    check(args, rows, tol=1e-5, num_queries_per_block=8, num_kv_pages_per_block=2)
    wide = np.asarray(args[4])
    wide = np.concatenate([wide, np.full((4, 512 - pps), -7, np.int32)], axis=1)
    args = (*args[:4], jnp.asarray(wide), *args[5:])
    check(args, rows, tol=1e-5, num_kv_pages_per_block=3, sliding_window=100)


def test_block_sizes_per_item_kind():
    """Defaults: q blocks of 128 tokens (KV re-read per 128 prefill tokens),
    8-row tiles for decodes (8 // gcd(G, 8) tokens), ~256-row tiles for prefill runs, kv-head
    blocks that tile the q dtype."""
    kw = dict(L=16, pages_per_seq=64, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
              quantized=False, num_queries_per_block=None, num_kv_pages_per_block=None,
              num_kv_heads_per_block=None, check_tiling=True)
    bq, bp, kb, small, large, _ = choose_blocks(T=512, N=64, K=8, H=128, **kw)
    assert (bq, bp, small, large) == (128, 16, 1, 32) and (kb * 8) % 16 == 0
    bq, bp, kb, small, large, _ = choose_blocks(T=20, N=9, K=3, H=64, **kw)
    assert (bq, kb, small, large) == (24, 3, 8, 8)
    assert choose_blocks(T=4096, N=4, K=1, H=256, **kw)[3:5] == (2, 64)
    assert choose_blocks(T=64, N=7, K=1, H=128, **kw)[3:5] == (8, 32)
    # Qwen2.5-14B (G = 5): only kb = K tiles bf16, so the q block halves to fit.
    bq, _, kb, _, _, vmem = choose_blocks(T=512, N=40, K=8, H=128, **kw)
    assert (bq, kb) == (64, 8) and vmem <= 12 * 2**20
    with pytest.raises(ValueError, match="num_kv_heads_per_block=1"):
        choose_blocks(T=512, N=32, K=8, H=128, **kw | dict(num_kv_heads_per_block=1))
    with pytest.raises(ValueError, match="head_dim must be a multiple of 64"):
        choose_blocks(T=512, N=32, K=8, H=80, **kw)
    with pytest.raises(ValueError, match="page_size must be a multiple of 8"):
        choose_blocks(T=512, N=32, K=8, H=128, **kw | dict(L=12))


def test_tpu_kv_page_bytes():
    """Padded HBM bytes per page under the (8 * packing, 128) tiling of (K, H)."""
    assert tpu_kv_page_bytes(16, 8, 128, jnp.bfloat16) == 16 * 16 * 128 * 2
    assert tpu_kv_page_bytes(16, 16, 128, jnp.bfloat16) == 16 * 16 * 128 * 2  # no padding
    assert tpu_kv_page_bytes(16, 3, 64, jnp.bfloat16) == 16 * 16 * 128 * 2    # SmolLM2: 10.7x
    assert tpu_kv_page_bytes(64, 8, 128, jnp.int8) == 64 * 32 * 128
    assert tpu_kv_page_bytes(64, 1, 256, jnp.float8_e4m3fn) == 64 * 32 * 256
    assert tpu_kv_page_bytes(16, 8, 128, jnp.float32) == 16 * 8 * 128 * 4
    assert tpu_kv_scale_page_bytes(16, 8) == 16 * 128 * 4


# (N, K, H) of the model shapes the project claims (lower_check covers them all).
MODEL_SHAPES = {
    "smollm2": (9, 3, 64), "gemma3-270m": (4, 1, 256), "gemma3-4b": (8, 4, 256),
    "gemma3-12b": (16, 8, 256), "gemma3-27b": (32, 16, 128), "llama3-8b": (32, 8, 128),
    "llama3-70b": (64, 8, 128), "qwen2.5-7b": (28, 4, 128), "qwen2.5-14b": (40, 8, 128),
    "mixtral": (32, 8, 128), "mha": (32, 32, 128),
}
LOWER_CASES = [  # (model, kv dtype, page size, window, soft cap)
    ("smollm2", "bfloat16", 16, None, None),
    ("gemma3-270m", "int8", 64, 512, 50.0),
    ("gemma3-4b", "float8_e4m3fn", 16, 1024, None),
    ("gemma3-27b", "bfloat16", 64, None, 30.0),
    ("llama3-70b", "int8", 16, None, None),
    ("qwen2.5-7b", "float8_e4m3fn", 64, None, None),
    ("mha", "bfloat16", 16, 4096, None),
]


@pytest.mark.parametrize("model, kv_dtype, L, window, cap", LOWER_CASES)
def test_lowers_for_tpu(model, kv_dtype, L, window, cap):
    """Pallas' Mosaic lowering accepts the kernel for these shapes (Mosaic's own
    compilation needs a TPU and does not run here)."""
    N, K, H = MODEL_SHAPES[model]
    text = lower_for_tpu(N, K, H, kv_dtype, L, sliding_window=window, soft_cap=cap)
    assert "tpu_custom_call" in text and "ragged_paged_attention_tpu" in text


@pytest.mark.parametrize("check_tiling", [True, False])
def test_broken_block_shape_fails_to_lower(check_tiling):
    """1 kv head per block with G = 4 gives bf16 q blocks of 4 heads, not a
    multiple of the 16-row tile: refused by our check, or by Pallas' lowering."""
    with pytest.raises(RuntimeError, match="TPU lowering failed for N=32 K=8"):
        lower_for_tpu(32, 8, 128, "bfloat16", 16, num_kv_heads_per_block=1,
                      check_tiling=check_tiling)
