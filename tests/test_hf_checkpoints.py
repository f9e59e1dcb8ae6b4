"""HF model folders (config.json + safetensors + tokenizer.json): jaxserve vs transformers.

Tiny random Llama, Mistral (sliding window 8, shorter than the prompts), Qwen2
(q/k/v bias, tied head) and Qwen3 (q/k norm, head_dim 32 != D/N) models are
written with ``save_pretrained(safe_serialization=True)``, one Qwen3 copy
sharded into many files + ``model.safetensors.index.json``, all with a small
byte-level BPE ``tokenizer.json`` and a ChatML template. Each is loaded by
``LLM(model=folder)`` (``checkpoints.loader`` -> ``load_hf``) and compared
with the transformers model it came from: last-position logits and greedy
tokens. Biases and norm weights are randomised (HF initialises them to 0 / 1).
Then the loader's errors, each a ValueError naming the file or tensor.
"""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from checkpoints.hf_loader import load_hf, model_config_from_hf
from checkpoints.loader import load_checkpoint
from conftest import XLA_CACHE
from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # transformers writes these models and is the reference

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there!",
          "Once upon a time there was a small model.", "1, 2, 3, 4, 5 and 6, 7, 8."]
VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.15, rms_norm_eps=1e-6)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(attention_bias=True, rope_theta=500000.0)),  # q/k/v and o biases
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
}
PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], list(range(10, 40)), [42] * 19, [200]]
TEXT = "Once upon a time the quick fox"
MAX_DIFFS: dict[str, float] = {}


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of VOCAB ids trained on CORPUS, ChatML specials at ids 0-2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.get_vocab_size() == VOCAB
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        chat_template=CHATML)


def make_hf(arch: str, seed: int = 0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval().to(torch.float32)
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, hf_tokenizer):
    """name -> (folder, HF model); "qwen3-sharded" holds qwen3's weights in many files."""
    out = {}
    for arch in ARCHS:
        model = make_hf(arch)
        folder = tmp_path_factory.mktemp(arch)
        model.save_pretrained(folder, safe_serialization=True)
        hf_tokenizer.save_pretrained(folder)
        out[arch] = (folder, model)
    folder = tmp_path_factory.mktemp("qwen3-sharded")
    out["qwen3"][1].save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    hf_tokenizer.save_pretrained(folder)
    out["qwen3-sharded"] = (folder, out["qwen3"][1])
    return out


def make_llm(folder) -> LLM:
    return LLM(str(folder), num_pages=64, page_size=8, compilation_cache_dir=XLA_CACHE)


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", [*ARCHS, "qwen3-sharded"])
def test_logits_and_greedy_match_hf(folders, hf_tokenizer, name):
    folder, hf = folders[name]
    if name == "qwen3-sharded":
        assert len(list(folder.glob("*.safetensors"))) > 3
        assert (folder / "model.safetensors.index.json").is_file()
    llm = make_llm(folder)
    cfg = llm.engine.model_config
    assert cfg.architecture == name.split("-")[0]
    ours = llm.engine.last_token_logits(PROMPTS)
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS]
    MAX_DIFFS[name] = max(float(np.abs(o - r).max()) for o, r in zip(ours, refs))
    print(f"{name}: max |logit diff| {MAX_DIFFS[name]:.2e}")
    for row, ref in zip(ours, refs):
        np.testing.assert_allclose(row, ref, atol=1e-4, rtol=0)
    if name == "mistral":  # the window changes these logits: the comparison above has teeth
        hf.config.sliding_window = None
        try:
            with torch.no_grad():
                full = hf(torch.tensor([PROMPTS[1]])).logits[0, -1].numpy()
        finally:
            hf.config.sliding_window = 8
        assert np.abs(full - refs[1]).max() > 1e-2

    n = 12
    text_ids = hf_tokenizer(TEXT).input_ids
    prompts = [PROMPTS[0], PROMPTS[1], TEXT]
    want = [hf_greedy(hf, p, n) for p in (PROMPTS[0], PROMPTS[1], text_ids)]
    assert len({tuple(w) for w in want}) == 3 and len(set(sum(want, []))) > 6  # telling apart
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[2].prompt_token_ids == text_ids
    assert outs[2].outputs[0].text == hf_tokenizer.decode(want[2], skip_special_tokens=True)


