"""One engine step of an exact shape, timed: the decode sweep and the device
benchmark drive ``Engine.execute_batch`` with hand-built batches rather than
the scheduler, so each point is exactly one shape (one XLA compilation per
row bucket or prompt length, then timed calls).

``step_batch(engine, S, q, ctx, rng)`` builds a ``ScheduledBatch`` of S
sequences, each computing ``q`` tokens that end at position ``ctx`` (``ctx -
q`` already "cached": pages taken with ``Engine.allocate_pages``, their K/V
whatever the cache holds, zeros at first: the timing does not depend on the
values); decode rows when ``q`` is 1. ``time_step`` runs it once untimed (the
compilation of its bucket), then ``iters`` timed calls, and gives the pages
back (``Engine.free_pages``). ``execute_batch`` returns host arrays, so each
call is synchronised. Times are ``time.perf_counter`` seconds.
"""

from __future__ import annotations

import statistics
import time

from jaxserve.engine.page_table import cdiv
from jaxserve.engine.request import Request, SamplingParams
from jaxserve.engine.scheduler import ScheduledBatch


def step_batch(engine, num_seqs: int, q_len: int, ctx: int, rng):
    """(batch, page lists): see the module docstring. Free every page list
    with ``engine.free_pages`` after.

    Raises:
      ValueError: fewer free pages than the batch needs.
    """
    reqs, pages = [], []
    try:
        for i in range(num_seqs):
            ids = rng.integers(0, engine.model_config.vocab_size, size=ctx).tolist()
            r = Request(f"_bench{i}", None, ids, SamplingParams(temperature=0), 0,
                        engine.eos_token_ids)
            r.page_ids = engine.allocate_pages(cdiv(ctx, engine.page_size))
            pages.append(r.page_ids)
            r.num_computed_tokens = ctx - q_len
            reqs.append(r)
    except ValueError:
        for p in pages:
            engine.free_pages(p)
        raise
    decode = num_seqs if q_len == 1 else 0
    return ScheduledBatch(reqs, [q_len] * num_seqs, num_decode=decode), pages


def time_step(engine, num_seqs: int, q_len: int, ctx: int, iters: int, rng) -> dict:
    """One step shape: {"num_seqs", "q_len", "ctx", "first_call_s" (compile
    and first run), "median_s", "min_s", "max_s", "iters", "compilations"
    (``Engine.num_compilations`` during the timed calls: 0 unless the bucket
    recompiled)}."""
    batch, pages = step_batch(engine, num_seqs, q_len, ctx, rng)
    try:
        t = time.perf_counter()
        engine.execute_batch(batch)  # compiles the bucket on its first use
        first = time.perf_counter() - t
        comp = engine.num_compilations
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            engine.execute_batch(batch)
            times.append(time.perf_counter() - t)
        comp = engine.num_compilations - comp
    finally:
        for p in pages:
            engine.free_pages(p)
    return {"num_seqs": num_seqs, "q_len": q_len, "ctx": ctx, "first_call_s": first,
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iters": iters, "compilations": comp}
