"""Building the engine's models: the target from its loaded checkpoint,
and the draft model of speculative decoding (``--speculative_method draft``).

``Engine.__init__`` calls ``build_model`` for the target after
``checkpoints.loader.load_for_engine`` has checked and read the checkpoint,
and ``load_draft`` for the draft: ``"self"`` is the target's own weights in
``draft_quantization`` (no second checkpoint: the host params already read
are quantized again, or the random target's weights copied); any other name
is loaded like ``EngineConfig.model``. The draft must have the target's
vocabulary (its Gumbel noise and its tokens are the target's), which is
checked from its config before its weights are read.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve import models
from jaxserve.models import MODEL_CLASSES
from sharding.mesh import validate_mesh_for_model


def build_model(config: EngineConfig, model_config: ModelConfig, params: dict | None,
                orbax_dir: str | None, attention_impl: str, mesh, sharding_rules) -> nnx.Module:
    """The NNX model of ``model_config`` in ``config``'s dtype and
    quantization, filled from ``params`` (HF-named host arrays), restored
    from ``orbax_dir`` straight into its shardings, or randomly initialised
    from ``config.seed`` when both are None.

    Raises:
      ValueError: gguf quantization without GGUF blocks, a quantization the
        model cannot take, a missing or misshapen tensor.
    """
    random_init = params is None and orbax_dir is None
    if random_init and config.quantization == "gguf":
        raise ValueError("quantization='gguf' keeps a GGUF file's own blocks; it needs a "
                         "GGUF checkpoint (random init has none)")
    from checkpoints.loader import check_quantization
    check_quantization(config, model_config)  # (again: model_config may be the caller's)
    model = MODEL_CLASSES[model_config.architecture](
        model_config, dtype=jnp.dtype(config.dtype),
        rngs=nnx.Rngs(config.seed) if random_init else None,
        attention_impl=attention_impl, interpret=config.attention_interpret,
        quantization=config.quantization,
        quantization_group_size=config.quantization_group_size)
    family = models.family(model)
    if orbax_dir is not None:  # each tensor (or quantized part) into its sharding
        from checkpoints.orbax_ckpt import restore_for_model
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
    dcfg = dataclasses.replace(config, quantization=spec.draft_quantization,
                               speculative=dataclasses.replace(spec, method=None))
    draft_orbax = None
    if model_config is not None:
        draft_config, draft_params = model_config, params_override
        if draft_params is None:
            dcfg = dataclasses.replace(dcfg, seed=config.seed + 1)
    elif spec.draft_model == "self":
        draft_config, draft_params, draft_orbax = target_config, params, orbax_dir
        if params is None and orbax_dir is None:
            draft_params = _host_params(target_model)
    else:
        from checkpoints.loader import load_for_engine, load_model_config
        draft_config = load_model_config(spec.draft_model)
        _check_vocab(draft_config, target_config, spec.draft_model)
        loaded = load_for_engine(dataclasses.replace(dcfg, model=spec.draft_model), mesh.shape)
        dcfg = loaded.config
        draft_config, draft_params, draft_orbax = (loaded.model_config, loaded.params,
                                                   loaded.orbax_dir)
    _check_vocab(draft_config, target_config, spec.draft_model or "the draft")
    if draft_config.architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported draft architecture {draft_config.architecture!r}; "
                         f"supported: {sorted(MODEL_CLASSES)}")
    rules = validate_mesh_for_model(mesh.shape, draft_config)
    model = build_model(dcfg, draft_config, draft_params, draft_orbax, attention_impl, mesh,
                        rules)
    return model, rules


def _check_vocab(draft: ModelConfig, target: ModelConfig, name: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {name!r} has a vocabulary of {draft.vocab_size} tokens, "
                         f"the target {target.vocab_size}: speculative decoding needs the "
                         f"same vocabulary and tokenizer")
