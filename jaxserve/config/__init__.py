"""Frozen configuration dataclasses for the engine.

The core never reads flags or environment variables: ``jaxserve.main`` turns
flags into these dataclasses, and everything below takes them as arguments.
Vary a config with ``dataclasses.replace``. Each class validates itself in
``__post_init__`` and raises ``ValueError`` naming the offending field and value.

Where each lives:
  ``model.py``   the architecture: ``ModelConfig``, ``RopeScaling``;
  ``engine.py``  how it is served: ``CacheConfig``, ``SchedulerConfig``,
                 ``ParallelConfig``, ``SpeculativeConfig``, ``LoRAConfig``,
                 ``EngineConfig``;
  ``checks.py``  ``check_positive``, shared by both.
Import them from ``jaxserve.config``.
"""

from jaxserve.config.checks import check_positive
from jaxserve.config.engine import (GGUF_BLOCK_METHODS, KV_CACHE_DTYPES, QUANTIZATION_CHOICES,
                                    QUANTIZATION_METHODS, CacheConfig, EngineConfig, LoRAConfig, ParallelConfig,
                                    SchedulerConfig, SpeculativeConfig, kv_cache_dtype_from_name)
from jaxserve.config.model import (HIDDEN_ACTS, LAYER_TYPES, ROPE_SCALING_TYPES, ModelConfig,
                                   RopeScaling)

__all__ = [
    "CacheConfig", "EngineConfig", "GGUF_BLOCK_METHODS", "HIDDEN_ACTS", "KV_CACHE_DTYPES", "LAYER_TYPES",
    "LoRAConfig", "ModelConfig", "ParallelConfig", "QUANTIZATION_CHOICES",
    "QUANTIZATION_METHODS", "ROPE_SCALING_TYPES", "RopeScaling", "SchedulerConfig",
    "SpeculativeConfig", "check_positive", "kv_cache_dtype_from_name",
]
