"""Read a llama-architecture GGUF file into HF-named, HF-laid-out numpy arrays.

``load_gguf(path)`` returns the ``ModelConfig``, every tensor dequantized to
``dtype`` under its Hugging Face Llama name, the tokenizer and chat template from
the metadata, and the scalar metadata. The result matches
``transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` tensor
for tensor (both dequantize with ``gguf.quants.dequantize``).

Layouts (numpy shapes; D model dim, V vocab, N query heads, K kv heads, H head
dim, F ffw dim; every matrix is HF's ``[out, in]``):
  model.embed_tokens.weight                      [V, D]
  model.layers.{i}.self_attn.q_proj.weight       [N*H, D]
  model.layers.{i}.self_attn.k_proj.weight       [K*H, D]
  model.layers.{i}.self_attn.v_proj.weight       [K*H, D]
  model.layers.{i}.self_attn.o_proj.weight       [D, N*H]
  model.layers.{i}.mlp.gate_proj.weight          [F, D]
  model.layers.{i}.mlp.up_proj.weight            [F, D]
  model.layers.{i}.mlp.down_proj.weight          [D, F]
  model.layers.{i}.input_layernorm.weight        [D]
  model.layers.{i}.post_attention_layernorm.weight [D]
  model.norm.weight                              [D]
  lm_head.weight                                 [V, D], only if the file has ``output.weight``

GGUF lists dims fastest-first (ggml ``ne``); numpy shapes read the other way, so
``dequantize`` already yields ``[out, in]``. llama.cpp's converter permutes the
rows of q_proj / k_proj within each head from HF's rotate-half order into
interleaved-pair order; ``unpermute_qk`` undoes it, so the params expect HF
(rotate-half) RoPE.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import gguf
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from checkpoints.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF name. ``{i}`` is the layer index; ``.weight`` / ``.bias``
# suffixes are carried over unchanged.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors a llama GGUF may carry that have no HF parameter (HF drops them too).
# rope_freqs holds Llama-3.1 RoPE scaling factors, which ModelConfig cannot express yet.
_IGNORED = ("rope_freqs.weight",)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclasses.dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, converted.

    Attributes:
      config: architecture, from ``model_config_from_gguf``.
      params: HF name -> array of ``dtype``, HF layout (see module docstring).
      tokenizer: built from the ``tokenizer.*`` metadata.
      chat_template: ``tokenizer.chat_template`` (Jinja source) or None.
      metadata: every scalar / string metadata field (arrays such as the token
        list are left out), keyed by GGUF name, e.g. ``"general.name"``.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    tokenizer: Tokenizer
    chat_template: str | None
    metadata: dict[str, Any]


def read_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All metadata of an open file as Python values (str, int, float, bool, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def model_config_from_gguf(fields: Mapping[str, Any],
                           tensor_names: frozenset[str] | set[str] | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from GGUF metadata.

    Args:
      fields: GGUF key -> value, as ``read_fields`` returns.
      tensor_names: names of the file's tensors; ``tie_word_embeddings`` is True
        when ``output.weight`` is not among them. None means tied.

    Returns:
      The config. ``eos_token_ids`` is ``tokenizer.ggml.eos_token_id`` followed by
      ``eot_token_id`` / ``eom_token_id`` when present and different.

    Raises:
      ValueError: the architecture is not supported (message lists the supported
        ones), or a required key is missing (message names it).
    """
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{list(SUPPORTED_ARCHITECTURES)}")

    def need(key: str) -> Any:
        if key not in fields:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return fields[key]

    hidden = int(need(f"{arch}.embedding_length"))
    heads = int(need(f"{arch}.attention.head_count"))
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = fields.get(f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=len(need("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(need(f"{arch}.feed_forward_length")),
        num_layers=int(need(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need(f"{arch}.context_length")),
        tie_word_embeddings=tensor_names is None or "output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama GGUF tensor name; None for ignored tensors.

    Raises:
      ValueError: a tensor name this loader does not know.
    """
    if gguf_name in _IGNORED:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    raise ValueError(f"unknown tensor {gguf_name!r} in a llama GGUF file")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    llama.cpp stores, within each head, rows ``[0, H/2, 1, H/2+1, ...]`` of the HF
    weight (interleaved rotary pairs); this restores HF's rotate-half order. Same
    as transformers' ``LlamaTensorProcessor._reverse_permute_weights``.

    Args:
      w: [n_head*H, ...] q_proj or k_proj weight (or bias) in GGUF row order.
      n_head: N for q_proj, K for k_proj.

    Returns:
      Array of the same shape and dtype, rows in HF order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """float32 values of one GGUF tensor, numpy shape (reversed ggml ``ne``).

    Raises:
      ValueError: ``gguf.quants`` cannot dequantize the tensor's type (names both).
    """
    qtype = tensor.tensor_type
    try:
        values = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name!r} has type {qtype.name}, which "
                         "gguf.quants cannot dequantize") from None
    return values.astype(np.float32, copy=False)


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file from its metadata alone (the file is
    memory-mapped; no tensor is dequantized).

    Raises:
      ValueError: unsupported architecture or missing metadata.
    """
    reader = gguf.GGUFReader(os.fspath(path))
    return model_config_from_gguf(read_fields(reader), {t.name for t in reader.tensors})


def load_gguf(path: str | os.PathLike, dtype: Any = np.float32,
              show_progress: bool = True) -> GGUFCheckpoint:
    """Load a llama-architecture GGUF file.

    Args:
      path: the ``.gguf`` file.
      dtype: numpy dtype of the returned params (e.g. ``np.float32``,
        ``ml_dtypes.bfloat16``); values are dequantized in float32 first.
      show_progress: draw a tqdm bar over the tensors.

    Returns:
      A ``GGUFCheckpoint``; params are fresh arrays (not views of the file).

    Raises:
      ValueError: unsupported architecture, unknown tensor name, a tensor type
        ``gguf.quants`` cannot dequantize, or an unsupported tokenizer kind.
    """
    reader = gguf.GGUFReader(os.fspath(path))
    fields = read_fields(reader)
    names = {t.name for t in reader.tensors}
    config = model_config_from_gguf(fields, names)
    params: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF tensors",
                       disable=not show_progress):
        name = hf_name(tensor.name)
        if name is None:
            continue
        values = dequantize_tensor(tensor)
        if ".self_attn.q_proj." in name:
            values = unpermute_qk(values, config.num_heads)
        elif ".self_attn.k_proj." in name:
            values = unpermute_qk(values, config.num_kv_heads)
        params[name] = np.array(values, dtype=dtype)  # copies: never a view of the mmap
    metadata = {k: v for k, v in fields.items() if not isinstance(v, list)}
    return GGUFCheckpoint(
        config=config,
        params=params,
        tokenizer=Tokenizer.from_gguf_fields(fields),
        chat_template=fields.get("tokenizer.chat_template"),
        metadata=metadata,
    )


__all__ = ["GGUFCheckpoint", "SUPPORTED_ARCHITECTURES", "dequantize_tensor", "hf_name",
           "load_gguf", "model_config_from_gguf", "read_fields", "unpermute_qk"]
