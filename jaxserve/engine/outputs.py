"""Output processing: a finished step's sampled tokens into its requests'
outputs.

``OutputProcessor.process`` takes one step's host ``StepResult``: prompt
logprobs into their requests, sampled tokens in place of their async
placeholders, the drafts a speculating row got accepted (``speculation.accept``),
each token's logprobs (the chosen one and the top ``logprobs``, with their
text), metrics, incremental detokenization, and the stop checks (stop
strings, EOS, stop ids, ``max_tokens``, ``max_model_len``, a token
constraint that completes or rejects the token), retiring finished sequences
through the scheduler. Every kept token (an accepted draft's too) advances
the sequence's token constraint (``Request.constraint``) once; a
recomputation after preemption or pause samples nothing already kept, so it
advances nothing. It reports per user request (``Group``: the
``n`` choices of one request and their detokenizers), one ``RequestOutput``
per step in which any choice changed, and retires a group once every choice
is done.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.engine.async_step import InFlightStep
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.plan import StepResult
from jaxserve.engine.request import (CompletionOutput, Logprob, Request, RequestMetrics,
                                     RequestOutput)
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.speculation import accept

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Group:
    """One user request: its choices (``params.n`` sequences, ``seqs[i]``
    is choice i) and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics


class OutputProcessor:
    """Turns steps' results into ``RequestOutput``s (module docstring).

    Args:
      tokenizer: the model's tokenizer (logprob texts), or None.
      scheduler: retires sequences that stop, caches their computed pages.
      max_model_len: longest sequence, tokens (a ``"length"`` stop).

    Attributes:
      groups: request id -> its live ``Group``.
      num_generation_tokens: tokens sampled into outputs since start.
      num_forced_tokens: of them, forced tokens of constrained sequences
        kept as drafts (``constraints.forced_drafts``).
    """

    def __init__(self, tokenizer, scheduler: Scheduler, max_model_len: int):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.groups: dict[str, Group] = {}
        self.num_generation_tokens = 0
        self.num_forced_tokens = 0

    def add(self, group: Group) -> None:
        """Register a new request's group (its outputs are reported from now)."""
        self.groups[group.request_id] = group

    def process(self, step: InFlightStep, res: StepResult, now: float,
                speculator=None) -> list[RequestOutput]:
        """Take a finished step's results into its sequences: prompt logprobs,
        prefix-cache pages, sampled tokens (replacing their placeholders),
        accepted drafts (graded with ``speculation.accept``, counted by
        ``speculator``), stop checks; returns the outputs of the groups that
        changed. A sequence that finished after the step was launched is
        skipped."""
        changed: dict[str, dict[int, tuple[str, list[int]]]] = {}
        for k, r in enumerate(step.batch.requests):
            if r.finished:
                continue  # stopped or aborted since: its token is dropped
            if k in res.prompt_logprobs:
                self._add_prompt_logprobs(r, *res.prompt_logprobs[k])
            if not step.samples[k]:  # a prompt chunk that does not reach the end
                self.scheduler.cache_computed_pages(r)
                continue
            slot = step.plan.row_slots[k]
            drafts = step.batch.drafts[k] if step.batch.drafts is not None else ()
            m = 0
            if drafts:  # speculation: roll back past the first rejected draft
                m = accept(drafts, res.token_ids[slot:slot + len(drafts) + 1])
                r.num_computed_tokens -= len(drafts) - m
                if r.constraint is not None:  # its drafts are forced tokens
                    self.num_forced_tokens += m
                else:
                    speculator.record(r, len(drafts), m)
            n_out = r.resolve_placeholder(int(res.token_ids[slot]))
            self.scheduler.cache_computed_pages(r)
            delta, toks = self._append(r, res, slot, n_out, now)
            for j in range(1, m + 1):  # the accepted drafts' next tokens, until a stop
                if r.finished:
                    break
                r.output_token_ids.append(int(res.token_ids[slot + j]))
                d, _ = self._append(r, res, slot + j, n_out + j, now)
                delta += d
                toks.append(int(res.token_ids[slot + j]))
            if m and not r.finished:
                self.scheduler.cache_computed_pages(r)
            changed.setdefault(r.group_id, {})[r.index] = (delta, toks)
        return [self.group_output(self.groups[gid], deltas, now)
                for gid, deltas in changed.items()]

    def _logprob_dict(self, chosen: int, lp: float, rank: int, top_ids, top_lps, k: int):
        """{token id: Logprob} of a position: the chosen token and the top ``k``."""
        def text(i):
            return self.tokenizer.decode([i], skip_special_tokens=False) \
                if self.tokenizer is not None else None
        out = {chosen: Logprob(lp, rank, text(chosen))}
        for j in range(k):
            i = int(top_ids[j])
            if i not in out:
                out[i] = Logprob(float(top_lps[j]), j + 1, text(i))
        return out

    def _add_prompt_logprobs(self, r: Request, lo: int, hi: int, arrays) -> None:
        lps, ranks, top_ids, top_lps = arrays
        k = r.params.prompt_logprobs
        assert len(r.prompt_logprobs) == lo, (len(r.prompt_logprobs), lo)
        for m, u in enumerate(range(lo, hi)):
            r.prompt_logprobs.append(self._logprob_dict(
                r.prompt_token_ids[u], float(lps[m]), int(ranks[m]), top_ids[m], top_lps[m], k))

    def _append(self, r: Request, res: StepResult, k: int, n_out: int,
                now: float) -> tuple[str, list[int]]:
        """Take slot ``k``'s sampled token, now ``r``'s ``n_out``-th output token
        on the host, into its logprobs, metrics, text and stop checks; returns
        (delta text, [token])."""
        tok = int(res.token_ids[k])
        top = None
        if r.params.logprobs is not None:
            top = (int(res.ranks[k]), res.top_ids[k], res.top_logprobs[k])
        return self.take_token(r, tok, float(res.logprobs[k]), top, n_out, now), [tok]

    def take_token(self, r: Request, tok: int, lp: float, top, n_out: int, now: float) -> str:
        """``r``'s ``n_out``-th output token ``tok`` (already in
        ``output_token_ids``, raw logprob ``lp``, ``top`` = (rank, top ids,
        top logprobs) when logprobs are asked) into its logprobs, metrics,
        text and stop checks; returns the delta text."""
        r.cumulative_logprob += lp
        if r.params.logprobs is not None:
            r.output_logprobs.append(self._logprob_dict(tok, lp, *top, r.params.logprobs))
        self.num_generation_tokens += 1
        if r.adapter is not None:
            r.adapter.num_generation_tokens += 1
        m = r.metrics
        m.num_output_tokens = max(m.num_output_tokens, n_out)
        if m.first_token_time is None:
            m.first_token_time = now
        detok = self.groups[r.group_id].detoks[r.index]
        p = r.params
        delta = detok.add(tok, check_stop=n_out >= p.min_tokens)
        reason, stop_reason = None, None
        ended = r.constraint is not None and self._constraint_ends(r, tok)
        if detok.stopped_on is not None:
            reason, stop_reason = "stop", detok.stopped_on
        elif n_out >= p.min_tokens and not p.ignore_eos and tok in r.eos_token_ids:
            reason = "stop"
        elif n_out >= p.min_tokens and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif ended:
            reason = "stop"
        elif n_out >= p.max_tokens or len(r.prompt_token_ids) + n_out >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(r, reason, stop_reason)
            delta += detok.finish()
        return delta

    @staticmethod
    def _constraint_ends(r: Request, tok: int) -> bool:
        """Advance ``r``'s constraint with its kept token ``tok``; True when
        the sequence must end there: the constraint is complete
        (``is_done``: it allows nothing but EOS, so the EOS step is skipped;
        an EOS it took also completes it), or it rejected ``tok`` (a token
        sampled from a row whose mask allowed nothing, or a backend whose
        mask and matcher disagree: nothing valid can follow). Either way
        the finish reason is ``"stop"``, as for EOS (vLLM's for a finished
        grammar); a rejection is logged."""
        if r.constraint.advance(tok):
            return r.constraint.is_done
        logger.warning("request %s: its token constraint rejected token %d after %d output "
                       "tokens; the sequence ends", r.request_id, tok, len(r.host_output_ids))
        return True

    def group_output(self, g: Group, deltas: dict, now: float) -> RequestOutput:
        """The group's output after a step: each choice's text and ids so far
        and its ``deltas`` {choice index: (delta text, delta ids)}; retires
        the group when every choice is done."""
        finished = all(r.finished for r in g.seqs)
        if finished:
            if g.metrics.finished_time is None:
                g.metrics.finished_time = now
            del self.groups[g.request_id]
        comps = []
        for r, detok in zip(g.seqs, g.detoks):
            delta_text, delta_ids = deltas.get(r.index, ("", []))
            comps.append(CompletionOutput(
                index=r.index, text=detok.output_text, token_ids=r.host_output_ids,
                finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                logprobs=list(r.output_logprobs) if g.params.logprobs is not None else None,
                cumulative_logprob=r.cumulative_logprob,
                delta_text=delta_text, delta_token_ids=delta_ids))
        plp = g.seqs[0].prompt_logprobs if g.params.prompt_logprobs is not None else None
        return RequestOutput(g.request_id, g.prompt, list(g.prompt_token_ids), comps,
                             finished, g.metrics, prompt_logprobs=plp)
