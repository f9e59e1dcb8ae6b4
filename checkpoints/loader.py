"""One entry point for every model source the engine accepts.

``load_checkpoint(model, dtype)`` loads an Orbax checkpoint folder
(``model_config.json`` + ``params/``, written by ``orbax_ckpt.save_orbax``)
with ``orbax_ckpt.load_orbax``, any other folder as an HF model folder
(``config.json`` + safetensors) with ``hf_loader.load_hf``, and anything else
(an alias such as ``"smollm2-135m"`` or a ``.gguf`` path) with ``fetch.resolve_model`` +
``gguf_loader.load_gguf``. All return a checkpoint with ``config``,
``params`` (HF names), ``tokenizer``, ``chat_template`` and ``metadata``.

``load_for_engine(config, mesh_shape)`` is the engine's one entry point:
it checks the mesh and the quantization against the checkpoint's config
before any weights are read, then loads (an Orbax folder's tensors are left
for the engine to restore into their shardings once the model exists).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Sequence

import numpy as np

from checkpoints.fetch import resolve_model
from checkpoints.gguf_loader import GGUFCheckpoint, load_gguf, load_gguf_config
from checkpoints.hf_loader import HFCheckpoint, load_hf, load_hf_config
from checkpoints.orbax_ckpt import (OrbaxCheckpoint, is_orbax_checkpoint, load_orbax,
                                    load_orbax_config, save_orbax)
from checkpoints.orbax_lora import check_adapters
from jaxserve.config import GGUF_BLOCK_METHODS, EngineConfig, ModelConfig


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


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """``[out, in]`` shapes of a model's quantizable projections (q/k/v/o,
    gate/up/down, experts' gate/up/down)."""
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    shapes = [(N * H, D), (K * H, D), (D, N * H), (F, D), (D, F)]
    if cfg.num_experts:
        shapes += [(cfg.moe_intermediate_size, D), (D, cfg.moe_intermediate_size)]
    return shapes


def check_quantization(config: EngineConfig, cfg: ModelConfig) -> None:
    """Reject, before weights load, a quantization the model cannot take.

    Raises:
      ValueError: ``int4`` with a group size that does not divide an input
        dim; ``gguf`` for an HF folder (an Orbax folder converted with
        ``gguf`` keeps the blocks; ``orbax_ckpt.resolve_quantization`` checks it).
    """
    from jaxserve.models import quant
    quant.check_shapes(config.quantization, config.quantization_group_size,
                       projection_shapes(cfg))
    if config.quantization in GGUF_BLOCK_METHODS and config.model:
        path = pathlib.Path(config.model).expanduser()
        if path.is_dir() and not is_orbax_checkpoint(path):
            raise ValueError(f"quantization={config.quantization!r} keeps a GGUF file's own "
                             f"blocks, but {config.model!r} is an HF folder; use int8, w8a8 or int4")


@dataclasses.dataclass
class EngineLoad:
    """What ``load_for_engine`` returns.

    Attributes:
      config: the engine config, with an Orbax checkpoint's own quantization
        filled in (``orbax_ckpt.resolve_quantization``).
      model_config, tokenizer, chat_template: the checkpoint's.
      params: HF name -> numpy array or ``quant.QuantizedTensor`` (GGUF
        blocks with ``quantization="gguf"``); None for an Orbax folder, whose
        tensors the engine restores straight into their shardings
        (``orbax_ckpt.restore_for_model``) once the model exists.
      orbax_dir: the Orbax folder, or None.
    """

    config: EngineConfig
    model_config: ModelConfig
    params: dict | None
    tokenizer: Any
    chat_template: str | None
    orbax_dir: str | None


