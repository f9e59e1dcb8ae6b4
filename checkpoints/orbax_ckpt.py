"""Orbax checkpoints: any loaded checkpoint saved once, restored straight into a sharding.

Layout of a checkpoint folder written by ``save_orbax``::

    <dir>/model_config.json   jaxserve.config.ModelConfig fields (dataclasses.asdict)
    <dir>/params/             Orbax PyTree checkpoint: HF tensor name -> array, as
                              ``checkpoints.loader.load_checkpoint`` returns them
    <dir>/tokenizer.json      the ``tokenizers`` pipeline (only if the source had one)
    <dir>/tokenizer_meta.json bos/eos/unk/pad ids and the chat template
    <dir>/jaxserve_orbax.json format version, source, the source's scalar
                              metadata, and the size of every file under params/
    <dir>/lora/<name>/        PEFT LoRA adapters converted with the base (only
                              if any; ``checkpoints.orbax_lora``)

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
projection (``quant.is_projection``), and an untied ``lm_head.weight`` unless
converted with ``quantize_lm_head=False``, is stored as its parts, ``<HF name>:q``
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
import os
import pathlib
from typing import Any, Mapping

import numpy as np
from tqdm.auto import tqdm

from checkpoints.orbax_metadata import (CONFIG_FILE, FORMAT_VERSION, INFO_FILE, PARAMS_DIR, PARTS,
                                    TOKENIZER_FILE, TOKENIZER_META_FILE, SavedQuantization,
                                    assemble_parts, check_params_files, crc32, file_sizes,
                                    is_orbax_checkpoint, json_safe, load_orbax_config, part_shapes,
                                    read_info, read_json, resolve_quantization, saved_quantization)
from checkpoints.orbax_lora import INFO_KEY as LORA_INFO_KEY
from checkpoints.orbax_lora import save_adapters
from jaxserve.config import ModelConfig

CHUNK_BYTES = 4 << 20  # largest chunk of a saved tensor
_GROUP_BYTES = 1 << 30  # tensors restored per Orbax call (and per progress-bar update)


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


def save_orbax(output_dir: str | os.PathLike, checkpoint, source: str = "",
               quantization: str = "none", group_size: int = 32,
               lora_adapters: Mapping[str, Any] | None = None) -> list[pathlib.Path]:
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
      lora_adapters: name -> ``peft.PeftAdapter``, already checked
        (``orbax_lora.check_adapters``): copied under ``lora/<name>/`` and
        listed in ``jaxserve_orbax.json`` (``checkpoints.orbax_lora``).

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
        params |= {f"{name}:{part}": np.asarray(getattr(a, part)) for part in PARTS
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
        ckptr.save(out / PARAMS_DIR, args=ocp.args.PyTreeSave(params, save_args=save_args))
    written = [out / PARAMS_DIR, out / CONFIG_FILE]
    (out / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(checkpoint.config), indent=1))
    tok = checkpoint.tokenizer
    if tok is not None:
        tok.backend.save(os.fspath(out / TOKENIZER_FILE))
        meta = {"special_ids": {"bos": tok.bos_token_id, "eos": tok.eos_token_id,
                                "unk": tok.unk_token_id, "pad": tok.pad_token_id},
                "chat_template": checkpoint.chat_template}
        (out / TOKENIZER_META_FILE).write_text(json.dumps(meta, indent=1))
        written += [out / TOKENIZER_FILE, out / TOKENIZER_META_FILE]
    lora_written, lora_table = save_adapters(out, dict(lora_adapters or {}))
    written += lora_written
    sizes = file_sizes(out / PARAMS_DIR)
    info = {"format_version": FORMAT_VERSION, "source": source,
            "metadata": json_safe(checkpoint.metadata or {}),
            "params_files": sizes,
            "params_crc32": {rel: crc32(out / PARAMS_DIR / rel) for rel in sizes}}
    if quantization != "none":
        info["quantization"] = {"method": quantization, "group_size": group_size,
                                "formats": formats}
    if lora_table:
        info[LORA_INFO_KEY] = lora_table
    (out / INFO_FILE).write_text(json.dumps(info, indent=1, default=str))
    return written + [out / INFO_FILE]


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
    saved = read_info(folder).get("quantization")
    formats = saved.formats if saved is not None else {}
    with ocp.PyTreeCheckpointer() as ckptr:
        if shardings is not None:
            missing = [name for name in shardings if name not in tree]
            if missing:
                stored = f" (stored quantized: restore {missing[0]}:q and its other parts)" \
                    if f"{missing[0]}:q" in tree else ""
                raise ValueError(f"{folder / PARAMS_DIR}: the checkpoint lacks tensor "
                                 f"{missing[0]!r} ({len(missing)} missing){stored}")
            for name in shardings:
                base, _, part = name.rpartition(":")
                lacking = [f"{base}:{p}" for p in PARTS if part in PARTS and base in formats
                           and f"{base}:{p}" in tree and f"{base}:{p}" not in shardings]
                if lacking:
                    raise ValueError(f"{folder / PARAMS_DIR}: restoring {name!r} needs "
                                     f"{lacking[0]!r} too (the parts of one quantized tensor)")
            tree = {name: tree[name] for name in shardings}

        def args(name):
            base, _, part = name.rpartition(":")
            cast = None if part in PARTS and base in formats else dtype  # parts as saved
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
                    params |= ckptr.restore(folder / PARAMS_DIR, args=restore)
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"{folder / PARAMS_DIR}: cannot restore tensors {names[0]!r}.."
                                     f"{names[-1]!r}: {e}") from None
                bar.update(len(names))
    return assemble_parts(params, formats)


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
    the float tensor in its ``q``'s layout (``load`` quantizes it); a plain
    variable over a quantized tensor (a quantized LM head restored with
    ``quantize_lm_head=False``) gets its parts, dequantized on load.

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
    from sharding.rules import _logical_axes as logical_axes
    from sharding.rules import hf_shardings

    saved = saved_quantization(path)
    formats = saved.formats if saved is not None else {}
    named = dict(named_params)
    for name, (var, expert) in named_params.items():
        fmt = formats.get(name)
        if not isinstance(var, quant.QuantizedWeight) and fmt is not None:
            # stored quantized, held dense (an LM head with quantize_lm_head=False):
            # its parts restore as that format's would; ``put_param`` dequantizes them.
            names = logical_axes(var)
            named[name] = (nnx.eval_shape(lambda v=var, f=fmt, n=names: quant.QuantizedWeight(
                v.value.shape, n, f)), expert)
            continue
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

    params = folder / PARAMS_DIR
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

    params = pathlib.Path(path).expanduser().absolute() / PARAMS_DIR
    tree = _metadata_tree(params.parent)
    saved = read_info(params.parent).get("quantization")
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
    if not (folder / TOKENIZER_FILE).is_file():
        return None, None
    try:
        backend = tokenizers.Tokenizer.from_file(os.fspath(folder / TOKENIZER_FILE))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"{folder / TOKENIZER_FILE}: cannot load tokenizer: {e}") from None
    meta = read_json(folder / TOKENIZER_META_FILE)
    template, ids = meta.get("chat_template"), meta.get("special_ids", {})
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / TOKENIZER_META_FILE}: chat_template is not a string")
    if not isinstance(ids, dict) or not all(
            i is None or (isinstance(i, int) and not isinstance(i, bool) and i >= 0)
            for i in ids.values()):
        raise ValueError(f"{folder / TOKENIZER_META_FILE}: special_ids is not an object of "
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
    info = read_info(folder)
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
