"""Serving-benchmark arithmetic: per-request latencies from timestamps, and
the figures of a run (pure functions, no engine, no clock).

Definitions follow vLLM's ``benchmarks/benchmark_serving.py``
(``calculate_metrics``), which is how the field reports serving numbers:

* TTFT: first output token seen by the client - request sent.
* E2E latency: last output seen - request sent.
* TPOT (per request): (E2E - TTFT) / (output tokens - 1); undefined for one
  token (left out of the TPOT figures; counted as 0 against a TPOT SLO).
* ITL: the gaps between successive outputs of one request that carry tokens
  (one gap per streamed message, however many tokens it holds), pooled over
  all requests.
* Percentiles: ``numpy.percentile`` (linear interpolation), reported as mean,
  p50, p90, p99. An empty sample gives ``None`` (JSON null).
* Throughput: completed requests, prompt tokens, output tokens and their sum,
  each divided by the level's duration (first send to last finish), per s.
* Goodput: completed requests meeting every given SLO, per s of duration.

All times in: seconds (any one clock); latencies out: milliseconds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclasses.dataclass
class RequestRecord:
    """What a load generator saw of one request.

    Attributes:
      request_id: the engine's id.
      workload: the shape it was drawn from (``"chat"``, ``"rag"``, ...).
      prompt_tokens: prompt length, tokens.
      send_time: when it was sent (added to the engine / the RPC started), s.
      chunk_times: when each output carrying tokens arrived, s, ascending.
      chunk_tokens: tokens in each of those outputs (same length as chunk_times).
      end_time: when the final output arrived, s (None: not finished).
      cached_tokens: prompt tokens served from the prefix cache (engine's count).
      queue_ms: engine's arrival -> first scheduled, ms (None when unknown).
      prefill_ms: engine's first scheduled -> first token, ms (None when unknown).
      error: why it failed, or None.
      token_ids: the output tokens, when the driver kept them.
      disagg_route: from a disaggregated decode worker: ``"handoff"`` or why
        it ran there (``RequestMetrics.disagg_route``); None elsewhere.
      kv_transfer_ms, kv_transfer_bytes: a handoff's KV pull.
    """

    request_id: str
    workload: str
    prompt_tokens: int
    send_time: float
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    end_time: float | None = None
    cached_tokens: int = 0
    queue_ms: float | None = None
    prefill_ms: float | None = None
    error: str | None = None
    token_ids: list[int] | None = None
    disagg_route: str | None = None
    kv_transfer_ms: float | None = None
    kv_transfer_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_ms(self) -> float | None:
        return (self.chunk_times[0] - self.send_time) * 1e3 if self.chunk_times else None

    @property
    def e2e_ms(self) -> float | None:
        return None if self.end_time is None else (self.end_time - self.send_time) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), ms; None below two tokens."""
        n = self.output_tokens
        if not self.ok or n < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between successive token-carrying outputs, ms."""
        t = self.chunk_times
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]

    @property
    def decode_ms_per_token(self) -> float | None:
        """The decode phase per token: TPOT (the same quantity, named by phase)."""
        return self.tpot_ms


def describe(xs) -> dict:
    """{"mean", "p50", "p90", "p99"} of ``xs`` (numpy linear percentiles), and
    "n"; values are None when ``xs`` is empty."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return {"n": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    a = np.asarray(xs, np.float64)
    return {"n": len(xs), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def parse_slo(spec: str | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}.

    Keys: ``ttft_ms``, ``tpot_ms``, ``e2e_ms`` (all ms, each optional).

    Raises:
      ValueError: an unknown key, a missing ``=``, or a value that is not a
        positive finite number.
    """
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo wants key=value pairs with keys {', '.join(SLO_KEYS)}; "
                             f"got {part!r}")
        try:
            v = float(value)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"--slo {key} must be a positive number of ms, got {value!r}")
        out[key] = v
    return out


def meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    """A completed request within every SLO (vLLM: TPOT of a one-token request is 0)."""
    if not r.ok:
        return False
    values = {"ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms or 0.0, "e2e_ms": r.e2e_ms}
    return all(values[k] <= limit for k, limit in slo.items())


def duration_s(records: list[RequestRecord]) -> float:
    """First send to last finish over the records, s (0 when none finished)."""
    ends = [r.end_time for r in records if r.end_time is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.send_time for r in records)


def summarize(records: list[RequestRecord], duration: float | None = None,
              slo: dict[str, float] | None = None) -> dict:
    """The figures of one level.

    Args:
      records: every request of the level, failed ones included.
      duration: seconds to divide by; default ``duration_s(records)``.
      slo: ``parse_slo`` output; goodput counts requests meeting all of it
        (with no SLO every completed request is good).

    Returns:
      a dict: ``completed``, ``failed``, ``duration_s``, ``input_tokens``,
      ``output_tokens``, ``cached_tokens``, ``request_throughput``,
      ``input_throughput``, ``output_throughput``, ``total_token_throughput``
      (per s), ``goodput`` (requests/s), ``good_fraction``, and ``describe``
      dicts (ms) ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``, ``queue_ms``,
      ``prefill_ms``, ``decode_ms_per_token``.
    """
    slo = slo or {}
    dur = duration_s(records) if duration is None else duration
    ok = [r for r in records if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = sum(meets_slo(r, slo) for r in ok)
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: None)
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": dur,
        "input_tokens": n_in, "output_tokens": n_out,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": per_s(len(ok)), "input_throughput": per_s(n_in),
        "output_throughput": per_s(n_out), "total_token_throughput": per_s(n_in + n_out),
        "goodput": per_s(good), "good_fraction": good / len(ok) if ok else None, "slo": slo,
        "ttft_ms": describe(r.ttft_ms for r in ok),
        "tpot_ms": describe(r.tpot_ms for r in ok),
        "itl_ms": describe(x for r in ok for x in r.itl_ms),
        "e2e_ms": describe(r.e2e_ms for r in ok),
        "queue_ms": describe(r.queue_ms for r in ok),
        "prefill_ms": describe(r.prefill_ms for r in ok),
        "decode_ms_per_token": describe(r.decode_ms_per_token for r in ok),
    }


def by_workload(records: list[RequestRecord], slo: dict[str, float] | None = None) -> dict:
    """``summarize`` per workload name (the per-shape breakdown of a mixed run);
    throughputs there are over the whole level's duration."""
    dur = duration_s(records)
    names = sorted({r.workload for r in records})
    return {w: summarize([r for r in records if r.workload == w], dur, slo) for w in names}


def disagg_summary(records: list[RequestRecord]) -> dict | None:
    """A disaggregated level's routing split and KV transfers: ``routes``
    {route: requests}, ``handoffs``, ``transfer_ms`` (``describe``),
    ``transfer_bytes`` (sum), ``bytes_per_handoff`` (mean) and
    ``transfer_ms_per_prompt_token`` (``describe`` over handoffs), or None
    when no record carries a route (not a decode worker)."""
    ok = [r for r in records if r.ok and r.disagg_route is not None]
    if not ok:
        return None
    routes: dict[str, int] = {}
    for r in ok:
        routes[r.disagg_route] = routes.get(r.disagg_route, 0) + 1
    hand = [r for r in ok if r.disagg_route == "handoff"]
    return {"routes": routes, "handoffs": len(hand),
            "transfer_ms": describe(r.kv_transfer_ms for r in hand),
            "transfer_bytes": sum(r.kv_transfer_bytes for r in hand),
            "bytes_per_handoff": sum(r.kv_transfer_bytes for r in hand) / len(hand)
            if hand else None,
            "transfer_ms_per_prompt_token": describe(
                r.kv_transfer_ms / max(1, r.prompt_tokens - r.cached_tokens) for r in hand)}
