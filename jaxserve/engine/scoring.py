"""Scoring: logits of given token ids, for parity tests, perplexity and KL
(``jaxserve.bench.eval``). Nothing is sampled or kept: each call takes fresh
pages from the allocator (no prefix cache), runs one prefill, and frees them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxserve.engine.page_table import PageAllocator, cdiv
from jaxserve.engine.request import Request
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import ScheduledBatch


def last_token_logits(runner, allocator: PageAllocator, prompts: Sequence,
                      encode: Callable[[object], list[int]],
                      eos_token_ids: frozenset[int], adapters: Sequence = (),
                      slots=None) -> np.ndarray:
    """f32[n, V] next-token logits of each of the n prompts (each checked by
    ``encode``), computed in one ragged prefill through ``runner``.
    ``adapters``: each prompt's LoRA ``Adapter`` (None: the base), whose
    slots ``slots`` (``AdapterSlots``) pins for the step.

    Raises:
      ValueError: bad prompt, the prompts do not fit in the free pages, or
        their adapters do not fit in the free slots.
    """
    reqs = []
    adapters = list(adapters) or [None] * len(prompts)
    try:
        for ids, adapter in zip(prompts, adapters):
            ids = encode(ids)
            r = Request(f"_logits{len(reqs)}", None, ids, SamplingParams(temperature=0),
                        0, eos_token_ids)
            r.page_ids = allocator.allocate(cdiv(len(ids), allocator.page_size))
            reqs.append(r)
            if adapter is not None:
                if not slots.can_acquire(adapter):
                    raise ValueError("the prompts' adapters do not fit in the free LoRA slots")
                r.lora_slot = slots.acquire(adapter)
        batch = ScheduledBatch(reqs, [r.num_tokens for r in reqs], num_decode=0)
        return runner.execute(batch, return_logits=True).logits
    finally:
        for r in reqs:
            allocator.free(r.page_ids)
            if r.lora_slot:
                slots.release(r.lora_slot)


def prompt_logits(runner, allocator: PageAllocator, ids: list[int], max_model_len: int,
                  eos_token_ids: frozenset[int]) -> np.ndarray:
    """f32[T, V] next-token logits after each of the T checked ``ids``: row t
    is the model's distribution over token t + 1 given tokens 0..t
    (``ModelRunner.token_logits``); T x V f32 is ~100 MB for T = 512,
    V = 49152.

    Raises:
      ValueError: T above ``max_model_len``, more pages than are free, or a
        multi-host job.
    """
    if len(ids) > max_model_len:
        raise ValueError(f"prompt_logits: {len(ids)} tokens exceed max_model_len "
                         f"{max_model_len}")
    r = Request("_prompt_logits", None, ids, SamplingParams(temperature=0), 0, eos_token_ids)
    r.page_ids = allocator.allocate(cdiv(len(ids), allocator.page_size))
    try:
        return runner.token_logits(ScheduledBatch([r], [len(ids)], num_decode=0))
    finally:
        allocator.free(r.page_ids)
