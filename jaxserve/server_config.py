"""The serving process's configuration: the API servers' limits and
transport (``ServerConfig``) and disaggregated prefill/decode
(``DisaggConfig``). Frozen dataclasses checked in ``__post_init__``
(``ValueError`` naming the field and value), like ``jaxserve.config``'s
engine configs, which they sit beside.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import check_positive


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    """Per-stream output bounds (the rule: ``jaxserve.server.backpressure``).

    Args:
      buffer_outputs: most ``RequestOutput``s waiting unread in one engine
        request's queue (one a step); one more aborts the request.
      stall_timeout_s: seconds output may wait while the consumer takes
        nothing, before the request is aborted; None turns the check off.
      pause_after_s: seconds output may wait unread before the request is
        paused (its sequences set aside, slots and pages freed, until the
        consumer has read everything queued); it is paused as well when more
        than ``buffer_outputs // 4`` outputs wait. None turns pausing off.

    Raises:
      ValueError: ``buffer_outputs`` < 1, or a time not > 0.
    """

    buffer_outputs: int = 256
    stall_timeout_s: float | None = 30.0
    pause_after_s: float | None = 1.0

    def __post_init__(self):
        if isinstance(self.buffer_outputs, bool) or not isinstance(self.buffer_outputs, int) \
                or self.buffer_outputs < 1:
            raise ValueError(f"stream_buffer_outputs must be an int >= 1, got "
                             f"{self.buffer_outputs!r}")
        for name in ("stall_timeout_s", "pause_after_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"stream_{name} must be > 0 or None, got {v!r}")

    @property
    def check_interval_s(self) -> float:
        """How often the stall watch looks: a quarter of the stall timeout and
        half the pause time, at most 1 s."""
        return min(1.0, (self.stall_timeout_s or 4.0) / 4, (self.pause_after_s or 2.0) / 2)

    @property
    def watched(self) -> bool:
        """Whether a watch must run (a stall timeout or a pause time is set)."""
        return self.stall_timeout_s is not None or self.pause_after_s is not None


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    """Disaggregated prefill/decode (``jaxserve.disagg``).

    Attributes:
      role: ``"both"`` (prefill and decode here, the default), ``"prefill"``
        (serve the ``PrefillWorker`` control service beside ``Generation``
        and hold finished prompts' pages for a decode worker) or
        ``"decode"`` (route prompts to ``prefill_workers``).
      prefill_workers: a decode worker's prefill workers, gRPC ``host:port``s.
      min_prefill_tokens: shortest uncached prompt a decode worker hands off.
      max_cached_ratio: a prompt at least this much in the decode worker's
        prefix cache runs there.
      kv_lease_s: how long a prefill worker holds a finished prompt's pages
        (and an offered buffer) for a pull, seconds.
      prefill_timeout_s: a decode worker's deadline for a ``Prefill`` call.
      transfer_timeout_s: its deadline for ``Pull`` plus the KV pull.
    """

    role: str = "both"
    prefill_workers: tuple[str, ...] = ()
    min_prefill_tokens: int = 256
    max_cached_ratio: float = 0.5
    kv_lease_s: float = 30.0
    prefill_timeout_s: float = 120.0
    transfer_timeout_s: float = 20.0

    def __post_init__(self):
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.role == "decode" and not self.prefill_workers:
            raise ValueError("role 'decode' needs prefill_workers (--prefill_workers host:port,...)")
        if self.role != "decode" and self.prefill_workers:
            raise ValueError(f"prefill_workers (--prefill_workers) are for role 'decode', "
                             f"not {self.role!r}")
        for w in self.prefill_workers:
            host, _, port = w.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"prefill worker address (--prefill_workers) must be host:port, "
                                 f"got {w!r}")
        if not isinstance(self.min_prefill_tokens, int) or self.min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens (--disagg_min_prefill_tokens) must be an "
                             f"integer >= 0, got {self.min_prefill_tokens!r}")
        if not 0.0 < self.max_cached_ratio <= 1.0:
            raise ValueError(f"max_cached_ratio (--disagg_max_cached_ratio) must be in (0, 1], "
                             f"got {self.max_cached_ratio!r}")
        for name, flag in (("kv_lease_s", "kv_lease_s"),
                           ("prefill_timeout_s", "disagg_prefill_timeout_s"),
                           ("transfer_timeout_s", "disagg_transfer_timeout_s")):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} (--{flag}) must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The gRPC server (``jaxserve.server``).

    Attributes:
      host: address to bind; loopback unless told otherwise.
      port: gRPC port; 0 picks a free one (printed at start-up).
      metrics_port: Prometheus ``/metrics`` HTTP port on ``host``; 0 picks a
        free one, None turns the endpoint off.
      http_port: the OpenAI-compatible HTTP API (``jaxserve.server.http``)
        on ``host``, same engine; 0 picks a free one, None turns it off.
      max_http_body_bytes: largest HTTP request body; beyond it 413.
      max_waiting_requests: requests allowed to wait for their first step;
        beyond it ``Generate`` answers RESOURCE_EXHAUSTED.
      max_prompt_len: longest prompt accepted, tokens (None: max_model_len - 1).
      stream_stall_timeout_s, stream_buffer_outputs: a stream whose client
        reads nothing for this many seconds while output waits (None: never),
        or with more outputs than this waiting, is aborted
        (``StreamLimits, applied by jaxserve.server.backpressure``).
      stream_pause_after_s: a stream whose client reads nothing for this
        many seconds while output waits is paused until it reads (None:
        never); see ``stream_limits``.
      max_message_bytes: largest gRPC message received or sent, bytes.
      grace_period_s: on SIGTERM, seconds running requests get to finish
        before they are aborted; the process exits within it.
      tls_cert, tls_key: PEM file paths; both or neither (TLS off).
      auth_token: bearer token every call must carry in ``authorization:
        Bearer <token>`` metadata; None turns the check off.
      disagg: this worker's role in disaggregated prefill/decode.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = 8000
    http_port: int | None = None
    max_http_body_bytes: int = 16 << 20
    max_waiting_requests: int = 256
    max_prompt_len: int | None = None
    stream_stall_timeout_s: float | None = 30.0
    stream_buffer_outputs: int = 256
    stream_pause_after_s: float | None = 1.0
    max_message_bytes: int = 16 << 20
    grace_period_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    disagg: DisaggConfig = DisaggConfig()

    def __post_init__(self):
        for name in ("port", "metrics_port", "http_port"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v < 65536):
                raise ValueError(f"{name} must be in [0, 65536), got {v!r}")
        check_positive("max_waiting_requests", self.max_waiting_requests)
        check_positive("max_prompt_len", self.max_prompt_len, allow_none=True)
        self.stream_limits()  # checks them
        check_positive("max_message_bytes", self.max_message_bytes)
        check_positive("max_http_body_bytes", self.max_http_body_bytes)
        if not self.grace_period_s > 0:
            raise ValueError(f"grace_period_s must be > 0, got {self.grace_period_s!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert and tls_key go together, got tls_cert={self.tls_cert!r} "
                             f"and tls_key={self.tls_key!r}")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must be None or a non-empty string, got ''")

    def stream_limits(self) -> StreamLimits:
        """The ``stream_*`` fields as ``StreamLimits``.

        Raises:
          ValueError: as ``StreamLimits``."""
        return StreamLimits(self.stream_buffer_outputs, self.stream_stall_timeout_s,
                            self.stream_pause_after_s)
