"""Frozen configuration dataclasses for the engine.

The core never reads flags or environment variables: ``jaxserve.main`` turns
flags into these dataclasses, and everything below takes them as arguments.
Vary a config with ``dataclasses.replace``. Each class validates itself in
``__post_init__`` and raises ``ValueError`` naming the offending field and value.
"""

from __future__ import annotations

import dataclasses


def check_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    """Check a config field is a positive int (or None with ``allow_none``).

    Raises:
      ValueError: it is not (names the field and the value).
    """
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


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
            check_positive("original_max_position_embeddings", self.original_max_position_embeddings)
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
        """The attention score scale: ``query_pre_attn_scalar ** -0.5``, else ``head_dim ** -0.5``."""
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
# auto -> None, fp8_e4m3 -> "float8_e4m3fn".
KV_CACHE_DTYPES = (None, "float32", "bfloat16", "float16", "int8", "float8_e4m3fn")


def kv_cache_dtype_from_name(name: str) -> str | None:
    """``CacheConfig.dtype`` of a ``--kv_cache_dtype`` (vLLM) name: ``"auto"``
    -> None, ``"fp8_e4m3"`` / ``"fp8"`` -> ``"float8_e4m3fn"``, others unchanged.

    Raises:
      ValueError: an unknown name (names the value and the choices).
    """
    value = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn"}.get(name, name)
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, float16, "
                         f"int8, fp8_e4m3; got {name!r}")
    return value

