"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer"): the
inverse frequencies with their long-context rescalings, the cos / sin
tables of a step's positions, one per distinct (base, scaling) of a
model's layers, and the rotate-half rotation HF's Llama applies.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  freq_factors: tuple[float, ...] = ()):
    """RoPE inverse frequencies f32 [H/2], radians per position.

    ``theta ** (-2i / H)`` (Su et al. 2021; HF ``_compute_default_rope_parameters``),
    then rescaled by ``scaling`` (``RopeScaling``: linear, or llama3 as HF
    ``_compute_llama3_parameters``), or divided elementwise by
    ``freq_factors`` (a GGUF's ``rope_freqs`` tensor: llama.cpp's form of
    the same llama3 rescaling).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if freq_factors:
        inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_position_embeddings  # llama3
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(positions_T, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 freq_factors: tuple[float, ...] = ()):
    """cos, sin of shape [T, H/2] in f32 (HF ``LlamaRotaryEmbedding``; the
    frequencies of ``rope_inv_freq``)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
    freqs_TH2 = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs_TH2), jnp.sin(freqs_TH2)


def layer_rope_tables(cfg: ModelConfig, positions_T):
    """The distinct RoPE (cos, sin) [T, H/2] tables of a model's layers and
    the index of each layer's table (``ModelConfig.layer_rope``): one table
    for most models, two for Gemma 3 (local and global bases). Returns
    ``(tables, index)``, a list and a tuple of ints of length num_layers."""
    keys: dict = {}
    index = []
    for i in range(cfg.num_layers):
        index.append(keys.setdefault(cfg.layer_rope(i), len(keys)))
    tables = [rope_cos_sin(positions_T, cfg.head_dim, *key, cfg.rope_freq_factors)
              for key in keys]
    return tables, tuple(index)


def apply_rope(x_TNH, cos_TH2, sin_TH2):
    """Rotate-half RoPE on [T, heads, H]; math in f32."""
    x = x_TNH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos_TH2[:, None, :], sin_TH2[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_TNH.dtype)
