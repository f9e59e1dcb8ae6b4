"""Gemma 3 text decoder (HF ``Gemma3ForCausalLM``) in Flax NNX.

Dimension letters as in ``llama.py`` (T tokens, D model dim, N query heads,
K kv heads, H head dim, F GeGLU width, V vocab).

What differs from Llama, and where it lives:

* **Interleaved local and global attention.** ``ModelConfig.layer_types``
  names each layer ``"sliding_attention"`` (a window of
  ``sliding_window`` tokens, RoPE base ``rope_local_theta``, 10,000) or
  ``"full_attention"`` (RoPE base ``rope_theta``, 1,000,000, with
  ``rope_scaling`` where the config sets it: linear x8 on 4B and larger).
  Gemma 3 repeats five local layers and one global layer. Both kinds run
  through the same ragged paged attention (XLA on CPU, Pallas on GPU/TPU),
  which takes the window per layer; the KV cache keeps every position for
  every layer (a local layer's kernel never reads pages wholly outside its
  window, so its cost follows the window, not the context).
* **Norms.** RMSNorm scales by ``1 + w`` (zero-centred weights,
  ``llama.RMSNorm(offset=1)``), in f32 as HF. Four per block, a pre- and a
  post-norm around each of attention and the MLP:
  ``x + post_attn(attn(input(x)))``, then ``x + post_ffw(mlp(pre_ffw(x)))``.
  Per-head q/k RMSNorm (``1 + w`` too) before RoPE.
* **Scores** are scaled by ``query_pre_attn_scalar ** -0.5`` (256 in every
  Gemma 3 size, = H for the 270M and 1B) and soft-capped when
  ``attn_logit_softcapping`` is set (Gemma 2; None in Gemma 3).
* **GeGLU**: ``down(gelu_tanh(gate(x)) * up(x))`` (``hidden_act``
  ``gelu_pytorch_tanh``).
* **Embedding** scaled by ``sqrt(D)`` (in the parameter dtype, as HF's
  ``Gemma3TextScaledWordEmbedding``); the LM head is the embedding (tied);
  ``final_logit_softcapping`` where set.

The attention module, the MLP and the parameter plumbing are ``llama.py``'s
(same logical axis names, so the same sharding rules, quantization and
Orbax layout apply).

References: HF transformers ``models/gemma3/modeling_gemma3.py`` (v5);
Gemma Team 2025, "Gemma 3 Technical Report" (5:1 local:global layers,
1,024-token windows, RoPE bases 10k / 1M); Beltagy et al. 2020 (sliding
windows).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import GGUF_BLOCK_METHODS, LoRAConfig, ModelConfig
from jaxserve.models import quant, stack
from jaxserve.models.llama import (MLP, Attention, AttentionMetadata, LlamaForCausalLM, RMSNorm,
                                   _param, attention_hf_params)
from jaxserve.models.params import lm_head, load_tied_head, put_param
from jaxserve.models.rope import layer_rope_tables

# Gemma's RMSNorm multiplies by (1 + w).
NORM_OFFSET = 1.0


class Gemma3DecoderLayer(nnx.Module):
    """Sandwich-norm block: ``x + post_attn(attn(input(x)))``, then
    ``x + post_ffw(mlp(pre_ffw(x)))``."""

    def __init__(self, cfg: ModelConfig, dtype, rngs, qfmt=None, adopt=False,
                 lora: LoRAConfig | None = None, **attn):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps, dtype, offset=NORM_OFFSET)
        self.self_attn = Attention(cfg, dtype, rngs, qfmt=qfmt, adopt=adopt,
                                   norm_offset=NORM_OFFSET, lora=lora, **attn)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype, offset=NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(D, eps, dtype, offset=NORM_OFFSET)
        self.mlp = MLP(cfg, dtype, rngs, qfmt, adopt, lora=lora)
        self.post_feedforward_layernorm = RMSNorm(D, eps, dtype, offset=NORM_OFFSET)


def gemma3_layer(layer: Gemma3DecoderLayer, x_DT, k_cache, v_cache, cos_TH2, sin_TH2, window,
                 index, *, md: AttentionMetadata):
    """One sandwich-norm block (``stack.run_layers``' body, ``md`` bound):
    returns (x_DT [D, T], k_cache, v_cache, None)."""
    h_DT, k_cache, v_cache = layer.self_attn(layer.input_layernorm(x_DT), cos_TH2, sin_TH2,
                                             k_cache, v_cache, md, index, window)
    x_DT = x_DT + layer.post_attention_layernorm(h_DT)
    h_DT = layer.mlp(layer.pre_feedforward_layernorm(x_DT), md.lora_slots)
    return x_DT + layer.post_feedforward_layernorm(h_DT), k_cache, v_cache, None


class Gemma3ForCausalLM(nnx.Module):
    """Gemma 3 decoder with its tied LM head; the interface of
    ``LlamaForCausalLM`` (``__call__``, ``logits_of``; ``lora`` adds its
    adapter slots to q/k/v/o and gate/up/down).

    Raises:
      ValueError: ``cfg.architecture`` is not ``"gemma3"``, or the config
        lacks what Gemma 3 always has (q/k norm, a tied head), or an unknown
        quantization method.
    """

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "xla", interpret=False, quantization: str = "none",
                 quantization_group_size: int = 32, lora: LoRAConfig | None = None,
                 quantize_lm_head: bool = True):
        if cfg.architecture != "gemma3" or not cfg.qk_norm or not cfg.tie_word_embeddings:
            raise ValueError(f"Gemma3ForCausalLM needs architecture 'gemma3' with qk_norm and "
                             f"tied embeddings, got {cfg.architecture!r} (qk_norm="
                             f"{cfg.qk_norm}, tie_word_embeddings={cfg.tie_word_embeddings})")
        self.cfg = cfg
        V, D = cfg.vocab_size, cfg.hidden_size
        qfmt = quant.method_format(quantization, quantization_group_size)
        adopt = quantization in GGUF_BLOCK_METHODS
        self.embed_tokens = _param((V, D), ("vocab", "embed"), dtype, rngs)
        self.layers = nnx.List([
            Gemma3DecoderLayer(cfg, dtype, rngs, qfmt, adopt, lora, attention_impl=attention_impl,
                               interpret=interpret, sliding_window=cfg.layer_window(i))
            for i in range(cfg.num_layers)])
        self.layer_windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
        self.layer_segments = None  # set by stack.stack_layers
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype, offset=NORM_OFFSET)
        self.lm_head = lm_head(cfg, self.embed_tokens, dtype, rngs,
                               qfmt if quantize_lm_head else None, adopt)

    def __call__(self, k_cache, v_cache, md: AttentionMetadata, return_hidden: bool = False):
        """Forward one step (arguments and results as ``LlamaForCausalLM.__call__``)."""
        cfg = self.cfg
        embed_VD = self.embed_tokens.value
        x_DT = embed_VD[md.input_ids].T * jnp.asarray(cfg.hidden_size ** 0.5, embed_VD.dtype)
        x_DT, k_cache, v_cache, _ = stack.run_layers(
            self, functools.partial(gemma3_layer, md=md), x_DT, k_cache, v_cache,
            layer_rope_tables(cfg, md.positions))
        out = (self.logits_of(x_DT[:, md.logits_indices]), k_cache, v_cache)
        return out + (x_DT,) if return_hidden else out

    logits_of = LlamaForCausalLM.logits_of


def hf_params(model: Gemma3ForCausalLM) -> dict[str, tuple[nnx.Param, int | None]]:
    """HF tensor name -> (the ``nnx.Param`` it fills, None), in load order:
    llama's names (``attention_hf_params``, ``mlp.{gate,up,down}_proj``) plus
    ``model.layers.{i}.{pre,post}_feedforward_layernorm.weight`` [D]. Norm
    weights are HF's zero-centred ones (a GGUF's ``w + 1`` is converted by
    the loader)."""
    out = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        out |= attention_hf_params(layer, pre)
        for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[pre + f"{n}.weight"] = getattr(layer, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[pre + f"mlp.{n}.weight"] = getattr(layer.mlp, n)
    return {name: (p, None) for name, p in out.items()}


def load_params(model: Gemma3ForCausalLM, params: dict) -> None:
    """Copy an HF-named dict of arrays into ``model`` in place (names as
    ``hf_params``; values as ``llama.load_params`` takes them).

    Raises:
      ValueError: a tensor is missing or has the wrong shape.
    """
    for name, (p, _) in hf_params(model).items():
        put_param(p, name, params)
    load_tied_head(model, params)
