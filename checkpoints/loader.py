"""One entry point for every model source the engine accepts.

``load_checkpoint(model, dtype)`` loads an HF model folder (``config.json`` +
safetensors) with ``hf_loader.load_hf``, and anything else (an alias such as
``"smollm2-135m"`` or a ``.gguf`` path) with ``fetch.resolve_model`` +
``gguf_loader.load_gguf``. Both return a checkpoint with ``config``,
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
from jaxserve.config import ModelConfig


def load_model_config(model: str | os.PathLike) -> ModelConfig:
    """``model``'s ``ModelConfig`` without reading its weights (``config.json``
    of an HF folder, or a GGUF file's metadata), for checks that must fail
    before any weights load (the mesh).

    Raises:
      ValueError: as ``load_checkpoint``.
      RuntimeError: downloading an alias failed.
    """
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return load_hf_config(path)
    return load_gguf_config(resolve_model(os.fspath(model)))


def load_checkpoint(model: str | os.PathLike, dtype: Any = np.float32,
                    show_progress: bool = True) -> GGUFCheckpoint | HFCheckpoint:
    """Load ``model``: an HF folder, a ``.gguf`` file or a model alias.

    Args:
      model: a folder (read as an HF checkpoint), or what ``resolve_model`` takes.
      dtype: numpy dtype of the returned params.
      show_progress: draw a tqdm bar while reading tensors.

    Raises:
      ValueError: unknown alias, missing file, or a bad checkpoint (see
        ``load_hf`` and ``load_gguf``).
      RuntimeError: downloading an alias failed.
    """
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return load_hf(path, dtype=dtype, show_progress=show_progress)
    return load_gguf(resolve_model(os.fspath(model)), dtype=dtype, show_progress=show_progress)


__all__ = ["load_checkpoint", "load_model_config"]
