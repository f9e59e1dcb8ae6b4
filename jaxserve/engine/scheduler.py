"""Continuous-batching scheduler (host Python, one plan per step).

Policy (vLLM v0 style, prefill first): when requests wait and there is room
(``max_num_seqs``, ``max_num_batched_tokens``, free pages), the step is a
prefill of as many waiting requests as fit, packed ragged; otherwise the step
decodes one token for every running request. A running request that needs a
new page when none is free preempts the most recently admitted request
(recompute preemption: its pages are freed and it rejoins the front of the
queue, keeping its output tokens, so the next prefill recomputes them).
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.config import SchedulerConfig
from jaxserve.engine.page_table import PageAllocator
from jaxserve.engine.request import Request, RequestStatus


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def page_bucket(n: int, minimum: int = 4) -> int:
    """Smallest of {2^k, 3 * 2^(k-1)} >= max(n, minimum): at most 33% padding,
    about twice the bucket count of powers of two."""
    p = next_pow2(n, minimum)
    return p * 3 // 4 if p >= 4 and p * 3 // 4 >= max(n, minimum) else p


@dataclasses.dataclass
class ScheduledBatch:
    """One step's plan: the requests and how many new tokens each computes."""

    decode: bool
    requests: list[Request]
    q_lens: list[int]


class Scheduler:
    """Admits, batches, preempts and retires requests.

    Args:
      config: batching limits; ``max_model_len`` must be resolved (not None).
      allocator: the page allocator of the KV cache.
    """

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, max_model_len: int):
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Keep ~1% of pages free when admitting, so decode does not preempt at once.
        self.watermark_pages = max(1, allocator.num_pages // 100)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Plan the next step, or None when nothing can run."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        cfg = self.config
        reqs, q_lens = [], []
        while self.waiting and len(self.running) + len(reqs) < cfg.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if reqs:
                tokens = sum(q_lens) + n
                work = next_pow2(max(q_lens + [n])) * (len(reqs) + 1)
                if tokens > cfg.max_num_batched_tokens or work > 2 * cfg.max_num_batched_tokens:
                    break
            need = self.allocator.pages_needed(req.page_ids, req.num_tokens)
            reserve = self.watermark_pages if (self.running or reqs) else 0
            if need + reserve > self.allocator.num_free_pages:
                break
            req.page_ids += self.allocator.allocate(need)
            self.waiting.popleft()
            reqs.append(req)
            q_lens.append(n)
        if not reqs:
            return None
        for req in reqs:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return ScheduledBatch(decode=False, requests=reqs, q_lens=q_lens)

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Request] = []
        for req in list(self.running):
            if req not in self.running:  # preempted below by an earlier request
                continue
            while self.allocator.pages_needed(req.page_ids, req.num_tokens) > \
                    self.allocator.num_free_pages:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            req.page_ids += self.allocator.allocate(
                self.allocator.pages_needed(req.page_ids, req.num_tokens))
            scheduled.append(req)
        if not scheduled:
            return None
        return ScheduledBatch(decode=True, requests=scheduled, q_lens=[1] * len(scheduled))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.page_ids)
        req.page_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Retire ``req`` (running or waiting) and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.page_ids:
            self.allocator.free(req.page_ids)
            req.page_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
