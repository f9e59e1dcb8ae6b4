"""A Hugging Face ``config.json`` as a ``ModelConfig``, and the tensors each family's checkpoint holds.

``HF_ARCHITECTURES`` maps the ``config.json`` ``architectures[0]`` name to a
function that returns the family's ``ModelConfig`` fields
(``model_config_from_hf``); ``expected_tensors`` names every tensor (HF
names, ``[out, in]`` layouts) a checkpoint of that config must hold, and
``MOE_TENSOR_NAMES`` the per-expert ones. Add an entry to both for a new
family. ``checkpoints.hf_loader`` reads the folders.

Every problem raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from jaxserve.config import ROPE_SCALING_TYPES, ModelConfig, RopeScaling


def _rope_scaling(rope: Mapping[str, Any] | None) -> RopeScaling | None:
    """A ``RopeScaling`` from an HF rope dict (v5 ``rope_parameters`` or v4
    ``rope_scaling``: ``rope_type`` (or ``type``), ``factor``, and llama3's
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).

    Raises:
      ValueError: a kind other than default, linear or llama3 (yarn, dynamic,
        longrope, ...), or a missing key (names it).
    """
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (default, "
                         f"{', '.join(ROPE_SCALING_TYPES)})")
    keys = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if rope.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {kind!r} lacks {missing[0]!r}")
    return RopeScaling(kind, **{k: int(rope[k]) if k == "original_max_position_embeddings"
                                else float(rope[k]) for k in keys})


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of a family with one kind of layer:
    ``rope_theta`` + ``rope_scaling`` (transformers v4) or ``rope_parameters``
    (v5).

    Raises:
      ValueError: as ``_rope_scaling``.
    """
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(rope))


def _qwen_window(hf: Mapping[str, Any]) -> int | None:
    """Qwen2/3 sliding window: set only when every layer slides (``use_sliding_window``
    with layers from ``max_window_layers`` on; transformers' ``layer_types`` rule).

    Raises:
      ValueError: some layers slide and others do not.
    """
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if window is None:
        return None
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(hf.get("num_hidden_layers", 0))]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise ValueError(f"layer_types {types} mix sliding and full attention; not supported")


