"""Orbax checkpoints: any loaded checkpoint saved once, restored straight into a sharding.

Layout of a checkpoint folder written by ``save_orbax``::

    <dir>/model_config.json   jaxserve.config.ModelConfig fields (dataclasses.asdict)
    <dir>/params/             Orbax PyTree checkpoint: HF tensor name -> array, as
                              ``checkpoints.loader.load_checkpoint`` returns them
    <dir>/tokenizer.json      the ``tokenizers`` pipeline (only if the source had one)
    <dir>/tokenizer_meta.json bos/eos/unk/pad ids and the chat template
    <dir>/jaxserve_orbax.json format version, source, the source's scalar
                              metadata, and the size of every file under params/

``restore_orbax(dir, shardings)`` gives each tensor an
``ArrayRestoreArgs(sharding=...)``, so Orbax (tensorstore) reads into each
device only the chunks of its shard and no full host copy is made; without
shardings it returns numpy arrays. Before reading, every file under
``params/`` is checked against the sizes recorded at save time, so a deleted
or truncated file is reported by name (``ValueError``) instead of as a
tensorstore error deep in the restore; any other read failure is re-raised as
a ``ValueError`` naming the params folder and the tensors being read. The JSON
files are checked too (``jaxserve_orbax.json``'s tables must be objects of
non-negative ints over paths inside ``params/``), and ``load_orbax`` checks
the tensor shapes in Orbax's metadata against ``model_config.json``.

Quantized checkpoints (``convert_to_orbax(..., quantization="int8")``): each
projection (``quant.is_projection``) is stored as its parts, ``<HF name>:q``
(int8 ``[..., F, D]``, or uint8 ``[..., F, D/2]`` of packed int4), ``:scale``
(f32 ``[..., F, G]``) and ``:zero`` (f32 ``[..., F, G]``, only when the
format has one); ``jaxserve_orbax.json`` records under ``quantization`` the
method, its group size and every such tensor's ``TensorFormat``::

    "quantization": {"method": "int4", "group_size": 32,
                     "formats": {"model.layers.0.self_attn.q_proj.weight":
                                 {"bits": 4, "group_size": 32, "zero_point": true,
                                  "act_int8": false}, ...}}

The parts restore in their saved dtypes (never cast to ``dtype``), each
straight into its sharding (``sharding.rules.hf_shardings`` names one per
part), and come back re-assembled as ``quant.QuantizedTensor``s under the HF
name, of ``jax.Array``s when restored into shardings (so
``QuantizedWeight.load`` keeps them in place). ``restore_for_model`` does all
of this for a model's own params.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
import os
import pathlib
from typing import Any, Mapping

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig

FORMAT_VERSION = 1
_INFO, _CONFIG, _PARAMS = "jaxserve_orbax.json", "model_config.json", "params"
CHUNK_BYTES = 4 << 20  # largest chunk of a saved tensor
_TOKENIZER, _TOKENIZER_META = "tokenizer.json", "tokenizer_meta.json"
_GROUP_BYTES = 1 << 30  # tensors restored per Orbax call (and per progress-bar update)
_PARTS = ("q", "scale", "zero")  # a quantized tensor's parts, stored as "<name>:<part>"


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


@dataclasses.dataclass
class OrbaxCheckpoint:
    """An Orbax checkpoint folder, loaded (same fields as ``GGUFCheckpoint``).

    Attributes:
      config: from ``model_config.json``.
      params: HF name -> array (numpy without shardings, else ``jax.Array``
        in its sharding); None when loaded with ``with_params=False``.
      tokenizer: ``checkpoints.tokenizer.Tokenizer``, or None if none was saved.
      chat_template: Jinja source or None.
      metadata: the source checkpoint's scalar metadata, plus ``"source"``.
      quantization: how the projections are stored; None when unquantized.
    """

    config: ModelConfig
    params: dict[str, Any] | None
    tokenizer: Any
    chat_template: str | None
    metadata: dict[str, Any]
    quantization: SavedQuantization | None = None


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder with ``model_config.json`` and ``params/``."""
    path = pathlib.Path(path).expanduser()
    return (path / _CONFIG).is_file() and (path / _PARAMS).is_dir()


def _json_safe(metadata: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items()
            if isinstance(v, (str, int, float, bool, type(None), dict))}


