"""Engine (add_request / step / abort) and the vLLM-style ``LLM`` facade.

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
step) and ``_process`` takes every accepted token of a row; its module
docstring has the design.

A user request is a group of ``n`` sequences (``Request``), one per choice;
outputs are reported per group, one ``RequestOutput`` per step in which any
of its choices changed.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig)
from jaxserve.engine import compile_cache, multihost, shapes
from jaxserve.engine.build import build_model, load_draft
from jaxserve.engine.async_step import InFlightStep, StepInfo, StepPipeline, sync_reason
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.page_table import PageAllocator, cdiv, page_hashes
from jaxserve.engine.request import (CompletionOutput, Logprob, Request, RequestMetrics,
                                     RequestOutput, RequestStatus, SamplingParams, check_text)
from jaxserve.engine.runner import ModelRunner, StepResult
from jaxserve.engine.sampling import MAX_BANNED
from jaxserve.engine.scheduler import ScheduledBatch, Scheduler
from jaxserve.engine.speculation import DraftModelProposer, Speculator, accept
from jaxserve.models import MODEL_CLASSES
from pallas_kernels.ragged_paged_attention.quant import KVPages, check_kv_cache_dtype
from sharding.mesh import make_mesh, parse_mesh_spec, validate_mesh_for_model


@dataclasses.dataclass
class EngineStats:
    """A snapshot of the engine for metrics (counts; tokens where named).

    Attributes:
      num_running, num_waiting: sequences (choices) in each state.
      pages_total, pages_used, pages_free: KV pages; free includes cached
        pages no sequence holds (they are evicted on demand).
      pages_cached: pages findable in the prefix cache.
      prefix_cache_queries, prefix_cache_hits: prompt tokens looked up and
        served from the cache; ``prefix_cache_hit_rate`` = hits / queries.
      num_preemptions: sequences preempted so far.
      prompt_tokens, generation_tokens: prompt tokens computed (cache hits
        excluded; recomputation after preemption counts again) and tokens
        sampled, since start.
      num_steps: steps run.
      num_compilations: XLA programs traced and compiled (or loaded from the
        persistent cache) since start: one per new bucket shape. Each stays
        in host memory (40-55 MB for SmolLM2 on CPU), so a rising count is
        what a rising RSS under varied traffic comes from.
      spec_num_drafts, spec_num_draft_tokens, spec_num_accepted_tokens:
        speculative decoding: verification rows that carried drafts, draft
        tokens verified, drafts accepted (0 without speculation).
      spec_accepted_per_position: drafts accepted at each draft position
        0..k-1; spec_mean_acceptance_length: 1 + accepted / drafts (tokens
        per verification row, vLLM's figure); spec_k: the policy's latest k.
    """

    num_running: int
    num_waiting: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    num_compilations: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_mean_acceptance_length: float = 0.0
    spec_k: int = 0


class KVHandoffError(ValueError):
    """A prefilled request's KV cannot be taken (``Engine.add_prefilled``);
    ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"KV handoff refused ({reason}): {message}")
        self.reason = reason


