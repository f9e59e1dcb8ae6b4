"""LoRA adapters shipped inside an Orbax checkpoint folder and registered from it at start.

``convert_to_orbax(model, out, lora_modules=[(name, path), ...])`` first
reads every PEFT adapter folder and checks it against the base model
(``check_adapters``: ``peft.load_adapter`` + ``peft.check_adapter`` with
slots as wide as the adapter's own rank), so a bad entry fails the
conversion before anything is written; then ``save_orbax`` writes the base
and ``save_adapters`` copies each adapter's two PEFT files byte for byte::

    <dir>/lora/<name>/adapter_config.json
    <dir>/lora/<name>/adapter_model.safetensors

and ``jaxserve_orbax.json`` lists them under ``lora_adapters``::

    "lora_adapters": {"sql": {"source": "/adapters/sql", "rank": 8,
                              "target_modules": ["k_proj", ...],
                              "files": {"adapter_config.json": 412, ...}}}

(older readers ignore the key; ``format_version`` stays 1). Serving the
folder, ``checkpoint_adapters(dir)`` gives the (name, folder) pairs to
register with ``Engine.add_lora`` (``jaxserve.main`` and ``LLM`` do so at
start); it checks the table and the files' sizes, so a deleted or
truncated adapter file is a ``ValueError`` naming it.

A name is 1-64 characters of ``[A-Za-z0-9._-]`` (it is a folder name),
not ``.`` or ``..``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
from typing import Any, Sequence

from checkpoints.orbax_metadata import INFO_FILE, is_orbax_checkpoint, read_info
from checkpoints.peft import CONFIG_FILE, WEIGHTS_FILE, PeftAdapter, check_adapter, load_adapter
from jaxserve.config import LoRAConfig, ModelConfig

LORA_DIR = "lora"
INFO_KEY = "lora_adapters"
FILES = (CONFIG_FILE, WEIGHTS_FILE)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"the name {name!r} is not 1-64 characters of [A-Za-z0-9._-] (it "
                         f"names a folder of the checkpoint)")


def check_adapters(entries: Sequence[tuple[str, str]],
                   model_config: ModelConfig) -> dict[str, PeftAdapter]:
    """Read and check every (name, PEFT folder) of ``entries`` against the model.

    Returns:
      name -> ``PeftAdapter``, in the given order.

    Raises:
      ValueError: ``LoRA adapter 'name=path': ...``: a bad or repeated name,
        or what ``peft.load_adapter`` / ``check_adapter`` raise (the file and
        the field or tensor; e.g. an adapter of another model).
    """
    out: dict[str, PeftAdapter] = {}
    for name, path in entries:
        try:
            _check_name(name)
            if name in out:
                raise ValueError(f"the name {name!r} is given twice")
            adapter = load_adapter(os.fspath(path))
            # Slots as wide as this adapter (512 at most: LoRAConfig's bound, which
            # check_adapter then names): the serving --max_lora_rank is chosen later.
            check_adapter(adapter, model_config,
                          LoRAConfig(max_loras=1, max_lora_rank=min(adapter.rank, 512)))
        except ValueError as e:
            raise ValueError(f"LoRA adapter '{name}={path}': {e}") from None
        out[name] = adapter
    return out


def save_adapters(out: pathlib.Path, adapters: dict[str, PeftAdapter]
                  ) -> tuple[list[pathlib.Path], dict[str, Any]]:
    """Copy each adapter's two PEFT files into ``out/lora/<name>/``.

    Returns:
      (the folders written, the ``lora_adapters`` table of ``jaxserve_orbax.json``).
    """
    written, table = [], {}
    for name, adapter in adapters.items():
        folder = out / LORA_DIR / name
        folder.mkdir(parents=True)
        for f in FILES:
            shutil.copyfile(pathlib.Path(adapter.path) / f, folder / f)
        table[name] = {"source": adapter.path, "rank": adapter.rank,
                       "target_modules": list(adapter.target_modules),
                       "files": {f: (folder / f).stat().st_size for f in FILES}}
        written.append(folder)
    return written, table


def checkpoint_adapters(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The LoRA adapters an Orbax checkpoint folder ships, as (name, folder).

    ``[]`` for anything else (an alias, a GGUF file, an HF folder) and for a
    checkpoint without adapters.

    Raises:
      ValueError: a corrupt ``lora_adapters`` table, or an adapter file that
        is missing or not the size recorded (names the file).
    """
    folder = pathlib.Path(path).expanduser()
    if not is_orbax_checkpoint(folder):
        return []
    table = read_info(folder).get(INFO_KEY, {})
    info = folder / INFO_FILE
    if not isinstance(table, dict):
        raise ValueError(f"{info}: {INFO_KEY} is not an object (corrupt file)")
    out = []
    for name, entry in table.items():
        try:
            _check_name(name)
        except ValueError as e:
            raise ValueError(f"{info}: {INFO_KEY}: {e} (corrupt file)") from None
        files = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(files, dict) or set(files) != set(FILES):
            raise ValueError(f"{info}: {INFO_KEY}[{name!r}].files must list {', '.join(FILES)} "
                             f"(corrupt file)")
        adapter_dir = folder / LORA_DIR / name
        for f, size in files.items():
            p = adapter_dir / f
            if not p.is_file():
                raise ValueError(f"{p}: missing (LoRA adapter {name!r} of the checkpoint)")
            if p.stat().st_size != size:
                raise ValueError(f"{p}: {p.stat().st_size} bytes, {INFO_FILE} records {size} "
                                 f"(truncated or replaced)")
        out.append((name, os.fspath(adapter_dir)))
    return out


__all__ = ["FILES", "INFO_KEY", "LORA_DIR", "check_adapters", "checkpoint_adapters",
           "save_adapters"]
