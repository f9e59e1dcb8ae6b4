"""Requests in: a prompt's token ids, and the checks of a request against the
engine's limits, once, before anything is queued.

``Intake.encode`` takes a prompt in any of its forms (a string, token ids,
vLLM's dict prompts) to checked ids; ``Intake.new_group`` checks the request
(id, prompt length against ``max_model_len``, ``n`` against
``max_num_seqs``, its longest sequence against the KV cache, ``min_tokens``'
banned ids, ``logit_bias`` and ``allowed_token_ids`` against the
vocabulary) and builds its ``outputs.Group``: one ``Request`` per choice,
seeded (its own seed, or one drawn from the engine's seed), with a
detokenizer each and, when its params need a token mask, its own token
constraint (``constraints.ConstraintFactory``). Nothing is registered or
queued here: the engine does that.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Container

import numpy as np

from jaxserve.engine.constraints import ConstraintFactory, check_token_ids
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import Group
from jaxserve.engine.page_table import cdiv
from jaxserve.engine.request import Request, RequestMetrics
from jaxserve.engine.sampling_params import SamplingParams, check_text
from jaxserve.engine.sampling import MAX_BANNED


class Intake:
    """Encodes prompts and checks requests (module docstring).

    Args:
      tokenizer: the model's tokenizer, or None (token ids only).
      vocab_size: V; prompt ids must be in [0, V).
      max_model_len: longest sequence, tokens.
      max_num_seqs: most sequences of a step (``n``'s ceiling).
      page_size, num_pages: the KV cache's pages (a sequence must fit).
      seed: seeds the per-request seeds of requests that give none.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 page_size: int, num_pages: int, seed: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.page_size = page_size
        self.num_pages = num_pages
        self._seed_rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        # Each constrained sequence's TokenConstraint (constraints.py).
        self.constraints = ConstraintFactory(tokenizer, vocab_size)

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or vLLM's dict forms
        ``{"prompt": str}`` / ``{"prompt_token_ids": [int]}``.

        Raises:
          ValueError: empty prompt, ids outside the vocabulary, text without a
            tokenizer, or a prompt of another type.
        """
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt"}:
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            else:
                raise ValueError(f"a dict prompt needs exactly one key, 'prompt' or "
                                 f"'prompt_token_ids'; got keys {sorted(prompt)}")
        if not isinstance(prompt, (str, list, tuple, np.ndarray)):
            raise ValueError(f"prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: ''")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(check_text(prompt, "prompt"))
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError(f"prompt is empty: {prompt!r}")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return ids

    def new_group(self, request_id: str | None, prompt, params: SamplingParams | None,
                  arrival_time: float | None, eos_token_ids: frozenset[int],
                  taken: Container[str], constraints: list | None = None) -> Group:
        """Check a request and build its group (not yet registered or queued).

        Args:
          request_id: the caller's id, or None for the next free number.
          prompt: as ``encode`` takes it.
          params: its ``SamplingParams`` (None: the defaults).
          arrival_time: ``time.monotonic()`` seconds it arrived (None: now).
          eos_token_ids: the ids that end its sequences (the engine's now).
          taken: ids in use (the engine's live requests).
          constraints: each sequence's token constraint, built beforehand
            (``ConstraintFactory.build_all``, off the engine's thread); None
            builds them here.

        Raises:
          ValueError: bad prompt or params, duplicate id, a prompt that
            leaves no room in ``max_model_len``, ``n`` above
            ``max_num_seqs``, a sequence larger than the whole KV cache,
            more stop and EOS ids than ``min_tokens`` can ban, token ids of
            ``logit_bias`` / ``allowed_token_ids`` outside the vocabulary, or
            a constraint the structured-outputs backend rejects.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in taken:  # skip ids the caller chose
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in taken:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than "
                             f"max_model_len={self.max_model_len}")
        if params.n > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n must be <= max_num_seqs="
                             f"{self.max_num_seqs}, got {params.n}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if cdiv(longest, self.page_size) > self.num_pages:
            raise ValueError(f"a sequence of {longest} tokens needs more than the "
                             f"{self.num_pages} pages of the KV cache")
        if params.min_tokens and len(params.stop_token_ids) + len(eos_token_ids) > MAX_BANNED:
            raise ValueError(f"min_tokens supports at most {MAX_BANNED} stop and EOS ids, "
                             f"got {len(params.stop_token_ids) + len(eos_token_ids)}")
        check_token_ids(params, self.vocab_size)
        if constraints is None:
            constraints = self.constraints.build_all(params, eos_token_ids)
        elif len(constraints) != params.n:
            raise ValueError(f"{len(constraints)} constraints for a request of n={params.n}")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        text = prompt if isinstance(prompt, str) else None
        seqs: list[Request] = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(seq_id, text, ids, params, (seed + i) % 2**32,
                                eos_token_ids, metrics=metrics, group_id=request_id,
                                index=i, fork_of=seqs[0] if i else None,
                                constraint=constraints[i]))
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]
        return Group(
            request_id, text, ids, params, seqs,
            [IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                    params.include_stop_str_in_output) for _ in seqs], metrics)