def _file_sizes(folder: pathlib.Path) -> dict[str, int]:
    return {os.fspath(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _crc32(path: pathlib.Path) -> int:
    """CRC32 (``zlib``) of a file, read in 16 MiB blocks (nothing is kept)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def save_orbax(output_dir: str | os.PathLike, checkpoint, source: str = "",
               quantization: str = "none", group_size: int = 32) -> list[pathlib.Path]:
    """Write ``checkpoint`` (what ``checkpoints.loader.load_checkpoint`` returns)
    as an Orbax checkpoint folder (layout in the module docstring).

    Args:
      output_dir: folder to create; it must not exist or be empty.
      checkpoint: has ``config`` (``ModelConfig``), ``params`` (HF name ->
        numpy array, or ``quant.QuantizedTensor``, stored as its parts),
        ``tokenizer`` (or None), ``chat_template``, ``metadata``.
      source: what it was loaded from (recorded in ``jaxserve_orbax.json``).
      quantization, group_size: the method the ``QuantizedTensor``s were
        made with (recorded in ``jaxserve_orbax.json``).

    Returns:
      The files and folders written, ``params/`` first.

    Raises:
      ValueError: ``output_dir`` exists and is not an empty folder, or
        ``QuantizedTensor``s with ``quantization="none"``.
    """
    import orbax.checkpoint as ocp  # local: loading GGUF/HF never needs Orbax

    from jaxserve.models import quant

    out = pathlib.Path(output_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty")
    params, formats = {}, {}
    for name, a in checkpoint.params.items():
        if not isinstance(a, quant.QuantizedTensor):
            params[name] = np.asarray(a)
            continue
        formats[name] = dataclasses.asdict(a.fmt)
        params |= {f"{name}:{part}": np.asarray(getattr(a, part)) for part in _PARTS
                   if getattr(a, part) is not None}
    if formats and quantization == "none":
        raise ValueError(f"{out}: tensor {next(iter(formats))!r} is quantized, but "
                         f"quantization='none'")
    out.mkdir(parents=True, exist_ok=True)
    # Chunks of at most 4 MiB: a process restoring into a sharding reads only
    # the chunks its devices' slices overlap (one chunk per tensor would make
    # every host read every whole tensor).
    save_args = {name: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for name in params}
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(out / _PARAMS, args=ocp.args.PyTreeSave(params, save_args=save_args))
    written = [out / _PARAMS, out / _CONFIG]
    (out / _CONFIG).write_text(json.dumps(dataclasses.asdict(checkpoint.config), indent=1))
    tok = checkpoint.tokenizer
    if tok is not None:
        tok.backend.save(os.fspath(out / _TOKENIZER))
        meta = {"special_ids": {"bos": tok.bos_token_id, "eos": tok.eos_token_id,
                                "unk": tok.unk_token_id, "pad": tok.pad_token_id},
                "chat_template": checkpoint.chat_template}
        (out / _TOKENIZER_META).write_text(json.dumps(meta, indent=1))
        written += [out / _TOKENIZER, out / _TOKENIZER_META]
    sizes = _file_sizes(out / _PARAMS)
    info = {"format_version": FORMAT_VERSION, "source": source,
            "metadata": _json_safe(checkpoint.metadata or {}),
            "params_files": sizes,
            "params_crc32": {rel: _crc32(out / _PARAMS / rel) for rel in sizes}}
    if quantization != "none":
        info["quantization"] = {"method": quantization, "group_size": group_size,
                                "formats": formats}
    (out / _INFO).write_text(json.dumps(info, indent=1, default=str))
    return written + [out / _INFO]


def _read_json(path: pathlib.Path) -> dict[str, Any]:
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


def _read_info(folder: pathlib.Path) -> dict[str, Any]:
    """``jaxserve_orbax.json``, checked: ``format_version`` an int no newer than
    ``FORMAT_VERSION``; ``source`` a string; ``metadata`` an object;
    ``params_files`` (relative path -> size) and ``params_crc32`` (relative
    path -> CRC32) objects of non-negative ints whose paths stay inside
    ``params/``. ``{}`` when the file is absent (a folder another tool wrote).

    Raises:
      ValueError: the file is unreadable or any of the above is wrong (names the file).
    """
    path = folder / _INFO
    if not path.is_file():
        return {}
    info = _read_json(path)

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
        info["quantization"] = _parse_quantization(info["quantization"], bad)
    return info


def _parse_quantization(value, bad) -> SavedQuantization:
    """``jaxserve_orbax.json``'s ``quantization`` object as a ``SavedQuantization``.

    Raises:
      ``bad(what)``: an unknown method, a bad group size, or a format that is
        not a ``TensorFormat``'s fields.
    """
    from jaxserve.config import QUANTIZATION_METHODS
    from jaxserve.models import quant

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
    return _read_info(pathlib.Path(path).expanduser()).get("quantization")


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
        if config.quantization == "gguf":
            raise ValueError(f"{path}: quantization='gguf' keeps a GGUF file's own blocks, but "
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


def _assemble(params: dict[str, Any], formats: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with each complete set of ``<name>:<part>`` arrays replaced
    by one ``quant.QuantizedTensor`` under ``name`` (in the same order)."""
    from jaxserve.models import quant

    out: dict[str, Any] = {}
    for key, arr in params.items():
        name, _, part = key.rpartition(":")
        if part not in _PARTS or name not in formats:
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
    file = pathlib.Path(path).expanduser() / _CONFIG
    fields = _read_json(file)
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
    params = folder / _PARAMS
    if not params.is_dir():
        raise ValueError(f"{params}: missing; not an Orbax checkpoint folder")
    info = _read_info(folder)  # {} when written by another tool: Orbax's errors will do
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
        if _crc32(file) != saved:
            raise ValueError(f"{file}: CRC32 differs from the one recorded when saved "
                             f"(the file is corrupted)")


def restore_orbax(path: str | os.PathLike, shardings: Mapping[str, Any] | None = None,
                  dtype: Any = None, show_progress: bool = True) -> dict[str, Any]:
    """Restore the params of an Orbax checkpoint folder.

    Args:
      path: the folder (``save_orbax``'s ``output_dir``).
      shardings: stored name -> ``jax.sharding.Sharding`` of each tensor to
        restore (``sharding.rules.hf_shardings``: HF names, and
        ``<HF name>:<part>`` for the parts of a quantized one; tensors of the
        checkpoint not named are skipped): each array is restored straight
        into its sharding, every process reading only its shards. None: every
        tensor, as numpy arrays on the host.
      dtype: dtype of the restored unquantized arrays (numpy or jnp dtype);
        None keeps the saved dtype (float32 for GGUF and HF sources). The
        parts of quantized tensors always keep theirs.
      show_progress: draw a tqdm bar over the tensors.

    Returns:
      HF name -> ``jax.Array`` (with ``shardings``), ``np.ndarray``, or, for
      a quantized tensor, a ``quant.QuantizedTensor`` of either.

    Raises:
      ValueError: missing folder or file, a truncated file (names it), a
        tensor in ``shardings`` that the checkpoint lacks (or stores
        quantized: name its parts), some but not all parts of a quantized
        tensor, or a read error (names the tensors).
    """
    import orbax.checkpoint as ocp

    folder = pathlib.Path(path).expanduser().absolute()
    check_params_files(folder)
    tree = _metadata_tree(folder)
    saved = _read_info(folder).get("quantization")
    formats = saved.formats if saved is not None else {}
    with ocp.PyTreeCheckpointer() as ckptr:
        if shardings is not None:
            missing = [name for name in shardings if name not in tree]
            if missing:
                stored = f" (stored quantized: restore {missing[0]}:q and its other parts)" \
                    if f"{missing[0]}:q" in tree else ""
                raise ValueError(f"{folder / _PARAMS}: the checkpoint lacks tensor "
                                 f"{missing[0]!r} ({len(missing)} missing){stored}")
            for name in shardings:
                base, _, part = name.rpartition(":")
                lacking = [f"{base}:{p}" for p in _PARTS if part in _PARTS and base in formats
                           and f"{base}:{p}" in tree and f"{base}:{p}" not in shardings]
                if lacking:
                    raise ValueError(f"{folder / _PARAMS}: restoring {name!r} needs "
                                     f"{lacking[0]!r} too (the parts of one quantized tensor)")
            tree = {name: tree[name] for name in shardings}

        def args(name):
            base, _, part = name.rpartition(":")
            cast = None if part in _PARTS and base in formats else dtype  # parts as saved
            if shardings is None:
                return ocp.RestoreArgs(restore_type=np.ndarray, dtype=cast)
            return ocp.ArrayRestoreArgs(sharding=shardings[name], dtype=cast)

        groups, size = [[]], 0
        for name, meta in tree.items():
            nbytes = int(np.prod(meta.shape)) * np.dtype(meta.dtype).itemsize
            if groups[-1] and size + nbytes > _GROUP_BYTES:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
        params: dict[str, Any] = {}
        with tqdm(total=len(tree), desc="restoring Orbax tensors",
                  disable=not show_progress) as bar:
            for names in groups:
                restore = ocp.args.PyTreeRestore(
                    item={n: tree[n] for n in names}, restore_args={n: args(n) for n in names},
                    partial_restore=True)
                try:
                    params |= ckptr.restore(folder / _PARAMS, args=restore)
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"{folder / _PARAMS}: cannot restore tensors {names[0]!r}.."
                                     f"{names[-1]!r}: {e}") from None
                bar.update(len(names))
    return _assemble(params, formats)


def restore_for_model(path: str | os.PathLike, named_params: Mapping[str, tuple[Any, Any]],
                      mesh, rules, dtype: Any = None, show_progress: bool = True) -> dict[str, Any]:
    """Restore a model's params from an Orbax folder straight into the
    shardings its variables give them (``restore_orbax`` over
    ``sharding.rules.hf_shardings(named_params, mesh, rules)``).

    A ``QuantizedWeight`` whose placeholder format differs from the saved
    one (``adopt``, ``gguf``: each tensor keeps its file's type) is sharded
    as the saved format would be (an abstract ``QuantizedWeight`` of that
    format, ``nnx.eval_shape``; nothing is allocated); its ``load`` then
    adopts the format. A ``QuantizedWeight`` over an unquantized tensor gets
    the float tensor in its ``q``'s layout (``load`` quantizes it).

    Args:
      named_params: HF name -> (variable or ``QuantizedWeight``, expert index
        or None), as ``llama.hf_params`` / ``moe.hf_params`` return.
      mesh, rules: as ``hf_shardings``.
      dtype, show_progress: as ``restore_orbax``.

    Raises:
      ValueError: as ``restore_orbax``, or a saved format a non-``adopt``
        weight does not have (names the tensor and both formats).
    """
    from flax import nnx

    from jaxserve.models import quant
    from sharding.rules import hf_shardings

    saved = saved_quantization(path)
    formats = saved.formats if saved is not None else {}
    named = dict(named_params)
    for name, (var, expert) in named_params.items():
        fmt = formats.get(name)
        if isinstance(var, quant.QuantizedWeight) and fmt is None:
            named[name] = (var.q, expert)
        if not isinstance(var, quant.QuantizedWeight) or fmt is None or fmt == var.fmt:
            continue
        if not var.adopt:
            raise ValueError(f"{path}: tensor {name!r} is stored as {fmt}, the model's "
                             f"weight is {var.fmt}")
        named[name] = (nnx.eval_shape(lambda v=var, f=fmt: quant.QuantizedWeight(
            v.shape, v.names, f)), expert)
    return restore_orbax(path, hf_shardings(named, mesh, rules), dtype, show_progress)


def _metadata_tree(folder: pathlib.Path) -> dict[str, Any]:
    """Orbax's metadata of ``<folder>/params``: name -> object with ``shape`` and ``dtype``.

    Raises:
      ValueError: Orbax cannot read it, or it is not such a mapping (names the folder).
    """
    import orbax.checkpoint as ocp

    params = folder / _PARAMS
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            item = ckptr.metadata(params).item_metadata
        tree = None if item is None else item.tree
        for meta in (tree or {}).values():  # every entry must have a shape and a dtype
            [int(d) for d in meta.shape], np.dtype(meta.dtype)
    except Exception as e:  # noqa: BLE001 - Orbax raises many kinds
        raise ValueError(f"{params}: cannot read the Orbax metadata: "
                         f"{' '.join(str(e).split())[:300]}") from None
    if tree is None:  # Orbax only logs a warning when _METADATA is unreadable
        raise ValueError(f"{params}: Orbax finds no tensor metadata (_METADATA missing "
                         "or corrupt)")
    return tree


def check_orbax_shapes(path: str | os.PathLike, config: ModelConfig) -> None:
    """Check that the Orbax params hold every tensor ``config`` needs
    (``hf_loader.expected_tensors``) in its shape, from the metadata alone.

    Raises:
      ValueError: unreadable metadata, a missing tensor or another shape; the
        message names the params folder, the tensor and both shapes.
    """
    from checkpoints.hf_loader import expected_tensors

    params = pathlib.Path(path).expanduser().absolute() / _PARAMS
    tree = _metadata_tree(params.parent)
    saved = _read_info(params.parent).get("quantization")
    formats = saved.formats if saved is not None else {}
    expected = {}  # stored name -> shape
    for name, shape in expected_tensors(config).items():
        if name in formats:
            expected |= {f"{name}:{part}": s for part, s in part_shapes(formats[name],
                                                                       shape).items()}
        else:
            expected[name] = shape
    missing = [name for name in expected if name not in tree]
    if missing:
        raise ValueError(f"{params}: lacks tensor {missing[0]!r} ({len(missing)} missing) "
                         f"that model_config.json implies")
    for name, shape in expected.items():
        if tuple(tree[name].shape) != shape:
            raise ValueError(f"{params}: tensor {name!r} has shape {tuple(tree[name].shape)}, "
                             f"model_config.json implies {shape}")


def load_orbax_tokenizer(path: str | os.PathLike):
    """(``Tokenizer``, chat template) saved in the folder; (None, None) if none.

    Raises:
      ValueError: a corrupt ``tokenizer.json`` or ``tokenizer_meta.json``.
    """
    import tokenizers

    from checkpoints.tokenizer import Tokenizer

    folder = pathlib.Path(path).expanduser()
    if not (folder / _TOKENIZER).is_file():
        return None, None
    try:
        backend = tokenizers.Tokenizer.from_file(os.fspath(folder / _TOKENIZER))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"{folder / _TOKENIZER}: cannot load tokenizer: {e}") from None
    meta = _read_json(folder / _TOKENIZER_META)
    template, ids = meta.get("chat_template"), meta.get("special_ids", {})
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / _TOKENIZER_META}: chat_template is not a string")
    if not isinstance(ids, dict) or not all(
            i is None or (isinstance(i, int) and not isinstance(i, bool) and i >= 0)
            for i in ids.values()):
        raise ValueError(f"{folder / _TOKENIZER_META}: special_ids is not an object of "
                         "token ids")
    return Tokenizer(backend, ids, template), template


