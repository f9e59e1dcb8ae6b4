"""Tiny random Gemma 3 (``gemma3_text``) and Llama 3.2 (``rope_type: llama3``)
HF folders: jaxserve vs transformers, last-position logits within 1e-4 and
greedy tokens.

* Gemma 3: a sliding layer (window 8, local RoPE base 10k) and a global one
  (RoPE base 1M, linear scaling x4 as on Gemma 3 4B+), q/k norms, sandwich
  norms with zero-centred weights, GeGLU, scaled embedding, tied head,
  ``query_pre_attn_scalar`` 48 (not head_dim 32) and a final logit soft cap,
  so each of them changes the logits (checked by switching it off in HF).
* Llama 3.2: llama3 RoPE scaling (factor 32, original context 16 so every
  band of the 8 frequencies is exercised within 30 positions), tied head.
* The same Llama 3.2 as a GGUF with llama.cpp's ``rope_freqs`` tensor (the
  llama3 factors as per-frequency divisors, as ``convert_hf_to_gguf.py``
  writes them) gives the same logits.

The tokenizer and helpers are ``test_hf_checkpoints``'s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from test_hf_checkpoints import COMMON, PROMPTS, hf_greedy, make_llm, make_tokenizer

from checkpoints.hf_loader import load_hf, model_config_from_hf
from jaxserve import SamplingParams
from jaxserve.config import RopeScaling

pytestmark = pytest.mark.slow  # transformers writes these models and is the reference

GEMMA3 = dict(head_dim=32, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
              query_pre_attn_scalar=48, final_logit_softcapping=3.0,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0}
MODELS = {
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
    "llama3.2": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                 dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
}


def make_hf(name: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides})).eval().to(torch.float32)
    with torch.no_grad():  # HF initialises norms to 0 (Gemma) or 1: make them count
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(0.3 * torch.randn_like(p) + (0.0 if name == "gemma3" else 1.0))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tok = make_tokenizer()
    out = {}
    for name in MODELS:
        model = make_hf(name)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        out[name] = (folder, model)
    return out


def hf_last_logits(model, prompts):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1].numpy() for p in prompts]


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_match_hf(folders, name):
    folder, hf = folders[name]
    llm = make_llm(folder)
    ours = llm.engine.last_token_logits(PROMPTS)
    refs = hf_last_logits(hf, PROMPTS)
    diff = max(float(np.abs(o - r).max()) for o, r in zip(ours, refs))
    print(f"{name}: max |logit diff| {diff:.2e}")
    for row, ref in zip(ours, refs):
        np.testing.assert_allclose(row, ref, atol=1e-4, rtol=0)
    n = 12
    want = [hf_greedy(hf, p, n) for p in PROMPTS[:3]]
    assert len({tuple(w) for w in want}) == 3
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("name, change", [
    ("gemma3", dict(sliding_window=4096)),  # the window (prompt of 30 > 8)
    ("gemma3", dict(query_pre_attn_scalar=32)),
    ("gemma3", dict(final_logit_softcapping=None)),
    ("gemma3", dict(rope_parameters={**GEMMA3["rope_parameters"], "full_attention": {
        "rope_type": "default", "rope_theta": 1e6}})),
    ("gemma3", dict(rope_parameters={**GEMMA3["rope_parameters"], "sliding_attention": {
        "rope_type": "default", "rope_theta": 1e6}})),
    ("llama3.2", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
])
def test_each_feature_changes_the_logits(folders, name, change):
    """The 1e-4 agreement above has teeth: HF with one feature switched off
    (same weights) differs from the reference by far more."""
    _, hf = folders[name]
    other = make_hf(name, **change)
    other.load_state_dict(hf.state_dict())
    a, b = hf_last_logits(hf, [PROMPTS[1]])[0], hf_last_logits(other, [PROMPTS[1]])[0]
    assert np.abs(a - b).max() > 1e-2


def test_configs(folders):
    g = load_hf(folders["gemma3"][0]).config
    assert (g.architecture, g.layer_types, g.sliding_window) == (
        "gemma3", ("sliding_attention", "full_attention"), 8)
    assert (g.layer_window(0), g.layer_window(1)) == (8, None)
    assert (g.rope_theta, g.rope_local_theta, g.query_pre_attn_scalar) == (1e6, 1e4, 48.0)
    assert g.layer_rope(0) == (1e4, None)
    assert g.layer_rope(1) == (1e6, RopeScaling("linear", 4.0))
    assert (g.hidden_act, g.qk_norm, g.tie_word_embeddings, g.final_logit_softcapping) == (
        "gelu_pytorch_tanh", True, True, 3.0)
    params = load_hf(folders["gemma3"][0]).params
    assert "model.layers.1.pre_feedforward_layernorm.weight" in params
    assert "lm_head.weight" not in params
    l3 = load_hf(folders["llama3.2"][0]).config
    assert l3.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 16)
    assert (l3.rope_theta, l3.tie_word_embeddings) == (500000.0, True)


def test_transformers_v4_config_spellings():
    """Configs written by transformers 4.x (real Gemma 3 and Llama 3.1 folders)."""
    g = model_config_from_hf(dict(
        architectures=["Gemma3ForCausalLM"], **{**COMMON, "num_hidden_layers": 12},
        head_dim=32, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
        sliding_window=512))
    assert g.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert g.layer_rope(5) == (1e6, RopeScaling("linear", 8.0)) and g.layer_rope(4) == (1e4, None)
    assert (g.query_pre_attn_scalar, g.tie_word_embeddings) == (256.0, True)
    l31 = model_config_from_hf(dict(
        architectures=["LlamaForCausalLM"], **COMMON, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}))
    assert l31.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("changes, match", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope scaling 'yarn' is not"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "lacks 'low_freq_factor'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": -1.0}), "factor must be > 0"),
])
def test_bad_rope_scaling(changes, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(dict(architectures=["LlamaForCausalLM"], **COMMON, **changes))


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_activation="silu"), "hidden_activation 'silu' is not supported for gemma3"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(layer_types=["full_attention"]), "layer_types must be"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "scaled RoPE on sliding_attention"),
])
def test_bad_gemma3_config(changes, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(dict(architectures=["Gemma3ForCausalLM"], **COMMON, **changes))


def llama3_freq_factors(rope: dict, head_dim: int) -> list[float]:
    """llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.generate_extra_tensors``:
    the llama3 rescaling as one divisor per frequency."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = (rope["low_freq_factor"], rope["high_freq_factor"],
                      rope["original_max_position_embeddings"])
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_llama3_gguf_rope_freqs_match_hf(folders, tmp_path):
    """The Llama 3.2 weights as a GGUF whose llama3 scaling is the ``rope_freqs``
    tensor: the same logits as the HF model with ``rope_type: llama3``."""
    import gguf

    from tiny_gguf import write_tiny_gguf
    from jaxserve import LLM
    from jaxserve.config import ModelConfig

    _, hf = folders["llama3.2"]
    cfg = ModelConfig(vocab_size=COMMON["vocab_size"], tie_word_embeddings=True, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rope_theta=500000.0, rms_norm_eps=1e-6, max_position_embeddings=256)
    factors = np.asarray(llama3_freq_factors(LLAMA3_ROPE, 16), np.float32)
    path = tmp_path / "llama32.gguf"
    state = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gguf(path, cfg, qtype=gguf.GGMLQuantizationType.F32, params=state,
                    extra_tensors={"rope_freqs.weight": factors})
    llm = LLM(str(path), num_pages=64, page_size=8)
    assert llm.engine.model_config.rope_freq_factors == tuple(float(f) for f in factors)
    assert sorted(set(np.round(factors, 3))) != [1.0]  # all three bands are present
    ours = llm.engine.last_token_logits(PROMPTS)
    for row, ref in zip(ours, hf_last_logits(hf, PROMPTS)):
        np.testing.assert_allclose(row, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_gemma3_pallas_interpret_equals_xla(folders):
    """Both layer kinds through the Pallas kernel (interpreted): the 30-token
    prompt is longer than the window of 8, decode rows attend to windows too."""
    from conftest import XLA_CACHE
    from jaxserve import LLM
    folder = folders["gemma3"][0]
    outs = {}
    for impl in ("xla", "pallas"):
        llm = LLM(str(folder), attention_impl=impl, attention_interpret=impl == "pallas",
                  num_pages=64, page_size=8, compilation_cache_dir=XLA_CACHE)
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    assert outs["pallas"] == outs["xla"]


def test_gemma3_and_llama3_orbax_round_trip(folders, tmp_path):
    """``--mode convert`` of both: model_config.json keeps layer types, RoPE
    scaling and soft caps, and the restored model gives the same logits."""
    from checkpoints.loader import convert_to_orbax, load_model_config
    for name in MODELS:
        folder = folders[name][0]
        out = tmp_path / name
        convert_to_orbax(folder, out, show_progress=False)
        assert load_model_config(out) == load_model_config(folder)
        a = make_llm(folder).engine.last_token_logits(PROMPTS[:2])
        b = make_llm(out).engine.last_token_logits(PROMPTS[:2])
        np.testing.assert_array_equal(a, b)
