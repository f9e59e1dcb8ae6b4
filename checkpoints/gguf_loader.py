"""Read a llama- or gemma3-architecture GGUF file into HF-named, HF-laid-out numpy arrays.

``load_gguf(path)`` returns the ``ModelConfig``, every tensor dequantized to
``dtype`` under its Hugging Face name, the tokenizer and chat template from
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
(rotate-half) RoPE. Gemma 3 (``LAYER_NAMES["gemma3"]``: q/k norms and four
norms per block) is stored unpermuted, with every norm weight as ``w + 1``
(llama.cpp multiplies by it; Gemma by ``1 + w``): the loader subtracts the 1
again, as transformers does.

A file's header is walked once by ``checkpoints.gguf_check`` (every count,
length, type tag, offset and tensor extent against the file size), which
also returns every metadata value; tensors are then read from a memory map
at the extents it checked (``gguf.GGUFReader``, which builds one numpy view
per array element, is not used: 16 s for a 262,144-token vocabulary). Then
its metadata types, special token ids, tokenizer fields and tensor shapes
are checked against the metadata; every failure is a one-line
``ValueError`` starting with the path.

``load_gguf(path, keep_blocks=True)`` (``--quantization gguf``) keeps every
Q8_0, Q4_0 and Q4_1 tensor as a ``jaxserve.models.quant.QuantizedTensor``
parsed straight from the file's bytes (``blocks_to_quantized``; no f32 round
trip), so the weights stay as small as in the file. ggml's blocks of 32
inputs along a row (little-endian, ``ggml-common.h``)::

  Q8_0  34 bytes: f16 d, int8 q[32]           w = d * q
  Q4_0  18 bytes: f16 d, u8 qs[16]            w = d * (q - 8)
  Q4_1  20 bytes: f16 d, f16 m, u8 qs[16]     w = d * q + m
        element j of the block in the low nibble of qs[j], j + 16 in the high one

become ``quant.Q8_0`` (scale d) and ``quant.Q4`` (scale d, zero -8d or m; the
nibbles repacked to quant.py's order, input 2j low and 2j + 1 high in byte j).
Their ``dequantize()`` equals ``gguf.quants.dequantize`` bit for bit. The q/k
row un-permutation moves the rows of q, scale and zero alike (a row's blocks
never mix rows). ``tensor_types(path)`` reads each tensor's type from the
header alone, for planning before anything loads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any, Iterator, Mapping

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from tqdm.auto import tqdm

from checkpoints.gguf_check import (GGUFLayout, TensorExtent, check_gguf, errors_name,
                                    load_gguf_fields, read_header)
from checkpoints.tokenizer import Tokenizer
from jaxserve.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# ggml types ``keep_blocks`` keeps quantized (``blocks_to_quantized``).
KEPT_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)

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
# Gemma 3 (llama.cpp ``LLM_ARCH_GEMMA3``): sandwich norms and q/k norms;
# ``ffn_norm`` is the norm before the MLP, which HF calls pre_feedforward.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
LAYER_NAMES = {"llama": _LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES}
# Tensors a GGUF may carry that have no HF parameter. rope_freqs (Llama 3.1+)
# is read into ``ModelConfig.rope_freq_factors`` instead.
_IGNORED = ("rope_freqs.weight",)
# Gemma's norms scale by (1 + w); llama.cpp's converter stores w + 1 (its
# RMSNorm multiplies by the weight), so the loader subtracts it again, as
# transformers' ``Gemma2TensorProcessor`` does.
_NORM_SHIFT = {"gemma3": 1.0}
# llama.cpp writes no local RoPE base or layer pattern for Gemma 3: it uses
# these (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``), as do HF's defaults.
_GEMMA3_ROPE_LOCAL_THETA = 10000.0
_GEMMA3_SLIDING_PATTERN = 6
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclasses.dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, converted.

    Attributes:
      config: architecture, from ``model_config_from_gguf``.
      params: HF name -> array of ``dtype``, HF layout (see module docstring);
        with ``keep_blocks``, a ``QuantizedTensor`` for each Q8_0/Q4_0/Q4_1 tensor.
      tokenizer: built from the ``tokenizer.*`` metadata.
      chat_template: ``tokenizer.chat_template`` (Jinja source) or None.
      metadata: every scalar / string metadata field (arrays such as the token
        list are left out), keyed by GGUF name, e.g. ``"general.name"``.
    """

    config: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer
    chat_template: str | None
    metadata: dict[str, Any]


