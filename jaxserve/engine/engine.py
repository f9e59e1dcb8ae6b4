"""Engine: ``add_request`` / ``step`` / ``abort``, wired from narrow parts.

One thread, one loop: ``step()`` asks the scheduler for a plan, runs it on
device through the ModelRunner, appends the sampled tokens, detokenizes, and
retires finished requests; the gRPC server drives ``step()`` from its own
loop. With ``EngineConfig.async_scheduling`` (the default) a ``step()``
launches the next step before it waits for the one launched by the call
before, so the host's scheduling and detokenizing overlap the device
(``jaxserve.engine.async_step`` has the design); each call still returns the
outputs of one step, the same outputs as synchronous steps give, and no
threads are involved.

With ``EngineConfig.speculative`` set, ``jaxserve.engine.speculation``
plans the steps (drafts for decoding sequences, verified in the same ragged
step) and the output processor takes every accepted token of a row; its
module docstring has the design.

A user request is a group of ``n`` sequences (``outputs.Group``), one per
choice; outputs are reported per group, one ``RequestOutput`` per step in
which any of its choices changed.

The parts: ``build`` (load and validate once -> parts), ``intake`` (prompt
ids and request checks), ``scheduler``, ``async_step`` (launch / collect),
``runner``, ``outputs`` (``OutputProcessor``), ``kv_handoff``, ``warmup``,
``scoring``; ``views`` holds the read-only properties and narrow entry
points (multi-host following and scoring among them); ``llm`` the ``LLM``
facade.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Container, Iterable, Sequence

import jax

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.adapters import EngineLoRA, build_slots
from jaxserve.engine.async_step import InFlightStep, StepInfo, StepPipeline, sync_reason
from jaxserve.engine.build import build_engine
from jaxserve.engine.intake import Intake
from jaxserve.engine.kv_handoff import KVHandoff, check_prefilled_params
from jaxserve.engine.outputs import Group, OutputProcessor
from jaxserve.engine.request import Request, RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.spec_policy import ForcedDraftPolicy
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.views import EngineViews
from jaxserve.engine.warmup import Warmup
from pallas_kernels.ragged_paged_attention.quant import KVPages


class Engine(EngineViews, EngineLoRA):
    """The serving engine.

    Args:
      config: ``EngineConfig``.
      model_config, params, tokenizer, chat_template: give these to bypass
        loading ``config.model`` (tests use tiny random models this way);
        ``params=None`` with a ``model_config`` means random initialisation.
      devices: the devices of the mesh ``config.parallel``; default all of
        ``jax.devices()`` (the first one alone for the one-device default).
      draft_parts: ``{"model_config": ..., "params": ...}`` of a draft model
        given directly (tests), for ``speculative.method == "draft"``.
      spec_policy: a ``spec_policy.SpecPolicy`` to use instead of the
        learned one (tests with a fake cost model).

    Raises:
      ValueError: as ``build.build_engine``: unknown model alias, missing
        file, bad config, a mesh that does not fit the devices or the model,
        a draft model whose vocabulary differs from the target's, or
        speculation in a multi-host job.
    """

    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None,
                 params: dict | None = None, tokenizer=None, chat_template: str | None = None,
                 devices: Sequence[jax.Device] | None = None, draft_parts: dict | None = None,
                 spec_policy=None):
        p = build_engine(config, model_config=model_config, params=params, tokenizer=tokenizer,
                         chat_template=chat_template, devices=devices, draft_parts=draft_parts,
                         spec_policy=spec_policy)
        self.config, self.mesh, self.model_config = p.config, p.mesh, p.model_config
        self.tokenizer, self.chat_template = p.tokenizer, p.chat_template
        self.attention_impl, self.max_model_len = p.attention_impl, p.max_model_len
        self.attention_check = p.attention_check  # the start-up self-check, or None
        self.allocator, self.scheduler, self.runner = p.allocator, p.scheduler, p.runner
        self.speculator, self.eos_token_ids = p.speculator, p.eos_token_ids
        self._intake = Intake(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                              self.config.scheduler.max_num_seqs, self.allocator.page_size,
                              self.allocator.num_pages, self.config.seed)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.max_model_len)
        self.handoff = KVHandoff(self.scheduler, self.runner, self.outputs, self.model_config)
        self._pending: list[RequestOutput] = []  # outputs the next step() returns first
        self.forced_policy = ForcedDraftPolicy()  # forced tokens as drafts when they pay
        self._steps = StepPipeline(self.scheduler, self.runner, self.speculator,
                                   self.forced_policy)
        self._in_flight: InFlightStep | None = None  # launched, results not yet read
        self._num_steps = 0
        self.last_step: StepInfo | None = None  # the latest step's shape and time
        self._warmup = Warmup(self.runner, self.scheduler)
        self.adapters = build_slots(self.config, self.runner, self.model_config, self.scheduler)

    # ---- requests -----------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or vLLM's dict forms
        ``{"prompt": str}`` / ``{"prompt_token_ids": [int]}`` (``Intake.encode``).

        Raises:
          ValueError: empty prompt, ids outside the vocabulary, text without a
            tokenizer, or a prompt of another type.
        """
        return self._intake.encode(prompt)

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, hold_kv: bool = False,
                    constraints: list | None = None, lora=None) -> str:
        """Queue a request (its ``params.n`` choices); returns its id.

        ``arrival_time`` (``time.monotonic()`` seconds, default now) is where
        queue time, TTFT and E2E start: a server passes the time the request
        reached it. ``hold_kv`` (a prefill worker's request, ``n == 1``):
        when it finishes, its pages stay held for ``export_kv`` /
        ``release_kv`` instead of being freed (an abort still frees them).
        ``constraints``: its sequences' token constraints from
        ``build_constraints`` (built off this thread); None builds them here
        when ``params`` need a token mask (structured outputs,
        ``allowed_token_ids``, ``bad_words``). ``lora``: an adapter's name
        or an ``adapters.LoRARequest`` (None: the base model).

        Raises:
          ValueError: bad prompt or params, duplicate id, a prompt that leaves no
            room in ``max_model_len``, ``n`` above ``max_num_seqs``, a
            sequence larger than the whole KV cache, ``hold_kv`` with
            ``n > 1``, token ids of ``logit_bias`` / ``allowed_token_ids``
            outside the vocabulary, or a constraint the structured-outputs
            backend rejects; ``adapters.UnknownAdapterError`` for an unknown
            adapter.
        """
        adapter = self.resolve_lora(lora)
        group = self._new_group(request_id, prompt, params, arrival_time, constraints)
        if adapter is not None:
            adapter.num_requests += 1
            for r in group.seqs:
                r.adapter = adapter
        if hold_kv:
            if group.params.n != 1:
                raise ValueError(f"hold_kv needs SamplingParams.n == 1, got {group.params.n}")
            group.seqs[0].hold_kv = True
        self.outputs.add(group)
        for r in group.seqs:
            self.scheduler.add(r)
        return group.request_id

    def _new_group(self, request_id, prompt, params, arrival_time, constraints=None) -> Group:
        return self._intake.new_group(request_id, prompt, params, arrival_time,
                                      self.eos_token_ids, self.outputs.groups, constraints)

    def build_constraints(self, params: SamplingParams) -> list:
        """Each sequence's token constraint for a request with ``params``
        (``constraints.ConstraintFactory.build_all``), for ``add_request``'s
        ``constraints``. Safe on any thread: a server calls it in a worker
        thread so a grammar compile never stalls the step loop.

        Raises:
          ValueError: params the structured-outputs backend rejects.
        """
        return self._intake.constraints.build_all(params, self.eos_token_ids)

    def set_max_forced_drafts(self, k: int) -> None:
        """Set ``SchedulerConfig.max_forced_drafts`` (0 turns forced drafting
        off) from the next step on; a benchmark compares both.

        Raises:
          ValueError: ``k`` not an integer >= 0.
        """
        self.scheduler.config = dataclasses.replace(self.scheduler.config, max_forced_drafts=k)

    def set_forced_draft_policy(self, policy: ForcedDraftPolicy) -> None:
        """Use ``policy`` to decide when forced tokens ride as drafts, from
        the next step on (tests pin one with a given ``cost_fn``, so the
        choice does not follow the machine's measured step times)."""
        self.forced_policy = self._steps.forced_policy = policy

    def compile_structured(self, spec) -> None:
        """Compile a ``StructuredOutputsParams`` with the engine's grammar
        backend, cached by spec, so the request that carries it finds it
        compiled. Safe on any thread (a server calls it off its event loop).

        Raises:
          ValueError: a schema, regex or grammar the backend cannot compile
            (``structured_outputs.<field>: <why>``), or no tokenizer.
        """
        self._intake.constraints.compile(spec, self.eos_token_ids)

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or each of an iterable of ids) in any state
        (waiting, mid-prefill, decoding): its pages are freed now, and its
        final output (finish_reason "abort") comes from the next ``step``.
        Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, (str, int)) else list(request_id)
        for rid in ids:
            group = self.outputs.groups.get(str(rid))
            if group is None:
                continue
            for r in group.seqs:
                if not r.finished:
                    self.scheduler.finish(r, "abort")
            self._pending.append(self.outputs.group_output(group, {}, time.monotonic()))

    def pause(self, request_id: str) -> bool:
        """Set a request's unfinished choices aside: the running ones are
        preempted (pages freed, tokens kept), none is scheduled until
        ``resume``; a token already in flight still lands and is reported.
        For a stream whose client stopped reading
        (``jaxserve.server.backpressure``). Returns False for an unknown or
        finished id."""
        group = self.outputs.groups.get(str(request_id))
        live = [r for r in group.seqs if not r.finished] if group else []
        for r in live:
            self.scheduler.pause(r)
        return bool(live)

    def resume(self, request_id: str) -> bool:
        """Schedule a paused request's choices again (first in the queue);
        they are prefilled again from the tokens known so far, with prefix
        cache hits for the pages still cached, and then go on as if never
        paused (greedy tokens unchanged). Returns False when none was paused."""
        group = self.outputs.groups.get(str(request_id))
        paused = [r for r in group.seqs if r in self.scheduler.paused] if group else []
        for r in reversed(paused):
            self.scheduler.resume(r)
        return bool(paused)

    def requeue_outputs(self, outputs: Sequence[RequestOutput], front: bool = False) -> None:
        """Give back outputs ``step`` returned that the caller does not own
        (another caller's requests): the next ``step`` returns them again,
        after the outputs queued since (before them with ``front``)."""
        if front:
            self._pending[:0] = outputs
        else:
            self._pending.extend(outputs)

    def discard_outputs(self, request_ids: Container[str]) -> None:
        """Drop the queued outputs of ``request_ids`` (requests their caller
        aborted and will not read)."""
        self._pending = [o for o in self._pending if o.request_id not in request_ids]

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, running, in flight or has output to report."""
        return self.scheduler.has_unfinished() or bool(self._pending) or (
            self._in_flight is not None and self._in_flight.live)

    def get_sequences(self, request_id: str) -> list[Request]:
        """The live sequences (choices) of a request, for inspection; [] when
        gone. Between steps their ``output_token_ids`` may end in a
        placeholder (-1) for a token in flight; ``host_output_ids`` omit it."""
        group = self.outputs.groups.get(str(request_id))
        return list(group.seqs) if group else []

    # ---- KV handoff (disaggregated prefill/decode: ``kv_handoff``) -----------

    def cached_prefix_pages(self, token_ids: Sequence[int]) -> int:
        """Full pages of a prompt's prefix that this engine's prefix cache
        holds now (``Scheduler.cached_prefix_pages``)."""
        return self.scheduler.cached_prefix_pages(token_ids)

    def kv_fingerprint(self) -> str:
        """What two engines must share for KV pages to move between them
        (``KVHandoff.fingerprint``: SHA-256 hex of the model config, page
        size, KV dtype and a sample of the weights)."""
        return self.handoff.fingerprint()

    def export_kv(self, request_id: str, skip_pages: int = 0
                  ) -> list[tuple[KVPages, KVPages]]:
        """Copy a finished ``hold_kv`` request's pages from ``skip_pages`` on
        and release them (``KVHandoff.export``).

        Raises:
          KeyError: no pages are held under ``request_id`` (released, leased
            out, aborted, or never a ``hold_kv`` request).
          ValueError: ``skip_pages`` outside [0, held pages).
        """
        return self.handoff.export(request_id, skip_pages)

    def release_kv(self, request_id: str) -> bool:
        """Free a finished ``hold_kv`` request's held pages (lease expired,
        or the decode side gave up); False when none were held."""
        return self.handoff.release(request_id)

    def add_prefilled(self, request_id: str | None, prompt_token_ids: Sequence[int],
                      params: SamplingParams, first_token: int,
                      kv: list[tuple[KVPages, KVPages]],
                      skip_pages: int = 0, arrival_time: float | None = None,
                      first_logprob: float = 0.0, transfer_ms: float | None = None,
                      transfer_bytes: int = 0, scheduled_time: float | None = None) -> str:
        """Start a request whose prompt another engine prefilled: its first
        ``skip_pages`` pages come from this engine's prefix cache, the rest
        from ``kv`` (``export_kv``'s buffers, written into fresh pages), its
        first output token is ``first_token``; it joins the running batch as
        a decoding sequence, and its first output comes from the next
        ``step``. ``scheduled_time`` (monotonic s, default now): when its
        prefill began elsewhere, so ``queue_ms`` ends and ``prefill_ms``
        (prefill, handoff and transfer) starts there. Returns its id.

        Raises:
          ValueError: as ``add_request``; ``n > 1``, ``logprobs`` or
            ``prompt_logprobs`` (the handoff carries one token's id only).
          KVHandoffError: the pages cannot be taken now (``reason``:
            ``"evicted"``: the prefix-cache pages it skipped are gone;
            ``"no_pages"`` / ``"no_slot"``: no room; ``"bad_kv"``: buffers of
            the wrong page count or shape); nothing is changed then, and the
            caller runs the request with ``add_request`` instead.
        """
        params = params if params is not None else SamplingParams()
        check_prefilled_params(params)
        group = self._new_group(request_id, list(prompt_token_ids), params, arrival_time)
        self._pending.append(self.handoff.add_prefilled(
            group, first_token, kv, skip_pages, first_logprob, transfer_ms, transfer_bytes,
            scheduled_time))
        return group.request_id

    # ---- metrics and warm-up ---------------------------------------------------

    def stats(self) -> EngineStats:
        """Counts for metrics; see ``EngineStats``."""
        a, s, sp = self.allocator, self.scheduler, self.speculator
        spec = {} if sp is None else dict(
            spec_num_drafts=sp.stats.num_drafts, spec_num_draft_tokens=sp.stats.num_draft_tokens,
            spec_num_accepted_tokens=sp.stats.num_accepted_tokens,
            spec_accepted_per_position=tuple(sp.stats.accepted_per_position),
            spec_mean_acceptance_length=float(sp.stats.mean_acceptance_length), spec_k=sp.k)
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_paused=len(s.paused), pages_total=a.num_pages,
            pages_used=a.num_pages - a.num_free_pages, pages_free=a.num_free_pages,
            pages_cached=a.num_cached_pages, prefix_cache_queries=a.prefix_queries,
            prefix_cache_hits=a.prefix_hits, prefix_cache_hit_rate=a.prefix_hit_rate,
            num_preemptions=s.num_preemptions, prompt_tokens=self._steps.num_prompt_tokens,
            generation_tokens=self.outputs.num_generation_tokens, num_steps=self._num_steps,
            num_compilations=self.runner.num_compilations,
            num_forced_tokens=self.outputs.num_forced_tokens, **self._structured_stats(),
            attention_impl=self.attention_impl,
            attention_fallback=(self.attention_check.reason or "") if self.attention_check
            else "", **spec)

    def _structured_stats(self) -> dict:
        f = self._intake.constraints
        g = f.grammar_stats()
        out = dict(structured_requests=f.num_requests)
        if g is not None:
            out.update(grammar_compiled=g.compiled, grammar_compile_seconds=g.compile_seconds,
                       grammar_cache_hits=g.cache_hits, mask_fills=g.fills,
                       mask_fill_seconds=g.fill_seconds)
        return out

    def warmup(self, on_compiled=None, max_tokens: int | None = None,
               background: bool = False, max_rows: int | None = None,
               variants: bool = True) -> int:
        """Compile every step program this engine can reach (its draft
        model's too) before serving, so no request waits on XLA
        (``Warmup.run`` has the details). ``on_compiled(i, T, seconds)``
        reports progress; ``max_tokens`` / ``max_rows`` cap the prefill /
        decode buckets to a known batch; ``variants=False``: plain sampling
        only; ``background``: the smallest buckets now, the rest in a daemon
        thread (``warmup_done`` is set at its end) while ``Scheduler.caps``
        keeps steps within the ready buckets (one-process, no speculation).
        Returns the compilations it caused (before returning).

        Raises:
          MultihostError: a multi-host step failed.
        """
        sp = self.speculator
        return self._warmup.run(sp.draft.runner if sp is not None and sp.draft else None,
                                on_compiled, max_tokens, background, max_rows, variants,
                                speculating=sp is not None)

    # ---- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs of requests that changed.

        With async scheduling the step whose outputs come back is the one
        launched by the previous call (or now, if none is in flight), and the
        next one is launched before its results are read, unless
        ``async_step.sync_reason`` says it must wait.

        Raises:
          MultihostError: a multi-host step failed. After any failure the
            sequences of the steps in flight are re-queued (their tokens
            known on the host kept), so the engine stays consistent.
        """
        outputs, self._pending = self._pending, []
        cur, self._in_flight = self._in_flight, None
        try:
            if cur is not None and not cur.live:
                cur = None  # every sequence of it finished (aborted) since it was launched
            if cur is None:
                cur = self._steps.launch(None)
                if cur is None:
                    self._steps.idle()
                    return outputs
            forced = self.scheduler.config.max_forced_drafts if self.speculator is None else 0
            if self.config.async_scheduling and sync_reason(
                    cur, self.runner, forced, self.forced_policy,
                    len(self.scheduler.running)) is None \
                    and not (self.speculator is not None and self.speculator.wants_host_tokens):
                self._in_flight = self._steps.launch(cur)
                cur.overlapped = self._in_flight is not None
            res = self._steps.collect(cur)
        except BaseException:
            self._steps.fail(cur, self._in_flight)
            self._in_flight = None
            self._pending[:0] = outputs  # kept for the next call
            raise
        t = time.monotonic()
        outputs += self.outputs.process(cur, res, t, self.speculator)
        cur.host_s += time.monotonic() - t
        if self._in_flight is not None and self._in_flight.deferred:
            try:  # its constraints have taken cur's tokens: fill its masks, sample
                self._steps.sample(self._in_flight)
            except BaseException:
                self._steps.fail(self._in_flight)
                self._in_flight = None
                raise
        self.last_step = self._steps.info(cur)
        self._num_steps += 1
        if not self.last_step.compiled:
            if self.speculator is not None:
                self.speculator.observe_step(sum(cur.batch.q_lens), self.last_step.seconds)
            else:
                self.forced_policy.observe_step(sum(cur.batch.q_lens), self.last_step.seconds)
        if self._in_flight is not None and not self._in_flight.live:
            self._in_flight = None  # every row finished at ``cur``: nothing of it is wanted
        if self._in_flight is None and not self.scheduler.has_unfinished():
            self._steps.idle()
        return outputs