def load_orbax(path: str | os.PathLike, dtype: Any = np.float32,
               shardings: Mapping[str, Any] | None = None, show_progress: bool = True,
               with_params: bool = True) -> OrbaxCheckpoint:
    """Load an Orbax checkpoint folder: config, tokenizer and (unless
    ``with_params=False``) params via ``restore_orbax(path, shardings, dtype)``;
    the params' shapes are checked against the config first (``check_orbax_shapes``).

    Raises:
      ValueError: see ``load_orbax_config``, ``check_orbax_shapes``,
        ``restore_orbax``, ``load_orbax_tokenizer``; every message names the
        file or folder.
    """
    folder = pathlib.Path(path).expanduser()
    config = load_orbax_config(folder)
    check_params_files(folder, crc=False)  # sizes; restore_orbax checks the CRC32s too
    check_orbax_shapes(folder, config)
    info = _read_info(folder)
    tokenizer, template = load_orbax_tokenizer(folder)
    params = restore_orbax(folder, shardings, dtype, show_progress) if with_params else None
    return OrbaxCheckpoint(config=config, params=params, tokenizer=tokenizer,
                           chat_template=template,
                           metadata={**info.get("metadata", {}), "source": info.get("source", "")},
                           quantization=info.get("quantization"))


__all__ = ["OrbaxCheckpoint", "SavedQuantization", "check_orbax_shapes", "check_params_files",
           "is_orbax_checkpoint", "load_orbax", "load_orbax_config", "load_orbax_tokenizer",
           "part_shapes", "resolve_quantization", "restore_for_model", "restore_orbax",
           "save_orbax", "saved_quantization"]
