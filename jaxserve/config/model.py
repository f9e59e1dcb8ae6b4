"""The model's architecture: ``ModelConfig`` and its RoPE scaling.

Filled from a checkpoint's metadata (``checkpoints``) or built by hand for tiny
test models; validated in ``__post_init__`` (``ValueError`` naming the field and value).
"""

from __future__ import annotations

import dataclasses

from jaxserve.config.checks import check_positive


ROPE_SCALING_TYPES = ("linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF ``layer_types`` names
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are rescaled for a longer context.

    ``rope_type``:

    * ``"linear"`` (position interpolation, Chen et al. 2023; Gemma 3's
      global layers, factor 8): every inverse frequency is divided by ``factor``.
    * ``"llama3"`` (Llama 3.1/3.2; HF ``_compute_llama3_parameters``): with
      wavelength ``2 pi / f``, frequencies whose wavelength is shorter than
      ``original_max_position_embeddings / high_freq_factor`` are kept, those
      longer than ``original_max_position_embeddings / low_freq_factor`` are
      divided by ``factor``, and those between are interpolated smoothly:
      ``(1 - a) f / factor + a f`` with ``a = (original / wavelength -
      low_freq_factor) / (high_freq_factor - low_freq_factor)``.

    Attributes:
      rope_type: one of ``ROPE_SCALING_TYPES``.
      factor: scale of the context (> 0; 8 for Llama 3.1, 32 for Llama 3.2).
      low_freq_factor, high_freq_factor: llama3's band edges (1 and 4 in Llama 3.x).
      original_max_position_embeddings: llama3's pre-training context, tokens (8192).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope scaling type must be one of {list(ROPE_SCALING_TYPES)}, "
                             f"got {self.rope_type!r}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3":
            check_positive("original_max_position_embeddings",
                           self.original_max_position_embeddings)
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < "
                                 f"high_freq_factor, got {self.low_freq_factor!r} and "
                                 f"{self.high_freq_factor!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3),
    of a mixture-of-experts one built on it (Mixtral, Qwen3-MoE), or of Gemma 3.

    Built from GGUF metadata by ``checkpoints.gguf_loader.model_config_from_gguf``,
    from an HF ``config.json`` by ``checkpoints.hf_loader.model_config_from_hf``,
    or written by hand for tiny random test models.

    Attributes:
      architecture: key into ``jaxserve.models.MODEL_CLASSES`` (e.g. ``"llama"``).
      vocab_size: number of token ids V.
      hidden_size: model width D.
      intermediate_size: SwiGLU width F.
      num_layers: decoder blocks.
      num_heads: query heads N.
      num_kv_heads: key/value heads K (GQA when K < N; N % K == 0).
      head_dim: H; usually D // N.
      rope_theta: RoPE base frequency (GGUF ``rope.freq_base``) of full-attention
        layers (all layers of most families).
      rope_scaling: None, or the ``RopeScaling`` of the full-attention layers
        (Llama 3.1/3.2: llama3; Gemma 3 4B+: linear).
      rope_freq_factors: () or H/2 divisors of the full-attention layers'
        inverse frequencies (a GGUF's ``rope_freqs`` tensor: llama.cpp's
        form of Llama 3.1+'s llama3 scaling).
      rms_norm_eps: epsilon inside RMSNorm.
      max_position_embeddings: context length the model was trained for, tokens.
      tie_word_embeddings: the LM head reuses the token embedding matrix.
      bos_token_id / eos_token_ids: special ids from the tokenizer metadata.
      attention_bias: q_proj, k_proj and v_proj add a bias (Qwen2; HF
        ``attention_bias`` of Llama and Qwen3).
      attention_out_bias: o_proj adds a bias (HF ``attention_bias`` of Llama and Qwen3).
      qk_norm: RMSNorm over H of each query and key head before RoPE (Qwen3).
      sliding_window: None, or W: a sliding layer's query at position i sees only
        kv positions (i - W, i], tokens (Mistral ``sliding_window``: every layer).
      layer_types: () (every layer slides iff ``sliding_window`` is set), or one
        of ``LAYER_TYPES`` per layer (HF ``layer_types``; Gemma 3: five
        ``"sliding_attention"`` layers, then one ``"full_attention"``).
      rope_local_theta: RoPE base of the sliding layers when ``layer_types``
        mixes both kinds (Gemma 3 ``rope_local_base_freq``, 10,000; never
        scaled); None: ``rope_theta``.
      query_pre_attn_scalar: attention scores are scaled by its ``** -0.5``
        (Gemma); None: ``head_dim ** -0.5``.
      attn_logit_softcapping: None, or c: scores become ``c * tanh(s / c)`` (Gemma 2).
      final_logit_softcapping: None, or c: the logits become ``c * tanh(z / c)``.
      hidden_act: the gated MLP's activation, one of ``HIDDEN_ACTS`` (``"silu"``:
        SwiGLU; ``"gelu_pytorch_tanh"``: Gemma's GeGLU with the tanh GELU).
      num_experts: E, routed SwiGLU experts per MoE layer; 0 for a dense model
        (``jaxserve.models.moe``: Mixtral, Qwen3-MoE).
      num_experts_per_tok: k, experts each token is routed to (1 <= k <= E).
      moe_intermediate_size: SwiGLU width of one expert (Mixtral: its
        ``intermediate_size``; Qwen3-MoE: ``moe_intermediate_size``).
      norm_topk_prob: the k routing weights sum to 1 (softmax over the top-k
        router logits; Mixtral, Qwen3-MoE ``norm_topk_prob=true``); else they
        are the top-k of the softmax over all E experts.
      mlp_only_layers: layers of an MoE model that have a dense SwiGLU of
        ``intermediate_size`` instead of experts (Qwen3-MoE ``mlp_only_layers``
        and ``decoder_sparse_step``, resolved), sorted.
    """

    architecture: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] = ()
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            check_positive(name, getattr(self, name))
        check_positive("sliding_window", self.sliding_window, allow_none=True)
        for name in ("tie_word_embeddings", "attention_bias", "attention_out_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        self._check_attention()
        self._check_moe()

    def _check_attention(self):
        if isinstance(self.rope_scaling, dict):  # from model_config.json (Orbax)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be None or a RopeScaling, got "
                             f"{self.rope_scaling!r}")
        factors = self.rope_freq_factors
        if not isinstance(factors, tuple) or (factors and (
                len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors))):
            raise ValueError(f"rope_freq_factors must be () or head_dim / 2 = "
                             f"{self.head_dim // 2} numbers > 0, got {factors!r:.80}")
        if factors and self.rope_scaling is not None:
            raise ValueError("rope_freq_factors and rope_scaling both rescale RoPE; give one")
        types = self.layer_types
        if not isinstance(types, tuple) or (types and len(types) != self.num_layers) or any(
                t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must be () or one of {list(LAYER_TYPES)} for each of "
                             f"the {self.num_layers} layers, got {types!r}")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be None or a number > 0, got {value!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {list(HIDDEN_ACTS)}, "
                             f"got {self.hidden_act!r}")

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window W, or None for a full-attention layer."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, RopeScaling | None]:
        """Layer ``i``'s RoPE (base, scaling): a sliding layer of a model that
        mixes both kinds uses ``rope_local_theta`` (if set) unscaled; every
        other layer ``rope_theta`` with ``rope_scaling``."""
        if (self.layer_types and self.layer_types[i] == "sliding_attention"
                and self.rope_local_theta is not None):
            return float(self.rope_local_theta), None
        return float(self.rope_theta), self.rope_scaling

    @property
    def sm_scale(self) -> float:
        """The attention score scale: ``query_pre_attn_scalar ** -0.5``, else
        ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def _check_moe(self):
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"num_experts must be an integer >= 0, got {self.num_experts!r}")
        if self.num_experts == 0:
            if self.num_experts_per_tok or self.mlp_only_layers:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok!r}) and "
                                 f"mlp_only_layers ({self.mlp_only_layers!r}) need num_experts > 0")
            return
        check_positive("num_experts_per_tok", self.num_experts_per_tok)
        check_positive("moe_intermediate_size", self.moe_intermediate_size)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        layers = self.mlp_only_layers
        if not isinstance(layers, tuple) or list(layers) != sorted(set(layers)) or any(
                not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"mlp_only_layers must be a sorted tuple of distinct layer indices "
                             f"in [0, {self.num_layers}), got {layers!r}")


# KV cache dtypes (None: the parameter dtype). ``--kv_cache_dtype`` names:
