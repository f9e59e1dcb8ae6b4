"""Read a Hugging Face model folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

``load_hf(path)`` returns an ``HFCheckpoint`` with the same fields as
``GGUFCheckpoint``: the ``ModelConfig`` (``model_config_from_hf``), every tensor
under its HF name converted to ``dtype`` (the names and ``[out, in]`` layouts of
``checkpoints.gguf_loader``'s docstring, plus q/k/v/o biases and Qwen3's
``self_attn.{q,k}_norm.weight`` [H], and for Mixtral / Qwen3-MoE each expert's
tensors as saved, ``MOE_TENSOR_NAMES``), the tokenizer and chat template, and
the raw ``config.json``. transformers 5 keeps experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2F, D]) but saves them per expert; a file
holding the fused form is rejected as missing the per-expert tensors.

Architectures and their tensors: ``checkpoints.hf_config`` (``HF_ARCHITECTURES``,
``model_config_from_hf``, ``expected_tensors``), imported here.

Safetensors files are parsed here (8-byte little-endian header length, JSON
header, raw little-endian data; https://github.com/huggingface/safetensors)
rather than with ``safetensors.safe_open(framework="numpy")``, which cannot
return bf16 tensors; ``ml_dtypes`` gives numpy bf16 and fp8. Sharded
checkpoints are read through ``model.safetensors.index.json``'s ``weight_map``.

Every problem with the folder raises ``ValueError`` naming the file (and the
tensor or field): a missing or corrupt ``config.json``, a truncated or corrupt
safetensors file, a missing, unexpected or misshapen tensor, an unsupported
architecture or option.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import pathlib
from typing import Any, Mapping

import ml_dtypes
import numpy as np
import tokenizers
from tqdm.auto import tqdm

from checkpoints.hf_config import (HF_ARCHITECTURES, MOE_TENSOR_NAMES, expected_tensors,
                                   model_config_from_hf)
from checkpoints.tokenizer import Tokenizer
from jaxserve.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype (little-endian); only floating weights are loaded.
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
           "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
           "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
# Tensors HF checkpoints may carry that no parameter uses (HF drops them too).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass
class HFCheckpoint:
    """Everything an HF model folder holds, converted.

    Attributes:
      config: architecture, from ``model_config_from_hf``.
      params: HF name -> array of ``dtype`` (``expected_tensors`` lists them).
      tokenizer: from ``tokenizer.json``, or None when the folder has none.
      chat_template: Jinja source (``chat_template.jinja``, ``tokenizer_config.json``
        or ``chat_template.json``), or None.
      metadata: the parsed ``config.json``.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    chat_template: str | None
    metadata: dict[str, Any]


# ---- config.json -> ModelConfig ---------------------------------------------

_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit on the JSON header


