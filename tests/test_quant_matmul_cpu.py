"""The CPU quantized-matmul kernels (``pallas_kernels/quant_matmul_cpu``):
each handler at each instruction-set level against the numpy reference
(f32 rounding; w8a8's int32 sums exactly), ``quantized_matmul`` with the
kernel against its XLA fallback, and a tiny engine whose greedy tokens are
the same either way. The kernel tests skip where the library was not built
(no compiler); the fallback tests run everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models import quant
from jaxserve.models.llama import LlamaForCausalLM, hf_params
from pallas_kernels import quant_matmul_cpu as qmm
from pallas_kernels.quant_matmul_cpu import ffi, reference
from tests.test_quant import TINY, _greedy, _llm

needs_kernel = pytest.mark.skipif(not qmm.available(), reason="quant_matmul_cpu not built")
ISAS = [0, 1, 2]  # scalar, AVX2, AVX-512 (a level above the CPU's runs the CPU's best)


def _case(F, D, M, fmt, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((F, D)).astype(np.float32)
    return quant.quantize_np(w, fmt), rng.standard_normal((D, M)).astype(np.float32)


def _tol(ref, D):
    return 4 * D * np.finfo(np.float32).eps * (np.abs(ref).max() + 1)


# F not a multiple of 16 throughout; M in {1, 2, 3, 17}; per-channel formats
# take a ragged D (83: no vector width divides it).
@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("F,D,M", [(37, 96, 1), (21, 83, 17)])
def test_int8_against_reference(isa, F, D, M):
    qt, x = _case(F, D, M, quant.INT8)
    got = np.asarray(qmm.int8_matmul(qt.q, qt.scale, x, isa=isa))
    ref = reference.int8_matmul(qt.q, qt.scale, x)
    assert np.abs(got - ref).max() <= _tol(ref, D)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("F,D,M,gs", [(37, 96, 2, 32), (21, 160, 3, 8)])  # 8: scalar groups
def test_q8g_against_reference(isa, F, D, M, gs):
    qt, x = _case(F, D, M, quant.TensorFormat(8, gs))
    got = np.asarray(qmm.q8g_matmul(qt.q, qt.scale, x, isa=isa))
    ref = reference.q8g_matmul(qt.q, qt.scale, x)
    assert np.abs(got - ref).max() <= _tol(ref, D)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("F,D,M,gs", [(37, 96, 3, 32), (21, 160, 17, 16)])  # 16: AVX2 width
def test_q4g_against_reference(isa, F, D, M, gs):
    qt, x = _case(F, D, M, quant.TensorFormat(4, gs, zero_point=True))
    got = np.asarray(qmm.q4g_matmul(qt.q, qt.scale, qt.zero, x, isa=isa))
    ref = reference.q4g_matmul(qt.q, qt.scale, qt.zero, x)
    assert np.abs(got - ref).max() <= _tol(ref, D)
    assert np.allclose(ref, quant.reference_linear(qt, x), rtol=1e-12, atol=1e-12)


def _weight_only(kind, F, D, M, gs, seed=0):
    """(kernel call(panel, threads=0), f64 reference) of one weight-only target."""
    fmt = {"f32": None, "int8": quant.INT8, "q8g": quant.TensorFormat(8, gs),
           "q4g": quant.TensorFormat(4, gs, zero_point=True)}[kind]
    if fmt is None:
        rng = np.random.default_rng(seed)
        w, x = rng.standard_normal((F, D)).astype(np.float32), \
            rng.standard_normal((D, M)).astype(np.float32)
        return (lambda isa, panel, threads=0: qmm.f32_matmul(w, x, isa=isa, panel=panel,
                                                            threads=threads),
                w.astype(np.float64) @ x.astype(np.float64))
    qt, x = _case(F, D, M, fmt, seed)
    parts = [a for a in (qt.q, qt.scale, qt.zero) if a is not None]
    kernel, ref = getattr(qmm, f"{kind}_matmul"), getattr(reference, f"{kind}_matmul")
    return (lambda isa, panel, threads=0: kernel(*parts, x, isa=isa, panel=panel,
                                                 threads=threads),
            ref(*parts, x))


# The panel path (kernel_panel.inc) forced on: F ragged against every ISA's
# panel height (8, 6, 4 rows), M ragged against the vector widths (16, 8) and
# the column blocks (32, 16, 4) and spans (128), D ragged for the per-channel
# formats (83), and group sizes the vector widths do not divide (8, 16: a lower level's bodies).
PANEL_CASES = [("f32", 37, 83, 33, None), ("int8", 21, 83, 7, None),
               ("int8", 13, 96, 50, None), ("q8g", 37, 96, 17, 32), ("q8g", 21, 160, 9, 8),
               ("q4g", 37, 96, 33, 32), ("q4g", 21, 160, 7, 16), ("f32", 8, 64, 16, None),
               ("q4g", 13, 64, 150, 32)]  # 150: two column spans (128, then 22 + padding)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,F,D,M,gs", PANEL_CASES)
def test_panel_against_reference(isa, kind, F, D, M, gs):
    call, ref = _weight_only(kind, F, D, M, gs)
    got = np.asarray(call(isa, 1))
    assert np.abs(got - ref).max() <= _tol(ref, D)
    # the row tiles agree to f32 rounding (a different summation order)
    assert np.abs(np.asarray(call(isa, 0)) - got).max() <= 2 * _tol(ref, D)


@needs_kernel
@pytest.mark.parametrize("kind", ["f32", "int8", "q8g", "q4g"])
def test_panel_rule_and_threads(kind):
    """The kernel's own rule (panel=-1) takes the row tiles below its column
    threshold and the panel path from it on (bit-equal to the forced forms), and
    a weight large enough for the thread pool gives the one-thread bits."""
    for M in (qmm.PANEL_COLUMNS[kind] - 1, qmm.PANEL_COLUMNS[kind]):
        call, ref = _weight_only(kind, 40, 64, M, 32, seed=M)
        want = 1 if M >= qmm.PANEL_COLUMNS[kind] else 0
        np.testing.assert_array_equal(np.asarray(call(-1, -1)), np.asarray(call(-1, want)))
    call, ref = _weight_only(kind, 1000, 64, 40, 32)  # 2.6M multiply-adds: the pool splits rows
    got = np.asarray(call(-1, 1))
    np.testing.assert_array_equal(got, np.asarray(call(-1, 1, threads=1)))
    assert np.abs(got - ref).max() <= _tol(ref, 64)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("F,D,M", [(37, 200, 1), (19, 83, 17)])  # ragged D: masked tail
def test_w8a8_int32_exact(isa, F, D, M):
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, (F, D), dtype=np.int8)
    q[0] = 127  # extreme products, summed exactly
    xq = rng.integers(-127, 128, (D, M), dtype=np.int8)
    xq[:, 0] = -127
    one_F1, one_1M = np.ones((F, 1), np.float32), np.ones((1, M), np.float32)
    got = np.asarray(qmm.w8a8_matmul(q, one_F1, xq, one_1M, isa=isa))
    np.testing.assert_array_equal(got, reference.int32_matmul(q, xq))  # |acc| < 2^24: exact
    qt, x = _case(F, D, M, quant.W8A8)
    xq, sx = quant.quantize_act_np(x)
    got = np.asarray(qmm.w8a8_matmul(qt.q, qt.scale, xq, sx[None], isa=isa))
    ref = reference.w8a8_matmul(qt.q, qt.scale, xq, sx[None])
    assert np.abs(got - ref).max() <= 4 * np.finfo(np.float32).eps * np.abs(ref).max()


@needs_kernel
def test_inside_jit_and_scan_and_threads():
    """Stacked layers under lax.scan, and the XLA thread pool split (a weight
    large enough to use it) equal one-thread results."""
    rng = np.random.default_rng(2)
    qts = [quant.quantize_np(rng.standard_normal((512, 64)).astype(np.float32), quant.Q4)
           for _ in range(3)]
    p, s, z = (jnp.stack([getattr(qt, a) for qt in qts]) for a in ("q", "scale", "zero"))
    x = jnp.asarray(rng.standard_normal((64, 16)).astype(np.float32))

    def body(c, layer):
        y = qmm.q4g_matmul(*layer, x)
        return c + y, y
    total, ys = jax.jit(lambda *a: jax.lax.scan(body, jnp.zeros((512, 16)), a))(p, s, z)
    for i, qt in enumerate(qts):
        ref = reference.q4g_matmul(qt.q, qt.scale, qt.zero, np.asarray(x))
        assert np.abs(np.asarray(ys[i]) - ref).max() <= _tol(ref, 64)
        one = np.asarray(qmm.q4g_matmul(qt.q, qt.scale, qt.zero, x, threads=1))
        np.testing.assert_array_equal(np.asarray(ys[i]), one)


def test_env_switch_forces_the_fallback(monkeypatch):
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "0")
    assert not qmm.available()


@pytest.mark.parametrize("fmt", [quant.INT8, quant.W8A8, quant.Q8_0, quant.Q4])
def test_quantized_matmul_kernel_equals_fallback(monkeypatch, fmt):
    """``quantized_matmul`` (``lowering="auto"``) with the kernel forced on and
    with it off: the same values within the fallback's own rounding (int8's
    two-term activations: ~2^-16 of amax)."""
    qt, x = _case(40, 128, 3, fmt)
    args = [None if a is None else jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero)]
    run = jax.jit(lambda q, s, z, x: quant.quantized_matmul(fmt, q, s, z, x))
    monkeypatch.setattr(ffi, "available", lambda: False)
    monkeypatch.setattr(qmm, "available", lambda: False)
    off = np.asarray(run(*args, jnp.asarray(x)))
    ref = quant.reference_linear(qt, x)
    assert np.abs(off - ref).max() <= 1e-3 * np.abs(ref).max()
    if not ffi._load():
        pytest.skip("quant_matmul_cpu not built")
    monkeypatch.setattr(qmm, "available", lambda: True)
    monkeypatch.setattr(qmm, "use_kernel", lambda kind, F, D, M: True)
    run = jax.jit(lambda q, s, z, x: quant.quantized_matmul(fmt, q, s, z, x))
    on = np.asarray(run(*args, jnp.asarray(x)))
    assert "jaxserve_qmm" in run.lower(*args, jnp.asarray(x)).as_text()
    assert np.abs(on - off).max() <= 1e-3 * np.abs(ref).max()
    assert np.abs(on - ref).max() <= _tol(ref, 128) * (30 if fmt.act_int8 else 1)


@pytest.fixture(scope="module")
def tiny_params():
    model = LlamaForCausalLM(TINY, rngs=nnx.Rngs(0))
    return {n: np.asarray(p[...]) * 3 for n, (p, _) in hf_params(model).items()}


@needs_kernel
@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_engine_greedy_tokens_same_with_kernel_and_fallback(monkeypatch, tiny_params, method):
    traced = []  # (kind, M) of every kernel call traced into the steps

    def use_kernel(kind, F, D, M):
        traced.append((kind, M))
        return True
    monkeypatch.setattr(qmm, "use_kernel", use_kernel)
    fused, parts_call = [], qmm.q4g_matmul_parts  # quant.linears' one call for q/k/v, gate/up

    def q4g_matmul_parts(parts, *a, **k):
        fused.append(len(parts))
        return parts_call(parts, *a, **k)
    monkeypatch.setattr(qmm, "q4g_matmul_parts", q4g_matmul_parts)
    with_kernel = _greedy(_llm(tiny_params, quantization=method))
    assert set(fused) == ({3, 2} if method == "int4" else set())
    # f32: the scanned layer's projections read in place by the dense target.
    # (int8's and int4's LM head: Q8_0 groups, quant.head_format)
    assert {k for k, _ in traced} == {"none": {"f32"}, "int8": {"int8", "q8g"},
                                      "int4": {"q4g", "q8g"}}[method]
    assert 1 in {m for _, m in traced} and max(m for _, m in traced) > 1  # decode and prefill
    monkeypatch.setattr(qmm, "available", lambda: False)
    fallback = _greedy(_llm(tiny_params, quantization=method))
    assert with_kernel == fallback


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 5])
def test_q4g_parts_equal_one_call_each(isa, M):
    """Three stacked 4-bit weights (ragged F) of one x in one call, read at the
    scan's layer: bit-equal to one row-tile call per part on that layer; a
    part of another G is refused."""
    rng = np.random.default_rng(M)
    L, D = 3, 128
    parts = []
    for F in (37, 16, 21):
        qts = [quant.quantize_np(rng.standard_normal((F, D)).astype(np.float32), quant.Q4)
               for _ in range(L)]
        parts.append(tuple(jnp.asarray(np.stack([getattr(t, n) for t in qts]))
                           for n in ("q", "scale", "zero")))
    x = jnp.asarray(rng.standard_normal((D, M)).astype(np.float32))

    def body(c, i):
        return c, qmm.q4g_matmul_parts(parts, x, layer=i, isa=isa)
    _, outs = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32)))()
    for j, p in enumerate(parts):
        assert outs[j].shape == (L, p[0].shape[1], M)
        for i in range(L):
            alone = qmm.q4g_matmul(*[a[i] for a in p], x, isa=isa, panel=0)
            np.testing.assert_array_equal(np.asarray(outs[j][i]), np.asarray(alone))
    q, s, z = parts[1]
    other_g = (q, s[..., :2], z[..., :2])  # G = 2 beside G = 4
    with pytest.raises(Exception, match="with one G"):
        np.asarray(qmm.q4g_matmul_parts([parts[0], other_g], x, layer=jnp.int32(0)))


@needs_kernel
@pytest.mark.parametrize("M", [2, 35])  # 35: the panel path (kernel rule), ragged columns
@pytest.mark.parametrize("fmt", [None, quant.INT8, quant.W8A8, quant.Q8_0, quant.Q4])
def test_stacked_parts_are_read_at_the_layer(fmt, M):
    """A weight stacked over 3 layers with a layer index gives exactly the
    2-D call on that layer's slice (the kernel offsets its pointers), inside
    a scan as ``stack.run_layers`` runs it; an index outside [0, L) is an error."""
    rng = np.random.default_rng(3)
    L, F, D = 3, 37, 96
    ws = rng.standard_normal((L, F, D)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((D, M)).astype(np.float32))
    if fmt is None:
        parts = [jnp.asarray(ws)]
        call = lambda *a, layer=None: qmm.f32_matmul(*a, layer=layer)  # noqa: E731
    else:
        qts = [quant.quantize_np(w, fmt) for w in ws]
        parts = [jnp.asarray(np.stack([getattr(t, n) for t in qts]))
                 for n in ("q", "scale", "zero") if getattr(qts[0], n) is not None]
        if fmt.act_int8:
            xq, sx = quant.quantize_act(x)
            def call(q, s, x_, layer=None):
                return qmm.w8a8_matmul(q, s, xq, sx, layer=layer)
        else:
            call = {8: qmm.int8_matmul if fmt.group_size is None else qmm.q8g_matmul,
                    4: qmm.q4g_matmul}[fmt.bits]

    def body(c, i):
        return c, call(*parts, x, layer=i)
    _, stacked_LFM = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32)))()
    for i in range(L):
        alone = call(*[p[i] for p in parts], x)
        np.testing.assert_array_equal(np.asarray(stacked_LFM[i]), np.asarray(alone))
    with pytest.raises(Exception, match="layer must be a scalar in"):
        np.asarray(call(*parts, x, layer=jnp.int32(L)))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,F,D", [(quant.Q4, 37, 96), (quant.TensorFormat(4, 16, True), 21, 80),
                                     (quant.Q8_0, 37, 96), (quant.TensorFormat(8, 8), 21, 40)])
def test_dequantize_targets_give_quant_dequantize_exactly(isa, fmt, F, D):
    """``q4g_dequantize`` / ``q8g_dequantize`` of a weight stacked over 3
    layers, at each layer, equal ``quant.dequantize`` of its slice bit for bit
    (``s q`` is exact in f32), the 2-D form too; a layer outside [0, L) is an error."""
    rng = np.random.default_rng(5)
    qts = [quant.quantize_np(w, fmt) for w in rng.standard_normal((3, F, D)).astype(np.float32)]
    q, s = (jnp.asarray(np.stack([getattr(t, n) for t in qts])) for n in ("q", "scale"))
    z = jnp.asarray(np.stack([t.zero for t in qts])) if fmt.zero_point else None
    if fmt.bits == 4:
        call = lambda *a, **k: qmm.q4g_dequantize(*a, isa=isa, **k)  # noqa: E731
        args = (q, s, z)
    else:
        call = lambda *a, **k: qmm.q8g_dequantize(*a, isa=isa, **k)  # noqa: E731
        args = (q, s)
    for i in range(3):
        want = np.asarray(quant.dequantize(fmt, q[i], s[i], None if z is None else z[i]))
        np.testing.assert_array_equal(np.asarray(call(*args, layer=jnp.int32(i))), want)
        np.testing.assert_array_equal(np.asarray(call(*[a[i] for a in args])), want)
        np.testing.assert_array_equal(want, qts[i].dequantize().astype(np.float32))
    with pytest.raises(Exception, match="layer must be a scalar in"):
        np.asarray(call(*args, layer=jnp.int32(3)))


@needs_kernel
@pytest.mark.parametrize("fmt", [quant.Q4, quant.Q8_0])
def test_wide_stacked_matmul_dequantizes_by_the_kernel_exactly(fmt):
    """Past the kernel's matmul widths a scanned layer's 4-bit / Q8_0 weight is
    dequantized in place by the kernel library, then the XLA dot: the same
    f32 values as XLA's dequantization, so the same product bit for bit."""
    rng = np.random.default_rng(6)
    L, F, D, M = 2, 48, 64, 600
    qts = [quant.quantize_np(w, fmt) for w in rng.standard_normal((L, F, D)).astype(np.float32)]
    names = ("q", "scale", "zero") if fmt.zero_point else ("q", "scale")
    stacked = [jnp.asarray(np.stack([getattr(t, n) for t in qts])) for n in names]
    if not fmt.zero_point:
        stacked.append(None)
    x = jnp.asarray(rng.standard_normal((D, M)).astype(np.float32))

    def wide(i):
        parts = [None if a is None else quant.StackedRead(a, i) for a in stacked]
        return quant.matmul_parts(fmt, parts, x)
    text = str(jax.make_jaxpr(wide)(jnp.int32(1)))
    assert "dequant_q" in text and "ffi_call" in text
    for i in range(L):
        got = np.asarray(jax.jit(wide)(jnp.int32(i)))
        w = quant.dequantize(fmt, *[None if a is None else a[i] for a in stacked])
        want = np.asarray(jax.jit(lambda w: jnp.einsum("fd,dt->ft", w, x))(w))
        np.testing.assert_array_equal(got, want)
