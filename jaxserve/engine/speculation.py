"""Speculative decoding in the engine: who drafts, where the drafts ride,
and how they are graded (Leviathan et al. 2023; Chen et al. 2023).

Per engine step (``Speculator.schedule``, called where the scheduler would be):

1. The policy (``spec_policy.SpecPolicy``) picks k from the number of
   decode-state sequences and the measured acceptance and step costs; k = 0
   plans a plain step (and, for ``ngram``, keeps proposing in the shadow, so
   its acceptance estimate never goes stale and speculation can come back).
2. The proposer drafts up to k tokens for each running sequence whose last
   token is known on the host: ``ngram`` (prompt lookup,
   ``spec_decode.ngram_propose``) before scheduling; ``draft`` (a second
   model, ``DraftModelProposer``) after the scheduler has reserved the
   budget and pages for k + 1 positions.
3. The scheduler gives each drafted sequence ``1 + len(drafts)`` query tokens
   in the same ragged step as plain decodes and prefill chunks (trimming
   drafts, never preempting, to fit the budget, the free pages, the logits
   rows, ``max_tokens`` and ``max_model_len``); the runner samples one token
   after the last token and after every draft ("slots": ``StepPlan.row_slots``).
4. Grading (``accept``): slot j samples the target's token for output
   position ``n + j`` exactly as a plain decode step would: the same
   temperature, filters, penalties, min_tokens bans and the same PRNG key
   ``fold_in(key(seed), n + j)``. Draft j + 1 is accepted while it equals
   slot j's token; the first slot whose token differs (or the slot after the
   last draft) supplies the target's own next token. So greedy outputs are
   the target's argmax, and sampled outputs are token for token what the
   request would have drawn without speculation, whatever k, the batch or the
   policy's choices.

Why this is exact. For a draft that proposes one token deterministically
(``ngram``; any proposer under greedy decoding) the draft distribution q is a
point mass on d, so Leviathan's rule "accept d with probability
min(1, p(d) / q(d)), else sample from norm(max(0, p - q))" is "accept with
probability p(d), else sample from p restricted to tokens != d": exactly the
event "the target's own sample equals d", with the target's own sample as the
replacement. For a sampling draft model the draft draws its token with the
same Gumbel noise as the target's slot (``fold_in(key(seed), n + j)``, same
temperature and filters): d = argmax(log q + g), the target's token
argmax(log p + g). Accepting iff they are equal outputs argmax(log p + g)
at every position, a sample of p: the Gumbel-max coupling of Daliri, Musco
and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding" (2024). It accepts with probability at least
(1 - TV(p, q)) / (1 + TV(p, q)) where the residual-sampling rule accepts
1 - TV; in exchange a seeded request's tokens do not depend on the drafter,
k or its batch-mates.

Pages: the scheduler allocates pages for the k + 1 positions before the step;
after grading, ``num_computed_tokens`` rolls back to the last accepted
position, so the K/V written for rejected drafts is overwritten later and the
prefix cache (which hashes only computed, host-known tokens) never names an
unverified token. An abort or preemption frees the pages as for any sequence.

The draft model (``DraftModelProposer``) has its own KV cache, indexed by
the target's page ids: the same page table, the same allocator, so the
draft's cache follows every rule of the target's (freed together, shared
together). ``Request.num_draft_computed`` is how far the draft's K/V of a
sequence is valid; before drafting, the draft first catches up on every
token it has not computed (the prompt after admission, the tokens of steps
that did not speculate, the last accepted draft), in chunks of the step
budget. It is reset on admission and preemption (new pages), and clipped to
``num_computed_tokens`` after grading. Prefix-cache hits are the target's
only: a new sequence's draft recomputes its prompt (writing the same values
into shared pages).

Constrained sequences (structured outputs, ``allowed_token_ids``,
``bad_words``: ``Request.constraint``) are never drafted for by the
proposer (a slot after a free draft would need the constraint's state after
it, and a draft the grammar rejects would waste its slot); their only
drafts are the tokens their constraint forces (``constraints.forced_drafts``,
with or without a speculator), always accepted, and not counted in the
speculation statistics or the policy's acceptance.

Speculative steps are synchronous (the next plan needs the accepted tokens on
the host); while the policy's k is 0 the engine's async scheduling runs as
without speculation.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.constraints import forced_drafts
from jaxserve.engine.plan import SeqView
from jaxserve.engine.request import Request, RequestStatus, decode_ready  # noqa: F401 (re-exported)
from jaxserve.engine.scheduler import ScheduledBatch, Scheduler
from jaxserve.engine.spec_decode import SpecStats, ngram_propose
from jaxserve.engine.spec_policy import SpecPolicy


def accept(drafts, sampled) -> int:
    """How many drafts the target accepts: the length of the longest prefix
    of ``drafts`` equal to ``sampled`` (the target's tokens after the last
    token and after each draft; ``len(sampled) == len(drafts) + 1``). The
    output is ``sampled[:m + 1]``."""
    m = 0
    while m < len(drafts) and int(drafts[m]) == int(sampled[m]):
        m += 1
    return m


class DraftModelProposer:
    """Drafts with a second model in the same engine (``--speculative_method
    draft``): one ``ModelRunner`` over the draft model whose KV cache has the
    target's page count and is indexed by the target's page ids.

    Args:
      runner: the draft's ``ModelRunner`` (same mesh, same pages).
      max_num_batched_tokens: most tokens of one draft step (catch-up chunks).

    Counters: ``num_steps`` draft steps run; ``seconds`` host wall time in them.
    """

    def __init__(self, runner, max_num_batched_tokens: int):
        self.runner = runner
        self.budget = max_num_batched_tokens
        self.num_steps = 0
        self.seconds = 0.0
        self._params: dict[int, object] = {}
        self.on_decode_step = None  # (rows, seconds) of each one-token-per-row step

    def _plain(self, params):
        key = id(params)
        if key not in self._params:
            self._params[key] = dataclasses.replace(params, logprobs=None, prompt_logprobs=None)
        return self._params[key]

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Draft ``ks[i]`` tokens for each decode-ready ``reqs[i]`` (pages for
        its next ``ks[i] + 1`` positions allocated), after catching the
        draft's cache up on the tokens it has not computed. Leaves each
        ``num_draft_computed`` at the draft's valid K/V (through its
        second-to-last draft)."""
        self._params = {}
        views = [SeqView(r, self._plain(r.params), list(r.all_token_ids),
                         min(r.num_draft_computed, r.num_computed_tokens))
                 for r in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        while True:
            budget = self.budget
            rows, q_lens = [], []
            for i, v in enumerate(views):
                if len(drafts[i]) >= ks[i] or budget == 0:
                    continue
                q = min(v.num_tokens - v.num_computed_tokens, budget)
                rows.append(i)
                q_lens.append(q)
                budget -= q
            if not rows:
                break
            order = sorted(range(len(rows)), key=lambda j: q_lens[j] != 1)  # decode rows first
            rows = [rows[j] for j in order]
            q_lens = [q_lens[j] for j in order]
            batch = ScheduledBatch([views[i] for i in rows], q_lens,
                                   num_decode=sum(q == 1 for q in q_lens))
            t0, compiled = time.monotonic(), self.runner.num_compilations
            res = self.runner.execute(batch)
            dt = time.monotonic() - t0
            self.num_steps += 1
            self.seconds += dt
            if batch.decode and self.on_decode_step is not None \
                    and compiled == self.runner.num_compilations:
                self.on_decode_step(len(rows), dt)
            for k, (i, q) in enumerate(zip(rows, q_lens)):
                v = views[i]
                v.num_computed_tokens += q
                if v.num_computed_tokens == v.num_tokens:  # its last token: a draft
                    tok = int(res.token_ids[k])
                    v.tokens.append(tok)
                    drafts[i].append(tok)
        for r, v in zip(reqs, views):
            r.num_draft_computed = v.num_computed_tokens
        return drafts


class Speculator:
    """The engine's speculation: policy, proposer and counters.

    Args:
      config: the ``SpeculativeConfig`` (method ``ngram`` or ``draft``).
      max_slots: logits rows of a step (the runner's ``max_rows``).
      draft: the ``DraftModelProposer`` for method ``draft``.
      policy: a ``SpecPolicy`` to use (tests pass one with a fake cost
        model); default one learned online.
    """

    def __init__(self, config: SpeculativeConfig, max_slots: int,
                 draft: DraftModelProposer | None = None, policy: SpecPolicy | None = None):
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.max_slots = max_slots
        self.draft = draft
        self.policy = policy or SpecPolicy(self.max_k, method=config.method)
        self.stats = SpecStats(self.max_k)
        self.k = self.max_k if not config.adaptive else 0  # the latest step's choice
        if draft is not None:
            draft.on_decode_step = self.policy.observe_draft_step
        self._shadow: dict[Request, tuple[int, list[int]]] = {}

    @property
    def wants_host_tokens(self) -> bool:
        """The next plan may draft: it needs this step's tokens on the host
        (so the engine plans it synchronously)."""
        return self.k > 0

    def schedule(self, scheduler: Scheduler) -> ScheduledBatch | None:
        """Plan a step as ``scheduler.schedule`` does, with drafts for the
        decode-ready sequences when the policy's k is above 0."""
        # Constrained sequences are not drafted: their verification slots
        # would need the constraint's mask after each draft.
        ready = [r for r in scheduler.running if decode_ready(r) and r.constraint is None]
        if self.config.adaptive:
            decoding = sum(1 for r in scheduler.running
                           if r.num_tokens - r.num_computed_tokens <= 1)
            prefill = min(scheduler.config.max_num_batched_tokens,
                          sum(max(0, r.num_tokens - r.num_computed_tokens - 1)
                              for r in scheduler.running))
            self.k = self.policy.choose_k(decoding, prefill)
        forced = forced_drafts(scheduler.running,  # constrained rows' free drafts
                               scheduler.config.max_forced_drafts)
        if self.k == 0 or not ready:
            if self.config.method == "ngram":
                self._shadow_propose(scheduler)
            return scheduler.schedule(forced or None, self.max_slots if forced else None)
        if self.config.method == "ngram":
            props = ngram_propose([r.all_token_ids for r in ready], [self.k] * len(ready),
                                  self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            drafts = {r: d for r, d in zip(ready, props) if d}
            for _ in range(len(ready) - len(drafts)):  # no proposal: position 0 missed
                self.policy.observe_acceptance(0, 0)
        else:
            drafts = {r: [0] * self.k for r in ready}
        batch = scheduler.schedule({**drafts, **forced} or None, self.max_slots)
        if batch is not None and batch.drafts is not None and self.draft is not None:
            rows = [k for k, d in enumerate(batch.drafts)
                    if d and batch.requests[k].constraint is None]
            proposed = self.draft.propose([batch.requests[k] for k in rows],
                                          [len(batch.drafts[k]) for k in rows])
            for k, d in zip(rows, proposed):
                assert len(d) == len(batch.drafts[k]), (len(d), len(batch.drafts[k]))
                batch.drafts[k] = d
        return batch

    def record(self, r: Request, num_drafted: int, num_accepted: int) -> None:
        """Count a graded row (engine stats, the policy, the request's metrics)."""
        self.stats.record(num_drafted, num_accepted)
        self.policy.observe_acceptance(num_drafted, num_accepted)
        r.metrics.num_draft_tokens += num_drafted
        r.metrics.num_accepted_tokens += num_accepted

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A target step's real token count and device seconds (not compiled)."""
        self.policy.observe_step(num_tokens, seconds)

    def _shadow_propose(self, scheduler: Scheduler) -> None:
        """While k is 0: grade the previous shadow proposals whose positions
        are now on the host, and propose again for sequences without one."""
        live = {r for r in scheduler.running}
        for r in list(self._shadow):
            start, prop = self._shadow[r]
            host = r.prompt_token_ids + r.host_output_ids
            if r not in live:
                del self._shadow[r]
            elif len(host) >= start + len(prop):
                self.policy.observe_shadow(len(prop), accept(prop, host[start:] + [-1]))
                del self._shadow[r]
        fresh = [r for r in scheduler.running
                 if r not in self._shadow and r.num_tokens - r.num_computed_tokens <= 1]
        if not fresh:
            return
        hosts = [r.prompt_token_ids + r.host_output_ids for r in fresh]
        props = ngram_propose(hosts, [self.max_k] * len(fresh), self.config.prompt_lookup_min,
                              self.config.prompt_lookup_max)
        for r, h, p in zip(fresh, hosts, props):
            if p:
                self._shadow[r] = (len(h), p)
            else:
                self.policy.observe_shadow(0, 0)
