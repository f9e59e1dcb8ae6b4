"""Write a tiny random llama GGUF file, for tests that must not need the real model.

``write_tiny_gguf(path, config)`` writes a file the way llama.cpp's converter would
(llama tensor names, q/k rows permuted, matrices quantized) with a byte-level BPE
tokenizer (256 byte tokens, ChatML specials, a few merges) and a ChatML chat
template, and returns the HF-layout float32 params that ``load_gguf`` must give
back bit for bit (quantization is per row, so it commutes with the row permutation).

A test fixture, not part of the product (it lived in ``checkpoints/`` until issue 31):
tests import it as ``from tiny_gguf import write_tiny_gguf`` (pytest puts ``tests/``
on ``sys.path``); ``conftest.tiny_gguf`` is the session's shared file.
"""

from __future__ import annotations

import os

import gguf
import numpy as np

from checkpoints.tokenizer import bytes_to_unicode
from jaxserve.config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
MERGES = ("Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_TOKEN_COUNT = len(SPECIAL_TOKENS) + 256 + len(MERGES)  # smallest vocab_size allowed


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF rotate-half rows -> interleaved pairs.

    Args:
      w: [n_head*H, D] HF q_proj / k_proj weight.
      n_head: N for q, K for k.
    """
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_tokens(vocab_size: int) -> list[str]:
    """Specials, the 256 GPT-2 byte characters, merge results, then ``<|extra_i|>`` fillers."""
    table = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [table[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in MERGES]
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    return tokens


def tokenizer_fields(vocab_size: int = 320) -> dict:
    """The ``tokenizer.*`` GGUF metadata ``write_tiny_gguf`` writes, as
    ``load_gguf_fields`` reads them back: ``Tokenizer.from_gguf_fields`` of
    this dict is the tiny file's tokenizer, with no file."""
    if vocab_size < _TOKEN_COUNT:
        raise ValueError(f"vocab_size must be >= {_TOKEN_COUNT}, got {vocab_size}")
    tokens = tiny_tokens(vocab_size)
    return {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS)
            + [1] * (len(tokens) - len(SPECIAL_TOKENS)),
            "tokenizer.ggml.merges": list(MERGES), "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 0,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML_TEMPLATE}


def write_tiny_gguf(path: str | os.PathLike, config: ModelConfig | None = None,
                    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
                    seed: int = 0, params: dict[str, np.ndarray] | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    chat_template: str = CHATML_TEMPLATE) -> dict[str, np.ndarray]:
    """Write a random llama GGUF for ``config`` and return its expected HF params.

    Args:
      path: file to write.
      config: architecture; default ``ModelConfig(vocab_size=320, ...)``. Its
        ``bos_token_id`` / ``eos_token_ids`` are ignored: BOS is ``<|im_start|>`` (1),
        EOS ``<|im_end|>`` (2), EOT ``<|endoftext|>`` (0).
      qtype: quantization of 2-D weights whose rows divide into its blocks (others F32).
      seed: numpy seed of the weights.
      params: HF name -> f32 array to write instead of random weights (an HF
        model's ``state_dict``; ``qtype=F32`` keeps them exact).
      extra_tensors: GGUF name -> f32 array written as it is (``rope_freqs.weight``).
      chat_template: the file's jinja chat template (ChatML by default).

    Returns:
      HF name -> float32 array, exactly what ``load_gguf(path).params`` should hold
      (``lm_head.weight`` only when ``config.tie_word_embeddings`` is False).

    Raises:
      ValueError: ``config.vocab_size`` is below the tokenizer's token count.
    """
    config = config or ModelConfig(vocab_size=320)
    if config.vocab_size < _TOKEN_COUNT:
        raise ValueError(f"vocab_size must be >= {_TOKEN_COUNT}, got {config.vocab_size}")
    c, rng = config, np.random.default_rng(seed)
    tokens = tiny_tokens(c.vocab_size)
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_layers)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf: str, shape: tuple[int, ...], n_head: int = 0, norm=False):
        w = (norm + 0.1 * rng.standard_normal(shape)).astype(np.float32)  # norms near 1
        if params is not None:
            w = np.asarray(params[hf], np.float32).reshape(shape)
        stored = permute_qk(w, n_head) if n_head else w
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if len(shape) == 2 and shape[-1] % block == 0:
            raw = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        else:
            writer.add_tensor(gguf_name, stored)
        expected[hf] = w

    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    add("token_embd.weight", "model.embed_tokens.weight", (V, D))
    for i in range(c.num_layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", (D,), norm=True)
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", (c.num_heads * c.head_dim, D),
            n_head=c.num_heads)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (c.num_kv_heads * c.head_dim, D),
            n_head=c.num_kv_heads)
        add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (c.num_kv_heads * c.head_dim, D))
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (D, c.num_heads * c.head_dim))
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,), norm=True)
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (F, D))
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", (F, D))
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", (D, F))
    add("output_norm.weight", "model.norm.weight", (D,), norm=True)
    if not c.tie_word_embeddings:
        add("output.weight", "lm_head.weight", (V, D))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


__all__ = ["CHATML_TEMPLATE", "MERGES", "SPECIAL_TOKENS", "permute_qk", "tiny_tokens",
           "tokenizer_fields", "write_tiny_gguf"]
