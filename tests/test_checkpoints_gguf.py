"""GGUF loading: dequantization, q/k un-permutation, config, tokenizer, chat template.

Three layers:
  1. hand-built quant blocks vs the numpy formulas (no file);
  2. a tiny random GGUF written by ``tests/tiny_gguf.py`` (seconds);
  3. ``@pytest.mark.real_model``: SmolLM2-135M-Instruct Q4_1 (fetched once through
     ``resolve_model("smollm2-135m")`` into the default cache) against
     transformers' own GGUF loader, tensor for tensor and id for id (the
     checkpoint and the HF model/tokenizer are session fixtures in conftest.py).
"""

import types

import gguf
import numpy as np
import pytest
from tiny_gguf import permute_qk, write_tiny_gguf

from checkpoints.gguf_loader import (dequantize_tensor, hf_name, load_gguf,
                                     model_config_from_gguf, read_fields, unpermute_qk)
from checkpoints.tokenizer import Tokenizer
from jaxserve.config import ModelConfig

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------- 1. dequantization


def _f16_bytes(x):
    """[n] values -> [n, 2] uint8, little-endian float16."""
    return np.asarray(x, "<f2").reshape(-1, 1).view(np.uint8)


def _hand_blocks(qtype, n_blocks, rng):
    """Raw blocks [1, n_blocks * type_size] uint8 and their expected values [1, 32 * n_blocks]."""
    d = rng.uniform(0.01, 0.1, n_blocks).astype(np.float16)
    if qtype == Q.Q8_0:
        q = rng.integers(-128, 128, (n_blocks, 32), dtype=np.int8)
        raw = np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)
        want = d.astype(np.float32)[:, None] * q.astype(np.float32)
    else:
        q = rng.integers(0, 16, (n_blocks, 32), dtype=np.uint8)
        packed = q[:, :16] | (q[:, 16:] << 4)  # element j in the low nibble, j + 16 in the high
        if qtype == Q.Q4_0:
            raw = np.concatenate([_f16_bytes(d), packed], axis=1)
            want = d.astype(np.float32)[:, None] * (q.astype(np.float32) - 8)
        else:  # Q4_1: x = d * q + m
            m = rng.uniform(-1, 1, n_blocks).astype(np.float16)
            raw = np.concatenate([_f16_bytes(d), _f16_bytes(m), packed], axis=1)
            want = (d.astype(np.float32)[:, None] * q.astype(np.float32)
                    + m.astype(np.float32)[:, None])
    return raw.reshape(1, -1), want.reshape(1, -1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_hand_built_blocks(qtype):
    raw, want = _hand_blocks(qtype, 4, np.random.default_rng(int(qtype)))
    tensor = types.SimpleNamespace(name="w", tensor_type=qtype, data=raw)
    got = dequantize_tensor(tensor)
    assert got.dtype == np.float32 and got.shape == (1, 128)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantize_roundtrip_error_bound(qtype):
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    got = dequantize_tensor(types.SimpleNamespace(
        name="w", tensor_type=qtype, data=gguf.quants.quantize(x, qtype)))
    blocks = x.reshape(-1, 32)
    span = (np.abs(blocks).max(1) * 2 if qtype != Q.Q4_1 else np.ptp(blocks, 1))
    step = span / (255 if qtype == Q.Q8_0 else 15)  # one quantization step per block
    err = np.abs(got - x).reshape(-1, 32).max(1)
    assert np.all(err <= step * 1.01 + 1e-6)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K,
                                   Q.Q6_K])