def read_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All metadata of an open file as Python values (str, int, float, bool, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _architecture(fields: Mapping[str, Any]) -> str:
    """``general.architecture``, checked to be one of ``SUPPORTED_ARCHITECTURES``.

    Raises:
      ValueError: another (or no) architecture; the message lists the supported ones.
    """
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r:.80}; supported: "
                         f"{list(SUPPORTED_ARCHITECTURES)}")
    return arch


def model_config_from_gguf(fields: Mapping[str, Any],
                           tensor_names: frozenset[str] | set[str] | None = None,
                           rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from GGUF metadata.

    Args:
      fields: GGUF key -> value, as ``read_fields`` returns.
      tensor_names: names of the file's tensors; ``tie_word_embeddings`` is True
        when ``output.weight`` is not among them. None means tied.
      rope_freqs: the ``rope_freqs.weight`` tensor's values f32[H/2] (Llama
        3.1+: llama.cpp's per-frequency RoPE divisors), or None.

    Returns:
      The config. ``eos_token_ids`` is ``tokenizer.ggml.eos_token_id`` followed by
      ``eot_token_id`` / ``eom_token_id`` when present and different (and,
      for Gemma 3, ``<end_of_turn>``, as its HF ``generation_config.json``
      and llama.cpp's end-of-generation tokens have it). RoPE scaling:
      ``rope_freqs``, or ``{arch}.rope.scaling.type`` ``linear`` with its
      ``factor``. Gemma 3: layer pattern, local RoPE base and score scale as
      llama.cpp sets them (``_gemma3_fields``).

    Raises:
      ValueError: the architecture is not supported (message lists the supported
        ones), a required key is missing or has the wrong type, a special token
        id lies outside the vocabulary, a RoPE scaling other than linear, or
        the values make no valid ``ModelConfig`` (message names the key or field).
    """
    arch = _architecture(fields)

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        """``fields[key]`` (or ``default``), checked to be an int (``kind=int``) or a number."""
        if key not in fields:
            if default is None:
                raise ValueError(f"GGUF metadata lacks required key {key!r}")
            return default
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            raise ValueError(f"GGUF metadata {key!r} must be "
                             f"{'an integer' if kind is int else 'a number'}, got {value!r:.80}")
        return value

    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ValueError("GGUF metadata lacks the token list tokenizer.ggml.tokens")
    hidden = get(f"{arch}.embedding_length")
    heads = get(f"{arch}.attention.head_count")
    kv_heads = get(f"{arch}.attention.head_count_kv", heads)
    head_dim = get(f"{arch}.attention.key_length", hidden // heads if heads > 0 else 0)
    if head_dim % 2:
        raise ValueError(f"head dim {head_dim} ({arch}.attention.key_length) is odd; "
                         "RoPE needs an even one")
    special: dict[str, int] = {}
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = get(f"tokenizer.ggml.{key}", -1)
        if token_id != -1 and not 0 <= token_id < len(tokens):
            raise ValueError(f"GGUF metadata tokenizer.ggml.{key} = {token_id} is outside "
                             f"the vocabulary of {len(tokens)} tokens")
        if token_id != -1:
            special[key] = token_id
    eos_ids = list(dict.fromkeys(special[k] for k in ("eos_token_id", "eot_token_id",
                                                      "eom_token_id") if k in special))
    family: dict[str, Any] = {}
    if arch == "gemma3":
        family = _gemma3_fields(fields, get, tokens, eos_ids)
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        family["rope_scaling"] = RopeScaling(
            "linear", float(get(f"{arch}.rope.scaling.factor", kind=float)))
    elif scaling != "none":
        raise ValueError(f"GGUF metadata {arch}.rope.scaling.type = {scaling!r:.40} is not "
                         "supported (none, linear; llama3 comes as the rope_freqs tensor)")
    if rope_freqs is not None:
        family["rope_freq_factors"] = tuple(float(f) for f in np.ravel(rope_freqs))
    return ModelConfig(
        architecture=arch,
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=get(f"{arch}.feed_forward_length"),
        num_layers=get(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0, float)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", kind=float)),
        max_position_embeddings=get(f"{arch}.context_length"),
        tie_word_embeddings=tensor_names is None or "output.weight" not in tensor_names,
        bos_token_id=special.get("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        **family,
    )


def _gemma3_fields(fields: Mapping[str, Any], get, tokens: list[str],
                   eos_ids: list[int]) -> dict[str, Any]:
    """The ``ModelConfig`` fields a Gemma 3 GGUF implies beyond llama's (as
    llama.cpp's ``LLM_ARCH_GEMMA3`` and transformers' GGUF loader read it):
    ``attention.sliding_window`` W; every sixth layer global (or
    ``attention.sliding_window_pattern``, a period or one bool per layer,
    True = sliding, where a file has it); the local RoPE base
    ``rope.freq_base_swa`` (default 10,000); scores scaled by ``key_length
    ** -0.5`` (``hidden / heads`` for the 62-layer 27B, as llama.cpp does);
    q/k norms, GeGLU, soft caps where the file sets them. Appends
    ``<end_of_turn>`` to ``eos_ids`` (in place) when the vocabulary has it.
    """
    n = get("gemma3.block_count")
    pattern = fields.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n or not all(isinstance(b, bool) for b in pattern):
            raise ValueError(f"GGUF metadata gemma3.attention.sliding_window_pattern must be "
                             f"one bool per layer ({n}), got {pattern!r:.80}")
        sliding = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        sliding = [bool((i + 1) % pattern) for i in range(n)]
    else:
        raise ValueError(f"GGUF metadata gemma3.attention.sliding_window_pattern must be a "
                         f"positive period or a list of bools, got {pattern!r:.80}")
    heads, hidden = get("gemma3.attention.head_count"), get("gemma3.embedding_length")
    head_dim = get("gemma3.attention.key_length", hidden // heads if heads > 0 else 0)
    caps = {name: float(get(f"gemma3.{name}", kind=float)) for name in (
        "attn_logit_softcapping", "final_logit_softcapping") if f"gemma3.{name}" in fields}
    if "<end_of_turn>" in tokens:
        eos_ids.append(tokens.index("<end_of_turn>"))
        eos_ids[:] = list(dict.fromkeys(eos_ids))
    return dict(
        sliding_window=get("gemma3.attention.sliding_window"),
        layer_types=tuple("sliding_attention" if b else "full_attention" for b in sliding),
        rope_local_theta=float(get("gemma3.rope.freq_base_swa", _GEMMA3_ROPE_LOCAL_THETA, float)),
        query_pre_attn_scalar=float(hidden // heads if n == 62 else head_dim),
        qk_norm=True, hidden_act="gelu_pytorch_tanh", **caps)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name of architecture ``arch``
    (``"llama"`` or ``"gemma3"``); None for ignored tensors.

    Raises:
      ValueError: a tensor name this loader does not know.
    """
    if gguf_name in _IGNORED:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_RE.fullmatch(gguf_name)
    names = LAYER_NAMES[arch]
    if match and match.group(2) in names:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{names[part]}.{suffix}"
    raise ValueError(f"unknown tensor {gguf_name!r} in a {arch} GGUF file")


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
    return dequantize_array(tensor.data, tensor.tensor_type, tensor.name)


def dequantize_array(data: np.ndarray, qtype: GGMLQuantizationType, name: str) -> np.ndarray:
    """float32 values of a tensor's bytes (``ReaderTensor.data``'s layout) of
    ggml type ``qtype`` (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants:
    whatever ``gguf.quants.dequantize`` implements).

    Raises:
      ValueError: ``gguf.quants`` cannot dequantize ``qtype`` (names ``name`` and it).
    """
    try:
        values = gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise ValueError(f"tensor {name!r} has type {qtype.name}, which "
                         "gguf.quants cannot dequantize") from None
    return values.astype(np.float32, copy=False)


def blocks_to_quantized(data: np.ndarray, qtype: GGMLQuantizationType,
                        shape: tuple[int, ...]):
    """A ``QuantizedTensor`` holding a Q8_0 / Q4_0 / Q4_1 tensor's ggml blocks
    as they are (module docstring); no value is rounded.

    Args:
      data: the tensor's bytes (``ReaderTensor.data``: uint8, any shape).
      qtype: one of ``KEPT_TYPES``.
      shape: numpy shape ``[..., F, D]`` (ggml ``ne`` reversed); 32 | D.

    Returns:
      ``QuantizedTensor`` with ``q`` int8 ``[..., F, D]`` (Q8_0) or packed
      uint8 ``[..., F, D/2]`` (Q4_0/1), f16 ``scale`` (and ``zero``) ``[..., F, D/32]``
      (``-8 d`` for Q4_0: exact in f16).

    Raises:
      ValueError: another type, or bytes that do not fill ``shape``'s blocks.
    """
    from jaxserve.models import quant  # local: reading GGUF as floats needs no jax

    if qtype not in KEPT_TYPES:
        raise ValueError(f"keep_blocks holds {[t.name for t in KEPT_TYPES]}, not {qtype.name}")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, F, D = shape
    if D % block or np.asarray(data).size != int(np.prod(shape)) // block * type_size:
        raise ValueError(f"{np.asarray(data).size} bytes of {qtype.name} do not fill a "
                         f"{tuple(shape)} tensor")
    blocks = np.asarray(data, np.uint8).reshape(-1, type_size)
    groups = (*lead, F, D // block)
    d = blocks[:, :2].copy().view(np.float16).reshape(groups)  # kept f16, as ggml's
    if qtype == GGMLQuantizationType.Q8_0:
        q = blocks[:, 2:].copy().view(np.int8).reshape(shape)
        return quant.QuantizedTensor(quant.Q8_0, tuple(shape), q, d)
    if qtype == GGMLQuantizationType.Q4_0:
        zero, qs = -8 * d, blocks[:, 2:]
    else:
        zero = blocks[:, 2:4].copy().view(np.float16).reshape(groups)
        qs = blocks[:, 4:]
    values = np.concatenate([qs & 15, qs >> 4], axis=1)  # ggml: j low, j + 16 high
    q = quant.pack_int4_np(values).reshape(*lead, F, D // 2)
    return quant.QuantizedTensor(quant.Q4, tuple(shape), q, d, zero)


def tensor_types(path: str | os.PathLike) -> dict[str, GGMLQuantizationType]:
    """HF name -> ggml type of every tensor of a GGUF file, from its header
    alone (``check_gguf``; nothing is read past the tensor table), so the
    engine can say before loading which tensors ``--quantization gguf``
    keeps quantized (``KEPT_TYPES``) and which become dense f32.

    Raises:
      ValueError: as ``check_gguf``, or an unknown tensor name.
    """
    path = os.fspath(path)
    with errors_name(path):
        layout = check_gguf(path)
        arch = _architecture(layout.fields)
        return {name: t.ggml_type for t in layout.tensors
                if (name := hf_name(t.name, arch)) is not None}


def _tensor_bytes(path: str, layout: GGUFLayout) -> Iterator[tuple[TensorExtent, np.ndarray]]:
    """Each tensor's extent and its bytes as ``gguf.ReaderTensor.data`` holds
    them for ``gguf.quants.dequantize``: uint8 ``[*reversed(ne[1:]), row
    bytes]`` (a read-only view of a memory map; copy before keeping it).

    Raises:
      ValueError: a big-endian file (its tensor data is not read here).
    """
    if layout.byte_order != "<":
        raise ValueError("big-endian GGUF files are not supported")
    data = np.memmap(path, np.uint8, mode="r")
    for t in layout.tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[t.ggml_type]
        row = t.dims[0] // block * type_size if t.dims else type_size
        yield t, data[t.start:t.start + t.nbytes].reshape(*reversed(t.dims[1:]), row)


def _open(path: str) -> tuple[GGUFLayout, dict[str, Any], ModelConfig]:
    """Check the file (``check_gguf``), read its metadata and config (with the
    ``rope_freqs`` tensor, the only one a config needs), and check its tensor
    table against the config (inside ``errors_name``). The last few files'
    results are kept while their size and mtime stay the same (an engine
    reads the config, then the tensors: SmolLM2's header check takes ~0.35 s)."""
    st = os.stat(path)
    layout, fields, config = _open_checked(path, st.st_size, st.st_mtime_ns)
    return layout, dict(fields), config


@functools.lru_cache(maxsize=4)
def _open_checked(path: str, size: int, mtime_ns: int):
    del size, mtime_ns  # the cache key: a rewritten file is read again
    layout, fields = read_header(path)
    rope_freqs = next((dequantize_array(data, t.ggml_type, t.name)
                       for t, data in _tensor_bytes(path, layout)
                       if t.name == "rope_freqs.weight"), None)
    config = model_config_from_gguf(fields, {t.name for t in layout.tensors}, rope_freqs)
    check_tensor_shapes(config, {t.name: tuple(reversed(t.dims)) for t in layout.tensors})
    return layout, fields, config


def check_tensor_shapes(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check that a llama GGUF file holds every tensor ``config`` needs, in its shape.

    Args:
      config: from ``model_config_from_gguf``.
      shapes: GGUF tensor name -> numpy shape (ggml ``ne`` reversed).

    Raises:
      ValueError: an unknown tensor name, a missing tensor, or a tensor whose
        shape differs from the one the metadata implies (names it and both shapes).
    """
    # local: hf_loader imports ml_dtypes and tokenizers
    from checkpoints.hf_loader import expected_tensors

    expected = expected_tensors(config)
    found = {}
    for gguf_name, shape in shapes.items():
        name = hf_name(gguf_name, config.architecture)
        if name is None:
            continue
        found[name] = gguf_name
        if name in expected and tuple(shape) != expected[name]:
            raise ValueError(f"tensor {gguf_name!r} has shape {tuple(shape)}, the metadata "
                             f"implies {expected[name]}")
    missing = [name for name in expected if name not in found]
    if missing:
        raise ValueError(f"the file lacks tensor {missing[0]!r} (HF name; {len(missing)} "
                         "missing) that its metadata implies")


def load_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file from its metadata alone (the file is
    memory-mapped; no tensor is dequantized).

    Raises:
      ValueError: a missing, truncated or corrupt file (``check_gguf``), an
        unsupported architecture, missing or mistyped metadata, or a tensor
        table that does not match the metadata; the message starts with the path.
    """
    path = os.fspath(path)
    with errors_name(path):
        return _open(path)[2]


def load_gguf(path: str | os.PathLike, dtype: Any = np.float32,
              show_progress: bool = True, keep_blocks: bool = False) -> GGUFCheckpoint:
    """Load a llama-architecture GGUF file.

    Args:
      path: the ``.gguf`` file.
      dtype: numpy dtype of the returned params (e.g. ``np.float32``,
        ``ml_dtypes.bfloat16``); values are dequantized in float32 first.
      show_progress: draw a tqdm bar over the tensors.
      keep_blocks: every Q8_0 / Q4_0 / Q4_1 tensor comes back as a
        ``QuantizedTensor`` of its file's blocks (``blocks_to_quantized``;
        f32 scales whatever ``dtype``); other types as ``dtype`` arrays.

    Returns:
      A ``GGUFCheckpoint``; params are fresh arrays (not views of the file).

    Raises:
      ValueError: as ``load_gguf_config``, or an unknown tensor name, a tensor
        type ``gguf.quants`` cannot dequantize, or an unsupported or
        inconsistent tokenizer; the message starts with the path.
    """
    path = os.fspath(path)
    with errors_name(path):
        layout, fields, config = _open(path)
        arch = config.architecture
        params: dict[str, np.ndarray] = {}
        for tensor, data in tqdm(_tensor_bytes(path, layout), total=len(layout.tensors),
                                 desc="dequantizing GGUF tensors", disable=not show_progress):
            name = hf_name(tensor.name, arch)
            if name is None:
                continue
            n_head = 0 if arch != "llama" else (  # only llama's q/k rows are permuted
                config.num_heads if ".self_attn.q_proj." in name else
                config.num_kv_heads if ".self_attn.k_proj." in name else 0)
            if keep_blocks and tensor.ggml_type in KEPT_TYPES:
                qt = blocks_to_quantized(data, tensor.ggml_type, tuple(reversed(tensor.dims)))
                if n_head:  # rows of q, scale and zero alike; fresh arrays
                    qt = dataclasses.replace(qt, **{k: unpermute_qk(getattr(qt, k), n_head)
                                                    for k in ("q", "scale", "zero")
                                                    if getattr(qt, k) is not None})
                params[name] = qt
                continue
            values = dequantize_array(data, tensor.ggml_type, tensor.name)
            if n_head:
                values = unpermute_qk(values, n_head)
            if name.endswith("norm.weight") and arch in _NORM_SHIFT:
                values = values - _NORM_SHIFT[arch]
            params[name] = np.array(values, dtype=dtype)  # copies: never a view of the mmap
        metadata = {k: v for k, v in fields.items() if not isinstance(v, list)}
        tokenizer = Tokenizer.from_gguf_fields(fields)
        return GGUFCheckpoint(
            config=config,
            params=params,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
            metadata=metadata,
        )


__all__ = ["KEPT_TYPES", "SUPPORTED_ARCHITECTURES", "GGUFCheckpoint", "blocks_to_quantized",
           "check_tensor_shapes", "dequantize_tensor", "hf_name", "load_gguf",
           "load_gguf_config", "load_gguf_fields", "model_config_from_gguf", "read_fields",
           "tensor_types", "unpermute_qk"]
