"""What every model family shares about its parameters: ``put_param`` (one
checkpoint array into its param, quantizing or dequantizing as the param's
format asks) and the LM head (``lm_head``, in the weight format; a tied head
filled from the embedding by ``load_tied_head``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models import quant


def lm_head(cfg: ModelConfig, embed_tokens: nnx.Param, dtype, rngs,
            qfmt: quant.TensorFormat | None, adopt: bool = False):
    """The LM head [V, D] of a model (shared by every family).

    * ``qfmt`` None (``quantization="none"``, or ``quantize_lm_head=False``):
      None for a tied head (``logits_of`` reads ``embed_tokens``), else an
      ``nnx.Param`` in ``dtype``.
    * else a ``quant.QuantizedWeight`` in ``quant.head_format(qfmt)`` (int8's
      and int4's head: Q8_0-style groups; ``adopt``: the GGUF tensor's own
      type). A tied head is then a second weight beside the embedding, built
      from the same values (a family's ``load_params`` fills it from
      ``model.embed_tokens.weight``: a GGUF's blocks as they are, a float
      array quantized), so the lookup stays exact and the model holds both;
      random init quantizes ``embed_tokens``' values.

    Logical axes ("vocab", "embed") in every form (``QuantizedWeight``: its
    scales ("vocab", None) per channel, ("vocab", "embed") grouped).
    """
    V, D = cfg.vocab_size, cfg.hidden_size
    if qfmt is None:
        if cfg.tie_word_embeddings:
            return None
        return quant.param((V, D), ("vocab", "embed"), dtype, rngs)
    if not adopt:  # int8's and int4's head: Q8_0-style groups (quant.head_format)
        qfmt = quant.head_format(qfmt)
    if not cfg.tie_word_embeddings:
        return quant.weight((V, D), ("vocab", "embed"), dtype, rngs, qfmt, adopt)
    head = quant.QuantizedWeight((V, D), ("vocab", "embed"), qfmt, adopt=adopt)
    if rngs is not None and qfmt.bits != 0:
        head.load(np.asarray(embed_tokens.value, np.float32), "lm_head (tied, random init)")
    return head


def load_tied_head(model, params: dict) -> None:
    """Fill a quantized tied head (``lm_head``) from ``params``'
    ``model.embed_tokens.weight``; nothing for any other head."""
    if model.cfg.tie_word_embeddings and isinstance(model.lm_head, quant.QuantizedWeight):
        put_param(model.lm_head, "model.embed_tokens.weight", params)


def put_param(p, name: str, params: dict, arr=None) -> None:
    """``p.value = params[name]`` (or ``arr``) in ``p``'s dtype.

    ``p`` may be a ``quant.QuantizedWeight``: a float array is quantized to
    its format, a ``quant.QuantizedTensor`` (GGUF blocks, a quantized Orbax
    checkpoint) is taken as it is. A ``QuantizedTensor`` for a plain param
    (a GGUF's Q8_0 embedding) is dequantized.

    Raises:
      ValueError: ``name`` missing from ``params``, or a shape (or format) that
        differs from ``p``'s.
    """
    if arr is None:
        if name not in params:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        arr = params[name]
    if isinstance(p, quant.QuantizedWeight):
        if not isinstance(arr, quant.QuantizedTensor) and p.adopt:  # gguf: another ggml type
            arr = quant.QuantizedTensor(quant.DENSE, tuple(arr.shape), np.asarray(arr, np.float32),
                                        None)
        p.load(arr, name)
        return
    if isinstance(arr, quant.QuantizedTensor):
        arr = arr.dequantize()
    if tuple(arr.shape) != tuple(p.value.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(arr.shape)} != model "
                         f"{tuple(p.value.shape)}")
    p.value = jnp.asarray(arr, dtype=p.value.dtype)