def load_for_engine(config: EngineConfig, mesh_shape) -> EngineLoad:
    """Check ``config.model`` against the mesh and the quantization from its
    config alone, then read it (everything ``Engine.__init__`` needs before
    it builds the model).

    Args:
      config: the engine config (``config.model`` names the checkpoint).
      mesh_shape: ``{axis: size}`` of the engine's mesh.

    Raises:
      ValueError: as ``load_checkpoint``; a mesh that cannot split the model
        or a quantization it cannot take, both before any weights are read.
      RuntimeError: downloading an alias failed.
    """
    from sharding.mesh import validate_mesh_for_model
    orbax = is_orbax_checkpoint(config.model)
    if orbax:  # a quantized checkpoint brings its own quantization
        from checkpoints.orbax_ckpt import resolve_quantization
        config = resolve_quantization(config.model, config)
    source_config = load_model_config(config.model)
    validate_mesh_for_model(mesh_shape, source_config)
    check_quantization(config, source_config)
    if orbax:
        ckpt = load_orbax(config.model, with_params=False)
    else:
        ckpt = load_checkpoint(config.model, dtype=np.dtype(
            "float32" if config.dtype != "float16" else "float16"),
            keep_blocks=config.quantization in GGUF_BLOCK_METHODS)
    return EngineLoad(config, ckpt.config, None if orbax else ckpt.params, ckpt.tokenizer,
                      ckpt.chat_template, config.model if orbax else None)


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
                     quantization: str = "none", group_size: int = 32,
                     lora_modules: Sequence[tuple[str, str]] = (),
                     quantize_lm_head: bool = True) -> list[pathlib.Path]:
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
        Q8_0 / Q4_0 / Q4_1 blocks (other types: dense f32). Embeddings, norms
        and routers stay ``dtype``; ``"none"`` stores everything in ``dtype``
        (a quantized source is dequantized).
      quantize_lm_head: an untied ``lm_head.weight`` is stored like a
        projection (``EngineConfig.quantize_lm_head``); False: in ``dtype``.
        A tied head has no tensor of its own: the engine quantizes it from
        the stored embedding on load (``params.load_tied_head``; for
        ``"gguf"`` the embedding is stored f32, so that head loads dense).
      lora_modules: (name, PEFT adapter folder) pairs shipped in the
        checkpoint (``checkpoints.orbax_lora``), each checked against the
        model before any weights load.

    Returns:
      The paths written.

    Raises:
      ValueError: as ``load_checkpoint``, ``output_dir`` exists and is not
        empty, an unknown method, ``"gguf"`` for a folder, or an int4 group
        size that does not divide an input dim, or an adapter of
        ``lora_modules`` the model cannot take (``LoRA adapter 'name=path':
        ...``; all before any weights load or anything is written).
      RuntimeError: downloading an alias failed.
    """
    from checkpoints.hf_loader import expected_tensors
    from jaxserve.models import quant

    out = pathlib.Path(output_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty")
    fmt = quant.method_format(quantization, group_size)
    if quantization in GGUF_BLOCK_METHODS and pathlib.Path(model).expanduser().is_dir():
        raise ValueError(f"quantization={quantization!r} keeps a GGUF file's own blocks, but "
                         f"{model!r} is a folder (HF or Orbax); use int8, w8a8 or int4")
    adapters = check_adapters(lora_modules, load_model_config(model)) if lora_modules else {}
    if fmt is not None:
        quant.check_shapes(quantization, group_size, [
            shape for name, shape in expected_tensors(load_model_config(model)).items()
            if quant.is_projection(name)])
    ckpt = load_checkpoint(model, dtype=dtype if fmt is None else np.float32,
                           show_progress=show_progress, keep_blocks=quantization in GGUF_BLOCK_METHODS)
    params = {}
    for name, w in ckpt.params.items():
        quantized = quant.is_projection(name) or quantize_lm_head and name == "lm_head.weight"
        if fmt is None or not quantized:
            params[name] = np.asarray(w.dequantize() if isinstance(w, quant.QuantizedTensor)
                                      else w, dtype)
        else:
            f = quant.head_format(fmt) if name == "lm_head.weight" else fmt
            if isinstance(w, quant.QuantizedTensor):  # GGUF blocks, or a quantized Orbax folder
                params[name] = w if quantization in GGUF_BLOCK_METHODS or w.fmt == f else \
                    quant.quantize_np(w.dequantize(), f)
            else:
                params[name] = quant.quantize_np(w, quant.DENSE if quantization in GGUF_BLOCK_METHODS else f)
    return save_orbax(out, dataclasses.replace(ckpt, params=params), source=os.fspath(model),
                      quantization=quantization, group_size=group_size,
                      lora_adapters=adapters)


__all__ = ["EngineLoad", "check_quantization", "convert_to_orbax", "load_for_engine",
           "projection_shapes", "load_checkpoint", "load_model_config"]
