"""One entry point for every model source the engine accepts.

``load_checkpoint(model, dtype)`` loads an Orbax checkpoint folder
(``model_config.json`` + ``params/``, written by ``orbax_ckpt.save_orbax``)
with ``orbax_ckpt.load_orbax``, any other folder as an HF model folder
(``config.json`` + safetensors) with ``hf_loader.load_hf``, and anything else
(an alias such as ``"smollm2-135m"`` or a ``.gguf`` path) with ``fetch.resolve_model`` +
``gguf_loader.load_gguf``. All return a checkpoint with ``config``,
``params`` (HF names), ``tokenizer``, ``chat_template`` and ``metadata``.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from checkpoints.fetch import resolve_model
from checkpoints.gguf_loader import GGUFCheckpoint, load_gguf, load_gguf_config
from checkpoints.hf_loader import HFCheckpoint, load_hf, load_hf_config
from checkpoints.orbax_ckpt import (OrbaxCheckpoint, is_orbax_checkpoint, load_orbax,
                                    load_orbax_config, save_orbax)
from jaxserve.config import ModelConfig


def load_model_config(model: str | os.PathLike) -> ModelConfig:
    """``model``'s ``ModelConfig`` without reading its weights
    (``model_config.json`` of an Orbax folder, ``config.json`` of an HF folder,
    or a GGUF file's metadata), for checks that must fail before any weights
    load (the mesh).

    Raises:
      ValueError: as ``load_checkpoint``.
      RuntimeError: downloading an alias failed.
    """
    path = pathlib.Path(model).expanduser()
    if is_orbax_checkpoint(path):
        return load_orbax_config(path)
    if path.is_dir():
        return load_hf_config(path)
    return load_gguf_config(resolve_model(os.fspath(model)))


def load_checkpoint(model: str | os.PathLike, dtype: Any = np.float32,
                    show_progress: bool = True) -> GGUFCheckpoint | HFCheckpoint | OrbaxCheckpoint:
    """Load ``model``: an Orbax folder, an HF folder, a ``.gguf`` file or a model alias.

    Args:
      model: a folder (Orbax if it has ``model_config.json`` and ``params/``,
        else HF), or what ``resolve_model`` takes. An Orbax folder's params
        come back as numpy arrays here; the engine restores them straight into
        their shardings instead (``orbax_ckpt.restore_orbax``).
      dtype: numpy dtype of the returned params.
      show_progress: draw a tqdm bar while reading tensors.

    Raises:
      ValueError: unknown alias, missing file, or a bad checkpoint (see
        ``load_orbax``, ``load_hf`` and ``load_gguf``).
      RuntimeError: downloading an alias failed.
    """
    path = pathlib.Path(model).expanduser()
    if is_orbax_checkpoint(path):
        return load_orbax(path, dtype=dtype, show_progress=show_progress)
    if path.is_dir():
        return load_hf(path, dtype=dtype, show_progress=show_progress)
    return load_gguf(resolve_model(os.fspath(model)), dtype=dtype, show_progress=show_progress)


def convert_to_orbax(model: str | os.PathLike, output_dir: str | os.PathLike,
                     dtype: Any = np.float32, show_progress: bool = True) -> list[pathlib.Path]:
    """Load ``model`` (anything ``load_checkpoint`` takes) and write it as an
    Orbax checkpoint folder (``orbax_ckpt.save_orbax``) in ``output_dir``.

    Args:
      dtype: numpy dtype the tensors are stored in (e.g. ``np.float32``,
        ``ml_dtypes.bfloat16``); the engine casts to its own dtype on restore.

    Returns:
      The paths written.

    Raises:
      ValueError: as ``load_checkpoint``, or ``output_dir`` exists and is not empty.
      RuntimeError: downloading an alias failed.
    """
    out = pathlib.Path(output_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty")
    ckpt = load_checkpoint(model, dtype=dtype, show_progress=show_progress)
    return save_orbax(out, ckpt, source=os.fspath(model))


__all__ = ["convert_to_orbax", "load_checkpoint", "load_model_config"]
