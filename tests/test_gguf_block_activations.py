"""``--quantization gguf_a8`` and ``gguf_a16``: a GGUF file's blocks x int8 /
int16 activations in blocks of 32 (``quant_format.quantize_act_blocks``).

The definition in numpy and under jit (equal bit for bit: XLA rewrites a
division by a constant or a broadcast value, so the definition is written in
products), the AVX-512 VNNI kernel and its fallbacks (every ISA level, ragged
F, 1 to 33 columns, stacked layers) against the f64 reference, the fused
q/k/v call, ``quantized_matmul`` with the kernel and without, the format a
loaded GGUF tensor takes, and a tiny GGUF engine: the same greedy tokens with
the kernel and without, and logits within the quantization's reach of
``gguf``'s both ways (gguf_a16: ``gguf``'s tokens, logits within 1e-4).
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import quant
from pallas_kernels import quant_matmul_cpu as qmm
from pallas_kernels.quant_matmul_cpu import ffi

needs_a8 = pytest.mark.skipif(not qmm.has_target("jaxserve_qmm_q4g_a8"),
                              reason="quant_matmul_cpu (with the a8 targets) not built, or "
                                     "JAXSERVE_CPU_KERNELS=0")
ISAS = [0, 1, 2]
A4 = dataclasses.replace(quant.Q4, act_block=quant.ACT_BLOCK)
A8 = dataclasses.replace(quant.Q8_0, act_block=quant.ACT_BLOCK)
A4_16 = dataclasses.replace(A4, act_bits=16)
A8_16 = dataclasses.replace(A8, act_bits=16)
# (format, its kernel function) per activation width
KERNELS = {8: ((A4, qmm.q4g_a8_matmul), (A8, qmm.q8g_a8_matmul)),
           16: ((A4_16, qmm.q4g_a16_matmul), (A8_16, qmm.q8g_a16_matmul))}


def _x(D, M, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((D, M)).astype(np.float32)
    x[3] *= 40  # an outlier channel, as LLM activations have
    x[32:64, 0] = 0  # an all-zero block: scale 1, q 0
    return x


def _weights(fmt, F, D, L=None, seed=1):
    rng = np.random.default_rng(seed)
    shape = (F, D) if L is None else (L, F, D)
    qt = quant.quantize_np(0.05 * rng.standard_normal(shape).astype(np.float32),
                           fmt.weight_only())
    return dataclasses.replace(qt, fmt=fmt)


def _layer(qt, i):
    parts = [None if a is None else a[i] for a in (qt.q, qt.scale, qt.zero)]
    return quant.QuantizedTensor(qt.fmt, qt.shape[1:], *parts)


@pytest.mark.parametrize("bits", [8, 16])
def test_block_quantization_numpy_and_jit_bit_equal(bits):
    levels, factor = quant.act_levels(bits)
    assert (levels, factor) == ((127, quant.ACT_SCALE) if bits == 8 else
                                (32767, quant.ACT_SCALE16))
    x = _x(96, 7)
    q, s = quant.quantize_act_blocks_np(x, 32, bits)
    assert q.dtype == (np.int8 if bits == 8 else np.int16) and s.shape == (3, 7)
    assert np.abs(q).max() == levels
    amax = np.abs(x.reshape(3, 32, 7)).max(axis=1)
    np.testing.assert_array_equal(s, np.where(amax > 0, amax * factor, 1))
    assert s[1, 0] == 1 and not q[32:64, 0].any()
    assert np.abs(q.reshape(3, 32, 7) * s[:, None] - x.reshape(3, 32, 7)).max() <= \
        0.5 * s.max() * (1 + 1e-6)
    qj, sj = jax.jit(lambda x: quant.quantize_act_blocks(x, 32, bits))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_array_equal(np.asarray(sj), s)
    fake = jax.jit(lambda x: quant.fake_quantize_act_blocks(x, 32, bits))(jnp.asarray(x))
    np.testing.assert_array_equal(
        np.asarray(fake), (q.reshape(3, 32, 7).astype(np.float32) * s[:, None]).reshape(96, 7))
    with pytest.raises(ValueError, match="does not divide the input dim 96"):
        quant.quantize_act_blocks_np(x, 64 + 1)
    with pytest.raises(ValueError, match="8 or 16 bits, got 4"):
        quant.quantize_act_blocks_np(x, 32, 4)


def test_format_and_adoption():
    placeholder = quant.method_format("gguf_a8")
    assert placeholder == A4 and placeholder.weight_only() == quant.Q4
    assert quant.adopted_format(quant.Q8_0, placeholder) == A8
    assert quant.adopted_format(quant.DENSE, placeholder) == quant.DENSE  # other ggml types
    assert quant.adopted_format(quant.Q4, quant.method_format("gguf")) == quant.Q4
    with pytest.raises(ValueError, match="act_block"):
        quant.TensorFormat(bits=8, act_int8=True, act_block=32)
    a16 = quant.method_format("gguf_a16")
    assert a16 == A4_16 and a16.weight_only() == quant.Q4
    assert quant.adopted_format(quant.Q8_0, a16) == A8_16
    with pytest.raises(ValueError, match="act_bits must be 8 or 16, got 12"):
        quant.TensorFormat(bits=4, group_size=32, act_block=32, act_bits=12)


@needs_a8
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("F", [48, 37])  # 48: the VNNI panels (32 + a 16-row tail); 37 ragged
@pytest.mark.parametrize("M", [1, 5, 12, 33])  # below and from the panels' 12 columns
def test_kernels_against_reference(isa, F, M):
    D = 96
    x = _x(D, M)
    for fmt, call in KERNELS[8] + KERNELS[16]:
        qt = _weights(fmt, F, D)
        ref = quant.reference_linear(qt, x)
        args = [jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero) if a is not None]
        y = np.asarray(call(*args, jnp.asarray(x), isa=isa))
        assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max(), (fmt, isa, F, M)


@needs_a8
@pytest.mark.parametrize("bits", [8, 16])
def test_narrow_widths_are_the_weight_only_kernel_on_the_block_values(bits):
    """Below the VNNI panels' 12 columns the kernel replaces x by its blocks'
    values (vectorised with AVX-512) and runs the weight-only kernel: bit for
    bit that kernel on numpy's ``quantize_act_blocks_np`` values."""
    D, F = 160, 48
    (fmt, call), _ = KERNELS[bits]
    qt = _weights(fmt, F, D)
    args = [jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero)]
    for M in (1, 3, 11):
        x = _x(D, M, seed=M)
        q, s = quant.quantize_act_blocks_np(x, 32, bits)
        xf = (q.reshape(D // 32, 32, M).astype(np.float32) * s[:, None]).reshape(D, M)
        np.testing.assert_array_equal(np.asarray(call(*args, jnp.asarray(x))),
                                      np.asarray(qmm.q4g_matmul(*args, jnp.asarray(xf))))


@needs_a8
def test_stacked_layers_read_in_place_under_scan():
    L, F, D, M = 3, 64, 160, 20
    x = jnp.asarray(_x(D, M))
    for fmt in (A4, A8, A4_16, A8_16):
        qt = _weights(fmt, F, D, L=L)
        parts = tuple(None if a is None else jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero))

        def body(c, i, parts=parts, fmt=fmt):
            return c, quant.matmul_parts(fmt, [None if p is None else quant.StackedRead(p, i)
                                               for p in parts], x)
        _, ys = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32)))()
        for i in range(L):
            ref = quant.reference_linear(_layer(qt, i), np.asarray(x))
            assert np.abs(np.asarray(ys[i]) - ref).max() <= 1e-6 * np.abs(ref).max()


