"""An Orbax checkpoint folder's metadata: its files, the JSON beside the tensors, quantization.

What can be read or checked without restoring a tensor: the file names of a
folder ``save_orbax`` writes (``checkpoints.orbax_ckpt``'s docstring has the
layout), ``jaxserve_orbax.json`` (format version, source, file sizes and
CRC32s, and how a quantized checkpoint stores its projections:
``SavedQuantization``), ``model_config.json`` (``load_orbax_config``), the
size/CRC check of ``params/`` (``check_params_files``), and the quantized
parts' shapes and re-assembly (``part_shapes``, ``assemble_parts``).

Every problem raises ``ValueError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import zlib
from typing import Any, Mapping

from jaxserve.config import GGUF_BLOCK_METHODS, QUANTIZATION_METHODS, ModelConfig
from jaxserve.models import quant

FORMAT_VERSION = 1
INFO_FILE, CONFIG_FILE, PARAMS_DIR = "jaxserve_orbax.json", "model_config.json", "params"
TOKENIZER_FILE, TOKENIZER_META_FILE = "tokenizer.json", "tokenizer_meta.json"
PARTS = ("q", "scale", "zero")  # a quantized tensor's parts, stored as "<name>:<part>"


@dataclasses.dataclass(frozen=True)
class SavedQuantization:
    """How a quantized checkpoint stores its projections (module docstring).

    Attributes:
      method: the ``EngineConfig.quantization`` it was converted with (never "none").
      group_size: its ``quantization_group_size``.
      formats: HF name -> ``quant.TensorFormat`` of every tensor stored as parts.
    """

    method: str
    group_size: int
    formats: dict[str, Any]


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder with ``model_config.json`` and ``params/``."""
    path = pathlib.Path(path).expanduser()
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def json_safe(metadata: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items()
            if isinstance(v, (str, int, float, bool, type(None), dict))}


