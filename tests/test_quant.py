"""Quantized weights (``jaxserve.models.quant``): each format's matmul against
a numpy f64 reference of its definition, the quantizers' error bounds, the
engine with every method (logits against an unquantized engine fed the
dequantized weights), tensor and expert parallelism (same tokens as one
device, parameters and scales really split), and the errors raised before
any weight loads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import quant
from jaxserve.models.llama import LlamaForCausalLM, hf_params
from jaxserve.models.llama import load_params as llama_load

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16)
TINY_MOE = ModelConfig(architecture="mixtral", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, norm_topk_prob=True)
PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], [200], list(range(10, 60)), [42] * 19]
FORMATS = {"int8": quant.INT8, "w8a8": quant.W8A8, "int4/32": quant.Q4,
           "int4/64": quant.TensorFormat(4, 64, zero_point=True), "Q8_0": quant.Q8_0,
           "dense": quant.DENSE}


def _parts(qt):
    return [None if a is None else jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero)]


def _split_bound(qt, x):
    """The CPU int8 lowering's bound: x is carried as s1 q1 + s2 q2 with
    |error| <= amax / (2 * 127 * 254) per element (plus f32 rounding)."""
    amax = np.abs(x).max(axis=0)
    return np.abs(qt.dequantize()).astype(np.float64) @ np.ones(x.shape[0]) \
        [:, None] * (amax / (2 * 127 * 254))[None, :]


# ---- the linear against numpy ----------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("lowering", ["auto", "exact", "cpu"])
@pytest.mark.parametrize("F, D, T", [(48, 128, 1), (96, 256, 17)])
def test_linear_equals_numpy_reference(name, lowering, F, D, T):
    fmt = FORMATS[name]
    rng = np.random.default_rng(F * D + T)
    w = rng.standard_normal((F, D)).astype(np.float32) * rng.uniform(0.1, 3, (F, 1)).astype(
        np.float32)
    x = rng.standard_normal((D, T)).astype(np.float32)
    x[rng.integers(D), :] *= 8  # an outlier channel, as real activations have
    qt = quant.quantize_np(w, fmt)
    ref = quant.reference_linear(qt, x)
    y = np.asarray(quant.quantized_matmul(fmt, *_parts(qt), jnp.asarray(x), lowering))
    assert y.shape == (F, T) and y.dtype == np.float32
    # f32 rounding of a D-long sum of |w x| terms (x's own int8 rounding is
    # part of w8a8's definition, so its reference already holds it).
    xr = x if not fmt.act_int8 else (lambda q, s: q * s)(*quant.quantize_act_np(x))
    scale = np.abs(qt.dequantize()).astype(np.float64) @ np.abs(xr).astype(np.float64)
    bound = 4e-7 * np.sqrt(D) * scale + 1e-30
    if fmt == quant.INT8 and lowering != "exact" and jax.default_backend() == "cpu" \
            or fmt == quant.INT8 and lowering == "cpu":
        bound = bound + _split_bound(qt, x)
    assert np.all(np.abs(y - ref) <= bound), np.abs(y - ref).max()


def test_quantizers_round_to_nearest_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3, 96)).astype(np.float32)  # stacked, as experts are
    for fmt in (quant.INT8, quant.Q8_0, quant.Q4, quant.TensorFormat(4, 96, zero_point=True)):
        qt = quant.quantize_np(w, fmt)
        g = w.shape[-1] // qt.scale.shape[-1]
        step = np.repeat(qt.scale.astype(np.float32), g, axis=-1)
        # f16 group scales/zeros: q is rounded against the stored values, so
        # only their own f16 rounding (2^-11 relative) adds to half a step.
        slack = 1e-6 if fmt.group_size is None else 2 ** -10 * np.abs(w).max()
        assert np.all(np.abs(qt.dequantize() - w) <= step / 2 + slack), fmt
        assert qt.scale.dtype == (np.float32 if fmt.group_size is None else np.float16)
        if fmt.bits == 4:
            assert qt.q.dtype == np.uint8 and qt.q.shape == (5, 3, 48)
            assert quant.unpack_int4_np(qt.q).max() <= 15
        else:
            assert qt.q.dtype == np.int8 and np.abs(qt.q).max() == 127
    q = np.random.default_rng(1).integers(0, 16, (4, 64)).astype(np.uint8)
    np.testing.assert_array_equal(quant.unpack_int4_np(quant.pack_int4_np(q)), q)
    zeros = quant.quantize_np(np.zeros((2, 32), np.float32), quant.Q4)  # flat groups stay exact
    np.testing.assert_array_equal(zeros.dequantize(), 0)


def test_ggml_q4_0_and_q4_1_blocks_are_held_exactly():
    """Q4_0 (d * (q - 8)) and Q4_1 (d * q + m) fit scale * q + zero with no
    rounding: d f16, q <= 15 (products need <= 15 bits)."""
    rng = np.random.default_rng(0)
    d = rng.standard_normal((6, 4)).astype(np.float16)
    m = rng.standard_normal((6, 4)).astype(np.float16)
    q = rng.integers(0, 16, (6, 128)).astype(np.uint8)
    qg = q.reshape(6, 4, 32).astype(np.float32)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    for zero, expect in ((-8 * d, d32[..., None] * (qg - 8)),
                         (m, d32[..., None] * qg + m32[..., None])):
        qt = quant.QuantizedTensor(quant.Q4, (6, 128), quant.pack_int4_np(q), d, zero)
        np.testing.assert_array_equal(qt.dequantize(), expect.reshape(6, 128))


def test_bad_formats():
    with pytest.raises(ValueError, match="group size 48 does not divide the input dim 64"):
        quant.quantize_np(np.zeros((4, 64), np.float32), quant.TensorFormat(4, 48, True))
    with pytest.raises(ValueError, match="bits must be 0, 4 or 8"):
        quant.TensorFormat(bits=3)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.method_format("int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    w = quant.QuantizedWeight((8, 32), ("mlp", "embed"), quant.INT8)
    with pytest.raises(ValueError, match=r"up: checkpoint shape \(8, 16\) != model \(8, 32\)"):
        w.load(np.zeros((8, 16), np.float32), "up")
    with pytest.raises(ValueError, match="checkpoint format"):
        w.load(quant.quantize_np(np.ones((8, 32), np.float32), quant.Q4), "up")


# ---- the engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_params():
    model = LlamaForCausalLM(TINY, rngs=nnx.Rngs(0))
    return {n: np.asarray(p[...]) * 3 for n, (p, _) in hf_params(model).items()}


def _llm(params=None, cfg=TINY, **kw):
    kw = dict(num_pages=64, max_num_seqs=4, max_num_batched_tokens=64) | kw
    return LLM("tiny", model_config=cfg, params=params, **kw)


def _greedy(llm, n=10, prompts=PROMPTS):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_engine_logits_equal_the_dequantized_model(tiny_params, method, head):
    """A quantized engine computes what an f32 engine computes with the
    dequantized weights (w8a8 also rounds its activations: compared loosely):
    the projections, and the tied LM head unless ``quantize_lm_head=False``
    (the reference: an untied f32 model whose head is the dequantized
    embedding, its lookup the exact one)."""
    fmt = quant.method_format(method)
    deq = {n: quant.quantize_np(a, fmt).dequantize() if "_proj" in n else a
           for n, a in tiny_params.items()}
    hfmt = quant.head_format(fmt)  # int8's and int4's head: Q8_0 groups
    deq["lm_head.weight"] = quant.quantize_np(tiny_params["model.embed_tokens.weight"],
                                              hfmt).dequantize() if head \
        else tiny_params["model.embed_tokens.weight"]
    ref = _llm(deq, cfg=dataclasses.replace(TINY, tie_word_embeddings=False)
               ).engine.last_token_logits(PROMPTS)
    llm = _llm(tiny_params, quantization=method, quantize_lm_head=head)
    got = llm.engine.last_token_logits(PROMPTS)
    tol = {"int4": 1e-4, "int8": 2e-3, "w8a8": 0.1}[method] * np.abs(ref).max()
    assert np.abs(got - ref).max() <= tol
    model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state)
    assert isinstance(model.layers[0].mlp.up_proj, quant.QuantizedWeight)
    assert isinstance(model.embed_tokens, nnx.Param)  # kept precise
    assert np.array_equal(model.embed_tokens[...], tiny_params["model.embed_tokens.weight"])
    assert isinstance(model.lm_head, quant.QuantizedWeight) if head else model.lm_head is None


# ---- the LM head ----------------------------------------------------------------


def _head_tensor(head: quant.QuantizedWeight) -> quant.QuantizedTensor:
    return quant.QuantizedTensor(head.fmt, head.shape, *[
        None if a is None else np.asarray(a) for a in head.parts()])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
def test_quantized_head_logits_equal_the_numpy_reference(method, tied):
    """``logits_of`` with a quantized head: the format's numpy reference
    (``reference_linear``) of the final-normed x, within f32 rounding (plus
    the CPU int8 lowering's split bound); a tied head holds the embedding's
    values quantized, beside the exact embedding; the head keeps the logical
    axes ("vocab", "embed")."""
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(1), quantization=method)
    head = model.lm_head
    fmt = quant.head_format(quant.method_format(method))  # int8/int4 heads: Q8_0 groups
    assert isinstance(head, quant.QuantizedWeight) and head.fmt == fmt
    assert head.names == ("vocab", "embed") and head.shape == (cfg.vocab_size, cfg.hidden_size)
    qt = _head_tensor(head)
    embed = np.asarray(model.embed_tokens[...])
    if tied:  # the same values, quantized; the lookup table untouched (f32)
        want = quant.quantize_np(embed, fmt)
        assert all(np.array_equal(a, b) for a, b in zip(_parts(qt), _parts(want)))
    names = {n for n, _ in hf_params(model).items()}
    assert ("lm_head.weight" in names) != tied
    x = np.random.default_rng(2).standard_normal((cfg.hidden_size, 5)).astype(np.float32) * 3
    got = np.asarray(model.logits_of(jnp.asarray(x)))
    xn = np.asarray(model.norm(jnp.asarray(x)))
    ref = quant.reference_linear(qt, xn).T
    xr = xn if not fmt.act_int8 else (lambda q, s: q * s)(*quant.quantize_act_np(xn))
    bound = 4e-7 * np.sqrt(cfg.hidden_size) * (
        np.abs(qt.dequantize()).astype(np.float64) @ np.abs(xr).astype(np.float64)).T + 1e-30
    if fmt == quant.INT8 and jax.default_backend() == "cpu":
        bound = bound + _split_bound(qt, xn).T
    assert got.shape == (5, cfg.vocab_size) and got.dtype == np.float32
    assert np.all(np.abs(got - ref) <= bound), np.abs(got - ref).max()


def test_dense_head_is_todays_head(tiny_params):
    """``quantize_lm_head=False``: no head weight of its own (tied), and the
    logits are exactly the f32 einsum over the embedding, as before the
    quantized head existed; the engine's logits equal an f32 model's with
    the same projections bit for bit."""
    model = LlamaForCausalLM(TINY, quantization="int8", quantize_lm_head=False)
    llama_load(model, tiny_params)
    assert model.lm_head is None
    x = jnp.asarray(np.random.default_rng(3).standard_normal((TINY.hidden_size, 3)), jnp.float32)
    want = jnp.einsum("vd,dr->rv", model.embed_tokens[...], model.norm(x),
                      preferred_element_type=jnp.float32)
    assert np.array_equal(np.asarray(model.logits_of(x)), np.asarray(want))
    dense = _llm(tiny_params, quantization="int8", quantize_lm_head=False)
    deq = {n: quant.quantize_np(a, quant.INT8).dequantize() if "_proj" in n else a
           for n, a in tiny_params.items()}
    ref = _llm(deq).engine.last_token_logits(PROMPTS)
    got = dense.engine.last_token_logits(PROMPTS)
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()


def test_gguf_head_is_the_files_blocks(tiny_gguf):
    """``gguf``, tied (the tiny file's ``token_embd`` is Q8_0): the head is
    a ``QuantizedWeight`` of the file's own blocks, the lookup the file's
    dequantized embedding (exact); greedy tokens as the dense-head engine's."""
    from checkpoints.gguf_loader import load_gguf
    blocks = load_gguf(tiny_gguf, show_progress=False, keep_blocks=True).params
    embed = blocks["model.embed_tokens.weight"]
    assert isinstance(embed, quant.QuantizedTensor) and embed.fmt == quant.Q8_0
    kw = dict(num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, quantization="gguf")
    llm = LLM(tiny_gguf, **kw)
    model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state)
    assert isinstance(model.lm_head, quant.QuantizedWeight) and model.lm_head.fmt == quant.Q8_0
    assert all(np.array_equal(a, b) for a, b in zip(_parts(_head_tensor(model.lm_head)),
                                                    _parts(embed)))
    assert np.array_equal(np.asarray(model.embed_tokens[...]), embed.dequantize())
    dense = LLM(tiny_gguf, quantize_lm_head=False, **kw)
    prompts = [[5, 17, 99, 3, 250, 7], [200, 1, 9]]
    assert _greedy(llm, 8, prompts) == _greedy(dense, 8, prompts)


def test_weight_bytes(tiny_params):
    """Projection bytes: int8 about 1/4 of f32 (+ one scale per channel),
    int4 about 1/8 (+ two f32 per 32 inputs)."""
    def projection_bytes(llm):
        model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state)
        return sum(layer.mlp.up_proj.nbytes if hasattr(layer.mlp.up_proj, "nbytes")
                   else layer.mlp.up_proj[...].nbytes for layer in model.layers)
    f32 = projection_bytes(_llm(tiny_params))
    assert projection_bytes(_llm(tiny_params, quantization="int8")) <= 0.27 * f32
    assert projection_bytes(_llm(tiny_params, quantization="int4")) <= 0.16 * f32


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4"])
def test_tensor_parallel_quantized_matches_one_device(tiny_params, method):
    one = _llm(tiny_params, quantization=method)
    tp = _llm(tiny_params, quantization=method, mesh="tp=2", devices=jax.devices()[:2])
    assert _greedy(tp, 6, PROMPTS[::2]) == _greedy(one, 6, PROMPTS[::2])
    layer = tp.engine.runner.layer_params(0)  # layer 0's slice of the stacked layers
    attn, mlp = layer.self_attn, layer.mlp
    spec = lambda p: tuple(p[...].sharding.spec) + (None,) * (p[...].ndim  # noqa: E731
                                                             - len(p[...].sharding.spec))
    assert spec(attn.q_proj.q) == ("tp", None)  # column-parallel: output rows split
    assert spec(attn.q_proj.scale) == ("tp", None)  # scales follow their channels
    assert spec(mlp.down_proj.q) == (None, "tp")  # row-parallel: the input dim split
    grouped = method == "int4"
    assert spec(mlp.down_proj.scale) == ((None, "tp") if grouped else (None, None))
    if grouped:
        assert spec(mlp.down_proj.zero) == (None, "tp")
    shard = attn.q_proj.q[...].addressable_shards[0].data
    packed = 2 if method == "int4" else 1  # two uint4 per byte
    assert shard.shape == (TINY.num_heads * TINY.head_dim // 2, TINY.hidden_size // packed)
    head = nnx.merge(tp.engine.runner.graphdef, tp.engine.runner.state).lm_head
    assert isinstance(head, quant.QuantizedWeight)  # the tied head, quantized
    assert spec(head.q) == ("tp", None) and spec(head.scale) == ("tp", None)  # vocab rows split


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_expert_parallel_quantized_matches_one_device(method):
    one = _llm(cfg=TINY_MOE, quantization=method)
    ep = _llm(cfg=TINY_MOE, quantization=method, mesh="tp=2,ep=2", devices=jax.devices()[:4])
    assert _greedy(ep, 6, PROMPTS[::2]) == _greedy(one, 6, PROMPTS[::2])
    model = nnx.merge(ep.engine.runner.graphdef, ep.engine.runner.state)
    assert isinstance(model.layers[0].mlp.gate_proj, quant.QuantizedWeight)
    gate = ep.engine.runner.layer_params(0).mlp.gate_proj  # layer 0's slice
    assert tuple(gate.q[...].sharding.spec)[:2] == ("ep", "tp")
    assert tuple(gate.scale[...].sharding.spec)[:2] == ("ep", "tp")
    assert gate.q[...].addressable_shards[0].data.shape[:2] == (2, 32)


def test_bad_quantization_fails_before_the_model_is_built(tiny_params):
    with pytest.raises(ValueError, match="quantization_group_size=48 does not divide the input "
                                         "dim 64"):
        _llm(tiny_params, quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        _llm(None, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        _llm(tiny_params, quantization="int3")


def test_int8_kv_cache_on_tp2_matches_one_device(tiny_params):
    """int8 weights and an int8 KV cache together, split over tp=2 (the
    scales [P, L, K] split over kv heads like their pages)."""
    kw = dict(quantization="int8", kv_cache_dtype="int8")
    one = _llm(tiny_params, **kw)
    tp = _llm(tiny_params, **kw, mesh="tp=2", devices=jax.devices()[:2])
    assert _greedy(tp, 6, PROMPTS[::2]) == _greedy(one, 6, PROMPTS[::2])
    k0 = tp.engine.runner.k_cache[0]
    assert k0.pages_PLKH.dtype == jnp.int8
    assert tuple(k0.scales_PLK.sharding.spec)[:3] == (None, None, "tp")


TINY_GEMMA3 = ModelConfig(architecture="gemma3", vocab_size=128, hidden_size=32,
                          intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=8, qk_norm=True, tie_word_embeddings=True,
                          hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=8.0)


@pytest.mark.parametrize("cfg", [TINY_GEMMA3, TINY_MOE,
                                 dataclasses.replace(TINY_MOE, tie_word_embeddings=False)],
                         ids=["gemma3", "moe-tied", "moe-untied"])
def test_other_families_quantize_the_head(cfg):
    """Gemma 3 and the MoE models load a quantized head from their params
    (tied: from the embedding, which stays exact; untied: ``lm_head.weight``),
    its logits the numpy reference's; ``quantize_lm_head=False``: no quantized head."""
    from jaxserve import models
    from jaxserve.engine.build import MODEL_CLASSES
    cls = MODEL_CLASSES[cfg.architecture]
    src = cls(cfg, rngs=nnx.Rngs(0))
    family = models.family(src)
    params = {n: np.asarray(p[...]) if e is None else np.asarray(p[...])[e]
              for n, (p, e) in family.hf_params(src).items()}
    model = cls(cfg, quantization="w8a8")
    family.load_params(model, params)
    head = params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    qt = quant.quantize_np(head, quant.W8A8)
    assert all(np.array_equal(a, b) for a, b in zip(_parts(_head_tensor(model.lm_head)),
                                                    _parts(qt)))
    assert np.array_equal(np.asarray(model.embed_tokens[...]), params["model.embed_tokens.weight"])
    x = np.random.default_rng(0).standard_normal((cfg.hidden_size, 3)).astype(np.float32)
    xn = np.asarray(model.norm(jnp.asarray(x)))
    ref = quant.reference_linear(qt, xn).T
    got = np.asarray(model.logits_of(jnp.asarray(x)))
    cap = cfg.final_logit_softcapping
    ref = ref if cap is None else cap * np.tanh(ref / cap)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    dense = cls(cfg, quantization="w8a8", quantize_lm_head=False)
    family.load_params(dense, params)
    assert not isinstance(dense.lm_head, quant.QuantizedWeight)
