"""The serving benchmark's JSON, level by level: ``level_dict`` (one
concurrency level's figures, ``stats.summarize`` and the engine's counters,
every request's timestamps relative to the level's start), ``request_dict``,
the per-level request slices and the drawn shapes.
"""

from __future__ import annotations

import math
import sys

from jaxserve.bench import serving, stats
from jaxserve.bench.workloads import SHAPES, BenchRequest


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def slices(requests: list[BenchRequest], counts: list[int]) -> list[list[BenchRequest]]:
    out, lo = [], 0
    for n in counts:
        out.append(requests[lo:lo + n])
        lo += n
    return out


def request_dict(r: stats.RequestRecord, t0: float) -> dict:
    rel = lambda t: None if t is None else round(t - t0, 6)  # noqa: E731
    return {"id": r.request_id, "workload": r.workload, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens,
            "send_s": rel(r.send_time), "first_token_s": rel(r.chunk_times[0]) if r.chunk_times
            else None, "end_s": rel(r.end_time), "queue_ms": r.queue_ms,
            "prefill_ms": r.prefill_ms, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
            "e2e_ms": r.e2e_ms, "error": r.error,
            "chunk_times_s": [rel(t) for t in r.chunk_times], "chunk_tokens": r.chunk_tokens,
            "disagg_route": r.disagg_route, "kv_transfer_ms": r.kv_transfer_ms,
            "kv_transfer_bytes": r.kv_transfer_bytes}


def level_dict(run: serving.LevelRun, slo: dict, mode: str = "continuous batching") -> dict:
    pages = [s[1] for s in run.kv_series]
    return {
        "concurrency": run.concurrency,
        "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
        "mode": mode,
        "summary": stats.summarize(run.records, slo=slo),
        "by_workload": stats.by_workload(run.records, slo),
        "kv": {"pages_total": run.pages_total, "peak_pages": max(pages, default=0),
               "mean_pages": sum(pages) / len(pages) if pages else 0.0,
               "series": [[round(t, 4), p, a, w] for t, p, a, w in run.kv_series]},
        "prefix_cache": {"hits": run.prefix_hits, "queries": run.prefix_queries,
                         "hit_rate": run.prefix_hits / run.prefix_queries
                         if run.prefix_queries else None},
        "preemptions": run.preemptions,
        "compilations": run.compilations,
        "num_steps": len(run.steps) if run.steps else None,
        "device": run.device_dict(),
        "speculation": run.spec_dict(),
        "disagg": stats.disagg_summary(run.records),
        "http": run.http,
        "requests": [request_dict(r, run.t0) for r in run.records],
    }


def shapes(requests: list[BenchRequest]) -> dict:
    out = {}
    for w in SHAPES:
        rs = [r for r in requests if r.workload == w]
        if rs:
            out[w] = {"requests": len(rs),
                      "prompt_tokens_mean": sum(len(r.prompt_ids) for r in rs) / len(rs),
                      "output_tokens": sum(r.output_len for r in rs) / len(rs)}
    return out

