"""Requests, sampling parameters and outputs (vLLM-compatible shapes).

Times are ``time.monotonic()`` seconds; derived figures are milliseconds.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's output (vLLM's ``SamplingParams``).

    Attributes:
      max_tokens: most output tokens (>= 1).
      temperature: >= 0; 0 means greedy.
      top_k: keep the k most likely tokens; 0 or -1 turns it off.
      top_p: nucleus mass in (0, 1]; 1 turns it off.
      min_p: in [0, 1]; drop tokens below min_p * the top probability.
      seed: per-request seed; the same seed gives the same tokens alone or
        batched. None draws one from the engine's seed.
      stop: strings that end the output (not included in the text).
      stop_token_ids: ids that end the output (included in token_ids).
      ignore_eos: keep going past EOS.
      min_tokens: EOS and stop ids are suppressed until this many tokens.
      n, logprobs, prompt_logprobs, presence_penalty, frequency_penalty,
      repetition_penalty: accepted only at their defaults for now (n=1,
      logprobs None or 0 = the chosen token's logprob, no penalties); other
      values raise ``ValueError`` rather than being silently ignored.

    Raises:
      ValueError: naming the field and value, from ``__post_init__``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            bad("seed", "must be an integer in [0, 2**32)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative integers")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.n != 1:
            bad("n", "other than 1 is not supported yet")
        if self.logprobs not in (None, 0):
            bad("logprobs", "other than None or 0 (the chosen token's logprob) is not supported yet")
        if self.prompt_logprobs is not None:
            bad("prompt_logprobs", "is not supported yet")
        if self.presence_penalty != 0.0:
            bad("presence_penalty", "is not supported yet (must be 0)")
        if self.frequency_penalty != 0.0:
            bad("frequency_penalty", "is not supported yet (must be 0)")
        if self.repetition_penalty != 1.0:
            bad("repetition_penalty", "is not supported yet (must be 1)")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (monotonic s) and derived latencies (ms) of one request.

    ``queue_ms``: arrival to first scheduled; ``ttft_ms``: arrival to first
    token; ``tpot_ms``: mean time per output token after the first;
    ``e2e_ms``: arrival to finish; ``num_cached_tokens``: prompt tokens served
    from the prefix cache (0 until prefix caching lands).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def queue_ms(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return (self.first_scheduled_time - self.arrival_time) * 1e3

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_time is None:
            return None
        return (self.first_token_time - self.arrival_time) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None \
                or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) * 1e3 / (self.num_output_tokens - 1)

    @property
    def e2e_ms(self) -> float | None:
        if self.finished_time is None:
            return None
        return (self.finished_time - self.arrival_time) * 1e3


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request. ``text``/``token_ids`` are cumulative;
    ``delta_text``/``delta_token_ids`` are what this step added (for streaming)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[float] | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestOutput:
    """The state of a request after a step (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


@dataclasses.dataclass(eq=False)
class Request:
    """Host-side state of one request, owned by the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics = None  # type: ignore[assignment]
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.monotonic())

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