@dataclasses.dataclass(eq=False)
class _Group:
    """One user request: its choices and their detokenizers."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    metrics: RequestMetrics


class Engine:
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
      spec_policy: a ``spec_decode.SpecPolicy`` to use instead of the
        learned one (tests with a fake cost model).

    Raises:
      ValueError: unknown model alias, missing file, bad config, a mesh whose
        size differs from the number of devices (before any weights are read)
        or that cannot split the model (before the weights reach the devices),
        a draft model whose vocabulary differs from the target's, or
        speculation in a multi-host job.
    """

    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None,
                 params: dict | None = None, tokenizer=None, chat_template: str | None = None,
                 devices: Sequence[jax.Device] | None = None, draft_parts: dict | None = None,
                 spec_policy=None):
        self.config = config
        if config.compilation_cache_dir:  # process-wide, first folder wins: see compile_cache
            compile_cache.enable(config.compilation_cache_dir)
        if devices is None and config.parallel.num_devices == 1:
            devices = jax.devices()[:1]
        self.mesh = make_mesh(config.parallel.mesh_shape, devices)
        # An fp8 KV cache where the device has no fp8 fails before any weights load.
        check_kv_cache_dtype(config.cache.dtype or config.dtype, self.mesh.devices.flat[0])
        orbax_dir = None
        if jax.process_count() > 1 and config.speculative.method is not None:
            raise ValueError(f"speculative decoding ({config.speculative.method!r}) runs in "
                             f"one-process jobs only; this job has {jax.process_count()}")
        if jax.process_count() > 1:  # every process of a job must build the same engine
            if self.mesh.devices.size != jax.device_count():
                raise ValueError(f"a multi-host mesh must span every device of the job: --mesh "
                                 f"{dict(self.mesh.shape)} has {self.mesh.devices.size} devices, "
                                 f"the job {jax.device_count()} ({jax.process_count()} processes "
                                 f"x {jax.local_device_count()})")
            from checkpoints.loader import load_model_config
            multihost.check_same_setup(dict(
                engine={k: v for k, v in dataclasses.asdict(config).items()
                        if k not in ("model", "compilation_cache_dir")},
                model=dataclasses.asdict(model_config or load_model_config(config.model)),
                mesh=dict(self.mesh.shape)))
        if model_config is None:  # alias, .gguf, HF or Orbax folder: checked, then loaded
            from checkpoints.loader import load_for_engine
            loaded = load_for_engine(config, self.mesh.shape)
            config = self.config = loaded.config  # an Orbax checkpoint's own quantization
            model_config, params, orbax_dir = loaded.model_config, loaded.params, loaded.orbax_dir
            tokenizer, chat_template = loaded.tokenizer, loaded.chat_template
        if model_config.architecture not in MODEL_CLASSES:
            raise ValueError(f"unsupported architecture {model_config.architecture!r}; "
                             f"supported: {sorted(MODEL_CLASSES)}")
        sharding_rules = validate_mesh_for_model(self.mesh.shape, model_config)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        impl = config.attention_impl
        if impl == "auto":
            impl = "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
        if impl == "pallas" and jax.default_backend() not in ("gpu", "tpu") \
                and not config.attention_interpret:
            raise ValueError(f"attention_impl='pallas' has no lowering on "
                             f"{jax.default_backend()!r}; set attention_interpret=True")
        self.attention_impl = impl
        model = build_model(config, model_config, params, orbax_dir, impl, self.mesh,
                            sharding_rules)
        draft = None
        if config.speculative.method == "draft":  # its vocabulary is checked before it loads
            parts = dict(draft_parts or {})
            draft = load_draft(config, model_config, model, params, orbax_dir, impl, self.mesh,
                               model_config=parts.get("model_config"),
                               params_override=parts.get("params"))
        self.max_model_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        cache: CacheConfig = config.cache
        kv_dtype = jnp.dtype(cache.dtype or config.dtype)
        page_bytes = ModelRunner.kv_bytes_per_page(model_config, cache.page_size, kv_dtype) + (
            0 if draft is None else ModelRunner.kv_bytes_per_page(draft[0].cfg, cache.page_size,
                                                                  kv_dtype))
        num_pages = cache.num_pages or max(1, cache.memory_bytes // page_bytes)
        self.allocator = PageAllocator(num_pages, cache.page_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.max_model_len)
        # Speculation: a full batch still has max_num_seqs sampling rows for drafts.
        rows = config.scheduler.max_num_seqs * (2 if config.speculative.method else 1)
        sc = config.scheduler
        max_tokens = shapes.max_step_tokens(sc.max_num_batched_tokens, sc.max_num_seqs,
                                            self.max_model_len, sc.enable_chunked_prefill)
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=cache.page_size,
                                  max_model_len=self.max_model_len, kv_dtype=kv_dtype,
                                  max_num_seqs=rows, mesh=self.mesh, rules=sharding_rules,
                                  scan_layers=config.scan_layers, max_num_tokens=max_tokens)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            frozenset([tokenizer.eos_token_id]) if tokenizer is not None
            and tokenizer.eos_token_id is not None else frozenset())
        self._groups: dict[str, _Group] = {}
        self._pending: list[RequestOutput] = []
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.speculator = None
        if config.speculative.method is not None:
            proposer = None
            if draft is not None:
                proposer = DraftModelProposer(ModelRunner(
                    draft[0], num_pages=num_pages, page_size=cache.page_size,
                    max_model_len=self.max_model_len, kv_dtype=kv_dtype,
                    max_num_seqs=config.scheduler.max_num_seqs, mesh=self.mesh, rules=draft[1],
                    scan_layers=config.scan_layers, max_num_tokens=max_tokens),
                    config.scheduler.max_num_batched_tokens)
            self.speculator = Speculator(config.speculative, self.runner.max_rows, proposer,
                                         spec_policy)
        self._steps = StepPipeline(self.scheduler, self.runner, self.speculator)
        self._in_flight: InFlightStep | None = None  # launched, results not yet read
        self._num_generation_tokens = 0
        self._num_steps = 0
        self.last_step: StepInfo | None = None  # the latest step's shape and time
        # The load's host buffers (HF-named params, unstacked layers) are
        # garbage now: drop the last references, then hand them to the OS.
        params = loaded = model = draft = parts = None  # noqa: F841
        compile_cache.trim_host_heap()
        # warmup(background=True): set when every step program is ready (set
        # now: nothing is pending before a warm-up); warmup_programs counts
        # the programs traced, warmup_error holds a background failure.
        self.warmup_done = threading.Event()
        self.warmup_done.set()
        self.warmup_programs = 0
        self.warmup_error: Exception | None = None

    # ---- requests -----------------------------------------------------------

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
        bad = [i for i in ids if not 0 <= i < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        return ids

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, hold_kv: bool = False) -> str:
        """Queue a request (its ``params.n`` choices); returns its id.

        ``arrival_time`` (``time.monotonic()`` seconds, default now) is where
        queue time, TTFT and E2E start: a server passes the time the request
        reached it. ``hold_kv`` (a prefill worker's request, ``n == 1``):
        when it finishes, its pages stay held for ``export_kv`` /
        ``release_kv`` instead of being freed (an abort still frees them).

        Raises:
          ValueError: bad prompt or params, duplicate id, a prompt that leaves no
            room in ``max_model_len``, ``n`` above ``max_num_seqs``, a
            sequence larger than the whole KV cache, or ``hold_kv`` with
            ``n > 1``.
        """
        group = self._new_group(request_id, prompt, params, arrival_time)
        if hold_kv:
            if group.params.n != 1:
                raise ValueError(f"hold_kv needs SamplingParams.n == 1, got {group.params.n}")
            group.seqs[0].hold_kv = True
        self._groups[group.request_id] = group
        for r in group.seqs:
            self.scheduler.add(r)
        return group.request_id

    def _new_group(self, request_id, prompt, params, arrival_time) -> _Group:
        """Check a request and build its group (not yet registered or queued)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self._groups:  # skip ids the caller chose
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than "
                             f"max_model_len={self.max_model_len}")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"SamplingParams.n must be <= max_num_seqs="
                             f"{self.config.scheduler.max_num_seqs}, got {params.n}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if cdiv(longest, self.allocator.page_size) > self.allocator.num_pages:
            raise ValueError(f"a sequence of {longest} tokens needs more than the "
                             f"{self.allocator.num_pages} pages of the KV cache")
        if params.min_tokens and len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED:
            raise ValueError(f"min_tokens supports at most {MAX_BANNED} stop and EOS ids, "
                             f"got {len(params.stop_token_ids) + len(self.eos_token_ids)}")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        text = prompt if isinstance(prompt, str) else None
        seqs: list[Request] = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seqs.append(Request(seq_id, text, ids, params, (seed + i) % 2**32,
                                self.eos_token_ids, metrics=metrics, group_id=request_id,
                                index=i, fork_of=seqs[0] if i else None))
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None]
        return _Group(
            request_id, text, ids, params, seqs,
            [IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                    params.include_stop_str_in_output) for _ in seqs], metrics)

    # ---- KV handoff (disaggregated prefill/decode, ``jaxserve.disagg``) ------

    def cached_prefix_pages(self, token_ids: Sequence[int]) -> int:
        """Full pages of a prompt's prefix that this engine's prefix cache
        holds now (never the page of the last token, whose logits a prefill
        must compute), as ``Scheduler`` admission would reuse them."""
        L = self.allocator.page_size
        max_pages = (len(token_ids) - 1) // L
        if not self.allocator.enable_prefix_caching or max_pages <= 0:
            return 0
        return len(self.allocator.lookup(page_hashes(list(token_ids[:max_pages * L]), L),
                                         max_pages))

    def kv_fingerprint(self) -> str:
        """What two engines must share for KV pages to move between them: a
        SHA-256 (hex) over the model config, the page size, the KV cache
        dtype and a sample of the weights (the first 64 values of the first
        16 parameter arrays), so a prefill worker serving another model, or
        the same shapes with other weights, is told apart. Computed once."""
        if getattr(self, "_kv_fingerprint", None) is None:
            import hashlib
            import json
            h = hashlib.sha256(json.dumps(
                [dataclasses.asdict(self.model_config), self.allocator.page_size,
                 str(self.runner.kv_dtype)], sort_keys=True, default=str).encode())
            for leaf in jax.tree.leaves(self.runner.state)[:16]:
                h.update(np.asarray(jnp.ravel(leaf)[:64]).tobytes())
            self._kv_fingerprint = h.hexdigest()
        return self._kv_fingerprint

    @property
    def num_held_kv(self) -> int:
        """Finished ``hold_kv`` requests whose pages are still held."""
        return len(self.scheduler.held)

    def export_kv(self, request_id: str, skip_pages: int = 0
                  ) -> list[tuple[KVPages, KVPages]]:
        """Copy a finished ``hold_kv`` request's pages from ``skip_pages`` on
        (``ModelRunner.read_pages``: per power-of-two piece, one buffer per
        K/V over every layer, on one device) and release them.

        Raises:
          KeyError: no pages are held under ``request_id`` (released, leased
            out, aborted, or never a ``hold_kv`` request).
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

    def release_kv(self, request_id: str) -> bool:
        """Free a finished ``hold_kv`` request's held pages (lease expired,
        or the decode side gave up); False when none were held."""
        return self.scheduler.release(str(request_id))

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
        if params.n != 1 or params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("a prefilled request needs n == 1 and no logprobs or "
                             "prompt_logprobs")
        group = self._new_group(request_id, list(prompt_token_ids), params, arrival_time)
        r, alloc, L = group.seqs[0], self.allocator, self.allocator.page_size
        ids = r.prompt_token_ids
        n_kv = sum(jax.tree.leaves(piece)[0].shape[1] for piece in kv)
        if skip_pages < 0 or skip_pages + n_kv != cdiv(len(ids), L):
            raise KVHandoffError("bad_kv", f"{skip_pages} cached + {n_kv} sent pages do not "
                                 f"cover a {len(ids)}-token prompt in pages of {L}")
        hits: list[int] = []
        if skip_pages:
            r.page_hashes = page_hashes(ids[:skip_pages * L], L)
            hits = alloc.lookup(r.page_hashes, skip_pages)
            if len(hits) < skip_pages:
                raise KVHandoffError("evicted", f"{skip_pages - len(hits)} of the "
                                     f"{skip_pages} cached prefix pages were evicted")
        sched = self.scheduler
        if len(sched.running) >= self.config.scheduler.max_num_seqs:
            raise KVHandoffError("no_slot", f"{len(sched.running)} sequences run already")
        reserve = sched.watermark_pages if sched.running else 0
        if n_kv + alloc.count_free_among(hits) + reserve > alloc.num_free_pages:
            raise KVHandoffError("no_pages", f"{n_kv} pages needed, "
                                 f"{alloc.num_free_pages} free")
        alloc.share(hits)
        new = alloc.allocate(n_kv)
        try:
            self.runner.write_pages(new, kv)
        except ValueError as e:
            alloc.free(hits + new)
            raise KVHandoffError("bad_kv", str(e)) from None
        now = time.monotonic()
        r.page_ids = hits + new
        r.num_computed_tokens = len(ids)
        r.num_registered_pages = len(hits)
        r.status = RequestStatus.RUNNING
        sched.running.append(r)
        alloc.prefix_queries += len(ids)
        alloc.prefix_hits += skip_pages * L
        m = group.metrics
        m.first_scheduled_time = now if scheduled_time is None else scheduled_time
        m.num_cached_tokens = skip_pages * L
        m.disagg_route, m.kv_transfer_ms, m.kv_transfer_bytes = \
            "handoff", transfer_ms, transfer_bytes
        self._groups[group.request_id] = group
        r.output_token_ids.append(int(first_token))
        sched.cache_computed_pages(r)
        delta = self._take_token(r, int(first_token), float(first_logprob), None, 1, now)
        self._pending.append(self._group_output(group, {0: (delta, [int(first_token)])}, now))
        return group.request_id

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or each of an iterable of ids) in any state
        (waiting, mid-prefill, decoding): its pages are freed now, and its
        final output (finish_reason "abort") comes from the next ``step``.
        Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, (str, int)) else list(request_id)
        for rid in ids:
            group = self._groups.get(str(rid))
            if group is None:
                continue
            for r in group.seqs:
                if not r.finished:
                    self.scheduler.finish(r, "abort")
            self._pending.append(self._group_output(group, {}, time.monotonic()))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or (
            self._in_flight is not None and self._in_flight.live)

    def get_sequences(self, request_id: str) -> list[Request]:
        """The live sequences (choices) of a request, for inspection; [] when
        gone. Between steps their ``output_token_ids`` may end in a
        placeholder (-1) for a token in flight; ``host_output_ids`` omit it."""
        group = self._groups.get(str(request_id))
        return list(group.seqs) if group else []

    # -- read-only views and narrow entry points for the server, the
    # benchmarks and disaggregation (nothing outside jaxserve/engine/ reaches
    # into the runner, allocator, scheduler or speculator) --

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

    @property
    def kv_channel(self):
        """The KV handoff channel of a disaggregated role, or None."""
        return self.runner.channel

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
        """The speculation policy (``spec_decode.SpecPolicy``) or None."""
        return None if self.speculator is None else self.speculator.policy

    def warmup_draft(self, counts) -> int:
        """Compile the draft model's step programs for token counts
        ``counts``; 0 without a draft model."""
        if self.speculator is None or self.speculator.draft is None:
            return 0
        return self.speculator.draft.runner.warmup(counts)

    # -- raw step driving, for the benchmarks that time one step shape --

    def allocate_pages(self, n: int) -> list[int]:
        """Take ``n`` free KV pages (``PageAllocator.allocate``).

        Raises:
          ValueError: fewer than ``n`` pages are free."""
        return self.allocator.allocate(n)

    def free_pages(self, page_ids: list[int]) -> None:
        """Give back pages taken with ``allocate_pages``."""
        self.allocator.free(page_ids)

    def execute_batch(self, batch, return_logits: bool = False):
        """Run one ``ScheduledBatch`` through the model and sampler
        (``ModelRunner.execute``) and return its host ``StepResult``."""
        return self.runner.execute(batch, return_logits=return_logits)

    def stats(self) -> EngineStats:
        """Counts for metrics; see ``EngineStats``."""
        a, s = self.allocator, self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), pages_total=a.num_pages,
            pages_used=a.num_pages - a.num_free_pages, pages_free=a.num_free_pages,
            pages_cached=a.num_cached_pages, prefix_cache_queries=a.prefix_queries,
            prefix_cache_hits=a.prefix_hits, prefix_cache_hit_rate=a.prefix_hit_rate,
            num_preemptions=s.num_preemptions, prompt_tokens=self._steps.num_prompt_tokens,
            generation_tokens=self._num_generation_tokens, num_steps=self._num_steps,
            num_compilations=self.runner.num_compilations, **self._spec_stats())

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                    spec_num_accepted_tokens=st.num_accepted_tokens,
                    spec_accepted_per_position=tuple(st.accepted_per_position),
                    spec_mean_acceptance_length=float(st.mean_acceptance_length),
                    spec_k=self.speculator.k)

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

    def warmup(self, on_compiled=None, max_tokens: int | None = None,
               background: bool = False, max_rows: int | None = None,
               variants: bool = True) -> int:
        """Compile every step program this engine can reach
        (``ModelRunner.step_buckets``) before serving, so no request waits
        on XLA; with ``compilation_cache_dir`` set, a second start loads
        them from disk (``compile_cache`` counts which). Each bucket's
        sampling (plain and penalised) and prompt-logprob programs come with
        it (``ModelRunner.warmup``). ``on_compiled(i, T, seconds)`` reports
        progress. ``max_tokens``:
        only the programs of steps of at most this many tokens (every bucket
        below it and the one holding it), for a known batch (the CLI demo:
        its prompt tokens plus one per sequence; a step past it, after a
        preemption, compiles on first use); ``max_rows`` likewise caps the
        decode buckets (a batch of that many sequences). ``variants=False``:
        only plain sampling, no penalised sampling or prompt logprobs (a
        known batch without them). ``background``: compile only
        the smallest decode and prefill buckets now and the rest, smallest
        first, in a daemon thread (``warmup_done`` is set at its end), while
        the scheduler keeps every step within the buckets ready so far
        (``Scheduler.caps``), so a step never waits on a compile; a
        one-process engine without speculation only (otherwise all now).
        Returns the compilations it caused (before returning).

        Raises:
          MultihostError: a multi-host step failed.
        """
        if background and max_tokens is None and max_rows is None and variants \
                and self.speculator is None and self.runner.channel is None:
            return self._warmup_in_background(on_compiled)

        def wanted(runner):  # (decode, T) buckets, ascending T within each kind
            buckets = runner.step_buckets()
            out = []
            for kind, most in ((True, max_rows), (False, max_tokens)):
                ts = [T for d, T in buckets if d == kind]
                most = max_tokens if most is None else most
                cap = ts[-1] if most is None or not ts else \
                    next((T for T in ts if T >= most), ts[-1])
                out += [(kind, T) for T in ts if T <= cap]
            return out
        n = self.runner.warmup(wanted(self.runner), on_compiled=on_compiled, variants=variants)
        draft = self.speculator.draft if self.speculator is not None else None
        if draft is not None:  # the draft model's steps have the same buckets
            n += draft.runner.warmup(wanted(draft.runner), variants=variants)
        compile_cache.trim_host_heap()  # compilers' scratch back to the OS
        self.warmup_done.set()
        return n

    def _warmup_in_background(self, on_compiled=None) -> int:
        """``warmup(background=True)``: the smallest decode and prefill
        buckets now, the rest in ascending T (prefill first at a tie, so the
        row cap never passes the token cap) in a daemon thread that raises
        ``Scheduler.caps`` after each bucket and lifts them at the end."""
        buckets = sorted(self.runner.step_buckets(), key=lambda b: (b[1], b[0]))
        first = [next(b for b in buckets if b[0]), next(b for b in buckets if not b[0])]
        ready = list(first)

        def caps():
            return (max(T for d, T in ready if d), max(T for d, T in ready if not d))
        self.warmup_done.clear()
        n = self.runner.warmup(first, on_compiled=on_compiled)
        self.scheduler.caps = caps()

        def rest():
            try:
                for i, b in enumerate(b for b in buckets if b not in first):
                    t0 = time.monotonic()
                    self.warmup_programs += self.runner.warmup([b])
                    ready.append(b)
                    self.scheduler.caps = caps()
                    if on_compiled is not None:
                        on_compiled(len(first) + i, b[1], time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - a failed compile keeps today's caps
                self.warmup_error = e
            else:
                self.scheduler.caps = None
                compile_cache.trim_host_heap()
            finally:
                self.warmup_done.set()
        self.warmup_programs = n
        threading.Thread(target=rest, name="jaxserve-warmup", daemon=True).start()
        return n

    # ---- multi-host ---------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True on process 0 of a multi-host job (and in a one-process run):
        the process that schedules, tokenizes and serves."""
        return jax.process_index() == 0

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
            if self.config.async_scheduling and sync_reason(cur, self.runner) is None and not (
                    self.speculator is not None and self.speculator.wants_host_tokens):
                self._in_flight = self._steps.launch(cur)
                cur.overlapped = self._in_flight is not None
            res = self._steps.collect(cur)
        except BaseException:
            self._steps.fail(cur, self._in_flight)
            self._in_flight = None
            self._pending[:0] = outputs  # kept for the next call
            raise
        t = time.monotonic()
        outputs += self._process(cur, res, t)
        cur.host_s += time.monotonic() - t
        self.last_step = self._steps.info(cur)
        self._num_steps += 1
        if self.speculator is not None and not self.last_step.compiled:
            self.speculator.observe_step(sum(cur.batch.q_lens), self.last_step.seconds)
        if self._in_flight is not None and not self._in_flight.live:
            self._in_flight = None  # every row finished at ``cur``: nothing of it is wanted
        if self._in_flight is None and not self.scheduler.has_unfinished():
            self._steps.idle()
        return outputs

    def _process(self, step: InFlightStep, res: StepResult, now: float) -> list[RequestOutput]:
        """Take a finished step's results into its sequences: prompt logprobs,
        prefix-cache pages, sampled tokens (replacing their placeholders),
        stop checks; returns the outputs of the groups that changed. A
        sequence that finished after the step was launched is skipped."""
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
                self.speculator.record(r, len(drafts), m)
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
        return [self._group_output(self._groups[gid], deltas, now)
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
        return self._take_token(r, tok, float(res.logprobs[k]), top, n_out, now), [tok]

    def _take_token(self, r: Request, tok: int, lp: float, top, n_out: int, now: float) -> str:
        """``r``'s ``n_out``-th output token ``tok`` (already in
        ``output_token_ids``, raw logprob ``lp``, ``top`` = (rank, top ids,
        top logprobs) when logprobs are asked) into its logprobs, metrics,
        text and stop checks; returns the delta text."""
        r.cumulative_logprob += lp
        if r.params.logprobs is not None:
            r.output_logprobs.append(self._logprob_dict(tok, lp, *top, r.params.logprobs))
        self._num_generation_tokens += 1
        m = r.metrics
        m.num_output_tokens = max(m.num_output_tokens, n_out)
        if m.first_token_time is None:
            m.first_token_time = now
        detok = self._groups[r.group_id].detoks[r.index]
        p = r.params
        delta = detok.add(tok, check_stop=n_out >= p.min_tokens)
        reason, stop_reason = None, None
        if detok.stopped_on is not None:
            reason, stop_reason = "stop", detok.stopped_on
        elif n_out >= p.min_tokens and not p.ignore_eos and tok in r.eos_token_ids:
            reason = "stop"
        elif n_out >= p.min_tokens and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif n_out >= p.max_tokens or len(r.prompt_token_ids) + n_out >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(r, reason, stop_reason)
            delta += detok.finish()
        return delta

    def _group_output(self, g: _Group, deltas: dict, now: float) -> RequestOutput:
        """The group's output after a step; retires it when every choice is done."""
        finished = all(r.finished for r in g.seqs)
        if finished:
            if g.metrics.finished_time is None:
                g.metrics.finished_time = now
            del self._groups[g.request_id]
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

    # ---- numerics hooks -----------------------------------------------------

    def last_token_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """f32[n, V] next-token logits of each prompt, computed in one ragged
        prefill (nothing is kept in the cache). For parity tests and scoring.

        Raises:
          ValueError: bad prompt, or the prompts do not fit in the free pages.
        """
        reqs = []
        try:
            for ids in prompts:
                ids = self.encode(ids)
                r = Request(f"_logits{len(reqs)}", None, ids, SamplingParams(temperature=0),
                            0, self.eos_token_ids)
                r.page_ids = self.allocator.allocate(cdiv(len(ids), self.allocator.page_size))
                reqs.append(r)
            batch = ScheduledBatch(reqs, [r.num_tokens for r in reqs], num_decode=0)
            return self.runner.execute(batch, return_logits=True).logits
        finally:
            for r in reqs:
                self.allocator.free(r.page_ids)

    def prompt_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """f32[T, V] next-token logits after each of the T tokens: row t is
        the model's distribution over token t + 1 given tokens 0..t. One
        prefill of the whole sequence in fresh pages (no prefix cache; the
        pages are freed after), through ``ModelRunner.token_logits``. For
        perplexity and KL divergence (``jaxserve.bench.eval``); T x V f32 is
        ~100 MB for T = 512, V = 49152.

        Raises:
          ValueError: bad ids, T above ``max_model_len``, more pages than are
            free, or a multi-host job.
        """
        ids = self.encode(token_ids)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt_logits: {len(ids)} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        r = Request("_prompt_logits", None, ids, SamplingParams(temperature=0), 0,
                    self.eos_token_ids)
        r.page_ids = self.allocator.allocate(cdiv(len(ids), self.allocator.page_size))
        try:
            return self.runner.token_logits(ScheduledBatch([r], [len(ids)], num_decode=0))
        finally:
            self.allocator.free(r.page_ids)