@needs_a8
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 16])
def test_fused_parts_take_the_activation_blocks(isa, bits):
    """``q4g_matmul_parts(act_block=32, act_bits=bits)``: q/k/v in one call,
    each part equal to its own ``q4g_a8_matmul`` / ``q4g_a16_matmul`` (the same
    blocks, the same row tiles)."""
    L, D, M = 2, 128, 3
    x = jnp.asarray(_x(D, M))
    (fmt, call), _ = KERNELS[bits]
    qts = [_weights(fmt, F, D, L=L, seed=F) for F in (64, 32, 48)]
    parts = [tuple(jnp.asarray(a) for a in (t.q, t.scale, t.zero)) for t in qts]
    outs = qmm.q4g_matmul_parts(parts, x, layer=jnp.int32(1), isa=isa, act_block=32,
                                act_bits=bits)
    for t, p, y in zip(qts, parts, outs):
        alone = call(*p, x, layer=jnp.int32(1), isa=isa)
        np.testing.assert_allclose(np.asarray(y), np.asarray(alone), rtol=0, atol=1e-6)
        ref = quant.reference_linear(_layer(t, 1), np.asarray(x))
        assert np.abs(np.asarray(y) - ref).max() <= 1e-6 * np.abs(ref).max()
    with pytest.raises(Exception, match="act_block must be 0 or 32"):
        np.asarray(qmm.q4g_matmul_parts(parts, x, layer=jnp.int32(0), act_block=16))