def test_supported_types_shape(qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 2 * 256  # two K-quant super-blocks' worth of elements per row
    raw = np.zeros((3, n // block * size), np.uint8)
    got = dequantize_tensor(types.SimpleNamespace(name="w", tensor_type=qtype, data=raw))
    assert got.shape == (3, n) and got.dtype == np.float32 and not got.any()


def test_unsupported_type_names_tensor_and_type():
    tensor = types.SimpleNamespace(name="blk.0.odd.weight", tensor_type=Q.I32,
                                   data=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"blk\.0\.odd\.weight.*I32"):
        dequantize_tensor(tensor)


def test_permutation_matches_llama_cpp_and_inverts():
    rows = np.arange(8, dtype=np.float32)[:, None]  # one head of H = 8, HF row order
    assert permute_qk(rows, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # llama.cpp order
    w = np.random.default_rng(0).standard_normal((3 * 16, 24)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


def test_tensor_names():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.weird.weight"):
        hf_name("blk.0.weird.weight")


def test_unsupported_architecture():
    with pytest.raises(ValueError, match=r"'qwen2'.*llama"):
        model_config_from_gguf({"general.architecture": "qwen2"})


def test_unsupported_tokenizer_kind():
    with pytest.raises(ValueError, match=r"'t5'.*gpt2"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


# ---------------------------------------------------------------- 2. tiny GGUF


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    config = ModelConfig(vocab_size=300, num_layers=2, tie_word_embeddings=request.param)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    expected = write_tiny_gguf(path, config, seed=1)
    return config, path, expected, load_gguf(path, show_progress=False)


def test_tiny_params_exact(tiny):
    _, _, expected, ckpt = tiny
    assert sorted(ckpt.params) == sorted(expected)
    for name, want in expected.items():
        assert ckpt.params[name].dtype == np.float32
        np.testing.assert_array_equal(ckpt.params[name], want, err_msg=name)


def test_tiny_config_and_metadata(tiny):
    config, _, _, ckpt = tiny
    want = dict(config.__dict__, bos_token_id=1, eos_token_ids=(2, 0),
                rms_norm_eps=float(np.float32(config.rms_norm_eps)))
    assert ckpt.config.__dict__ == want
    assert ckpt.metadata["general.name"] == "tiny-random-llama"
    assert not any(isinstance(v, list) for v in ckpt.metadata.values())
    assert ckpt.chat_template and "<|im_start|>" in ckpt.chat_template


def test_tiny_dtype(tiny):
    _, path, expected, _ = tiny
    ckpt = load_gguf(path, dtype=np.float16, show_progress=False)
    emb = ckpt.params["model.embed_tokens.weight"]
    assert emb.dtype == np.float16
    np.testing.assert_array_equal(emb, expected["model.embed_tokens.weight"].astype(np.float16))


def test_tiny_tokenizer(tiny):
    tok = tiny[3].tokenizer
    ids = tok.encode("hello the world")
    assert [tok.id_to_token(i) for i in ids] == ["he", "llo", "Ġthe", "Ġworld"]
    assert tok.encode("<|im_start|>hi<|im_end|>") == [1, tok.encode("h")[0], tok.encode("i")[0], 2]
    assert tok.decode([1, *ids, 2]) == "hello the world"
    assert tok.decode([1, *ids], skip_special_tokens=False) == "<|im_start|>hello the world"
    assert tok.special_token_ids == frozenset({0, 1, 2})
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 300)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                   tokenize=True) == tok.encode(text, add_special_tokens=False)


def test_tiny_tokenizer_bos_and_missing_template(tiny):
    fields = read_fields(gguf.GGUFReader(tiny[1]))
    fields["tokenizer.ggml.add_bos_token"] = True
    del fields["tokenizer.chat_template"]
    tok = Tokenizer.from_gguf_fields(fields)
    assert tok.encode("he") == [1, 260]
    assert tok.encode("he", add_special_tokens=False) == [260]
    # No template: a plain transcript (BOS added as for any prompt), which
    # ends the assistant's turn at the next user line.
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "User: hi\nAssistant:"
    assert tok.apply_chat_template([{"role": "user", "content": "he"}],
                                   tokenize=True) == [1, *tok.encode("User: he\nAssistant:",
                                                                     add_special_tokens=False)]
    assert tok.chat_stop == ("\nUser:",)
    with pytest.raises(ValueError, match="unknown chat role 'narrator'"):
        tok.apply_chat_template([{"role": "narrator", "content": "hi"}])


# ---------------------------------------------------------------- 3. the real model

TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "multiple    spaces   between",
    "line one\nline two\n\n\tindented with a tab",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a != b && c <= d) { return {\"k\": [1, 2]}; }",
    "Ünïcödé façade naïve — “curly quotes” ‘single’",
    "emoji 🤗🚀👍🏽 and 漢字 かな 한국어 العربية",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567 3.14159 1,000,000 2024-01-31",
    "",
    "   ",
    "<repo_name>jaxserve<file_sep>main.py<|endoftext|>",
    "It's we'll they're I'M DON'T",
    "almost special <|im_start| and <im_end|>",
    "\r\nwindows line endings\r\n",
    "ﬁ ligature, combining é, zero\u200bwidth",
]


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_matches_hf(smollm2_ckpt, smollm2_hf_tokenizer, text):
    tok = smollm2_ckpt.tokenizer
    ids = tok.encode(text)
    assert ids == smollm2_hf_tokenizer(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == smollm2_hf_tokenizer.encode(
        text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == smollm2_hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.real_model
def test_real_tokenizer_specials(smollm2_ckpt, smollm2_hf_tokenizer):
    tok = smollm2_ckpt.tokenizer
    assert tok.vocab_size == len(smollm2_hf_tokenizer) == smollm2_ckpt.config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (smollm2_hf_tokenizer.bos_token_id,
                                                    smollm2_hf_tokenizer.eos_token_id)
    added = smollm2_hf_tokenizer.backend_tokenizer.get_added_tokens_decoder()
    hf_special = {i for i, t in added.items() if t.special}
    assert tok.special_token_ids == hf_special  # what decode(skip_special_tokens=True) drops
    assert all(tok.id_to_token(i) == smollm2_hf_tokenizer.convert_ids_to_tokens(i)
               for i in (0, 1, 2, 100, 5000, 49151))


CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? Answer with\nnewlines & “quotes”."}],
]


@pytest.mark.real_model
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["system_user", "multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_chat_template_matches_hf(smollm2_ckpt, smollm2_hf_tokenizer, messages,
                                       add_generation_prompt):
    tok = smollm2_ckpt.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == smollm2_hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                  tokenize=True)
    hf_ids = smollm2_hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert ids == list(getattr(hf_ids, "input_ids", None) or hf_ids)


@pytest.mark.real_model
def test_real_params_match_hf(smollm2_ckpt, smollm2_hf):
    state = smollm2_hf.state_dict()
    assert "lm_head.weight" not in smollm2_ckpt.params  # tied in this file
    assert sorted(smollm2_ckpt.params) == sorted(k for k in state if k != "lm_head.weight")
    for name, ours in smollm2_ckpt.params.items():
        theirs = state[name].numpy()
        assert ours.shape == theirs.shape and ours.dtype == np.float32, name
        assert float(np.abs(ours - theirs).max()) < 1e-6, name


@pytest.mark.real_model
def test_real_config_matches_hf(smollm2_ckpt, smollm2_hf):
    ours, theirs = smollm2_ckpt.config, smollm2_hf.config
    rope_theta = (theirs.rope_parameters or {}).get("rope_theta") if hasattr(
        theirs, "rope_parameters") else theirs.rope_theta
    assert ours.architecture == theirs.model_type == "llama"
    assert ours.hidden_size == theirs.hidden_size
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_layers == theirs.num_hidden_layers
    assert ours.num_heads == theirs.num_attention_heads
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.head_dim
    assert ours.rope_theta == rope_theta
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.vocab_size == theirs.vocab_size
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings is True
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == (theirs.eos_token_id,)
