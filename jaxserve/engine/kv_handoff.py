"""KV handoff between engines (disaggregated prefill/decode, ``jaxserve.disagg``).

A prefill worker runs a request with ``hold_kv``: when it finishes, its pages
stay held (``Scheduler.held``) instead of being freed. The decode worker asks
how many of the prompt's full pages its own prefix cache already holds
(``cached_prefix_pages``), the prefill worker exports the rest (``export``:
``ModelRunner.read_pages``, then releases them) or releases them when the
lease lapses (``release``), and the decode worker starts the request from
the transferred pages (``add_prefilled``): the skipped pages come from its
prefix cache, the others are written into fresh pages
(``ModelRunner.write_pages``), and the request joins the running batch as a
decoding sequence whose first output token the prefill worker sampled.
Admission is the scheduler's (``Scheduler.admit_prefilled``): nothing here
edits its running list or the allocator's counters.

Both engines must share ``fingerprint()`` (model config, page size, KV dtype
and a sample of the weights) for pages to move between them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.page_table import cdiv
from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from pallas_kernels.ragged_paged_attention.quant import KVPages


class KVHandoffError(ValueError):
    """A prefilled request's KV cannot be taken (``Engine.add_prefilled``);
    ``reason`` is a short label for metrics: ``"evicted"``, ``"no_pages"``,
    ``"no_slot"`` or ``"bad_kv"``."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"KV handoff refused ({reason}): {message}")
        self.reason = reason


def check_prefilled_params(params: SamplingParams) -> None:
    """Raise ``ValueError`` unless ``params`` suit a prefilled request:
    ``n == 1`` and no ``logprobs`` or ``prompt_logprobs`` (the handoff
    carries one token's id only)."""
    if params.n != 1 or params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("a prefilled request needs n == 1 and no logprobs or "
                         "prompt_logprobs")


class KVHandoff:
    """One engine's side of KV handoffs (module docstring).

    Args:
      scheduler: the engine's ``Scheduler`` (held pages, admission).
      runner: its ``ModelRunner`` (page reads and writes, the weights).
      outputs: its ``OutputProcessor`` (a prefilled request's group and
        first token).
      model_config: the model's ``ModelConfig`` (part of the fingerprint).
    """

    def __init__(self, scheduler, runner, outputs, model_config):
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.model_config = model_config
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """SHA-256 (hex) over the model config, the page size, the KV cache
        dtype and a sample of the weights (the first 64 values of the first
        16 parameter arrays), so a prefill worker serving another model, or
        the same shapes with other weights, is told apart. Computed once."""
        if self._fingerprint is None:
            h = hashlib.sha256(json.dumps(
                [dataclasses.asdict(self.model_config), self.scheduler.allocator.page_size,
                 str(self.runner.kv_dtype)], sort_keys=True, default=str).encode())
            for leaf in jax.tree.leaves(self.runner.state)[:16]:
                h.update(np.asarray(jnp.ravel(leaf)[:64]).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def num_held(self) -> int:
        """Finished ``hold_kv`` requests whose pages are still held."""
        return len(self.scheduler.held)

    def export(self, request_id: str, skip_pages: int = 0) -> list[tuple[KVPages, KVPages]]:
        """Copy a finished ``hold_kv`` request's pages from ``skip_pages`` on
        (``ModelRunner.read_pages``: per power-of-two piece, one buffer per
        K/V over every layer, on one device) and release them.

        Raises:
          KeyError: no pages are held under ``request_id``.
          ValueError: ``skip_pages`` outside [0, held pages).
        """
        pages = self.scheduler.held.get(str(request_id))
        if pages is None:
            raise KeyError(f"no KV pages are held for request {request_id!r}")
        if not 0 <= skip_pages < len(pages):
            raise ValueError(f"skip_pages must be in [0, {len(pages)}), got {skip_pages}")
        try:
            return self.runner.read_pages(pages[skip_pages:])
        finally:
            self.scheduler.release(str(request_id))

    def release(self, request_id: str) -> bool:
        """Free a finished ``hold_kv`` request's held pages; False when none were."""
        return self.scheduler.release(str(request_id))

    def add_prefilled(self, group, first_token: int, kv: list[tuple[KVPages, KVPages]],
                      skip_pages: int = 0, first_logprob: float = 0.0,
                      transfer_ms: float | None = None, transfer_bytes: int = 0,
                      scheduled_time: float | None = None) -> RequestOutput:
        """Start the checked, unregistered ``group`` (``n == 1``: an
        ``outputs.Group`` from ``Intake.new_group``) from ``kv``
        (``export``'s buffers) after ``skip_pages`` prefix-cache pages, with
        ``first_token`` as its first output token; registers the group and
        returns its first output. ``scheduled_time`` (monotonic s, default
        now): when its prefill began elsewhere.

        Raises:
          KVHandoffError: ``"bad_kv"``: the buffers' pages do not cover the
            prompt, or their shapes do not fit this cache; ``"evicted"``,
            ``"no_slot"``, ``"no_pages"``: ``Scheduler.admit_prefilled``.
            Nothing is changed then.
        """
        r, L = group.seqs[0], self.scheduler.allocator.page_size
        ids = r.prompt_token_ids
        n_kv = sum(jax.tree.leaves(piece)[0].shape[1] for piece in kv)
        if skip_pages < 0 or skip_pages + n_kv != cdiv(len(ids), L):
            raise KVHandoffError("bad_kv", f"{skip_pages} cached + {n_kv} sent pages do not "
                                 f"cover a {len(ids)}-token prompt in pages of {L}")
        self.scheduler.admit_prefilled(r, skip_pages, n_kv,
                                       lambda pages: self.runner.write_pages(pages, kv))
        now = time.monotonic()
        m = group.metrics
        m.first_scheduled_time = now if scheduled_time is None else scheduled_time
        m.num_cached_tokens = skip_pages * L
        m.disagg_route, m.kv_transfer_ms, m.kv_transfer_bytes = \
            "handoff", transfer_ms, transfer_bytes
        self.outputs.add(group)
        r.output_token_ids.append(int(first_token))
        self.scheduler.cache_computed_pages(r)
        delta = self.outputs.take_token(r, int(first_token), float(first_logprob), None, 1, now)
        return self.outputs.group_output(group, {0: (delta, [int(first_token)])}, now)
