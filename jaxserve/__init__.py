"""jaxserve: a JAX/XLA serving runtime for large language models.

The public names load on first use (PEP 562), so importing a light module
such as ``jaxserve.server.tokenize_pool`` (in a tokenizer worker process) or
``jaxserve.main`` does not import JAX.
"""

import importlib

_EXPORTS = {"LLM": "jaxserve.engine.llm", "Engine": "jaxserve.engine.engine",
            "SamplingParams": "jaxserve.engine.request",
            "RequestOutput": "jaxserve.engine.request",
            "CompletionOutput": "jaxserve.engine.request",
            "LoRARequest": "jaxserve.engine.adapters"}

__all__ = ["LLM", "CompletionOutput", "Engine", "LoRARequest", "RequestOutput",
           "SamplingParams"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