def test_tokenizer_and_chat_template_match_hf(folders, hf_tokenizer):
    ckpt = load_hf(folders["qwen2"][0])
    tok = ckpt.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 2) == (
        hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)
    for text in [TEXT, "Hello world, hello there!", "<|im_start|>user\nhé 🦊<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text).input_ids
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hello world"}]
    assert ckpt.chat_template == CHATML
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == want
    assert tok.apply_chat_template(messages, tokenize=True) == hf_tokenizer.encode(
        want, add_special_tokens=False)


def test_tiny_qwen3_writer_is_a_qwen3_transformers_reads(tmp_path):
    """``tiny_models.write_tiny_qwen3`` (the tool-aware server's model,
    written with numpy alone) is what transformers reads as a Qwen3 of the
    same weights: last-position logits and greedy tokens match, and its
    tokenizer and tool template render a tool conversation to the same ids."""
    from test_tool_parsers import HISTORY, QWEN_TOOLS, TOOLS
    from tiny_models import write_tiny_qwen3
    params = write_tiny_qwen3(tmp_path, QWEN_TOOLS, max_position_embeddings=256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval().to(torch.float32)
    assert type(hf) is transformers.Qwen3ForCausalLM and hf.config.head_dim == 32
    state = hf.state_dict()
    for name, value in params.items():  # q/k norms included
        np.testing.assert_array_equal(state[name].numpy(), value)
    llm = make_llm(tmp_path)
    assert llm.engine.model_config.architecture == "qwen3"
    ours = llm.engine.last_token_logits(PROMPTS)
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS]
    for row, ref in zip(ours, refs):
        np.testing.assert_allclose(row, ref, atol=1e-4, rtol=0)
    want = [hf_greedy(hf, p, 8) for p in PROMPTS[:2]]
    assert want[0] != want[1] and len(set(sum(want, []))) > 4  # telling apart
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = hf_tok.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=True,
                                      tokenize=False)
    assert '<tool_call>\n{"name": "get_weather"' in text
    ours = load_hf(tmp_path).tokenizer.apply_chat_template(HISTORY, tools=TOOLS, tokenize=True)
    assert ours == hf_tok.encode(text, add_special_tokens=False)


def test_config_and_params(folders):
    llama = load_hf(folders["llama"][0])
    c = llama.config
    assert (c.architecture, c.attention_bias, c.attention_out_bias, c.qk_norm) == (
        "llama", True, True, False)
    assert (c.rope_theta, c.rms_norm_eps, c.sliding_window) == (500000.0, 1e-6, None)
    assert load_hf(folders["mistral"][0]).config.sliding_window == 8
    q2 = load_hf(folders["qwen2"][0]).config
    assert (q2.attention_bias, q2.attention_out_bias, q2.tie_word_embeddings) == (True, False, True)
    whole, sharded = load_hf(folders["qwen3"][0]), load_hf(folders["qwen3-sharded"][0])
    assert (whole.config.head_dim, whole.config.qk_norm) == (32, True)
    assert whole.config == sharded.config
    hf_state = folders["qwen3"][1].state_dict()
    assert sorted(whole.params) == sorted(sharded.params) == sorted(hf_state)
    for name, value in whole.params.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, sharded.params[name])
        np.testing.assert_array_equal(value, hf_state[name].numpy())
    assert isinstance(load_checkpoint(folders["qwen3"][0]).params, dict)