# Weight quantization methods (``jaxserve.models.quant`` defines each).
QUANTIZATION_METHODS = ("none", "int8", "w8a8", "int4", "gguf")
# ``EngineConfig.quantization`` also takes "auto": the fastest of the formats that keep
# the checkpoint's numerics, measured once per machine (``jaxserve.engine.format_choice``).
QUANTIZATION_CHOICES = ("auto",) + QUANTIZATION_METHODS


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The preallocated paged KV cache.

    Attributes:
      page_size: tokens per page L.
      num_pages: pages P to allocate. When None, sized from ``memory_bytes``.
      memory_bytes: KV budget in bytes (K and V of all layers together), used when
        ``num_pages`` is None. Default 512 MiB (SmolLM2-135M f32: 728 pages
        of 16 tokens, 11,648 tokens), what a CPU start holds beside the
        weights; raise it on an accelerator.
      dtype: KV cache dtype name; None means the model's parameter dtype
        ("auto"). ``"int8"`` stores int8 K/V with one f32 scale per token per
        kv head beside its page; ``"float8_e4m3fn"`` stores fp8 (GPU/TPU);
        ``"bfloat16"``, ``"float32"``, ``"float16"`` store that dtype.
      enable_prefix_caching: reuse the K/V of full pages whose chained hash
        (previous page's hash, this page's token ids) matches a new request's
        prefix. On by default, as in vLLM v1.
    """

    page_size: int = 16
    num_pages: int | None = None
    memory_bytes: int = 512 << 20
    dtype: str | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        check_positive("page_size", self.page_size)
        check_positive("num_pages", self.num_pages, allow_none=True)
        check_positive("memory_bytes", self.memory_bytes)
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.dtype!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
      max_num_seqs: most sequences running at once (decode batch ceiling).
      max_num_batched_tokens: token budget of one step: decode tokens (one per
        running sequence) plus prefill tokens.
      max_model_len: longest sequence (prompt + output), tokens. None means the
        model's ``max_position_embeddings``.
      enable_chunked_prefill: split a prompt longer than the step's remaining
        budget into chunks that run beside the decodes (vLLM/Sarathi-Serve).
        When off, a prompt is prefilled whole; one longer than the budget runs
        in a step with no other prefill (beside the decodes).
      max_forced_drafts: most tokens a constrained sequence's grammar forces
        that ride one step as free drafts (``engine.constraints``); 0 turns
        forced drafting off.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    max_forced_drafts: int = 8

    def __post_init__(self):
        if isinstance(self.max_forced_drafts, bool) or not isinstance(
                self.max_forced_drafts, int) or self.max_forced_drafts < 0:
            raise ValueError(f"max_forced_drafts must be an integer >= 0, got "
                             f"{self.max_forced_drafts!r}")
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("max_model_len", self.max_model_len, allow_none=True)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh: sizes of its ``(dp, tp, ep)`` axes.

    ``sharding.mesh.parse_mesh_spec`` reads them from a ``"tp=2,ep=2"``
    string (``--mesh``, ``LLM(mesh=...)``); ``from_mesh_shape`` builds this
    from its dict. The all-ones default runs on one device (the first);
    any other shape runs on exactly as many devices as its product (all of
    ``jax.devices()`` unless the engine is given ``devices``).

    Attributes:
      tensor_parallel_size: tp; the weights' heads, MLP width and vocab and the
        KV cache's kv heads are split over it where tp divides them
        (``sharding.rules.ShardingRules.for_model``).
      data_parallel_size: dp; nothing is split over it yet (replicated).
      expert_parallel_size: ep; an MoE model's experts are split over it
        (``jaxserve.models.moe``); everything else is replicated along it.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self):
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        check_positive("data_parallel_size", self.data_parallel_size)
        check_positive("expert_parallel_size", self.expert_parallel_size)

    @classmethod
    def from_mesh_shape(cls, shape: dict[str, int]) -> ParallelConfig:
        """From ``{"dp": .., "tp": .., "ep": ..}`` (missing axes are 1)."""
        return cls(tensor_parallel_size=shape.get("tp", 1),
                   data_parallel_size=shape.get("dp", 1),
                   expert_parallel_size=shape.get("ep", 1))

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{"dp": .., "tp": .., "ep": ..}``, the mesh axes in order."""
        return {"dp": self.data_parallel_size, "tp": self.tensor_parallel_size,
                "ep": self.expert_parallel_size}

    @property
    def num_devices(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size * self.expert_parallel_size


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``jaxserve.engine.spec_decode``).

    Attributes:
      method: None (off), ``"ngram"`` (prompt lookup) or ``"draft"`` (a draft
        model in the same engine).
      num_speculative_tokens: k, most drafts verified per sequence per step;
        the policy picks 0..k each step.
      prompt_lookup_min, prompt_lookup_max: n-gram lengths ``ngram`` matches.
      draft_model: ``"self"`` (the target's own checkpoint, typically with
        ``draft_quantization``) or any model string ``EngineConfig.model``
        accepts; it must share the target's vocabulary.
      draft_quantization: weight format of the draft (``QUANTIZATION_METHODS``).
      adaptive: let the policy choose k per step (False: always k, tests).
    """

    method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    draft_model: str | None = None
    draft_quantization: str = "none"
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative method must be None, 'ngram' or 'draft', "
                             f"got {self.method!r}")
        check_positive("num_speculative_tokens", self.num_speculative_tokens)
        check_positive("prompt_lookup_min", self.prompt_lookup_min)
        check_positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model ('self' or a model)")
        if self.draft_quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"draft_quantization must be one of {list(QUANTIZATION_METHODS)}, "
                             f"got {self.draft_quantization!r}")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (``jaxserve.models.lora``): ``max_loras`` adapter
    slots on device (slot 0 is the base model, slots 1..max_loras hold
    adapters), every adapter's rank zero-padded to ``max_lora_rank``."""

    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self):
        check_positive("max_loras", self.max_loras)
        check_positive("max_lora_rank", self.max_lora_rank)
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank must be <= 512, got {self.max_lora_rank}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs.

    Attributes:
      model: alias (``"smollm2-135m"``), path to a ``.gguf`` file, an HF model
        folder (``config.json`` + safetensors) or an Orbax checkpoint folder
        (``model_config.json`` + ``params/``); see ``checkpoints.loader``.
      dtype: parameter and activation dtype name (``"float32"`` on CPU,
        ``"bfloat16"`` on GPU/TPU).
      seed: seed for requests that give none.
      compilation_cache_dir: persistent XLA compilation cache folder, or None
        (none set up by this engine). None here, where tests build engines
        directly; ``LLM`` and the CLI default to ``$JAXSERVE_CACHE/xla``
        (``jaxserve.engine.compile_cache.default_dir``). Process-wide: the
        first folder set in a process is the one used.
      attention_impl: "auto" (Pallas on GPU/TPU, XLA on CPU), "pallas" or "xla".
      scan_layers: run the decoder layers as one scanned layer body
        (``jax.lax.scan`` over stacked layer parameters; one body per run of
        layers of the same structure: ``jaxserve.models.stack``), so a step
        program's size and compile time do not grow with depth. False
        unrolls every layer into the step program (to compare, or debug).
      attention_interpret: run the Pallas kernel in the Pallas interpreter
        (lets ``attention_impl="pallas"`` run on CPU; slow, for tests).
      parallel: the device mesh (``ParallelConfig``); default one device.
      async_scheduling: plan and launch step N+1 before step N's tokens reach
        the host, so the device is not idle while the host schedules, builds
        metadata and detokenizes (``jaxserve.engine.async_step``; vLLM v1's
        async scheduling). Outputs are the same as with synchronous steps;
        steps whose plan needs step N's tokens on the host (penalties,
        prompt logprobs), and every step of a multi-host job, run
        synchronously. False: every step is synchronous.
      quantization: weight format of the linear projections (q/k/v/o,
        gate/up/down, experts): ``"none"``, ``"int8"`` (weight-only, per output
        channel, symmetric), ``"w8a8"`` (int8 weights x per-token int8
        activations, int32 accumulation), ``"int4"`` (weight-only, groups of
        ``quantization_group_size`` along the input dim, scale and zero point),
        ``"gguf"`` (a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks, kept as they
        are), or ``"auto"`` (the engine picks: on CPU the fastest of the formats
        that keep the checkpoint's numerics, measured once per machine; see
        ``jaxserve.engine.format_choice``); the LM head too unless
        ``quantize_lm_head`` is False. Embeddings, norms, the MoE router and
        attention stay precise. See ``jaxserve.models.quant``.
      quantization_group_size: input elements per scale of ``"int4"``.
      quantize_lm_head: under a ``quantization`` other than ``"none"``, the
        LM head [V, D] is a weight of that format too (int8/w8a8 per output
        channel, int4 its groups, gguf the file's blocks of ``output.weight``,
        or of ``token_embd.weight`` when tied); a tied head is then a second,
        quantized copy beside the exact f32 embedding. False keeps the head
        in ``dtype`` (read from the embedding when tied).
      speculative: speculative decoding (``SpeculativeConfig``); off by default.
      lora: multi-LoRA slots (``LoRAConfig``); None: LoRA off (no adapter
        parameters, no per-token slot input).
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    seed: int = 0
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compilation_cache_dir: str | None = None
    attention_impl: str = "auto"
    scan_layers: bool = True
    attention_interpret: bool = False
    async_scheduling: bool = True
    quantization: str = "none"
    quantization_group_size: int = 32
    quantize_lm_head: bool = True
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    lora: LoRAConfig | None = None

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_impl not in ("auto", "pallas", "xla"):
            raise ValueError(f"attention_impl must be auto, pallas or xla, "
                             f"got {self.attention_impl!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        check_positive("quantization_group_size", self.quantization_group_size)
