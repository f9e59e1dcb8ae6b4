"""Building an engine: the one place that loads and validates, once, and
returns its parts (``build_engine`` -> ``EngineParts``).

Order (each check before the work it guards): the persistent compilation
cache; the mesh (built once) and the KV cache dtype on its devices; in a
multi-host job, that the mesh spans the job and every process has the same
setup; the checkpoint, checked against the mesh and the quantization from
its config alone before its weights are read
(``checkpoints.loader.load_for_engine``; a model given directly is checked
here instead), which yields the engine's final config (an Orbax
checkpoint's own quantization); the architecture, the sharding rules and the
attention path (the Pallas kernel's start-up self-check, with a fallback
to XLA: ``attention_check``); the model; the draft model; on one CPU device,
the CPU kernel's column limits for their weight kinds (``kernel_widths``:
this machine's, measured once); the KV pages from the memory budget; the
scheduler, the runner and the speculator.

``build_model`` builds the target from its loaded checkpoint and
``load_draft`` the draft model of speculative decoding
(``--speculative_method draft``): ``"self"`` is the target's own weights in
``draft_quantization`` (no second checkpoint: the host params already read
are quantized again, or the random target's weights copied); any other name
is loaded like ``EngineConfig.model``. The draft must have the target's
vocabulary (its Gumbel noise and its tokens are the target's), which is
checked from its config before its weights are read.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.loader import EngineLoad, check_quantization, load_for_engine, load_model_config
from checkpoints.orbax_ckpt import restore_for_model
from jaxserve import models
from jaxserve.config import GGUF_BLOCK_METHODS, EngineConfig, ModelConfig
from jaxserve.engine import (attention_check, compile_cache, format_choice, kernel_widths,
                             multihost, shapes)
from jaxserve.engine.attention_check import AttentionCheck
from jaxserve.engine.page_table import PageAllocator
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.speculation import DraftModelProposer, Speculator
from jaxserve.models import MODEL_CLASSES
from pallas_kernels.ragged_paged_attention.quant import check_kv_cache_dtype
from sharding.mesh import make_mesh, validate_mesh_for_model


@dataclasses.dataclass
class EngineParts:
    """An engine's checked config and its parts (``build_engine``).

    Attributes:
      config: the engine config the parts were built from (an Orbax
        checkpoint's own quantization filled in).
      mesh: the device mesh; model_config, tokenizer, chat_template: the model's.
      attention_impl: ``"pallas"`` or ``"xla"`` (``"auto"`` resolved).
      max_model_len: longest sequence, tokens.
      allocator, scheduler, runner: the KV page pool, the scheduler, the
        target's ``ModelRunner``.
      speculator: the ``Speculator``, or None without speculation.
      eos_token_ids: the model's EOS ids and the tokenizer's.
      attention_check: the Pallas kernel's start-up self-check (None when
        none ran: the XLA path chosen, or CPU).
    """

    config: EngineConfig
    mesh: jax.sharding.Mesh
    model_config: ModelConfig
    tokenizer: object
    chat_template: str | None
    attention_impl: str
    max_model_len: int
    allocator: PageAllocator
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Speculator | None
    eos_token_ids: frozenset[int]
    attention_check: AttentionCheck | None = None


def build_engine(config: EngineConfig, *, model_config: ModelConfig | None = None,
                 params: dict | None = None, tokenizer=None, chat_template: str | None = None,
                 devices: Sequence[jax.Device] | None = None, draft_parts: dict | None = None,
                 spec_policy=None) -> EngineParts:
    """Load, check and build everything ``Engine`` wires together (the
    module docstring has the order). Arguments as ``Engine``'s.

    Raises:
      ValueError: unknown model alias, missing file, bad config, a mesh whose
        size differs from the number of devices (before any weights are read)
        or that cannot split the model (before the weights reach the devices),
        a draft model whose vocabulary differs from the target's, or
        speculation in a multi-host job.
    """
    if config.compilation_cache_dir:  # process-wide, first folder wins: see compile_cache
        compile_cache.enable(config.compilation_cache_dir)
    if devices is None and config.parallel.num_devices == 1:
        devices = jax.devices()[:1]
    mesh = make_mesh(config.parallel.mesh_shape, devices)
    # An fp8 KV cache where the device has no fp8 fails before any weights load.
    check_kv_cache_dtype(config.cache.dtype or config.dtype, mesh.devices.flat[0])
    _check_job(config, mesh, model_config)
    if config.quantization == "auto":  # measured once per machine (format_choice)
        config = (format_choice.resolve(config, load_model_config(config.model))
                  if model_config is None else dataclasses.replace(config, quantization="none"))
    if model_config is None:  # alias, .gguf, HF or Orbax folder: checked, then loaded
        loaded, checked = load_for_engine(config, mesh.shape), True
    else:
        loaded = EngineLoad(config, model_config, params, tokenizer, chat_template, None)
        checked = False
    parts = _assemble(loaded, checked, mesh, dict(draft_parts or {}), spec_policy)
    # The load's host buffers (HF-named params, unstacked layers) are garbage
    # now (only _assemble's frame held them): hand them to the OS.
    loaded = params = draft_parts = None  # noqa: F841
    compile_cache.trim_host_heap()
    return parts


def _check_job(config: EngineConfig, mesh, model_config: ModelConfig | None) -> None:
    """A multi-host job: no speculation, a mesh over every device, and the
    same setup on every process (``multihost.check_same_setup``)."""
    if jax.process_count() > 1 and config.speculative.method is not None:
        raise ValueError(f"speculative decoding ({config.speculative.method!r}) runs in "
                         f"one-process jobs only; this job has {jax.process_count()}")
    if jax.process_count() > 1 and config.lora is not None:
        raise ValueError("LoRA adapters are served in one-process jobs only; this job has "
                         f"{jax.process_count()}")
    if jax.process_count() > 1:  # every process of a job must build the same engine
        if mesh.devices.size != jax.device_count():
            raise ValueError(f"a multi-host mesh must span every device of the job: --mesh "
                             f"{dict(mesh.shape)} has {mesh.devices.size} devices, "
                             f"the job {jax.device_count()} ({jax.process_count()} processes "
                             f"x {jax.local_device_count()})")
        multihost.check_same_setup(dict(
            engine={k: v for k, v in dataclasses.asdict(config).items()
                    if k not in ("model", "compilation_cache_dir")},
            model=dataclasses.asdict(model_config or load_model_config(config.model)),
            mesh=dict(mesh.shape)))


def resolve_attention_impl(config: EngineConfig, model_configs: Sequence[ModelConfig], *,
                           num_pages: int | None = None) -> tuple[str, AttentionCheck | None]:
    """``config.attention_impl`` resolved, after the Pallas kernel's start-up
    self-check where Pallas would serve (``attention_check.choose_attention_impl``):
    ``"auto"`` is ``"pallas"`` on GPU/TPU when the check passes on
    ``model_configs``, else ``"xla"`` (logged and counted). ``num_pages``:
    the KV cache's pages per layer, whose shape the kernel must be able to
    address (``attention_check.cache_refusal``).

    Returns:
      (``"pallas"`` or ``"xla"``, the ``AttentionCheck`` or None).

    Raises:
      ValueError: ``"pallas"`` on a backend without its lowering, unless
        ``attention_interpret``.
      AttentionCheckError: ``"pallas"`` (explicit) whose check failed.
    """
    return attention_check.choose_attention_impl(config, model_configs, num_pages=num_pages)


def _draft_model_config(config: EngineConfig, draft_parts: dict) -> ModelConfig | None:
    """The draft model's config (checked with the target's attention), or None."""
    spec = config.speculative
    if spec.method != "draft":
        return None
    if draft_parts.get("model_config") is not None:
        return draft_parts["model_config"]
    if spec.draft_model == "self":
        return None  # the target's own shapes
    return load_model_config(spec.draft_model)


def _assemble(loaded: EngineLoad, quantization_checked: bool, mesh, draft_parts: dict,
              spec_policy) -> EngineParts:
    """The parts of a loaded (or given) model: ``loaded.config`` is the
    engine's final config from here on."""
    config, model_config = loaded.config, loaded.model_config
    if model_config.architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {model_config.architecture!r}; "
                         f"supported: {sorted(MODEL_CLASSES)}")
    sharding_rules = validate_mesh_for_model(mesh.shape, model_config)
    draft_config = _draft_model_config(config, draft_parts)
    cache, sc = config.cache, config.scheduler
    kv_dtype = jnp.dtype(cache.dtype or config.dtype)
    # The KV caches' models: the target, and a draft model (its own config, or
    # the target's shapes for draft_model="self"); they share one page count.
    cache_configs = [model_config] + (
        [draft_config or model_config] if config.speculative.method == "draft" else [])
    platform = jax.default_backend()
    page_bytes = sum(ModelRunner.kv_bytes_per_page(mc, cache.page_size, kv_dtype, platform)
                     for mc in cache_configs)
    num_pages = cache.num_pages or max(1, cache.memory_bytes // page_bytes)
    impl, check = resolve_attention_impl(
        config, [model_config] + ([draft_config] if draft_config is not None else []),
        num_pages=num_pages)
    # Processes whose self-checks disagree would compile different steps (a hang).
    multihost.check_same_setup(dict(attention_impl=impl))
    model = build_model(config, model_config, loaded.params, loaded.orbax_dir, impl, mesh,
                        sharding_rules, quantization_checked=quantization_checked)
    draft = None
    if config.speculative.method == "draft":  # its vocabulary is checked before it loads
        draft = load_draft(config, model_config, model, loaded.params, loaded.orbax_dir, impl,
                           mesh, model_config=draft_parts.get("model_config"),
                           params_override=draft_parts.get("params"))
    # Before any program traces: the CPU kernel's column limits for the kinds these
    # weights use, this machine's (measured once, cached; kernel_widths).
    if mesh.size == 1:
        kernel_widths.resolve(model, model_config, config.quantization, config.dtype)
        if draft is not None:
            kernel_widths.resolve(draft[0], draft_config or model_config,
                                  config.speculative.draft_quantization, config.dtype)
    max_model_len = sc.max_model_len or model_config.max_position_embeddings
    allocator = PageAllocator(num_pages, cache.page_size, cache.enable_prefix_caching)
    scheduler = Scheduler(sc, allocator, max_model_len)
    # Speculation: a full batch still has max_num_seqs sampling rows for drafts.
    rows = sc.max_num_seqs * (2 if config.speculative.method else 1)
    max_tokens = shapes.max_step_tokens(sc.max_num_batched_tokens, sc.max_num_seqs,
                                        max_model_len, sc.enable_chunked_prefill)
    runner = ModelRunner(model, num_pages=num_pages, page_size=cache.page_size,
                         max_model_len=max_model_len, kv_dtype=kv_dtype, max_num_seqs=rows,
                         mesh=mesh, rules=sharding_rules, scan_layers=config.scan_layers,
                         max_num_tokens=max_tokens)
    speculator = None
    if config.speculative.method is not None:
        proposer = None
        if draft is not None:
            proposer = DraftModelProposer(ModelRunner(
                draft[0], num_pages=num_pages, page_size=cache.page_size,
                max_model_len=max_model_len, kv_dtype=kv_dtype, max_num_seqs=sc.max_num_seqs,
                mesh=mesh, rules=draft[1], scan_layers=config.scan_layers,
                max_num_tokens=max_tokens), sc.max_num_batched_tokens)
        speculator = Speculator(config.speculative, runner.max_rows, proposer, spec_policy)
    tokenizer = loaded.tokenizer
    eos = frozenset(model_config.eos_token_ids) | (
        frozenset([tokenizer.eos_token_id]) if tokenizer is not None
        and tokenizer.eos_token_id is not None else frozenset())
    return EngineParts(config, mesh, model_config, tokenizer, loaded.chat_template, impl,
                       max_model_len, allocator, scheduler, runner, speculator, eos, check)


def build_model(config: EngineConfig, model_config: ModelConfig, params: dict | None,
                orbax_dir: str | None, attention_impl: str, mesh, sharding_rules, *,
                quantization_checked: bool = False) -> nnx.Module:
    """The NNX model of ``model_config`` in ``config``'s dtype and
    quantization, filled from ``params`` (HF-named host arrays), restored
    from ``orbax_dir`` straight into its shardings, or randomly initialised
    from ``config.seed`` when both are None. ``quantization_checked``:
    ``load_for_engine`` has checked the quantization against this model
    already (else it is checked here, once).

    Raises:
      ValueError: gguf quantization without GGUF blocks, a quantization the
        model cannot take, a missing or misshapen tensor.
    """
    random_init = params is None and orbax_dir is None
    if random_init and config.quantization in GGUF_BLOCK_METHODS:
        raise ValueError(f"quantization={config.quantization!r} keeps a GGUF file's own blocks; it needs a "
                         "GGUF checkpoint (random init has none)")
    if not quantization_checked:
        check_quantization(config, model_config)
    model = MODEL_CLASSES[model_config.architecture](
        model_config, dtype=jnp.dtype(config.dtype),
        rngs=nnx.Rngs(config.seed) if random_init else None,
        attention_impl=attention_impl, interpret=config.attention_interpret,
        quantization=config.quantization,
        quantization_group_size=config.quantization_group_size, lora=config.lora,
        quantize_lm_head=config.quantize_lm_head)
    family = models.family(model)
    if orbax_dir is not None:  # each tensor (or quantized part) into its sharding
        params = restore_for_model(orbax_dir, family.hf_params(model), mesh,
                                   sharding_rules, dtype=jnp.dtype(config.dtype))
    if params is not None:
        family.load_params(model, params)
    return model


def _host_params(model) -> dict:
    """HF-named f32 host arrays of an unquantized model's weights."""
    family = models.family(model)
    out = {}
    for name, (p, expert) in family.hf_params(model).items():
        if not isinstance(p, nnx.Param):
            raise ValueError(f"draft_model='self' of a quantized random model: {name} is "
                             f"{type(p).__name__}; give the target's params")
        arr = np.asarray(p.value)
        out[name] = arr if expert is None else arr[expert]
    return out


def load_draft(config: EngineConfig, target_config: ModelConfig, target_model, params,
               orbax_dir, attention_impl: str, mesh, *, model_config: ModelConfig | None = None,
               params_override: dict | None = None):
    """The draft model of ``config.speculative`` on ``mesh``.

    Args:
      config: the engine's config (``speculative.draft_model``, ``.draft_quantization``).
      target_config, target_model, params, orbax_dir: the target's config,
        built model, host params (or None) and Orbax folder (or None), which
        ``"self"`` reuses.
      model_config, params_override: a draft given directly (tests): its
        config and HF-named params (None: random init from ``config.seed + 1``).

    Returns:
      (draft model, its ``ShardingRules`` on ``mesh``).

    Raises:
      ValueError: a vocabulary different from the target's (before the
        draft's weights are read), a mesh that cannot split it, a bad checkpoint.
    """
    spec = config.speculative
    dcfg = dataclasses.replace(config, lora=None,  # the draft runs without adapters
                               quantization=spec.draft_quantization,
                               speculative=dataclasses.replace(spec, method=None))
    draft_orbax, checked = None, False
    if model_config is not None:
        draft_config, draft_params = model_config, params_override
        if draft_params is None:
            dcfg = dataclasses.replace(dcfg, seed=config.seed + 1)
    elif spec.draft_model == "self":
        draft_config, draft_params, draft_orbax = target_config, params, orbax_dir
        if params is None and orbax_dir is None:
            draft_params = _host_params(target_model)
    else:
        draft_config = load_model_config(spec.draft_model)
        _check_vocab(draft_config, target_config, spec.draft_model)
        loaded = load_for_engine(dataclasses.replace(dcfg, model=spec.draft_model), mesh.shape)
        dcfg, checked = loaded.config, True
        draft_config, draft_params, draft_orbax = (loaded.model_config, loaded.params,
                                                   loaded.orbax_dir)
    _check_vocab(draft_config, target_config, spec.draft_model or "the draft")
    if draft_config.architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported draft architecture {draft_config.architecture!r}; "
                         f"supported: {sorted(MODEL_CLASSES)}")
    rules = validate_mesh_for_model(mesh.shape, draft_config)
    model = build_model(dcfg, draft_config, draft_params, draft_orbax, attention_impl, mesh,
                        rules, quantization_checked=checked)
    return model, rules


def _check_vocab(draft: ModelConfig, target: ModelConfig, name: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {name!r} has a vocabulary of {draft.vocab_size} tokens, "
                         f"the target {target.vocab_size}: speculative decoding needs the "
                         f"same vocabulary and tokenizer")
