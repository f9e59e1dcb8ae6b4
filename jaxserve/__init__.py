"""jaxserve: a JAX/XLA serving runtime for large language models."""

from jaxserve.engine.engine import LLM, Engine
from jaxserve.engine.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "RequestOutput", "CompletionOutput"]
