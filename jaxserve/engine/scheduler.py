"""Continuous-batching scheduler with chunked prefill and prefix caching
(host Python, one plan per step).

Policy (vLLM v1 / Sarathi-Serve): every step has a token budget,
``max_num_batched_tokens``. Running sequences are served first, in admission
order: a decoding sequence takes one token; a sequence part-way through its
prompt takes its next chunk (what is left of the budget). Then waiting
requests are admitted first come, first served while the budget, the
``max_num_seqs`` ceiling and the free pages allow; a prompt that does not fit
the remaining budget is cut into a chunk (unless chunked prefill is off).
Decodes therefore never stall behind a long prompt.

On admission a request reuses the cached pages of its longest cached prefix
(see ``page_table``); at least one token is always computed, so the last
prompt token's logits exist. Choices 1..n-1 of an ``n > 1`` request wait until
choice 0 has prefilled the prompt, then share its full prompt pages.

When a running sequence needs a page and none is free, the most recently
admitted running sequence is preempted (recompute: its pages are freed, and
it rejoins the front of the queue keeping its output tokens, which the next
prefill recomputes, mostly from the prefix cache).

With async scheduling the engine plans step N+1 while step N runs: the
sequences of N already count N's tokens as computed and each row of N that
samples holds a placeholder token (``Request.num_placeholders``), so a
decoding sequence simply takes its next token and page. A sequence whose
placeholders already reach ``max_tokens`` or ``max_model_len`` is not
planned again (it finishes when they resolve); one that still holds a
placeholder is never admitted (a preempted one waits for it), and the prefix
cache only ever hashes tokens known on the host.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from jaxserve.config import SchedulerConfig
from jaxserve.engine.kv_handoff import KVHandoffError
from jaxserve.engine.page_table import PageAllocator, page_hashes
from jaxserve.engine.request import Request, RequestStatus


def cache_root(req: Request) -> bytes | None:
    """The prefix-cache root of ``req``'s pages: its adapter's, or None."""
    return None if req.adapter is None else req.adapter.cache_root


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class ScheduledBatch:
    """One step's plan: the sequences and how many new tokens each computes.

    The first ``num_decode`` requests have exactly one new token each (decode
    rows); the rest are prefills, prefill chunks or speculative verification
    rows. A row whose tokens end before the sequence's last token (a
    non-final chunk) samples nothing. ``drafts[k]`` are row k's draft tokens
    (``jaxserve.engine.spec_decode``): its ``q_lens[k]`` counts its last
    token plus them, and it samples one token after each of them too; None
    when no row of the step speculates.
    """

    requests: list[Request]
    q_lens: list[int]
    num_decode: int
    drafts: list[list[int]] | None = None

    @property
    def decode(self) -> bool:
        """Every row is a decode row."""
        return self.num_decode == len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class Scheduler:
    """Admits, batches, preempts and retires sequences.

    Args:
      config: batching limits and the chunked-prefill switch.
      allocator: the page pool of the KV cache (prefix caching lives there).
      max_model_len: longest sequence, tokens.

    Counters: ``num_preemptions``, ``num_pauses``.
    """

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, max_model_len: int):
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Keep ~1% of pages free when admitting, so decode does not preempt at once.
        self.watermark_pages = max(1, allocator.num_pages // 100)
        self.num_preemptions = 0
        self.num_pauses = 0
        # Pages of finished ``hold_kv`` requests (a prefill worker's), by
        # request id, until ``release``: a decode worker pulls them first.
        self.held: dict[str, list[int]] = {}
        # Sequences set aside by ``pause`` (no pages, no slot) until ``resume``.
        self.paused: list[Request] = []
        # While a background warm-up compiles the larger step programs: (most
        # running sequences, most tokens of a step), both ladder values whose
        # programs exist, so no step waits on a compile; None: the config's.
        self.caps: tuple[int, int] | None = None
        # LoRA: the engine's ``adapters.AdapterSlots`` (None: LoRA off). A
        # sequence of an adapter pins its slot from admission until it is
        # unscheduled or finishes.
        self.adapters = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -----------------------------------------------------------

    def schedule(self, drafts: dict[Request, list[int]] | None = None,
                 max_slots: int | None = None) -> ScheduledBatch | None:
        """Plan the next step, or None when nothing can run.

        Args:
          drafts: speculation: draft tokens for running sequences in the
            decode state (their last token not computed, none in flight).
            Each gets ``1 + len(drafts)`` tokens and pages for them, drafts
            trimmed (never preempting anyone) to fit the budget, the free
            pages, its ``max_tokens``, ``max_model_len`` and ``max_slots``.
          max_slots: most sampled positions of the step (rows plus drafts:
            the runner's logits rows).
        """
        cfg = self.config
        alloc = self.allocator
        caps = self.caps
        budget = cfg.max_num_batched_tokens if caps is None else \
            min(cfg.max_num_batched_tokens, caps[1])
        max_seqs = cfg.max_num_seqs if caps is None else min(cfg.max_num_seqs, caps[0])
        decode: list[tuple[Request, int]] = []
        prefill: list[tuple[Request, int]] = []
        preempted = False
        drafts = drafts or {}
        planned: dict[Request, list[int]] = {}
        slots_left = (max_slots or cfg.max_num_seqs) - len(self.running)

        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue  # preempted below, or out of budget
            if req.num_placeholders and (len(req.output_token_ids) >= req.params.max_tokens
                                         or req.num_tokens >= self.max_model_len):
                continue  # its token in flight is its last (async scheduling)
            n = req.num_tokens - req.num_computed_tokens
            d = drafts.get(req)
            if d and n == 1 and not req.num_placeholders:
                room = min(len(d), budget - 1, max(0, slots_left),
                           req.params.max_tokens - len(req.output_token_ids) - 1,
                           self.max_model_len - req.num_tokens - 1)
                while room > 0 and alloc.pages_needed(
                        req.page_ids, req.num_computed_tokens + 1 + room) > alloc.num_free_pages:
                    room -= 1
                if room > 0:
                    planned[req] = list(d[:room])
                    slots_left -= room
                    n = 1 + room
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    continue
                n = budget
            while alloc.pages_needed(req.page_ids, req.num_computed_tokens + n) > \
                    alloc.num_free_pages:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            req.page_ids += alloc.allocate(
                alloc.pages_needed(req.page_ids, req.num_computed_tokens + n))
            (decode if n == 1 else prefill).append((req, n))
            budget -= n

        skipped: list[Request] = []
        num_drafts = sum(len(d) for d in planned.values())
        while self.waiting and not preempted and budget > 0 \
                and len(self.running) < max_seqs \
                and (max_slots is None or len(self.running) + num_drafts < max_slots):
            req = self.waiting.popleft()
            if self._gated(req) or not self._slot_ready(req):
                skipped.append(req)
                continue
            n = self._admit(req, budget, decode, prefill)
            if not n:
                self.waiting.appendleft(req)
                break
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        if not decode and not prefill:
            return None
        reqs = [r for r, _ in decode] + [r for r, _ in prefill]
        q_lens = [q for _, q in decode] + [q for _, q in prefill]
        return ScheduledBatch(reqs, q_lens, num_decode=len(decode),
                              drafts=[planned.get(r, []) for r in reqs] if planned else None)

    def _gated(self, req: Request) -> bool:
        """Choices 1.. of an n > 1 request wait for choice 0's prompt pages; a
        sequence preempted with a token in flight waits for that token."""
        if req.num_placeholders:
            return True
        parent = req.fork_of
        return (parent is not None and not req.output_token_ids
                and parent.status is not RequestStatus.FINISHED
                and parent.num_computed_tokens < len(parent.prompt_token_ids))

    def _slot_ready(self, req: Request) -> bool:
        """A LoRA request can get its adapter a slot now (else it waits, and
        requests behind it may pass)."""
        return req.adapter is None or self.adapters.can_acquire(req.adapter)

    def _admit(self, req: Request, budget: int, decode, prefill) -> int:
        """Try to start ``req`` within ``budget`` tokens; returns the tokens it
        computes this step, or 0 if it must wait."""
        cfg, alloc, L = self.config, self.allocator, self.allocator.page_size
        # Reuse cached pages of the prefix (never the last token: its logits are needed).
        max_pages = (req.num_tokens - 1) // L
        hits: list[int] = []
        if not req.wants_prompt_logprobs:
            if alloc.enable_prefix_caching:
                req.page_hashes = page_hashes(req.all_token_ids[:max_pages * L], L,
                                              req.page_hashes, cache_root(req))
                hits = alloc.lookup(req.page_hashes, max_pages)
            parent = req.fork_of
            if parent is not None and parent.status is RequestStatus.RUNNING \
                    and parent.num_computed_tokens >= len(parent.prompt_token_ids):
                fork = parent.page_ids[:min(max_pages, (len(parent.prompt_token_ids) - 1) // L)]
                if len(fork) > len(hits):
                    hits = fork
        computed = len(hits) * L
        n = req.num_tokens - computed
        if n > budget:
            if cfg.enable_chunked_prefill:
                n = budget
            elif prefill:  # unchunked: a long prompt may overrun the budget, beside decodes only
                return 0
        need = alloc.pages_needed(hits, computed + n)
        reserve = self.watermark_pages if (self.running or decode or prefill) else 0
        if need + alloc.count_free_among(hits) + reserve > alloc.num_free_pages:
            return 0
        if not req.wants_prompt_logprobs:
            alloc.prefix_queries += req.num_tokens
            alloc.prefix_hits += computed
        alloc.share(hits)
        req.page_ids = hits + alloc.allocate(need)
        if req.adapter is not None:
            req.lora_slot = self.adapters.acquire(req.adapter)
        req.num_computed_tokens = computed
        req.num_draft_computed = 0  # new pages: the draft model catches up from the start
        req.num_registered_pages = len(hits)
        if req.metrics.first_scheduled_time is None:
            req.metrics.num_cached_tokens = computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        (decode if n == 1 else prefill).append((req, n))
        return n

    # ---- prefilled elsewhere (KV handoff: ``jaxserve.engine.kv_handoff``) ------

    def cached_prefix_pages(self, token_ids: Sequence[int]) -> int:
        """Full pages of a prompt's prefix that the prefix cache holds now
        (never the page of the last token, whose logits a prefill must
        compute), as ``_admit`` would reuse them."""
        L = self.allocator.page_size
        max_pages = (len(token_ids) - 1) // L
        if not self.allocator.enable_prefix_caching or max_pages <= 0:
            return 0
        return len(self.allocator.lookup(page_hashes(list(token_ids[:max_pages * L]), L),
                                         max_pages))

    def admit_prefilled(self, req: Request, skip_pages: int, num_pages: int,
                        write: Callable[[list[int]], None]) -> None:
        """Start ``req``, whose whole prompt another engine prefilled, as a
        running decoding sequence: its first ``skip_pages`` pages from the
        prefix cache, then ``num_pages`` fresh pages that ``write(page_ids)``
        fills; its prompt counts as computed (the skipped pages as prefix
        cache hits).

        Raises:
          KVHandoffError: ``"evicted"``: a skipped page is no longer cached;
            ``"no_slot"``: ``max_num_seqs`` sequences run; ``"no_pages"``:
            too few free pages (beside the watermark while others run);
            ``"bad_kv"``: ``write`` raised ``ValueError``. Nothing is
            changed then (but ``req.page_hashes``).
        """
        alloc, L = self.allocator, self.allocator.page_size
        ids = req.prompt_token_ids
        hits: list[int] = []
        if skip_pages:
            req.page_hashes = page_hashes(ids[:skip_pages * L], L, root=cache_root(req))
            hits = alloc.lookup(req.page_hashes, skip_pages)
            if len(hits) < skip_pages:
                raise KVHandoffError("evicted", f"{skip_pages - len(hits)} of the "
                                     f"{skip_pages} cached prefix pages were evicted")
        if len(self.running) >= self.config.max_num_seqs:
            raise KVHandoffError("no_slot", f"{len(self.running)} sequences run already")
        reserve = self.watermark_pages if self.running else 0
        if num_pages + alloc.count_free_among(hits) + reserve > alloc.num_free_pages:
            raise KVHandoffError("no_pages", f"{num_pages} pages needed, "
                                 f"{alloc.num_free_pages} free")
        alloc.share(hits)
        new = alloc.allocate(num_pages)
        try:
            write(new)
        except ValueError as e:
            alloc.free(hits + new)
            raise KVHandoffError("bad_kv", str(e)) from None
        req.page_ids = hits + new
        req.num_computed_tokens = len(ids)
        req.num_registered_pages = len(hits)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        alloc.prefix_queries += len(ids)
        alloc.prefix_hits += skip_pages * L

    # ---- state changes --------------------------------------------------------

    def cache_computed_pages(self, req: Request) -> None:
        """Put ``req``'s newly filled, computed pages into the prefix cache."""
        alloc, L = self.allocator, self.allocator.page_size
        known = min(req.num_computed_tokens, req.num_tokens - req.num_placeholders)
        full = min(known // L, len(req.page_ids))
        if not alloc.enable_prefix_caching or full <= req.num_registered_pages:
            return
        req.page_hashes = page_hashes(req.all_token_ids[:full * L], L, req.page_hashes,
                                      cache_root(req))
        lo = req.num_registered_pages
        alloc.register(req.page_ids[lo:full], req.page_hashes[lo:full])
        req.num_registered_pages = full

    def _unschedule(self, req: Request) -> None:
        """Take a running ``req`` out of the batch: its pages are freed, its
        tokens stay on the host, and it is computed again from the start
        when next admitted."""
        self.running.remove(req)
        self.allocator.free(req.page_ids)
        self._release_slot(req)
        req.page_ids = []
        req.num_computed_tokens = 0
        req.num_registered_pages = 0
        req.status = RequestStatus.WAITING

    def _release_slot(self, req: Request) -> None:
        if req.lora_slot:
            self.adapters.release(req.lora_slot)
            req.lora_slot = 0

    def _preempt(self, req: Request) -> None:
        self._unschedule(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def pause(self, req: Request) -> None:
        """Set an unfinished ``req`` aside (its stream's client stopped
        reading): a running sequence is preempted (pages freed, its tokens
        kept on the host, a token in flight still lands), a waiting one
        leaves the queue; it holds no slot and no page, and is not scheduled
        until ``resume``. Paused already or finished: nothing happens."""
        if req.finished or req in self.paused:
            return
        if req in self.running:
            self._unschedule(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            return
        self.paused.append(req)
        self.num_pauses += 1

    def resume(self, req: Request) -> None:
        """Put a paused ``req`` back at the front of the queue; it is
        prefilled again from its prompt and outputs so far (the prefix cache
        serves the pages it still holds). Not paused: nothing happens."""
        if req in self.paused:
            self.paused.remove(req)
            self.waiting.appendleft(req)

    def requeue(self, req: Request) -> None:
        """Send an unfinished ``req`` back to the front of the queue with only
        its tokens known on the host (after a failed step): its pages are
        freed and it is prefilled again. Not counted as a preemption."""
        req.drop_placeholders()
        if req in self.running:
            self._unschedule(req)
            self.waiting.appendleft(req)

    def release(self, request_id: str) -> bool:
        """Free the held pages of a finished ``hold_kv`` request; False when
        none are held under that id (released already, or never held)."""
        pages = self.held.pop(request_id, None)
        if pages is None:
            return False
        self.allocator.free(pages)
        return True

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Retire ``req`` (running or waiting) and free its pages (or, for
        a ``hold_kv`` request that was not aborted, hold them in ``held``); a
        token of it still in flight is dropped."""
        req.drop_placeholders()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.paused:
            self.paused.remove(req)
        if req.page_ids:
            if req.hold_kv and reason != "abort":
                self.held[req.request_id] = req.page_ids
            else:
                self.allocator.free(req.page_ids)
            req.page_ids = []
        self._release_slot(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
