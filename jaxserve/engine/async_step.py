"""Launching and collecting engine steps, and async scheduling: the host plans
and launches step N+1 before it reads step N's results (vLLM v1's async
scheduling; tpu-inference's async scheduler).

One thread (the engine's), no queue beyond JAX's own: JAX dispatch is
asynchronous, so ``ModelRunner.launch`` returns device arrays at once and the
device runs the launched steps in order (each takes the KV caches the one
before it returns). With async scheduling on, one ``Engine.step()`` call is

    host:   [schedule N+1 | prepare N+1 | launch N+1] [wait N] [append, detokenize, stop N]
    device: ...... step N ..............................][ step N+1 ..........................
            (N was launched by the previous call)

so the host's work for N+1 and for N's outputs overlaps the device's work,
and the device idles only when the host takes longer than a step. Without
it (or when a step cannot overlap) the call launches N and waits at once.

How N+1 is planned before N's tokens exist: launching a step advances its
sequences' ``num_computed_tokens`` at once, and every row that samples gets a
placeholder token (``Request.add_placeholder``), so the scheduler sees the
token in flight: it gives the sequence its next position and page, and the
sampling tensors count it (the PRNG fold ``steps``, min_tokens bans). The
plan marks which input positions take their id from N's sampled ids on
device (``StepPlan.prev_rows``, -1 = the host's id; ``merge_input_ids`` runs
inside the jitted step). When N's results reach the host the placeholders are
replaced by the tokens, then stop strings, EOS and lengths are checked
exactly as in a synchronous step. A sequence that finished at N (or was
aborted between steps) but was computed in N+1 has its N+1 token dropped,
and nothing of it reaches the outputs; its pages were freed when it finished
(the device writes N+1's K/V into them before any later step, which may
reuse them, runs). A sequence whose token in flight reaches ``max_tokens``
is not planned again. A request added between calls joins the step after
the one already in flight (one step later than with synchronous steps). If
launching or collecting a step fails, the unfinished sequences of the steps
in flight go back to the queue with only their tokens known on the host
(``StepPipeline.fail``), so a later ``step()`` recomputes them.

Synchronous fallback (``sync_reason``): N+1 is not launched before N's
results are read when N verified speculative drafts (or the speculation
policy's k is above 0: the engine's check), when a live sequence of N uses presence / frequency /
repetition penalties (they need the output history on the host) or prompt
logprobs (their spans follow the logprobs already on the host), when a
constrained sequence's grammar forces more than N's own token (the forced
tokens after it ride N+1 as drafts, ``constraints.forced_drafts``, planned
from the constraint's state on the host once it has taken N's token), or
when another step ran on the runner since N
(``Engine.last_token_logits``): ``prev_rows`` always index the step
launched just before; and in a multi-host job (below).

Constrained rows (structured outputs, ``allowed_token_ids``, ``bad_words``)
otherwise overlap like any other: their next bitmask row needs N's token on
the host (only the host advances a grammar), but the model does not, so
N+1 is launched split at the logits (vLLM v1 and tpu-inference apply the
grammar bitmask between the model and the sampler the same way). The
step program of N+1 is launched with its constrained rows' masks unfilled
(``prepare_plan(..., fill_masks=False)``); after N's results are
processed (each constraint has taken N's token), ``StepPipeline.sample``
fills those rows from the constraints and launches N+1's sampling program
(``ModelRunner.launch_sampling``), before anything else is launched:

    host:   [plan N+1 | launch N+1's model] [wait N] [N's tokens, constraints] [fill N+1's masks | launch N+1's sampling]
    device: ... step N ....................][ N+1's model ..........................................][ N+1's sampling ]

so the mask filling and the grammar's advance overlap N+1's model, and the
programs are the same two (step, sampling) as a synchronous step's.

Multi-host (``runner.channel`` set): every step is synchronous. The plan
could carry ``prev_rows`` (it is one more leaf of the broadcast, and every
process keeps its own previous sampled ids), but process 0's broadcast of
N+1 is itself a collective: launched while N runs, it has no data dependency
on N, and with gloo it hung instead of failing when a follower died
mid-step (tests/test_multihost.py ``test_killed_follower_fails_the_job``);
and the followers cannot join it before they finish N, so little would
overlap anyway.

Timing (``StepInfo``): all host clocks (``time.monotonic``). A step's results
count as ready at the first moment the host sees them ready (it polls
``is_ready`` after scheduling, after preparing and before launching the next
step, and waits at the end), so ``device_ms`` and ``idle_ms`` are bounds to
within that polling.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from jaxserve.engine.constraints import forced_drafts
from jaxserve.engine.plan import fill_token_masks
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import ScheduledBatch, Scheduler
from jaxserve.engine.spec_policy import ForcedDraftPolicy


def merge_input_ids(host_ids_T, prev_rows_T, prev_ids_R):
    """Token ids of a step: the host's, or the previous step's sampled ids.

    Args:
      host_ids_T: i32[T] ids known on the host (0 where ``prev_rows_T`` >= 0).
      prev_rows_T: i32[T] row of the previous step whose sampled id goes at
        each position; -1 keeps the host's id.
      prev_ids_R: i32[R] the previous step's sampled ids, R = the runner's
        largest row bucket (rows past that step's count are 0).

    Returns:
      i32[T] ids.
    """
    return jnp.where(prev_rows_T >= 0, prev_ids_R[jnp.maximum(prev_rows_T, 0)], host_ids_T)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """The shape and times of one engine step (``Engine.last_step``), for
    per-phase rooflines, step traces and the device's idle fraction.

    Attributes:
      start: when the device could start the step: its launch, or the
        previous step's end if that was later; ``time.monotonic()`` s.
      seconds: ``device_ms`` in seconds: the jitted step, sampling and the
        copy back to the host.
      q_lens: tokens computed per sequence in the step, decode rows first.
      kv_lens: tokens in each sequence's KV cache after the step.
      num_decode: leading rows that computed one token each (decode rows).
      compiled: XLA traced/compiled something when the step was launched (on
        the host, inside the launch), so its ``device_ms`` includes compile
        time (the roofline leaves such steps out).
      host_ms: host work for the step: scheduling, metadata, the launch and
        the processing of its outputs (tokens, detokenizing, stop checks).
      device_ms: from the later of its launch and the previous step's end
        to its results being ready on the host.
      idle_ms: time the device had nothing of the engine's queued between the
        previous step's end and this step's launch: 0 when this step was
        queued before the previous one finished, or when the engine had no
        unfinished request between them.
      overlapped: the next step was launched before this step's results were
        read (async scheduling).
    """

    start: float
    seconds: float
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_decode: int
    compiled: bool
    host_ms: float = 0.0
    device_ms: float = 0.0
    idle_ms: float = 0.0
    overlapped: bool = False


@dataclasses.dataclass(eq=False)
class InFlightStep:
    """A launched step whose results the host has not processed yet.

    Attributes:
      batch: the scheduler's plan.
      plan: the runner's ``StepPlan``.
      outs: the runner's device arrays (``ModelRunner.run``).
      samples: per row, whether it samples a token (and holds a placeholder).
      kv_lens: tokens in each row's cache after the step.
      index: the runner's launch count when it was launched.
      prev: the step launched before it (for its device start), or None.
      launched: host time just before the launch, s.
      ready_at: first host time its results were seen ready, s, or None.
      host_s: host seconds spent on it so far.
      idle_s: the device's idle time before its launch, s.
      compiled: its launch compiled something.
      overlapped: the next step was launched before its results were read.
      deferred: its sampling is not launched yet (``StepPipeline.sample``
        launches it once the host has filled its constrained rows' masks).
    """

    batch: ScheduledBatch
    plan: object
    outs: tuple
    samples: list[bool]
    kv_lens: tuple[int, ...]
    index: int
    prev: InFlightStep | None
    launched: float
    ready_at: float | None = None
    host_s: float = 0.0
    idle_s: float = 0.0
    compiled: bool = False
    overlapped: bool = False
    deferred: bool = False

    def poll(self) -> bool:
        """Whether its results are ready; notes when first seen ready."""
        if self.ready_at is None and not self.deferred and self.outs[1].token_ids.is_ready():
            self.ready_at = time.monotonic()
        return self.ready_at is not None

    @property
    def live(self) -> bool:
        """Some sequence of it is still unfinished."""
        return any(not r.finished for r in self.batch.requests)


def sync_reason(step: InFlightStep, runner, max_forced_drafts: int = 0,
                forced_policy: ForcedDraftPolicy | None = None,
                num_rows: int = 1) -> str | None:
    """Why the step after ``step`` must wait for ``step``'s results on the
    host (None: it may be launched first). ``max_forced_drafts``: the
    scheduler's (``SchedulerConfig.max_forced_drafts``; 0 when a
    speculator plans the steps); ``forced_policy``: whether drafts would pay
    in a step of ``num_rows`` rows (None: always)."""
    if runner.channel is not None:
        return "multi-host: the next plan's broadcast would race this step's collectives"
    if runner.num_launched != step.index + 1:
        return "another step ran on the runner since"
    if step.batch.drafts is not None:
        return "speculation: how many drafts are accepted is known on the host only"
    for r in step.batch.requests:
        if r.finished:
            continue
        if r.params.has_penalties:
            return "penalties need the output history on the host"
        if r.wants_prompt_logprobs:
            return "prompt logprobs follow the logprobs on the host"
    if max_forced_drafts > 0:
        # The constraints have not taken this step's tokens yet, so a forced
        # run's first token is this step's; the rest could ride the next step
        # as drafts, planned from the host's constraint state after it.
        lengths = [min(max_forced_drafts, len(r.constraint.forced_tokens()[:max_forced_drafts + 1])
                       - 1)
                   for r, samples in zip(step.batch.requests, step.samples)
                   if samples and not r.finished and r.constraint is not None]
        lengths = [n for n in lengths if n > 0]
        if lengths and (forced_policy is None or forced_policy.best_cap(num_rows, lengths)):
            return "the grammar forces tokens after this step's: they ride as drafts"
    return None


class StepPipeline:
    """Launches engine steps and collects their results, keeping the clock
    of the device's timeline (one per engine; the engine thread's).

    Args:
      scheduler: plans the steps.
      runner: the ``ModelRunner`` that runs them.

    Counters: ``num_prompt_tokens`` (prompt tokens computed, cache hits
    excluded; recomputation counts again).
    """

    def __init__(self, scheduler: Scheduler, runner, speculator=None,
                 forced_policy: ForcedDraftPolicy | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator  # plans steps with drafts (jaxserve.engine.speculation)
        self.forced_policy = forced_policy  # whether forced tokens ride as drafts; None: always
        self.num_prompt_tokens = 0
        self._last: InFlightStep | None = None  # the latest launch, while the engine is busy

    def launch(self, prev: InFlightStep | None) -> InFlightStep | None:
        """Schedule, prepare and launch a step; None when nothing can run.

        Args:
          prev: the step in flight whose sampled ids the new step may take
            (the step launched just before), or None (synchronous).
        """
        t0 = time.monotonic()
        if self.speculator is None:  # constrained rows' forced tokens ride as drafts
            forced = forced_drafts(self.scheduler.running,
                                   self.scheduler.config.max_forced_drafts)
            if forced and self.forced_policy is not None:
                forced = self.forced_policy.choose(len(self.scheduler.running), forced)
            batch = self.scheduler.schedule(forced or None,
                                            self.runner.max_rows if forced else None)
        else:
            batch = self.speculator.schedule(self.scheduler)
        if batch is None:
            return None
        last = self._last
        if last is not None:
            last.poll()
        for r in batch.requests:
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = t0
        prev_rows_of: dict[Request, int] | None = None
        if prev is not None:
            prev_rows_of = {r: k for k, r in enumerate(prev.batch.requests) if prev.samples[k]}
        # Constrained rows behind a step in flight: their masks wait for its
        # tokens (``sample``), while the device runs this step's model.
        defer = prev is not None and any(r.constraint is not None for r in batch.requests)
        plan = self.runner.prepare(batch, prev_rows_of, fill_masks=not defer)
        samples, kv_lens = [], []
        for r, q in zip(batch.requests, batch.q_lens):
            start = r.num_computed_tokens
            computed = max(0, min(start + q, len(r.prompt_token_ids)) - start)
            self.num_prompt_tokens += computed
            if r.adapter is not None:
                r.adapter.num_prompt_tokens += computed
            r.num_computed_tokens += q
            kv_lens.append(r.num_computed_tokens)
            samples.append(r.num_computed_tokens >= r.num_tokens)
            if samples[-1]:
                r.add_placeholder()
        idle = 0.0
        if last is not None:
            last.poll()
        launched = time.monotonic()
        if last is not None and last.ready_at is not None:
            idle = max(0.0, launched - last.ready_at)
        compilations = self.runner.num_compilations
        index = self.runner.num_launched
        try:
            outs = self.runner.launch(plan, defer_sampling=defer)
        except BaseException:
            for r in batch.requests:
                self.scheduler.requeue(r)
            raise
        step = InFlightStep(batch, plan, outs, samples, tuple(kv_lens), index, last, launched,
                            idle_s=idle,
                            compiled=self.runner.num_compilations != compilations,
                            deferred=defer)
        step.host_s = time.monotonic() - t0
        self._last = step
        return step

    def sample(self, step: InFlightStep) -> None:
        """Launch a deferred step's sampling: fill its constrained rows'
        bitmasks from their constraints (which have taken the previous
        step's tokens by now), then launch the sampling program. Its model
        has been running on the device meanwhile."""
        t0 = time.monotonic()
        compilations = self.runner.num_compilations
        fill_token_masks(step.plan)
        step.outs = self.runner.launch_sampling(step.plan, step.outs)
        step.deferred = False
        step.compiled |= self.runner.num_compilations != compilations
        step.host_s += time.monotonic() - t0

    def collect(self, step: InFlightStep):
        """Wait for ``step``'s results; returns its ``StepResult``."""
        if not step.poll():
            jax.block_until_ready(step.outs[1])
            step.ready_at = time.monotonic()
        return self.runner.finish(step.plan, step.outs)

    def info(self, step: InFlightStep) -> StepInfo:
        """``step``'s ``StepInfo`` (after its results were processed)."""
        start = step.launched
        if step.prev is not None and step.prev.ready_at is not None:
            start = max(start, step.prev.ready_at)
        step.prev = None  # no chain of old steps kept alive
        device = max(0.0, step.ready_at - start)
        b = step.batch
        return StepInfo(start, device, tuple(b.q_lens), step.kv_lens, b.num_decode,
                        step.compiled, host_ms=step.host_s * 1e3, device_ms=device * 1e3,
                        idle_ms=step.idle_s * 1e3, overlapped=step.overlapped)

    def idle(self) -> None:
        """The engine has no unfinished request: the device's idle time
        until the next step is the engine's, not the host's."""
        self._last = None

    def fail(self, *steps: InFlightStep | None) -> None:
        """Steps that failed (or whose results are lost): their unfinished
        sequences go back to the queue with the tokens known on the host."""
        for step in steps:
            if step is not None:
                for r in step.batch.requests:
                    if not r.finished:
                        self.scheduler.requeue(r)
        self._last = None
