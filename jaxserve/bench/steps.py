"""One engine step of an exact shape, timed: the decode sweep and the device
benchmark run ``Engine.shaped_step`` batches rather than the scheduler's, so
each point is exactly one shape (one XLA compilation per row bucket or
prompt length, then timed calls). ``time_step`` runs the step once untimed
(the compilation of its bucket), then ``iters`` timed calls; each call
returns host arrays, so it is synchronised. Times are ``time.perf_counter``
seconds.
"""

from __future__ import annotations

import statistics
import time


def time_step(engine, num_seqs: int, q_len: int, ctx: int, iters: int, rng) -> dict:
    """One step shape: {"num_seqs", "q_len", "ctx", "first_call_s" (compile
    and first run), "median_s", "min_s", "max_s", "iters", "compilations"
    (``Engine.num_compilations`` during the timed calls: 0 unless the bucket
    recompiled)}."""
    with engine.shaped_step(num_seqs, q_len, ctx, rng) as run:
        t = time.perf_counter()
        run()  # compiles the bucket on its first use
        first = time.perf_counter() - t
        comp = engine.num_compilations
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        comp = engine.num_compilations - comp
    return {"num_seqs": num_seqs, "q_len": q_len, "ctx": ctx, "first_call_s": first,
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iters": iters, "compilations": comp}
