"""How one engine serves: the KV cache, the scheduler's limits, the mesh,
speculative decoding, LoRA slots, and the ``EngineConfig`` that holds them all.

Each dataclass validates itself in ``__post_init__`` (``ValueError`` naming the
field and value).
"""

from __future__ import annotations

import dataclasses

from jaxserve.config.checks import check_positive


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
QUANTIZATION_METHODS = ("none", "int8", "w8a8", "int4", "gguf", "gguf_a16", "gguf_a8")
# The methods that keep a GGUF file's own Q8_0 / Q4_0 / Q4_1 blocks: "gguf" with precise
# activations, "gguf_a16" / "gguf_a8" with the activations quantized to int16 / int8 in
# blocks of 32 along the input dim (gguf_a8 as llama.cpp computes those blocks;
# ``jaxserve.models.quant``).
GGUF_BLOCK_METHODS = ("gguf", "gguf_a16", "gguf_a8")
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
        are), ``"gguf_a16"`` (those blocks, with the activations quantized to
        int16 per token in blocks of 32 inputs: integer dot products, PPL and
        greedy tokens as ``"gguf"``'s within the eval's resolution),
        ``"gguf_a8"`` (the same with int8 blocks, as llama.cpp multiplies
        them),
        or ``"auto"`` (the engine picks: on CPU the fastest of the formats
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
