"""ModelRunner: metadata building, shape buckets and the jitted step.

``step_fn`` is a pure function of ``(params, k_cache, v_cache,
AttentionMetadata)`` (the metadata carries the token ids, positions,
``cu_q_lens``, ``kv_lens``, page table, and the counts of real rows and
decode rows) returning the logits of the rows in ``logits_indices`` and the
caches, which are donated so XLA updates them in place. It serves decode,
prefill and mixed steps alike (decode rows first, then prefill chunks, one
ragged attention). Sampling, top-N logprobs and prompt logprobs are a
second jitted function over the logits (still on device). The step also
takes the previous step's sampled ids (i32[R], R the largest row bucket) and
a plan leaf ``prev_rows`` i32[T] naming which of them are its input ids at
which positions, so async scheduling (``async_step.py``) can launch a step
before the host has the previous step's tokens; the shapes are fixed, so no
program is added.

A step's static dimensions are only its token count T and row count S
(``shapes.py``): T is the step's tokens rounded up a ladder with under 25%
padding, S = min(T, ladder(max_num_seqs)) (2 x max_num_seqs for a speculating
engine, whose sampled positions, "slots", are one per row plus one per draft
token: ``StepPlan.row_slots``); the mix of decode rows and prefill
chunks, the kv lengths and the pages are device values that the attention
loops over. The page table is always ``pages_per_row`` wide. So one program
per T serves decode and mixed steps alike (a decode step of n rows is T = S =
ladder(n)), every T a config can reach is known up front
(``shapes.step_token_counts``), and ``warmup`` compiles them all.
The step also returns the last layer's output x [D, T]; a step with prompt
logprobs gets them from a small jit over it (the LM head and log-softmax of
every token, one program per T on first use, not a second copy of the model);
``token_logits`` (eval's full-vocabulary logits of every token) is the same
kind of jit. Sampling is its own jit keyed by S, the top-N count
and the penalty tensors' widths. ``num_compilations`` counts traces of all
jits.

Sharding: every jit runs over the runner's mesh (axes dp, tp, ep; one device
by default). Params carry the ``NamedSharding`` their logical axis names get
from ``sharding.rules.ShardingRules.for_model``; each layer's K and V cache
is split over kv heads on ``tp`` (replicated when tp does not divide them);
the metadata, sampling tensors and logits are replicated.

Each layer's K and V cache is a ``quant.KVPages``: the [P, L, K, H] pages
and, for an int8 / fp8 cache, their f32[P, L, K] per-token scales (None
otherwise, so an unquantized cache is one array per layer and compiles as
before); the scales shard over kv heads like their pages, and are donated
with them. The caches keep
their sharding through ``out_shardings``, so donation still updates them in
place; XLA inserts the all-reduces of the row-parallel projections. The
model is traced under the mesh's abstract mesh, which an MoE block's
``shard_map`` over ep reads; an MoE model's steps also return its expert load
(``last_expert_load``, ``StepResult.expert_load``).

Parts kept apart: ``plan.py`` builds the host ``StepPlan`` of a batch and
holds ``StepResult``; ``programs.py`` (``ProgramsMixin``) the AOT warm-up,
the table of ready programs ``run`` calls and the executable store;
``kv_pages.py`` (``KVPagesMixin``) the KV page import/export of a handoff.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.engine import multihost, shapes
from jaxserve.engine.async_step import merge_input_ids
from jaxserve.engine.kv_pages import KVPagesMixin
from jaxserve.engine.page_table import cdiv
from jaxserve.engine.plan import (PlanLayout, StepPlan, StepResult, padding_plan, plan_treedef,
                                  prepare_plan)
from jaxserve.engine.programs import ProgramsMixin
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.sampling import prompt_logprobs, sample
from jaxserve.engine.scheduler import ScheduledBatch, next_pow2
from jaxserve.models import lora
from jaxserve.models.stack import stack_layers
from pallas_kernels.ragged_paged_attention import kernel_xla as rpa_xla
from pallas_kernels.ragged_paged_attention.kernel_tpu_schedule import (tpu_kv_page_bytes,
                                                                       tpu_kv_scale_page_bytes)
from pallas_kernels.ragged_paged_attention.quant import KVPages, is_quantized
from sharding.mesh import make_mesh, validate_mesh_for_model
from sharding.placement import place
from sharding.rules import ShardingRules, named_sharding, param_shardings


class ModelRunner(ProgramsMixin, KVPagesMixin):
    """Owns the parameters and the paged KV cache and runs steps.

    Args:
      model: an NNX model whose ``__call__`` follows ``LlamaForCausalLM``.
      num_pages: pages P of the cache; page_size L tokens each.
      max_model_len: longest sequence, tokens (the page table's width).
      max_num_seqs: most rows of a step (S's ceiling).
      kv_dtype: cache dtype; int8 and float8_e4m3fn pages carry f32 scales.
      mesh: the device mesh (axes dp, tp, ep; ``sharding.mesh.make_mesh``);
        None means the first device alone.
      rules: sharding rules of this model on ``mesh``; None means
        ``validate_mesh_for_model(mesh.shape, model.cfg)``.
      scan_layers: run the decoder layers as one scanned body per run of
        identical layers (``models.stack``; stacks ``model``'s layers in
        place); False unrolls them (one copy of the body per layer).
      max_num_tokens: the most tokens of one step (the top prefill bucket);
        None means ``max(max_model_len, max_num_seqs)``.

    Raises:
      ValueError: the mesh cannot run the model (see ``ShardingRules.for_model``).
    """

    def __init__(self, model: nnx.Module, *, num_pages: int, page_size: int,
                 max_model_len: int, kv_dtype, max_num_seqs: int = 64,
                 mesh: jax.sharding.Mesh | None = None, rules: ShardingRules | None = None,
                 scan_layers: bool = True, max_num_tokens: int | None = None):
        cfg = model.cfg
        self.model_config = cfg
        self.mesh = mesh if mesh is not None else make_mesh("tp=1", jax.devices()[:1])
        self.rules = rules if rules is not None else validate_mesh_for_model(self.mesh.shape, cfg)
        # One layer body per run of identical layers (jaxserve.models.stack).
        self.layer_segments = stack_layers(
            model, dynamic_window=model.layers[0].self_attn.attention_impl != "pallas") \
            if scan_layers else None
        has_expert_load = getattr(model, "has_expert_load", False)
        self.graphdef, state = nnx.split(model)
        self.param_shardings = param_shardings(state, self.mesh, self.rules)
        self.state = place(state, self.param_shardings)
        del state, model
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = cdiv(max_model_len, page_size)
        # Whole page blocks of the XLA attention, so it never pads the table.
        ppb = rpa_xla.DEFAULT_PAGES_PER_BLOCK
        self.pages_per_row = cdiv(self.max_pages_per_seq, ppb) * ppb
        self.max_rows = shapes.coarse_bucket(max_num_seqs)
        # The most tokens of one step (a scheduler's budget: shapes.max_step_tokens).
        self.max_tokens = max_num_tokens or max(max_model_len, self.max_rows)
        # Penalised steps' M = Mp (sampling.make_sampling_tensors): a row holds
        # at most max_model_len (and V) unique ids, so one width, compiled at
        # warm-up, serves every penalised step.
        self.penalty_width = next_pow2(min(max_model_len, cfg.vocab_size))
        self.lora_paths = lora.lora_paths(self.state)  # LoRA slot leaves (engine.adapters)
        self.layout = PlanLayout(page_size, num_pages, self.pages_per_row, self.max_rows,
                                 self.max_tokens, self.penalty_width, cfg.vocab_size,
                                 lora=bool(self.lora_paths))
        # One KVPages per K and V for every layer: [layers, P, L, K, H] pages
        # (and f32 [layers, P, L, K] scales when quantized), donated into
        # every step and updated in place (models.stack.layer_kv).
        self.kv_dtype = jnp.dtype(kv_dtype)
        quantized = is_quantized(kv_dtype)
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_sharding = named_sharding(self.mesh, self.rules,
                                          (None, None, None, "kv_heads", None))
        self.scale_sharding = named_sharding(self.mesh, self.rules,
                                             (None, None, None, "kv_heads")) if quantized else None

        def stacked_cache():
            return KVPages(jnp.zeros(shape, kv_dtype, device=self.kv_sharding),
                           jnp.zeros(shape[:4], jnp.float32, device=self.scale_sharding)
                           if quantized else None)
        self.k_stack, self.v_stack = stacked_cache(), stacked_cache()
        self._kv_specs = jax.tree.map(  # what an ahead-of-time compile lowers against
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            (self.k_stack, self.v_stack))
        self._init_programs()  # warm-up's table of ready programs (programs.py)
        caches = KVPages(self.kv_sharding, self.scale_sharding)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        # An MoE model also returns its expert load (jaxserve.models.moe).
        self.has_expert_load = has_expert_load
        self.last_expert_load: np.ndarray | None = None  # i32[num_layers, E], last step
        outs = (replicated, caches, caches) + ((replicated,) if self.has_expert_load else ()) \
            + (replicated,)  # the last layer's output x_DT, for prompt logprobs
        step_shardings = dict(in_shardings=(self.param_shardings, caches, caches, replicated,
                                            replicated, replicated),
                              out_shardings=outs, donate_argnums=(1, 2))
        # Two step programs (the design card's separate prefill and decode
        # steps) over the same scanned layer body: ``decode_step`` for steps
        # whose rows are all one-token decodes (T = S, bucketed by rows; the
        # attention compiles no prefill path), ``prefill_step`` for steps
        # with prompt chunks or verified drafts (bucketed by tokens; decode
        # rows ride along). ``StepPlan.md.decode_only`` picks one.
        self.num_decode_compilations = 0
        self.num_prefill_compilations = 0
        self.decode_step = jax.jit(self._decode_step, **step_shardings)
        self.prefill_step = jax.jit(self._prefill_step, **step_shardings)
        self.num_compilations = 0
        # Sampling is its own jit: its compilations depend only on the row
        # buckets, so they are shared by every prefill/decode shape.
        self._postprocess = jax.jit(self._postprocess_fn, static_argnums=(2,),
                                    in_shardings=replicated, out_shardings=replicated)
        # Prompt logprobs: every token's logits from the step's x_DT, a small
        # program per token count (not a second copy of the model's step).
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn, static_argnums=(3,))
        self._all_logits = jax.jit(self._all_logits_fn)  # token_logits: f32[T, V] per T
        self._init_kv_pages(caches, replicated)  # KV handoff (kv_pages.py)
        # The latest launched step's sampled ids, i32[max_rows] on device
        # (what ``prev_rows`` index), and the launches so far.
        self._no_prev = jnp.zeros(self.max_rows, jnp.int32, device=replicated)
        self._prev_ids = self._no_prev
        self.num_launched = 0
        # Multi-host: process 0 broadcasts each plan, the others ``follow``.
        self.channel: multihost.StepChannel | None = None
        if jax.process_count() > 1:  # the Engine has checked that the mesh spans the job
            self.channel = multihost.StepChannel()
        self._plan_treedef = plan_treedef()

    @staticmethod
    def kv_bytes_per_page(cfg, page_size: int, dtype, platform: str | None = None) -> int:
        """Bytes of K and V for one page across all layers, int8/fp8 scales
        (f32, one per token per kv head) included. At SmolLM2's K = 3, H = 64,
        30 layers, L = 16: f32 737,280, bf16 368,640, int8/fp8 195,840, so
        1 GiB holds 1,456 / 2,912 / 5,482 pages (int8 3.76x f32, 1.88x bf16).

        ``platform="tpu"``: the padded HBM bytes under XLA's TPU tiling of the
        minor dims (``kernel_tpu_schedule.tpu_kv_page_bytes`` and
        ``tpu_kv_scale_page_bytes``, an upper bound): K rounds up to the
        sublane tile and H to 128 lanes, so SmolLM2's bf16 pages take 10.7x
        their data there, and the page count a memory budget buys shrinks
        to match instead of overrunning HBM."""
        if platform == "tpu":
            per_layer = tpu_kv_page_bytes(page_size, cfg.num_kv_heads, cfg.head_dim, dtype) + (
                tpu_kv_scale_page_bytes(page_size, cfg.num_kv_heads)
                if is_quantized(dtype) else 0)
            return 2 * cfg.num_layers * per_layer
        per_head = cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if is_quantized(dtype) else 0)
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * per_head

    def layer_params(self, i: int):
        """Layer ``i``'s parameters as a per-layer NNX state (arrays sliced
        out of the stacked ones: copies, for inspection and tests), whether
        the layers are scanned or unrolled.

        Raises:
          IndexError: no layer ``i``.
        """
        if not 0 <= i < self.model_config.num_layers:
            raise IndexError(f"layer {i} of a {self.model_config.num_layers}-layer model")
        if self.layer_segments is None:
            return self.state["layers"][i]
        for seg, (a, b) in enumerate(self.layer_segments):
            if a <= i < b:
                return jax.tree.map(lambda x: self._slice_layer(x, i - a),
                                    self.state["layers"][seg])

    def _slice_layer(self, x, j: int):
        """``x[j]`` of a stacked [layers, ...] array, keeping the stacked
        layout's split of the other dims (a copy)."""
        spec = PartitionSpec(*tuple(x.sharding.spec)[1:])
        return jax.jit(lambda x: x[j], out_shardings=NamedSharding(self.mesh, spec))(x)

    @property
    def k_cache(self) -> tuple[KVPages, ...]:
        """Each layer's K ``KVPages`` ([P, L, K, H], scales [P, L, K]): copies
        sliced out of the stacked cache, for inspection (tests)."""
        return self._layer_views(self.k_stack)

    @property
    def v_cache(self) -> tuple[KVPages, ...]:
        """Each layer's V ``KVPages`` (as ``k_cache``)."""
        return self._layer_views(self.v_stack)

    def _layer_views(self, c: KVPages) -> tuple[KVPages, ...]:
        return tuple(KVPages(self._slice_layer(c.pages_PLKH, i), None if c.scales_PLK is None
                             else self._slice_layer(c.scales_PLK, i))
                     for i in range(self.model_config.num_layers))

    def _step(self, state, k_cache, v_cache, md, prev_rows_T, prev_ids_R):
        self.num_compilations += 1  # runs once per trace, i.e. per compilation
        md = dataclasses.replace(md, input_ids=merge_input_ids(md.input_ids, prev_rows_T,
                                                               prev_ids_R))
        model = nnx.merge(self.graphdef, state)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # MoE's shard_map reads it
            return model(k_cache, v_cache, md, return_hidden=True)

    def _decode_step(self, state, k_cache, v_cache, md, prev_rows_T, prev_ids_R):
        if not md.decode_only:
            raise ValueError("decode_step runs decode-only plans (md.decode_only)")
        self.num_decode_compilations += 1
        return self._step(state, k_cache, v_cache, md, prev_rows_T, prev_ids_R)

    def _prefill_step(self, state, k_cache, v_cache, md, prev_rows_T, prev_ids_R):
        if md.decode_only:
            raise ValueError("prefill_step runs plans with prompt chunks (not md.decode_only)")
        self.num_prefill_compilations += 1
        return self._step(state, k_cache, v_cache, md, prev_rows_T, prev_ids_R)

    def step_fn(self, state, k_cache, v_cache, md, prev_rows_T, prev_ids_R):
        """The step program for ``md``: ``decode_step`` when
        ``md.decode_only``, else ``prefill_step`` (same arguments and results)."""
        fn = self.decode_step if md.decode_only else self.prefill_step
        return fn(state, k_cache, v_cache, md, prev_rows_T, prev_ids_R)

    def _postprocess_fn(self, logits_RV, st, rows, want_top):
        """Sampling of a step's ``rows`` rows; the top ``MAX_LOGPROBS``
        logprobs only when ``want_top`` (a device bool), so one program per
        row count serves steps with and without logprobs."""
        self.num_compilations += 1
        out = sample(logits_RV[:rows], st, MAX_LOGPROBS, want_top, cpu_kernel=self.mesh.size == 1)
        ids_R = jnp.pad(out.token_ids, (0, self.max_rows - rows))  # the next step's prev ids
        return out, ids_R

    def _prompt_logprobs_fn(self, state, x_DT, targets_T, num_top):
        """Raw logprobs of ``targets_T[t]`` after token t, for every token t."""
        self.num_compilations += 1
        model = nnx.merge(self.graphdef, state)
        return prompt_logprobs(model.logits_of(x_DT), targets_T, num_top)

    def _all_logits_fn(self, state, x_DT):
        self.num_compilations += 1
        return nnx.merge(self.graphdef, state).logits_of(x_DT)

    def token_logits(self, batch: ScheduledBatch) -> np.ndarray:
        """f32[t, V] next-token logits after every token of ``batch`` (t its
        tokens, in the batch's order): one step, then the LM head over the
        step's last-layer output x_DT (``_all_logits``, a small jit per token
        count, as prompt logprobs do). Nothing is sampled; the step counts as
        launched, so an async engine step after it runs synchronously. For
        ``Engine.prompt_logits`` (eval).

        Raises:
          ValueError: in a multi-host job (the other processes would not run
            the step).
        """
        if self.channel is not None:
            raise ValueError("token_logits runs in a single-process job only")
        plan = self.prepare(batch)
        out = self.step_fn(self.state, self.k_stack, self.v_stack, plan.md, plan.prev_rows,
                           self._no_prev)
        _, self.k_stack, self.v_stack, *_, x_DT = out
        self.num_launched += 1
        return np.asarray(self._all_logits(self.state, x_DT))[:sum(batch.q_lens)]


    def execute(self, batch: ScheduledBatch, return_logits: bool = False) -> StepResult:
        """Run one step on device.

        Row k of the results belongs to ``batch.requests[k]``. Prompt-logprob
        rows are collected for requests with ``wants_prompt_logprobs`` whose
        step covers prompt positions they have no logprob for yet. In a
        multi-host job (``self.channel`` set, process 0) the plan is first
        broadcast to the other processes, which run the same step
        (``follow``).

        Returns:
          a ``StepResult`` of numpy arrays.

        Raises:
          MultihostError: a multi-host step failed after its plan was sent
            (fatal: the processes can no longer agree).
        """
        return self._execute_plan(self.prepare(batch), return_logits)

    def _execute_plan(self, plan: "StepPlan", return_logits: bool = False) -> StepResult:
        return self.finish(plan, self.launch(plan), return_logits)

    def launch(self, plan: StepPlan, defer_sampling: bool = False):
        """Start a plan's step on device without waiting for it (in a
        multi-host job, after broadcasting the plan); returns its device
        arrays for ``finish``. ``defer_sampling``: launch the step program
        only (its sampling comes with ``launch_sampling``, once the host has
        filled the plan's token bitmask rows; one-process jobs only).

        Raises:
          MultihostError: a multi-host step failed after its plan was sent.
          ValueError: ``defer_sampling`` in a multi-host job.
        """
        if self.channel is None:
            return self.run(plan, defer_sampling)
        if defer_sampling:
            raise ValueError("a multi-host step cannot defer its sampling (the plan is "
                             "broadcast whole)")
        try:
            self.channel.send(multihost.OP_STEP, plan.statics(), plan.leaves())
            return self.run(plan)
        except Exception as e:  # noqa: BLE001 - the processes are out of step: fatal
            raise self.channel.fail(e) from e

    def finish(self, plan: StepPlan, outs, return_logits: bool = False) -> StepResult:
        """Wait for a launched step and copy its results to the host.

        Raises:
          MultihostError: a multi-host step failed.
        """
        if self.channel is None:
            return self._finish(plan, outs, return_logits)
        try:
            return self._finish(plan, outs, return_logits)
        except Exception as e:  # the processes are out of step: fatal
            raise self.channel.fail(e) from e

    def empty_plan(self, num_tokens: int, num_top: int = 0, decode: bool = False,
                   penalised: bool = False, prompt_logprobs: bool = False) -> StepPlan:
        """A padding plan of ``num_tokens`` tokens in this runner's shapes
        (``plan.padding_plan``): running it compiles that program and
        changes nothing."""
        return padding_plan(self.layout, num_tokens, num_top, decode, penalised,
                            prompt_logprobs)

    def follow(self) -> int:
        """A multi-host job's other processes: run every step process 0
        broadcasts, until it sends STOP; returns the number of steps run.

        Raises:
          MultihostError: a step or the broadcast failed (the reason of the
            process that failed first is in the message).
        """
        steps = 0
        while True:
            op, statics, leaves = self.channel.recv()
            if op == multihost.OP_STOP:
                return steps
            try:
                plan = StepPlan.from_wire(statics, leaves, self._plan_treedef)
                jax.block_until_ready(self.run(plan))
            except Exception as e:  # noqa: BLE001
                raise self.channel.fail(e) from e
            steps += 1

    def stop_followers(self) -> None:
        """Process 0 of a multi-host job: tell the other processes to return
        from ``follow`` (once; a no-op without a channel or once broken)."""
        if self.channel is not None and not self.channel.stopped and self.channel.broken is None:
            self.channel.send(multihost.OP_STOP)

    def run(self, plan: "StepPlan", defer_sampling: bool = False):
        """Launch a plan's jitted step and sampling; returns device arrays
        ``(logits f32[R, V], SampleOutput, prompt logprobs or None,
        expert load or None)``. Every process of a job calls it with the same
        plans in the same order, so each one's previous sampled ids (what
        ``plan.prev_rows`` index) are the same. ``defer_sampling``: the
        ``SampleOutput`` is None until ``launch_sampling`` (the step program
        reads the previous step's sampled ids when launched, so the next
        step's sampling may come later)."""
        prev_ids = self._prev_ids if plan.uses_prev else self._no_prev
        md, T = plan.md, plan.md.input_ids.shape[0]
        step = self._ready(self._step_name(md.decode_only, T), self.step_fn)  # warmed up ahead
        out = step(self.state, self.k_stack, self.v_stack, md, plan.prev_rows, prev_ids)
        logits, self.k_stack, self.v_stack, *load, x_DT = out
        plp = None
        if plan.targets.shape[0]:
            fn = self._ready(f"prompt-logprobs-{T}-top{plan.num_top}",
                             lambda st, x, tg: self._prompt_logprobs(st, x, tg, plan.num_top))
            plp = fn(self.state, x_DT, plan.targets)
        self.num_launched += 1
        outs = (logits, None, plp, (load[0] if load else None))
        return outs if defer_sampling else self.launch_sampling(plan, outs)

    def launch_sampling(self, plan: "StepPlan", outs):
        """Launch the sampling of a step launched with ``defer_sampling``
        (with ``plan.sampling`` as it is now: its bitmask rows filled since);
        returns the step's device arrays with its ``SampleOutput``. It must
        come before the next step's launch (whose input ids may be these
        sampled ids)."""
        logits, _, plp, load = outs
        sampling = self._ready(self._sampling_name(plan.rows, plan.sampling),
                               lambda lg, st, top: self._postprocess(lg, st, plan.rows, top))
        so, self._prev_ids = sampling(logits, plan.sampling, np.bool_(plan.num_top > 0))
        return logits, so, plp, load

    def _finish(self, plan: "StepPlan", outs, return_logits: bool) -> StepResult:
        logits, so, plp, load = outs
        n = plan.num_requests
        self.last_expert_load = None if load is None else np.asarray(load)
        so = jax.tree.map(lambda a: np.asarray(a)[:n], so)
        plp = None if plp is None else [np.asarray(a) for a in plp]
        return StepResult(
            token_ids=so.token_ids, logprobs=so.logprobs, ranks=so.ranks,
            top_ids=so.top_ids[:, :plan.num_top], top_logprobs=so.top_logprobs[:, :plan.num_top],
            prompt_logprobs={k: (lo, hi, [a[i:i + hi - lo] for a in plp])
                             for k, (i, lo, hi) in plan.plp_spans.items()},
            logits=np.asarray(logits)[:n] if return_logits else None,
            expert_load=self.last_expert_load)

    def prepare(self, batch: ScheduledBatch, prev_rows_of: dict | None = None,
                fill_masks: bool = True) -> StepPlan:
        """A step's host arrays, padded to the buckets (``plan.prepare_plan``).

        Args:
          batch: the scheduler's plan.
          prev_rows_of: {request: its row in the step launched just before},
            for the requests whose last token is that step's placeholder
            (async scheduling); None when no request holds one.
          fill_masks: as ``plan.prepare_plan``.
        """
        return prepare_plan(batch, self.layout, prev_rows_of, fill_masks)