def test_bf16_checkpoint_reads_exactly(tmp_path):
    model = make_hf("qwen2").to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    state = model.state_dict()
    for dtype in (np.float32, ml_dtypes.bfloat16):
        params = load_hf(tmp_path, dtype=dtype).params
        assert load_hf(tmp_path).tokenizer is None  # no tokenizer.json: ids only
        for name, value in params.items():
            assert value.dtype == dtype
            np.testing.assert_array_equal(value.astype(np.float32),
                                          state[name].float().numpy(), err_msg=name)


def test_load_checkpoint_dispatches_gguf(tmp_path):
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", ModelConfig(vocab_size=300, num_layers=1))
    ckpt = load_checkpoint(tmp_path / "tiny.gguf", show_progress=False)
    assert sorted(ckpt.params) == sorted(expected)


# ---------------------------------------------------------------- errors


@pytest.fixture
def llama_copy(folders, tmp_path):
    """A writable copy of the llama folder."""
    return shutil.copytree(folders["llama"][0], tmp_path / "llama")


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


def test_missing_or_corrupt_config(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_hf(llama_copy)
    (llama_copy / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json: missing"):
        load_hf(llama_copy)
    with pytest.raises(ValueError, match="not a folder"):
        load_hf(llama_copy / "nothing")


@pytest.mark.parametrize("changes, match", [
    (dict(architectures=["GPT2LMHeadModel"]), r"config\.json: unsupported architecture "
                                              r"'GPT2LMHeadModel'.*LlamaForCausalLM"),
    (dict(architectures=None), r"config\.json: config\.json has no 'architectures'"),
    (dict(hidden_size=None), r"config\.json: .*'hidden_size'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}),
     r"config\.json: rope scaling 'yarn' is not supported"),
    (dict(hidden_act="gelu"), r"config\.json: hidden_act 'gelu'"),
    (dict(num_key_value_heads=3), r"config\.json: num_heads \(4\) must be a multiple"),
])
def test_bad_config(llama_copy, changes, match):
    edit_config(llama_copy, **changes)
    with pytest.raises(ValueError, match=match):
        load_hf(llama_copy)


def test_qwen_mixed_sliding_layers_rejected():
    hf = dict(architectures=["Qwen2ForCausalLM"], **COMMON, use_sliding_window=True,
              sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match="mix sliding and full attention"):
        model_config_from_hf(hf)
    assert model_config_from_hf({**hf, "max_window_layers": 0}).sliding_window == 16
    assert model_config_from_hf({**hf, "use_sliding_window": False}).sliding_window is None


def test_truncated_or_corrupt_safetensors(llama_copy):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: tensor"):
        load_hf(llama_copy)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file"):
        load_hf(llama_copy)
    path.write_bytes((20).to_bytes(8, "little") + b"{garbage" + b" " * 12 + data[100:])
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt safetensors header"):
        load_hf(llama_copy)
    path.unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors file"):
        load_hf(llama_copy)


def test_missing_unexpected_or_misshapen_tensor(llama_copy):
    path = llama_copy / "model.safetensors"
    state = load_file(path)
    name = "model.layers.1.self_attn.o_proj.bias"
    save_file({k: v for k, v in state.items() if k != name}, path)
    with pytest.raises(ValueError, match=rf"llama: the safetensors files lack tensor '{name}'"):
        load_hf(llama_copy)
    save_file({**state, "model.layers.0.mlp.up_proj.bias": torch.zeros(128)}, path)
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor "
                                         r"'model\.layers\.0\.mlp\.up_proj\.bias'"):
        load_hf(llama_copy)
    save_file({**state, name: torch.zeros(65)}, path)
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' has shape \(65,\)"):
        load_hf(llama_copy)


def test_sharded_index_points_at_wrong_file(folders, tmp_path):
    folder = shutil.copytree(folders["qwen3-sharded"][0], tmp_path / "sharded")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.self_attn.q_norm.weight"
    right = index["weight_map"][name]
    wrong = next(f for f in index["weight_map"].values() if f != right)
    index["weight_map"][name] = wrong
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{wrong}: lacks tensor '{name}'"):
        load_hf(folder)
    index_path.write_text("[]")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: corrupt"):
        load_hf(folder)