def _entry_ok(info: Any) -> bool:
    """A tensor entry has a string dtype, a list of non-negative int dims and
    ``data_offsets`` ``[begin, end]`` of ints with ``0 <= begin <= end``."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")
    return (isinstance(shape, list) and all(map(is_int, shape)) and isinstance(offsets, list)
            and len(offsets) == 2 and all(map(is_int, offsets)) and offsets[0] <= offsets[1])


def read_safetensors_header(path: pathlib.Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensor table of a safetensors file and where its data starts.

    Checked before anything is read from the data section: the 8-byte header
    length fits the file (and the format's 100 MiB limit), the header is a
    UTF-8 JSON object, every entry has a string dtype, non-negative int dims
    and ``data_offsets`` ``[begin, end]`` (``0 <= begin <= end``) inside the
    data section, spanning exactly ``prod(shape) * itemsize`` bytes for the
    dtypes this loader reads, and no two tensors overlap.

    Returns:
      (name -> {"dtype": str, "shape": [int], "data_offsets": [begin, end]},
       byte offset of the data section).

    Raises:
      ValueError: the file is missing, truncated or its header is corrupt; the
        message starts with the path and names the entry.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file ({size} bytes, too short "
                                 f"for the 8-byte header length; truncated?)")
            n = int.from_bytes(head, "little")
            if not 0 < n <= min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"{path}: not a safetensors file (header length {n}, file "
                                 f"size {size} bytes; truncated?)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ValueError(f"{path}: cannot read safetensors file: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: corrupt safetensors header: "
                         f"{' '.join(str(e).split())[:200]}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        if not _entry_ok(info):
            raise ValueError(f"{path}: corrupt safetensors header entry {name!r:.80}: "
                             f"{info!r:.200}")
        begin, end = info["data_offsets"]
        if end > data_size:
            raise ValueError(f"{path}: truncated: tensor {name!r:.80} ends at byte {end} of "
                             f"the data section, which has {data_size} bytes")
        dtype = _DTYPES.get(info["dtype"])
        nbytes = math.prod(info["shape"]) * (dtype.itemsize if dtype is not None else 0)
        if dtype is not None and end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r:.80} spans {end - begin} bytes, its "
                             f"dtype and shape need {nbytes}")
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                   for name, info in header.items()
                   if info["data_offsets"][1] > info["data_offsets"][0])
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"{path}: tensor {second!r:.80} overlaps tensor {first!r:.80} "
                             f"in the data section (corrupt header)")
    return header, 8 + n


def read_safetensors(path: pathlib.Path, names: Mapping[str, tuple[int, ...]], dtype,
                     progress=None) -> dict[str, np.ndarray]:
    """Read tensors ``names`` (name -> expected shape) from one file, converted to ``dtype``.

    Raises:
      ValueError: a name the file lacks, a shape other than expected, a
        non-float dtype, or a corrupt / truncated file (all name the file).
    """
    header, start = read_safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, shape in names.items():
            info = header.get(name)
            if info is None:
                raise ValueError(f"{path}: lacks tensor {name!r}")
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; "
                                 f"only {sorted(_DTYPES)} are supported")
            if tuple(info["shape"]) != tuple(shape):
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(info['shape'])}, "
                                 f"config.json implies {tuple(shape)}")
            begin, end = info["data_offsets"]
            f.seek(start + begin)
            raw = np.frombuffer(f.read(end - begin), _DTYPES[info["dtype"]]).reshape(shape)
            out[name] = np.array(raw, dtype=dtype)  # copies: writable, owns its memory
            if progress is not None:
                progress.update(1)
    return out


def _tensor_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it.

    Raises:
      ValueError: a corrupt index, an index naming a missing file, or no
        safetensors file at all.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: folder / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: corrupt safetensors index ({e!r})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors file (and no {INDEX_FILE}); "
                         "other weight formats are not supported")
    return {name: file for file in files for name in read_safetensors_header(file)[0]}


# ---- tokenizer ----------------------------------------------------------------

def _read_json(path: pathlib.Path, required: bool = False) -> dict[str, Any] | None:
    """A JSON object file, or None when absent and not ``required``.

    Raises:
      ValueError: required and absent, unreadable, or not a JSON object (names the file).
    """
    if not path.is_file():
        if required:
            raise ValueError(f"{path}: missing")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _chat_template(folder: pathlib.Path, tok_config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` (transformers v5), else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates: the "default"),
    else ``chat_template.json``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if template is None:
        template = (_read_json(folder / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def load_hf_tokenizer(folder: str | os.PathLike) -> tuple[Tokenizer | None, str | None]:
    """The folder's tokenizer and chat template.

    ``tokenizer.json`` is the whole ``tokenizers`` pipeline, used as is; the
    bos/eos/unk/pad tokens come from ``tokenizer_config.json`` (or
    ``special_tokens_map.json``), as strings or ``{"content": ...}`` dicts.

    Returns:
      (Tokenizer, chat template); (None, None) when there is no ``tokenizer.json``.

    Raises:
      ValueError: a corrupt ``tokenizer.json`` / ``tokenizer_config.json``, or
        only a sentencepiece ``tokenizer.model`` (names the file).
    """
    folder = pathlib.Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        if (folder / "tokenizer.model").is_file():
            raise ValueError(f"{folder / 'tokenizer.model'}: sentencepiece tokenizers are not "
                             "supported; save the model with a tokenizer.json")
        return None, None
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"{path}: cannot load tokenizer: {e}") from None
    tok_config = _read_json(folder / "tokenizer_config.json") or {}
    specials = {**(_read_json(folder / "special_tokens_map.json") or {}), **tok_config}
    ids = {}
    for name in ("bos", "eos", "unk", "pad"):
        token = specials.get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        ids[name] = backend.token_to_id(token) if isinstance(token, str) else None
    template = _chat_template(folder, tok_config)
    return Tokenizer(backend, ids, template), template


# ---- the folder ---------------------------------------------------------------

def _folder_config(folder: pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    config_path = folder / "config.json"
    hf = _read_json(config_path, required=True)
    try:
        return model_config_from_hf(hf, _read_json(folder / "generation_config.json")), hf
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_path}: {e}") from None


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of an HF folder from its ``config.json`` alone (no
    tensor is read), so a mesh can be checked before any weights load.

    Raises:
      ValueError: not a folder, or a missing or unsupported ``config.json``.
    """
    return _folder_config(pathlib.Path(path).expanduser())[0]


def load_hf(path: str | os.PathLike, dtype: Any = np.float32,
            show_progress: bool = False) -> HFCheckpoint:
    """Load an HF model folder (``save_pretrained(..., safe_serialization=True)`` layout).

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` or sharded
        ``model-*.safetensors`` + ``model.safetensors.index.json``; optionally
        ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.
      dtype: numpy dtype of the returned params (``np.float32``,
        ``ml_dtypes.bfloat16``, ...); stored values are converted (bf16 -> f32 exactly).
      show_progress: draw a tqdm bar over the tensors.

    Returns:
      An ``HFCheckpoint``; params are fresh arrays, exactly ``expected_tensors(config)``.

    Raises:
      ValueError: see the module docstring; every message names the file.
    """
    folder = pathlib.Path(path).expanduser()
    config, hf = _folder_config(folder)
    wanted = expected_tensors(config)
    where = _tensor_files(folder)
    missing = [name for name in wanted if name not in where]
    if missing:
        raise ValueError(f"{folder}: the safetensors files lack tensor {missing[0]!r} "
                         f"({len(missing)} missing) that config.json's {hf['architectures'][0]} "
                         f"needs")
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = [name for name in where if name not in wanted and name not in tied_head
             and not name.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise ValueError(f"{where[extra[0]]}: unexpected tensor {extra[0]!r}; config.json's "
                         f"{hf['architectures'][0]} has no such parameter")
    by_file: dict[pathlib.Path, dict[str, tuple[int, ...]]] = {}
    for name, shape in wanted.items():
        by_file.setdefault(where[name], {})[name] = shape
    params: dict[str, np.ndarray] = {}
    with tqdm(total=len(wanted), desc="reading safetensors", disable=not show_progress) as bar:
        for file, names in sorted(by_file.items()):
            params |= read_safetensors(file, names, dtype, bar)
    tokenizer, template = load_hf_tokenizer(folder)
    return HFCheckpoint(config=config, params=params, tokenizer=tokenizer,
                        chat_template=template, metadata=hf)


__all__ = ["HFCheckpoint", "HF_ARCHITECTURES", "INDEX_FILE", "MOE_TENSOR_NAMES", "expected_tensors",
           "load_hf", "load_hf_tokenizer", "model_config_from_hf", "read_safetensors",
           "read_safetensors_header"]