def _llama(hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported")
    bias = bool(hf.get("attention_bias", False))  # all four projections (modeling_llama.py)
    return dict(architecture="llama", attention_bias=bias, attention_out_bias=bias)


def _mistral(hf: Mapping[str, Any]) -> dict[str, Any]:
    return dict(architecture="mistral", sliding_window=hf.get("sliding_window", 4096))


def _qwen2(hf: Mapping[str, Any]) -> dict[str, Any]:
    # q/k/v always carry a bias, o_proj never (modeling_qwen2.py).
    return dict(architecture="qwen2", attention_bias=True, sliding_window=_qwen_window(hf))


def _qwen3(hf: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(architecture="qwen3", head_dim=int(hf.get("head_dim") or 128),
                attention_bias=bias, attention_out_bias=bias, qk_norm=True,
                sliding_window=_qwen_window(hf))


def _gemma3(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3 text (``Gemma3ForCausalLM``, ``model_type`` gemma3_text) as
    transformers reads its config: ``layer_types`` (or every
    ``sliding_window_pattern``-th layer global, default 6); RoPE per layer
    kind from v5 ``rope_parameters`` {full_attention, sliding_attention} or
    v4 ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (global
    layers only); defaults of ``Gemma3TextConfig`` for absent keys.

    Raises:
      ValueError: bidirectional attention (EmbeddingGemma), an activation
        other than the tanh GELU, a scaled local RoPE, attention biases, or a
        bad ``layer_types``.
    """
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder) is not supported")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for gemma3")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for gemma3 "
                         "(only gelu_pytorch_tanh)")
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers v5
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
        if _rope_scaling(local) is not None:
            raise ValueError("scaled RoPE on sliding_attention layers is not supported")
    else:
        full = hf.get("rope_scaling") or {}
        theta, local_theta = hf.get("rope_theta", 1e6), hf.get("rope_local_base_freq", 1e4)
    n = hf.get("num_hidden_layers", 0)
    period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % period else
                                      "full_attention" for i in range(n)]
    caps = {k: None if hf.get(k) is None else float(hf[k])
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(architecture="gemma3", head_dim=int(hf.get("head_dim") or 256),
                rope_theta=float(theta), rope_local_theta=float(local_theta),
                rope_scaling=_rope_scaling(full), layer_types=tuple(types),
                sliding_window=int(hf.get("sliding_window") or 4096),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
                qk_norm=True, hidden_act=act,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **caps)


def _mixtral(hf: Mapping[str, Any]) -> dict[str, Any]:
    # Every block is sparse; ``intermediate_size`` is each expert's width and
    # the router renormalises its top-k (modeling_mixtral.py).
    return dict(architecture="mixtral", sliding_window=hf.get("sliding_window"),
                num_experts=hf.get("num_local_experts", 8),
                num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                moe_intermediate_size=hf.get("intermediate_size"), norm_topk_prob=True)


def _qwen3_moe(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3 attention + sparse blocks. A layer i is dense (an MLP of
    ``intermediate_size``) when it is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0`` (modeling_qwen3_moe.py).

    Raises:
      ValueError: ``decoder_sparse_step`` < 1 or a bad ``mlp_only_layers`` entry.
    """
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    n = hf.get("num_hidden_layers", 0)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    if any(not isinstance(i, int) or not 0 <= i < n for i in only):
        raise ValueError(f"mlp_only_layers {only!r} must hold layer indices in [0, {n})")
    attention = _qwen3(hf)
    del attention["head_dim"]  # Qwen3-MoE defaults to D / N, not Qwen3's 128
    return dict(attention, architecture="qwen3_moe",
                num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
                num_experts_per_tok=hf.get("num_experts_per_tok", 8),
                moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                mlp_only_layers=tuple(i for i in range(n) if i in only or (i + 1) % step))


# config.json ``architectures[0]`` -> the family's ModelConfig fields (overriding
# the common ones of ``model_config_from_hf``).
HF_ARCHITECTURES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Gemma3ForCausalLM": _gemma3,
}

# Tensors of one MoE layer after "model.layers.{i}.": the router [E, D], then
# expert {e}'s gate [F, D], up [F, D] and down [D, F], one tensor per expert as
# transformers (4.x and 5.x) saves them. Same table as
# ``jaxserve.models.moe.HF_MOE_NAMES`` (checkpoints may not import models).
MOE_TENSOR_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
}


def _ids(value) -> list[int]:
    """An HF ``eos_token_id`` (None, int or list of ints) as a list."""
    return [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]


def model_config_from_hf(hf: Mapping[str, Any],
                         generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed ``config.json``.

    Args:
      hf: the ``config.json`` dict (transformers v4 or v5 spelling).
      generation_config: the ``generation_config.json`` dict, or None; its
        ``eos_token_id`` ids join ``eos_token_ids`` (Llama 3 instruct ends turns
        with ids listed only there).

    Raises:
      ValueError: no ``architectures``, an architecture not in ``HF_ARCHITECTURES``
        (names it and the supported ones), a missing required key (names it), or
        an option this runtime does not implement (quantization, an activation
        other than silu (Gemma 3: the tanh GELU), RoPE scaling other than
        linear and llama3, Qwen's mixed sliding/full layers, MLP bias).
    """
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' list")
    family = HF_ARCHITECTURES.get(archs[0])
    if family is None:
        why = " (multimodal checkpoints are not supported; text-only ones are)" \
            if archs[0].endswith("ForConditionalGeneration") else ""
        raise ValueError(f"unsupported architecture {archs[0]!r}{why}; supported: "
                         f"{sorted(HF_ARCHITECTURES)}")
    if hf.get("quantization_config"):
        raise ValueError(f"quantized checkpoints are not supported "
                         f"(quantization_config={hf['quantization_config']!r})")
    if archs[0] != "Gemma3ForCausalLM":
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"config.json lacks required key {key!r}")
        return hf[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    eos = dict.fromkeys(_ids(hf.get("eos_token_id"))
                        + _ids((generation_config or {}).get("eos_token_id")))
    fields = dict(
        vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads, **_rope(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=tuple(eos))
    return ModelConfig(**{**fields, **family(hf)})


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor ``cfg``'s model loads (what
    ``jaxserve.models.llama.load_params`` reads, or ``moe.load_params`` for an
    MoE config: ``MOE_TENSOR_NAMES`` in place of a sparse layer's MLP;
    ``gemma3.load_params``: two more norms per layer)."""
    D, N, K, H, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    E, Fe = cfg.num_experts, cfg.moe_intermediate_size
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        out |= {pre + "input_layernorm.weight": (D,),
                pre + "post_attention_layernorm.weight": (D,),
                pre + "self_attn.q_proj.weight": (N * H, D),
                pre + "self_attn.k_proj.weight": (K * H, D),
                pre + "self_attn.v_proj.weight": (K * H, D),
                pre + "self_attn.o_proj.weight": (D, N * H)}
        if E and i not in cfg.mlp_only_layers:
            router, gate, up, down = MOE_TENSOR_NAMES[cfg.architecture]
            out[pre + router] = (E, D)
            for e in range(E):
                out |= {pre + gate.format(e=e): (Fe, D), pre + up.format(e=e): (Fe, D),
                        pre + down.format(e=e): (D, Fe)}
        else:
            out |= {pre + "mlp.gate_proj.weight": (F, D), pre + "mlp.up_proj.weight": (F, D),
                    pre + "mlp.down_proj.weight": (D, F)}
        if cfg.attention_bias:
            out |= {pre + "self_attn.q_proj.bias": (N * H,),
                    pre + "self_attn.k_proj.bias": (K * H,),
                    pre + "self_attn.v_proj.bias": (K * H,)}
        if cfg.attention_out_bias:
            out[pre + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm:
            out |= {pre + "self_attn.q_norm.weight": (H,), pre + "self_attn.k_norm.weight": (H,)}
        if cfg.architecture == "gemma3":  # sandwich norms around the MLP
            out |= {pre + "pre_feedforward_layernorm.weight": (D,),
                    pre + "post_feedforward_layernorm.weight": (D,)}
    return out


# ---- safetensors ------------------------------------------------------------


__all__ = ["HF_ARCHITECTURES", "MOE_TENSOR_NAMES", "expected_tensors", "model_config_from_hf"]
