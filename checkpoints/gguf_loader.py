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
from checkpoints.gguf_config import (SUPPORTED_ARCHITECTURES, architecture, model_config_from_gguf,
                                     read_fields)
from checkpoints.tokenizer import Tokenizer
from jaxserve.config import ModelConfig

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
        arch = architecture(layout.fields)
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
