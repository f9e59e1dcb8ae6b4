"""``Engine``'s read-only views and narrow entry points, for the server, the
benchmarks and disaggregation: nothing outside ``jaxserve/engine/`` reaches
into the runner, allocator, scheduler or speculator; what they need is one
of these (multi-host following and scoring included). ``EngineViews`` is
mixed into ``engine.Engine`` and reads its ``allocator``, ``scheduler``,
``runner``, ``speculator``, ``outputs``, ``handoff``, ``_warmup``, ``encode``,
``eos_token_ids`` and ``max_model_len``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import jax
import numpy as np

from jaxserve.engine import scoring
from jaxserve.engine.page_table import cdiv
from jaxserve.engine.request import Request
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.scheduler import ScheduledBatch


class EngineViews:
    """Read-only properties and narrow entry points of ``Engine``."""

    # -- read-only views --

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return self.allocator.page_size

    @property
    def num_pages(self) -> int:
        """KV pages in the cache (per layer)."""
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """KV pages free now (cached-but-unreferenced pages count as free)."""
        return self.allocator.num_free_pages

    @property
    def kv_occupancy(self) -> float:
        """Fraction of KV pages in use, 0..1."""
        return self.allocator.occupancy

    @property
    def prefix_caching(self) -> bool:
        """Whether full pages are kept findable by hash (prefix caching)."""
        return self.allocator.enable_prefix_caching

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix page (pages in use are kept)."""
        self.allocator.reset_prefix_cache()

    @property
    def kv_dtype(self):
        """The KV cache's dtype (``jnp.dtype``)."""
        return self.runner.kv_dtype

    @property
    def devices(self) -> tuple:
        """The mesh's devices, flat, in mesh order."""
        return tuple(self.runner.mesh.devices.flat)

    @property
    def last_expert_load(self):
        """An MoE model's expert load of the last step: i32[num_layers, E],
        tokens routed to each expert per layer (None before the first step,
        or for a dense model)."""
        return self.runner.last_expert_load

    @property
    def num_compilations(self) -> int:
        """XLA programs this engine compiled (or loaded) so far."""
        return self.runner.num_compilations

    @property
    def num_running(self) -> int:
        """Sequences scheduled (holding KV pages)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be admitted."""
        return len(self.scheduler.waiting)

    @property
    def weights(self):
        """The model's parameter state (an ``nnx.State`` pytree of device
        arrays); read-only use: sizes, bytes per format."""
        return self.runner.state

    def kv_page_spec(self, num_pages: int):
        """``jax.ShapeDtypeStruct``s of ``num_pages`` exported pages
        (``ModelRunner.page_spec``): what a puller asks for."""
        return self.runner.page_spec(num_pages)

    def warmup_kv_handoff(self) -> int:
        """Compile the KV page gather/scatter programs of a handoff
        (``ModelRunner.warmup_pages``); returns the piece sizes compiled."""
        return self.runner.warmup_pages()

    @property
    def speculative(self) -> bool:
        """Whether this engine speculates (ngram or draft model)."""
        return self.speculator is not None

    @property
    def spec_k(self) -> int | None:
        """Draft tokens per step chosen now, or None without speculation."""
        return None if self.speculator is None else self.speculator.k

    @property
    def spec_max_k(self) -> int:
        """The most draft tokens per step (0 without speculation)."""
        return 0 if self.speculator is None else self.speculator.max_k

    @property
    def spec_policy(self):
        """The speculation policy (``spec_policy.SpecPolicy``) or None."""
        return None if self.speculator is None else self.speculator.policy

    def warmup_draft(self, counts) -> int:
        """Compile the draft model's step programs for token counts
        ``counts``; 0 without a draft model."""
        if self.speculator is None or self.speculator.draft is None:
            return 0
        return self.speculator.draft.runner.warmup(counts)

    # -- one step of an exact shape, for the benchmarks that time it --

    @contextlib.contextmanager
    def shaped_step(self, num_seqs: int, q_len: int, ctx: int, rng: np.random.Generator):
        """A step of exactly ``num_seqs`` sequences, each computing ``q_len``
        tokens that end at position ``ctx`` (decode rows when ``q_len`` is
        1), bypassing the scheduler: the context yields ``run()``, which
        executes that one batch (``ModelRunner.execute``, synchronised: it
        returns the host ``StepResult``) as often as called. The first
        ``ctx - q_len`` positions count as cached (pages taken for the
        context, whatever K/V they hold: timing does not depend on it);
        prompt ids are drawn from ``rng``. The pages are given back on exit.

        Raises:
          ValueError: fewer free pages than the batch needs.
        """
        reqs, pages = [], []
        try:
            for i in range(num_seqs):
                ids = rng.integers(0, self.model_config.vocab_size, size=ctx).tolist()
                r = Request(f"_shaped{i}", None, ids, SamplingParams(temperature=0), 0,
                            self.eos_token_ids)
                r.page_ids = self.allocator.allocate(cdiv(ctx, self.page_size))
                pages.append(r.page_ids)
                r.num_computed_tokens = ctx - q_len
                reqs.append(r)
            batch = ScheduledBatch(reqs, [q_len] * num_seqs,
                                   num_decode=num_seqs if q_len == 1 else 0)
            yield lambda: self.runner.execute(batch)
        finally:
            for p in pages:
                self.allocator.free(p)

    def step_buckets(self) -> list[tuple[bool, int]]:
        """Every step program this engine compiles, as (decode, T):
        ``decode_step`` per row bucket, then ``prefill_step`` per token
        bucket (``ModelRunner.step_buckets``)."""
        return self.runner.step_buckets()

    def step_token_counts(self) -> list[int]:
        """The token count T of every step program (``decode_step`` and
        ``prefill_step``, one compiled program each) this engine's limits
        can reach (``jaxserve.engine.shapes``), ascending, a T that both
        steps reach listed once."""
        return sorted({T for _, T in self.runner.step_buckets()})

    @property
    def is_leader(self) -> bool:
        """True on process 0 of a multi-host job (and in a one-process run):
        the process that schedules, tokenizes and serves."""
        return jax.process_index() == 0

    @property
    def num_held_kv(self) -> int:
        """Finished ``hold_kv`` requests whose pages are still held."""
        return self.handoff.num_held

    @property
    def warmup_done(self) -> threading.Event:
        """Set when every step program is ready (``warmup(background=True)``
        clears it until its thread ends; set before any warm-up)."""
        return self._warmup.done

    @property
    def warmup_programs(self) -> int:
        """Programs a background warm-up has traced so far."""
        return self._warmup.programs

    @property
    def warmup_error(self) -> Exception | None:
        """A background warm-up's failure, or None."""
        return self._warmup.error

    @property
    def _groups(self) -> dict:
        """Live requests by id (``OutputProcessor.groups``; tests read it)."""
        return self.outputs.groups

    # ---- multi-host ---------------------------------------------------------

    def follow(self) -> int:
        """Processes other than 0 of a multi-host job: run the steps process 0
        broadcasts until it calls ``stop_followers``; returns the steps run.

        Raises:
          ValueError: called on process 0 or in a one-process run.
          MultihostError: the job failed (a process died or a step failed).
        """
        if self.is_leader or self.runner.channel is None:
            raise ValueError(f"follow() runs on processes other than 0 of a multi-host job; "
                             f"this is process {jax.process_index()} of {jax.process_count()}")
        return self.runner.follow()

    def stop_followers(self) -> None:
        """Process 0 of a multi-host job: release the other processes from
        ``follow`` (call once, when done serving). A no-op otherwise.

        Raises:
          MultihostError: the broadcast failed (a process died).
        """
        self.runner.stop_followers()

    # ---- scoring (``scoring``) -------------------------------------------------

    def last_token_logits(self, prompts: Sequence[Sequence[int]], lora=None) -> np.ndarray:
        """f32[n, V] next-token logits of each prompt, computed in one ragged
        prefill (nothing is kept in the cache). For parity tests and scoring.
        ``lora``: an adapter (name or ``LoRARequest``) for all, a list with
        one per prompt (None: the base), or None.

        Raises:
          ValueError: bad prompt, the prompts do not fit in the free pages,
            an unknown adapter.
        """
        loras = lora if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        return scoring.last_token_logits(self.runner, self.allocator, prompts, self.encode,
                                         self.eos_token_ids,
                                         [self.resolve_lora(x) for x in loras], self.adapters)

    def prompt_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """f32[T, V] next-token logits after each of the T tokens: row t is
        the model's distribution over token t + 1 given tokens 0..t, from one
        prefill in fresh pages (``scoring.prompt_logits``). For perplexity
        and KL divergence (``jaxserve.bench.eval``).

        Raises:
          ValueError: bad ids, T above ``max_model_len``, more pages than are
            free, or a multi-host job.
        """
        return scoring.prompt_logits(self.runner, self.allocator, self.encode(token_ids),
                                     self.max_model_len, self.eos_token_ids)