@pytest.mark.parametrize("fmt", [A4, A8, A4_16, A8_16], ids=["q4", "q8", "q4_a16", "q8_a16"])
def test_quantized_matmul_kernel_equals_fallback(monkeypatch, fmt):
    qt = _weights(fmt, 64, 128)
    x = _x(128, 40)
    ref = quant.reference_linear(qt, x)
    args = [None if a is None else jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero)]
    monkeypatch.setattr(ffi, "available", lambda: False)
    monkeypatch.setattr(qmm, "available", lambda: False)
    monkeypatch.setattr(qmm, "has_target", lambda name: False)
    run = jax.jit(lambda q, s, z, x: quant.quantized_matmul(fmt, q, s, z, x))
    off = np.asarray(run(*args, jnp.asarray(x)))
    assert "jaxserve_qmm" not in run.lower(*args, jnp.asarray(x)).as_text()
    assert np.abs(off - ref).max() <= 1e-6 * np.abs(ref).max()
    # precise activations are measurably elsewhere: the test can tell the two apart
    # (int16 blocks: ~2e-5 of the largest output)
    precise = quant.reference_linear(dataclasses.replace(qt, fmt=fmt.weight_only()), x)
    assert np.abs(precise - ref).max() > (1e-3 if fmt.act_bits == 8 else 5e-6) * \
        np.abs(ref).max()
    monkeypatch.undo()
    if not qmm.has_target("jaxserve_qmm_q4g_a8"):
        pytest.skip("quant_matmul_cpu (with the a8 targets) not built, or JAXSERVE_CPU_KERNELS=0")
    monkeypatch.setattr(qmm, "use_kernel", lambda kind, F, D, M: True)
    run = jax.jit(lambda q, s, z, x: quant.quantized_matmul(fmt, q, s, z, x))
    on = np.asarray(run(*args, jnp.asarray(x)))
    assert f"_a{fmt.act_bits}" in run.lower(*args, jnp.asarray(x)).as_text()
    assert np.abs(on - off).max() <= 2e-6 * np.abs(ref).max()


@pytest.fixture(scope="module")
def q41_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("a8") / "q41.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_heads=4, num_kv_heads=2, num_layers=2),
                    qtype=gguf.GGMLQuantizationType.Q4_1)
    return str(path)


def _run(path, quantization, **kw):
    from jaxserve import LLM, SamplingParams
    llm = LLM(path, quantization=quantization, num_pages=32, max_num_seqs=4, **kw)
    prompts = ["hello world", "the quick brown fox jumps over", "a"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    logits = llm.engine.prompt_logits(list(range(3, 40)))
    return llm, [o.outputs[0].token_ids for o in outs], np.asarray(logits)


def test_engine_kernel_and_fallback_alike_and_near_gguf(monkeypatch, q41_gguf):
    traced, a8_call = [], qmm.q4g_a8_matmul  # the a8 target traced into the steps

    def q4g_a8_matmul(*a, **k):
        traced.append(a[3].shape[1])
        return a8_call(*a, **k)
    monkeypatch.setattr(qmm, "q4g_a8_matmul", q4g_a8_matmul)
    llm, tokens, logits = _run(q41_gguf, "gguf_a8")
    if qmm.has_target("jaxserve_qmm_q4g_a8"):  # projections and the tied Q4_1 head
        assert traced and max(traced) > 1
    monkeypatch.undo()
    _, exact_tokens, exact_logits = _run(q41_gguf, "gguf")
    # int8 blocks of the activations move the logits a little, not the model
    assert 0 < np.abs(logits - exact_logits).max() <= 0.05 * np.abs(exact_logits).max()
    monkeypatch.setattr(qmm, "available", lambda: False)
    monkeypatch.setattr(qmm, "has_target", lambda name: False)
    _, fb_tokens, fb_logits = _run(q41_gguf, "gguf_a8")
    assert fb_tokens == tokens
    # Each projection is the same within f32 rounding (tests above), but a value
    # within rounding of a block's .5 step quantizes to a neighbour, and that step
    # moves later blocks: two implementations land at different, equally near,
    # points (2 layers here: 1.2% of the largest logit apart, against 2.2% from gguf)
    assert np.abs(fb_logits - exact_logits).max() <= 0.05 * np.abs(exact_logits).max()


def test_engine_gguf_a16_keeps_gguf_tokens(monkeypatch, q41_gguf):
    """int16 blocks: ``gguf``'s greedy tokens, logits within 1e-4 of its
    largest (2 layers; int8 blocks move them 2.2%), and not bit-equal."""
    traced, a16_call = [], qmm.q4g_a16_matmul

    def q4g_a16_matmul(*a, **k):
        traced.append(a[3].shape[1])
        return a16_call(*a, **k)
    monkeypatch.setattr(qmm, "q4g_a16_matmul", q4g_a16_matmul)
    _, tokens, logits = _run(q41_gguf, "gguf_a16")
    if qmm.has_target("jaxserve_qmm_q4g_a16"):
        assert traced and max(traced) > 1
    monkeypatch.undo()
    _, exact_tokens, exact_logits = _run(q41_gguf, "gguf")
    assert tokens == exact_tokens
    assert 0 < np.abs(logits - exact_logits).max() <= 1e-4 * np.abs(exact_logits).max()


@pytest.mark.parametrize("method", ["gguf_a8", "gguf_a16"])
def test_block_activation_methods_need_gguf_blocks(method):
    from tests.test_quant import _llm
    with pytest.raises(ValueError, match=f"quantization='{method}' keeps a GGUF file's own"):
        _llm(None, quantization=method)
