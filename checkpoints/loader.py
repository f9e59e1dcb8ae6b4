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

import dataclasses
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
                    show_progress: bool = True,
                    keep_blocks: bool = False) -> GGUFCheckpoint | HFCheckpoint | OrbaxCheckpoint:
    """Load ``model``: an Orbax folder, an HF folder, a ``.gguf`` file or a model alias.

    Args:
      model: a folder (Orbax if it has ``model_config.json`` and ``params/``,
        else HF), or what ``resolve_model`` takes. An Orbax folder's params
        come back as numpy arrays here; the engine restores them straight into
        their shardings instead (``orbax_ckpt.restore_orbax``).
      dtype: numpy dtype of the returned params.
      show_progress: draw a tqdm bar while reading tensors.
      keep_blocks: a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors come back as
        ``jaxserve.models.quant.QuantizedTensor``s of the file's own blocks
        (``--quantization gguf``); ignored for folders.

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
    path = resolve_model(os.fspath(model))
    if keep_blocks:
        return load_gguf(path, dtype=dtype, show_progress=show_progress, keep_blocks=True)
    return load_gguf(path, dtype=dtype, show_progress=show_progress)


def convert_to_orbax(model: str | os.PathLike, output_dir: str | os.PathLike,
                     dtype: Any = np.float32, show_progress: bool = True,
                     quantization: str = "none", group_size: int = 32) -> list[pathlib.Path]:
    """Load ``model`` (anything ``load_checkpoint`` takes) and write it as an
    Orbax checkpoint folder (``orbax_ckpt.save_orbax``) in ``output_dir``.

    Args:
      dtype: numpy dtype the unquantized tensors are stored in (e.g.
        ``np.float32``, ``ml_dtypes.bfloat16``); the engine casts to its own
        dtype on restore.
      quantization, group_size: ``EngineConfig.quantization`` /
        ``quantization_group_size``: every projection (``quant.is_projection``)
        is stored as ``quant.quantize_np(w, quant.method_format(quantization,
        group_size))`` of its f32 weight; ``"gguf"`` keeps a GGUF file's own
        Q8_0 / Q4_0 / Q4_1 blocks (other types: dense f32). Embeddings, norms,
        routers and the LM head stay ``dtype``; ``"none"`` stores everything
        in ``dtype`` (a quantized source is dequantized).

    Returns:
      The paths written.

    Raises:
      ValueError: as ``load_checkpoint``, ``output_dir`` exists and is not
        empty, an unknown method, ``"gguf"`` for a folder, or an int4 group
        size that does not divide an input dim (before any weights load).
      RuntimeError: downloading an alias failed.
    """
    from checkpoints.hf_loader import expected_tensors
    from jaxserve.models import quant

    out = pathlib.Path(output_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty")
    fmt = quant.method_format(quantization, group_size)
    if quantization == "gguf" and pathlib.Path(model).expanduser().is_dir():
        raise ValueError(f"quantization='gguf' keeps a GGUF file's own blocks, but {model!r} "
                         f"is a folder (HF or Orbax); use int8, w8a8 or int4")
    if fmt is not None:
        quant.check_shapes(quantization, group_size, [
            shape for name, shape in expected_tensors(load_model_config(model)).items()
            if quant.is_projection(name)])
    ckpt = load_checkpoint(model, dtype=dtype if fmt is None else np.float32,
                           show_progress=show_progress, keep_blocks=quantization == "gguf")
    params = {}
    for name, w in ckpt.params.items():
        if fmt is None or not quant.is_projection(name):
            params[name] = np.asarray(w.dequantize() if isinstance(w, quant.QuantizedTensor)
                                      else w, dtype)
        elif isinstance(w, quant.QuantizedTensor):  # GGUF blocks, or a quantized Orbax folder
            params[name] = w if quantization == "gguf" or w.fmt == fmt else \
                quant.quantize_np(w.dequantize(), fmt)
        else:
            params[name] = quant.quantize_np(w, quant.DENSE if quantization == "gguf" else fmt)
    return save_orbax(out, dataclasses.replace(ckpt, params=params), source=os.fspath(model),
                      quantization=quantization, group_size=group_size)


__all__ = ["convert_to_orbax", "load_checkpoint", "load_model_config"]