def file_sizes(folder: pathlib.Path) -> dict[str, int]:
    return {os.fspath(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file()}


def crc32(path: pathlib.Path) -> int:
    """CRC32 (``zlib``) of a file, read in 16 MiB blocks (nothing is kept)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object file.

    Raises:
      ValueError: missing, unreadable, not JSON or not an object (names the file).
    """
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; not a jaxserve Orbax checkpoint") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_info(folder: pathlib.Path) -> dict[str, Any]:
    """``jaxserve_orbax.json``, checked: ``format_version`` an int no newer than
    ``FORMAT_VERSION``; ``source`` a string; ``metadata`` an object;
    ``params_files`` (relative path -> size) and ``params_crc32`` (relative
    path -> CRC32) objects of non-negative ints whose paths stay inside
    ``params/``. ``{}`` when the file is absent (a folder another tool wrote).

    Raises:
      ValueError: the file is unreadable or any of the above is wrong (names the file).
    """
    path = folder / INFO_FILE
    if not path.is_file():
        return {}
    info = read_json(path)

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {what} (corrupt file)")
    version = info.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise bad(f"format_version {version!r:.40} is not an int <= {FORMAT_VERSION}")
    if not isinstance(info.get("source", ""), str):
        raise bad("source is not a string")
    if not isinstance(info.get("metadata", {}), dict):
        raise bad("metadata is not an object")
    for key in ("params_files", "params_crc32"):
        table = info.get(key, {})
        if not isinstance(table, dict):
            raise bad(f"{key} is not an object")
        for rel, value in table.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(f"{key}[{rel!r:.80}] = {value!r:.40} is not a non-negative int")
            parts = pathlib.PurePosixPath(rel).parts
            if not parts or rel.startswith("/") or ".." in parts:
                raise bad(f"{key} names {rel!r:.80}, which is not a path inside params/")
    if "quantization" in info:
        info["quantization"] = parse_quantization(info["quantization"], bad)
    return info


def parse_quantization(value, bad) -> SavedQuantization:
    """``jaxserve_orbax.json``'s ``quantization`` object as a ``SavedQuantization``.

    Raises:
      ``bad(what)``: an unknown method, a bad group size, or a format that is
        not a ``TensorFormat``'s fields.
    """
    if not isinstance(value, dict):
        raise bad("quantization is not an object")
    method, group_size, formats = (value.get(k) for k in ("method", "group_size", "formats"))
    if method not in QUANTIZATION_METHODS or method == "none":
        raise bad(f"quantization.method {method!r:.40} is not one of "
                  f"{[m for m in QUANTIZATION_METHODS if m != 'none']}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise bad(f"quantization.group_size {group_size!r:.40} is not a positive int")
    if not isinstance(formats, dict):
        raise bad("quantization.formats is not an object")
    parsed = {}
    for name, fields in formats.items():
        try:
            if not isinstance(fields, dict):
                raise TypeError("not an object")
            parsed[name] = quant.TensorFormat(**fields)
        except (TypeError, ValueError) as e:
            raise bad(f"quantization.formats[{name!r:.80}] is not a TensorFormat: "
                      f"{' '.join(str(e).split())[:120]}") from None
    return SavedQuantization(method, group_size, parsed)


def saved_quantization(path: str | os.PathLike) -> SavedQuantization | None:
    """How an Orbax checkpoint folder stores its projections, from
    ``jaxserve_orbax.json`` alone; None for an unquantized checkpoint.

    Raises:
      ValueError: a corrupt ``jaxserve_orbax.json`` (names it).
    """
    return read_info(pathlib.Path(path).expanduser()).get("quantization")


def resolve_quantization(path: str | os.PathLike, config):
    """``config`` (an ``EngineConfig``) with the quantization of the Orbax
    checkpoint at ``path``: a quantized checkpoint's method and group size
    replace ``"none"``; an unquantized one keeps ``config``'s (int8 / w8a8 /
    int4 then quantize the restored floats as they load). Reads only
    ``jaxserve_orbax.json``.

    Raises:
      ValueError: an explicit method other than the checkpoint's (or an
        int4 group size other than its), or ``"gguf"`` for an unquantized
        checkpoint (no GGUF blocks to keep); names the folder and both.
    """
    saved = saved_quantization(path)
    if saved is None:
        if config.quantization in GGUF_BLOCK_METHODS:
            raise ValueError(f"{path}: quantization={config.quantization!r} keeps a GGUF file's own blocks, but "
                             f"this Orbax checkpoint is unquantized; convert the .gguf with "
                             f"--quantization gguf, or use int8, w8a8 or int4")
        return config
    if config.quantization not in ("none", saved.method):
        raise ValueError(f"{path}: the checkpoint is quantized {saved.method!r}, but "
                         f"quantization={config.quantization!r} was asked; pass "
                         f"{saved.method!r} or 'none' (the checkpoint's), or convert the "
                         f"source again with --quantization {config.quantization}")
    if config.quantization == "int4" and config.quantization_group_size != saved.group_size:
        raise ValueError(f"{path}: the checkpoint is int4 in groups of {saved.group_size}, but "
                         f"quantization_group_size={config.quantization_group_size} was asked")
    return dataclasses.replace(config, quantization=saved.method,
                               quantization_group_size=saved.group_size)


def part_shapes(fmt, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Stored part name (``"q"``, ``"scale"``, ``"zero"``) -> shape of a
    ``[..., F, D]`` weight in ``fmt`` (as ``quant.QuantizedTensor`` holds it)."""
    *lead, F, D = shape
    out = {"q": (*lead, F, D // 2) if fmt.bits == 4 else tuple(shape)}
    if fmt.bits:
        out["scale"] = (*lead, F, fmt.groups(D))
    if fmt.zero_point:
        out["zero"] = out["scale"]
    return out


def assemble_parts(params: dict[str, Any], formats: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with each complete set of ``<name>:<part>`` arrays replaced
    by one ``quant.QuantizedTensor`` under ``name`` (in the same order)."""
    out: dict[str, Any] = {}
    for key, arr in params.items():
        name, _, part = key.rpartition(":")
        if part not in PARTS or name not in formats:
            out[key] = arr
        elif name not in out:
            fmt = formats[name]
            q = params[f"{name}:q"]
            shape = (*q.shape[:-1], 2 * q.shape[-1]) if fmt.bits == 4 else tuple(q.shape)
            out[name] = quant.QuantizedTensor(fmt, shape, q, params.get(f"{name}:scale"),
                                              params.get(f"{name}:zero"))
    return out


def load_orbax_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of an Orbax checkpoint folder from
    ``model_config.json`` alone (no tensor is read).

    Raises:
      ValueError: the file is missing, not JSON, or not a valid ``ModelConfig``.
    """
    file = pathlib.Path(path).expanduser() / CONFIG_FILE
    fields = read_json(file)
    try:
        return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in fields.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from None


def check_params_files(path: str | os.PathLike, crc: bool = True) -> None:
    """Check every file under ``<path>/params`` against the sizes and (with
    ``crc``) CRC32s recorded at save time (the CRC pass streams every file
    once: about 1 s per GB here; no copy is kept).

    Raises:
      ValueError: ``params/`` is missing, or a recorded file is missing, has
        another size (truncated or overwritten) or another CRC32 (corrupted
        in place); the message names the file.
    """
    folder = pathlib.Path(path).expanduser()
    params = folder / PARAMS_DIR
    if not params.is_dir():
        raise ValueError(f"{params}: missing; not an Orbax checkpoint folder")
    info = read_info(folder)  # {} when written by another tool: Orbax's errors will do
    for rel, size in info.get("params_files", {}).items():
        file = params / rel
        if not file.is_file():
            raise ValueError(f"{file}: missing from the Orbax checkpoint")
        if file.stat().st_size != size:
            raise ValueError(f"{file}: {file.stat().st_size} bytes, {size} when saved "
                             f"(truncated or corrupted)")
    for rel, saved in (info.get("params_crc32", {}) if crc else {}).items():
        file = params / rel
        if not file.is_file():
            raise ValueError(f"{file}: missing from the Orbax checkpoint")
        if crc32(file) != saved:
            raise ValueError(f"{file}: CRC32 differs from the one recorded when saved "
                             f"(the file is corrupted)")
