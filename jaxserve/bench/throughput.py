"""Offline throughput benchmark: N concurrent requests of a fixed shape.

All requests arrive at once (vLLM's ``benchmark_throughput`` shape). Prompts
are slices of real English text re-tokenized, with lengths drawn uniformly
within +-10% of ``input_len``; EOS is ignored so every request produces
exactly ``output_len`` tokens. The first (warm-up) pass compiles every bucket
the workload touches; the second pass is timed. Reports output tokens/s,
median and p90 TTFT / TPOT (ms), peak host memory (RSS, MiB), KV occupancy,
and the number of XLA compilations.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time

import numpy as np

from jaxserve.bench.workloads import CORPUS
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import SamplingParams


@dataclasses.dataclass
class BenchResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    tpot_ms_p50: float
    tpot_ms_p90: float
    peak_kv_occupancy: float
    num_compilations: int
    peak_rss_mib: float


def make_prompts(engine: Engine, num_requests: int, input_len: int, seed: int) -> list[list[int]]:
    """Token-id prompts of about ``input_len`` tokens (+-10%), from real text."""
    rng = np.random.default_rng(seed)
    if engine.tokenizer is not None:
        base = engine.tokenizer.encode(CORPUS * (2 + input_len // 500),
                                       add_special_tokens=False)
    else:
        base = list(rng.integers(0, engine.model_config.vocab_size, size=4 * input_len + 64))
    lo, hi = max(1, int(input_len * 0.9)), max(1, int(input_len * 1.1))
    prompts = []
    for _ in range(num_requests):
        n = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(base) - n))
        prompts.append([int(t) for t in base[start:start + n]])
    return prompts


def run_once(engine: Engine, prompts, output_len: int) -> BenchResult:
    """One pass over ``prompts``, all arriving at once. The prefix cache is
    emptied first, so a repeated pass does not reuse the previous one's pages."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.allocator.reset_prefix_cache()
    t0 = time.monotonic()
    for p in prompts:
        engine.add_request(None, p, params)
    finals, peak_occ = [], 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals.append(out)
        peak_occ = max(peak_occ, engine.allocator.occupancy)
    wall = time.monotonic() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in finals)
    n_in = sum(len(p) for p in prompts)
    ttft = [o.metrics.ttft_ms for o in finals]
    tpot = [o.metrics.tpot_ms for o in finals if o.metrics.tpot_ms is not None]
    q = lambda xs, f: float(np.percentile(xs, f)) if xs else float("nan")
    return BenchResult(
        num_requests=len(prompts), input_tokens=n_in, output_tokens=n_out, wall_s=wall,
        output_tok_s=n_out / wall, total_tok_s=(n_in + n_out) / wall,
        ttft_ms_p50=statistics.median(ttft), ttft_ms_p90=q(ttft, 90),
        tpot_ms_p50=statistics.median(tpot) if tpot else float("nan"), tpot_ms_p90=q(tpot, 90),
        peak_kv_occupancy=peak_occ, num_compilations=engine.runner.num_compilations,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def format_result(label: str, r: BenchResult) -> str:
    return (f"{label}: {r.num_requests} requests, {r.input_tokens} prompt + {r.output_tokens} "
            f"output tokens in {r.wall_s:.2f} s\n"
            f"  output tokens/s     {r.output_tok_s:8.1f}   (total tokens/s {r.total_tok_s:.1f})\n"
            f"  TTFT ms  p50 {r.ttft_ms_p50:9.1f}   p90 {r.ttft_ms_p90:9.1f}\n"
            f"  TPOT ms  p50 {r.tpot_ms_p50:9.1f}   p90 {r.tpot_ms_p90:9.1f}\n"
            f"  peak KV occupancy   {100 * r.peak_kv_occupancy:6.1f} %\n"
            f"  XLA compilations    {r.num_compilations:6d} (cumulative)\n"
            f"  peak RSS            {r.peak_rss_mib:8.0f} MiB")