def kv_cache_dtype_name(name: str) -> str | None:
    """``CacheConfig.dtype`` of a ``--kv_cache_dtype`` name: ``"auto"`` -> None,
    ``"fp8_e4m3"`` (vLLM's name) -> ``"float8_e4m3fn"``, others unchanged.

    Raises:
      ValueError: an unknown name (names the value and the choices).
    """
    from jaxserve.config import KV_CACHE_DTYPES
    value = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn"}.get(name, name)
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, float16, "
                         f"int8, fp8_e4m3; got {name!r}")
    return value


def speculative_config_from_dict(d: dict | None) -> SpeculativeConfig:
    """``SpeculativeConfig`` of vLLM's ``speculative_config`` dict (``model``
    and ``quantization`` name the draft's; our field names work too).

    Raises:
      ValueError: an unknown key (names it) or a bad value.
    """
    if not d:
        return SpeculativeConfig()
    alias = {"model": "draft_model", "quantization": "draft_quantization"}
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    out = {}
    for k, v in d.items():
        name = alias.get(k, k)
        if name not in fields:
            raise ValueError(f"speculative_config: unknown key {k!r}; known: "
                             f"{sorted(fields | set(alias))}")
        out[name] = v
    return SpeculativeConfig(**out)


class LLM:
    """vLLM-style offline facade: ``LLM(model=...).generate(prompts, params)``.

    Args:
      model: alias (``"smollm2-135m"``), a ``.gguf`` path, an HF folder or an
        Orbax folder (``checkpoints.orbax_ckpt``; restored straight into the
        params' shardings on the mesh).
      dtype, seed, page_size, num_pages, kv_cache_memory_bytes, max_num_seqs,
      max_num_batched_tokens, max_model_len, enable_prefix_caching,
      enable_chunked_prefill, attention_impl, scan_layers, attention_interpret,
      async_scheduling: engine args (see ``jaxserve.config``).
      compilation_cache_dir: the persistent XLA compilation cache folder.
        ``"auto"`` (the default) is the CLI's, ``$JAXSERVE_CACHE/xla``
        (``~/.cache/jaxserve/xla``), so a second run (a notebook restarted)
        loads its programs instead of compiling them; None or ``""``: no
        persistent cache (nothing read or written, unless an earlier engine
        or the user set one up in this process: JAX keeps one cache folder
        per process, the first one set, see ``jaxserve.engine.compile_cache``);
        any other string is a folder (``./auto`` for one named auto).
      mesh: device mesh spec such as ``"tp=2"`` or ``"dp=1,tp=4,ep=2"``
        (``sharding.mesh.parse_mesh_spec``); None means one device.
      quantization, quantization_group_size: the weight format
        (``EngineConfig.quantization``): none, int8, w8a8, int4 or gguf.
      kv_cache_dtype: ``"auto"`` (the parameter dtype), ``"float32"``,
        ``"bfloat16"``, ``"float16"``, ``"int8"`` or ``"fp8_e4m3"``.
      speculative_config: vLLM's dict: ``{"method": "ngram" | "draft",
        "num_speculative_tokens": k, "prompt_lookup_min": .., "prompt_lookup_max":
        .., "model": draft model ("self" or a model string), "quantization":
        the draft's, "adaptive": bool}`` (``SpeculativeConfig``); None is off.
      model_config, params, tokenizer, chat_template, devices: see ``Engine``.

    Raises:
      ValueError: a bad engine arg or mesh spec (before any weights are read).
    """

    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "float32", seed: int = 0,
                 page_size: int = 16, num_pages: int | None = None,
                 kv_cache_memory_bytes: int = 512 << 20, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 compilation_cache_dir: str | None = compile_cache.AUTO,
                 attention_impl: str = "auto", scan_layers: bool = True,
                 attention_interpret: bool = False, async_scheduling: bool = True,
                 mesh: str | None = None, quantization: str = "none",
                 quantization_group_size: int = 32, kv_cache_dtype: str = "auto",
                 speculative_config: dict | None = None, **parts):
        parallel = ParallelConfig() if mesh is None else \
            ParallelConfig.from_mesh_shape(parse_mesh_spec(mesh))
        config = EngineConfig(
            model=model, dtype=dtype, seed=seed,
            cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                              memory_bytes=kv_cache_memory_bytes,
                              dtype=kv_cache_dtype_name(kv_cache_dtype),
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      enable_chunked_prefill=enable_chunked_prefill),
            compilation_cache_dir=compile_cache.resolve_dir(compilation_cache_dir),
            attention_impl=attention_impl, scan_layers=scan_layers,
            attention_interpret=attention_interpret, async_scheduling=async_scheduling,
            parallel=parallel, quantization=quantization,
            quantization_group_size=quantization_group_size,
            speculative=speculative_config_from_dict(speculative_config))
        self.engine = Engine(config, **parts)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in prompt order.

        Args:
          prompts: a string, a list of strings, a list of token-id lists, or
            vLLM's dict prompts (``{"prompt": ...}``, ``{"prompt_token_ids": ...}``).
          sampling_params: one ``SamplingParams`` for all, or a list, one each.

        Raises:
          ValueError: any bad prompt or params (nothing is queued then).
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for "
                             f"{len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        others: list[RequestOutput] = []  # outputs of requests added elsewhere: handed back
        try:
            for p, sp in zip(prompts, sampling_params):
                ids.append(engine.add_request(None, p, sp))
        except ValueError:
            for rid in ids:
                engine.abort(rid)
            engine._pending = [o for o in engine._pending if o.request_id not in ids]
            raise
        mine = set(ids)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in engine.step():
                    if out.request_id not in mine:
                        others.append(out)
                    elif out.finished:
                        final[out.request_id] = out
        finally:
            engine._pending[:0] = others
        return [final[rid] for rid in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs as it runs (``delta_text`` per step).

        Closing the iterator early (``break``, garbage collection, an
        exception in the consumer) aborts the request at once, freeing its
        pages. Outputs of other requests in the engine are kept for their owners.

        Raises:
          ValueError: bad prompt or params (raised at the first ``next``).
        """
        engine = self.engine
        rid = engine.add_request(request_id, prompt, sampling_params)
        done = False
        try:
            while not done:
                outs = engine.step()
                for out in outs:
                    if out.request_id == rid:
                        done = out.finished
                        yield out
                    else:
                        engine._pending.append(out)
        finally:
            if not done:
                engine.abort(rid)
                engine._pending = [o for o in engine._pending if o.request_id != rid]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        Raises:
          ValueError: the model has no chat template, or a message is malformed.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer / chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
            if isinstance(m["content"], str):
                check_text(m["content"], f"messages[{i}].content")
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """Generate replies to one conversation (list of role/content dicts) or
        a list of conversations, each rendered with the chat template (or,
        for a model without one, as a transcript that stops at the next
        user line: ``Tokenizer.chat_stop``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in convs]
        stop = self.engine.tokenizer.chat_stop
        if isinstance(sampling_params, (list, tuple)):
            sampling_params = [p.with_stop(stop) for p in sampling_params]
        else:
            sampling_params = (sampling_params or SamplingParams()).with_stop(stop)
        return self.generate(prompts, sampling_params)
