"""Requests and their outputs (vLLM-compatible shapes). What a request asks
of sampling is ``jaxserve.engine.sampling_params``.

Times are ``time.monotonic()`` seconds; derived figures are milliseconds.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxserve.engine.sampling_params import SamplingParams

# An output token sampled by a step that was launched but whose result has not
# reached the host yet (async scheduling, ``jaxserve.engine.async_step``).
PLACEHOLDER_ID = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (monotonic s) and derived latencies (ms) of one request.

    ``queue_ms``: arrival to first scheduled; ``prefill_ms``: first scheduled
    to first token (the prompt's prefill, all its chunks, plus any steps it
    waited out between chunks), so ``ttft_ms = queue_ms + prefill_ms``;
    ``ttft_ms``: arrival to first token; ``tpot_ms``: mean time per output
    token after the first, also named by its phase as ``decode_ms_per_token``;
    ``e2e_ms``: arrival to finish; ``num_cached_tokens``: prompt tokens served
    from the prefix cache at first scheduling; ``num_draft_tokens`` /
    ``num_accepted_tokens``: speculative drafts verified for it and accepted
    (``spec_acceptance_rate`` their ratio); ``disagg_route``: on a
    disaggregated decode worker (``jaxserve.disagg``), how the request was
    served (``"handoff"``: prefilled by a prefill worker, its KV pulled;
    otherwise the reason it ran locally: ``"short"``, ``"cached"``,
    ``"unsupported"``, ``"no_worker"``, or ``"fallback:<reason>"`` after a
    failed handoff), None elsewhere; ``kv_transfer_ms`` / ``kv_transfer_bytes``:
    the KV pull of a handoff (pull call to arrays in this worker's cache).
    Each is None until its
    timestamps exist (``tpot_ms`` also below two output tokens). With ``n > 1`` the choices share
    one ``RequestMetrics``: first token is the earliest choice's, finish the
    last one's, ``num_output_tokens`` the longest choice's.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    disagg_route: str | None = None
    kv_transfer_ms: float | None = None
    kv_transfer_bytes: int = 0

    @property
    def kv_handoff(self) -> bool:
        """The prompt was prefilled by a prefill worker and its KV pulled here."""
        return self.disagg_route == "handoff"

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens of this request's speculation (None
        when nothing was drafted for it)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def queue_ms(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return (self.first_scheduled_time - self.arrival_time) * 1e3

    @property
    def prefill_ms(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return (self.first_token_time - self.first_scheduled_time) * 1e3

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
    def decode_ms_per_token(self) -> float | None:
        """The decode phase's ms per output token: ``tpot_ms`` by its phase's name."""
        return self.tpot_ms

    @property
    def e2e_ms(self) -> float | None:
        if self.finished_time is None:
            return None
        return (self.finished_time - self.arrival_time) * 1e3


@dataclasses.dataclass
class Logprob:
    """A token's log probability (natural log, raw model distribution), its
    1-based rank in that distribution and its text (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the chosen (or prompt) token and the top candidates.
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request. ``text``/``token_ids`` are cumulative;
    ``delta_text``/``delta_token_ids`` are what this step added (for streaming).

    ``logprobs`` (when asked): one dict per output token holding the sampled
    token and the top ``SamplingParams.logprobs`` candidates.
    ``cumulative_logprob``: sum of the sampled tokens' raw logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
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
    # One entry per prompt token when asked: None for the first, then the
    # prompt token's and the top candidates' logprobs.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's field)."""
        return self.metrics.num_cached_tokens


@dataclasses.dataclass(eq=False)
class Request:
    """Host-side state of one sequence (one choice of a request), owned by
    the scheduler.

    ``group_id`` is the user's request id; with ``n > 1`` each choice is its own
    ``Request`` (``index`` 0..n-1) and choices 1.. carry ``fork_of`` = choice 0,
    whose prompt pages they share once it is prefilled. ``page_hashes`` are the
    chained hashes of the sequence's full pages (computed lazily);
    ``num_registered_pages`` of its pages are in the prefix cache.

    ``num_computed_tokens`` counts the tokens of every launched step, finished
    or not; a launched step that samples a token appends ``PLACEHOLDER_ID`` to
    ``output_token_ids`` at once (``num_placeholders`` of them, always the
    last ones: at most one per step in flight), which the engine replaces by
    the token when the step's results reach the host. So the scheduler can
    plan the next step (pages, positions, the PRNG fold, min_tokens) before
    they do. ``host_output_ids`` are the output tokens without them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics = None  # type: ignore[assignment]
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    group_id: str | None = None
    index: int = 0
    fork_of: Request | None = None
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_registered_pages: int = 0
    num_placeholders: int = 0
    num_draft_computed: int = 0  # tokens whose K/V the draft model's cache holds
    # A prefill worker's request (``jaxserve.disagg``): when it finishes, its
    # pages stay held (``Scheduler.held``) for a decode worker to pull.
    hold_kv: bool = False
    # The host-side token mask of a constrained request (structured outputs,
    # allowed_token_ids, bad_words): a ``token_mask.TokenConstraint``, one per
    # sequence (choices advance separately); None: unconstrained.
    constraint: object | None = None
    # LoRA: its ``adapters.Adapter`` (None: the base model) and, while
    # running, the slot it pinned (0: none).
    adapter: object | None = None
    lora_slot: int = 0

    def __post_init__(self):
        if self.group_id is None:
            self.group_id = self.request_id
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.monotonic())

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, placeholders included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def host_output_ids(self) -> list[int]:
        """The output tokens that have reached the host (no placeholder)."""
        return self.output_token_ids[:len(self.output_token_ids) - self.num_placeholders]

    def add_placeholder(self) -> None:
        """A launched step samples this sequence's next token."""
        self.output_token_ids.append(PLACEHOLDER_ID)
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> int:
        """The oldest placeholder's token has reached the host; returns the
        number of output tokens on the host now."""
        i = len(self.output_token_ids) - self.num_placeholders
        assert self.num_placeholders > 0 and self.output_token_ids[i] == PLACEHOLDER_ID
        self.output_token_ids[i] = token_id
        self.num_placeholders -= 1
        return i + 1

    def drop_placeholders(self) -> None:
        """Forget tokens still in flight (the sequence finished or is re-queued)."""
        if self.num_placeholders:
            del self.output_token_ids[-self.num_placeholders:]
            self.num_placeholders = 0

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0


def decode_ready(r: Request) -> bool:
    """``r`` is running, its only uncomputed token is its last, and that
    token is on the host (no step of it in flight): it can be drafted for."""
    return (r.status is RequestStatus.RUNNING and not r.num_placeholders
            and r.num_tokens - r.num_computed_tokens == 1)
