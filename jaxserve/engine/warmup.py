"""Warming an engine up: every step program it can reach compiled (or loaded)
before serving, so no request waits on XLA.

``Warmup.run`` makes ready each bucket's programs through
``ModelRunner.warmup`` (the target's, then a draft model's, whose steps have
the same buckets), optionally capped to a known batch (``max_tokens``,
``max_rows``) or to plain sampling (``variants=False``). With
``background=True`` only the smallest decode and prefill buckets are made
ready at once; a daemon thread does the rest, smallest first, raising
``Scheduler.caps`` after each so the scheduler never plans a step whose
program is not ready, and sets ``done`` at its end (``error`` holds a
failure; the caps then stay where they were).
"""

from __future__ import annotations

import threading
import time

from jaxserve.engine import compile_cache


class Warmup:
    """An engine's warm-up and its state.

    Args:
      runner: the target's ``ModelRunner``.
      scheduler: the ``Scheduler`` whose ``caps`` a background warm-up sets.

    Attributes:
      done: ``threading.Event`` set when every step program is ready (set
        before any warm-up: nothing is pending).
      programs: programs a background warm-up has traced so far.
      error: a background warm-up's failure, or None.
    """

    def __init__(self, runner, scheduler):
        self.runner = runner
        self.scheduler = scheduler
        self.done = threading.Event()
        self.done.set()
        self.programs = 0
        self.error: Exception | None = None

    def run(self, draft_runner=None, on_compiled=None, max_tokens: int | None = None,
            background: bool = False, max_rows: int | None = None,
            variants: bool = True, speculating: bool = False) -> int:
        """Compile every step program this engine can reach
        (``ModelRunner.step_buckets``) before serving, so no request waits
        on XLA; with ``compilation_cache_dir`` set, a second start loads
        them from disk (``compile_cache`` counts which). Each bucket's
        sampling (plain and penalised) and prompt-logprob programs come with
        it (``ModelRunner.warmup``). ``on_compiled(i, T, seconds)`` reports
        progress. ``max_tokens``:
        only the programs of steps of at most this many tokens (every bucket
        below it and the one holding it), for a known batch (the CLI demo:
        its prompt tokens plus one per sequence; a step past it, after a
        preemption, compiles on first use); ``max_rows`` likewise caps the
        decode buckets (a batch of that many sequences). ``variants=False``:
        only plain sampling, no penalised sampling or prompt logprobs (a
        known batch without them). ``background``: compile only
        the smallest decode and prefill buckets now and the rest, smallest
        first, in a daemon thread (``done`` is set at its end), while
        the scheduler keeps every step within the buckets ready so far
        (``Scheduler.caps``), so a step never waits on a compile; a
        one-process engine without speculation only (otherwise all now).
        Returns the compilations it caused (before returning).
        ``draft_runner``: a draft model's ``ModelRunner`` (warmed up after
        the target's), or None; ``speculating``: the engine speculates.

        Raises:
          MultihostError: a multi-host step failed.
        """
        if background and max_tokens is None and max_rows is None and variants \
                and not speculating and self.runner.channel is None:
            return self._in_background(on_compiled)

        def wanted(runner):  # (decode, T) buckets, ascending T within each kind
            buckets = runner.step_buckets()
            out = []
            for kind, most in ((True, max_rows), (False, max_tokens)):
                ts = [T for d, T in buckets if d == kind]
                most = max_tokens if most is None else most
                cap = ts[-1] if most is None or not ts else \
                    next((T for T in ts if T >= most), ts[-1])
                out += [(kind, T) for T in ts if T <= cap]
            return out
        n = self.runner.warmup(wanted(self.runner), on_compiled=on_compiled, variants=variants)
        if draft_runner is not None:  # the draft model's steps have the same buckets
            n += draft_runner.warmup(wanted(draft_runner), variants=variants)
        compile_cache.trim_host_heap()  # compilers' scratch back to the OS
        self.done.set()
        return n

    def _in_background(self, on_compiled=None) -> int:
        """``run(background=True)``: the smallest decode and prefill
        buckets now, the rest in ascending T (prefill first at a tie, so the
        row cap never passes the token cap) in a daemon thread that raises
        ``Scheduler.caps`` after each bucket and lifts them at the end."""
        buckets = sorted(self.runner.step_buckets(), key=lambda b: (b[1], b[0]))
        first = [next(b for b in buckets if b[0]), next(b for b in buckets if not b[0])]
        ready = list(first)

        def caps():
            return (max(T for d, T in ready if d), max(T for d, T in ready if not d))
        self.done.clear()
        n = self.runner.warmup(first, on_compiled=on_compiled)
        self.scheduler.caps = caps()

        def rest():
            try:
                for i, b in enumerate(b for b in buckets if b not in first):
                    t0 = time.monotonic()
                    self.programs += self.runner.warmup([b])
                    ready.append(b)
                    self.scheduler.caps = caps()
                    if on_compiled is not None:
                        on_compiled(len(first) + i, b[1], time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - a failed compile keeps today's caps
                self.error = e
            else:
                self.scheduler.caps = None
                compile_cache.trim_host_heap()
            finally:
                self.done.set()
        self.programs = n
        threading.Thread(target=rest, name="jaxserve-warmup", daemon=True).start()
        return n
