"""``EngineStats``: a snapshot of the engine for metrics (``Engine.stats``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    """A snapshot of the engine for metrics (counts; tokens where named).

    Attributes:
      num_running, num_waiting, num_paused: sequences (choices) in each
        state (paused: set aside by ``pause``, holding no slot or page).
      pages_total, pages_used, pages_free: KV pages; free includes cached
        pages no sequence holds (they are evicted on demand).
      pages_cached: pages findable in the prefix cache.
      prefix_cache_queries, prefix_cache_hits: prompt tokens looked up and
        served from the cache; ``prefix_cache_hit_rate`` = hits / queries.
      num_preemptions: sequences preempted so far.
      prompt_tokens, generation_tokens: prompt tokens computed (cache hits
        excluded; recomputation after preemption counts again) and tokens
        sampled, since start.
      num_steps: steps run.
      num_compilations: XLA programs traced and compiled (or loaded from the
        persistent cache) since start: one per new bucket shape. Each stays
        in host memory (40-55 MB for SmolLM2 on CPU), so a rising count is
        what a rising RSS under varied traffic comes from.
      spec_num_drafts, spec_num_draft_tokens, spec_num_accepted_tokens:
        speculative decoding: verification rows that carried drafts, draft
        tokens verified, drafts accepted (0 without speculation).
      spec_accepted_per_position: drafts accepted at each draft position
        0..k-1; spec_mean_acceptance_length: 1 + accepted / drafts (tokens
        per verification row, vLLM's figure); spec_k: the policy's latest k.
      num_forced_tokens: output tokens of constrained sequences that a
        grammar forced and that rode a step as free drafts
        (``constraints.forced_drafts``).
      structured_requests: requests given token constraints (structured
        outputs, allowed_token_ids, bad_words).
      grammar_compiled, grammar_compile_seconds, grammar_cache_hits: the
        grammar backend's compiles (cache misses), their wall seconds (sum),
        and cache hits (``jaxserve.engine.structured``).
      mask_fills, mask_fill_seconds: bitmask rows filled by grammar matchers
        on the host, and their wall seconds (sum).
      attention_impl: the attention path serving ("pallas" or "xla").
      attention_fallback: why the Pallas kernel's start-up self-check sent
        the engine to the XLA path ("compile_error" or "mismatch"), or ""
        (``jaxserve.engine.attention_check``).
    """

    num_running: int
    num_waiting: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    num_compilations: int = 0
    num_paused: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_mean_acceptance_length: float = 0.0
    spec_k: int = 0
    num_forced_tokens: int = 0
    structured_requests: int = 0
    grammar_compiled: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    mask_fills: int = 0
    mask_fill_seconds: float = 0.0
    attention_impl: str = ""
    attention_fallback: str = ""


__all__ = ["EngineStats"]
