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
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.engine import compile_cache, multihost
from jaxserve.engine.async_step import merge_input_ids
from jaxserve.engine.executables import ExecutableStore, fingerprint, fresh_compile
from jaxserve.engine.page_table import cdiv
from jaxserve.engine.request import MAX_LOGPROBS
from jaxserve.engine.sampling import (SamplingTensors, make_sampling_tensors, prompt_logprobs,
                                      sample)
from jaxserve.engine.scheduler import ScheduledBatch, next_pow2
from jaxserve.engine import shapes
from jaxserve.engine.shapes import bucket
from jaxserve.models.llama import AttentionMetadata
from jaxserve.models.stack import stack_layers
from pallas_kernels.ragged_paged_attention import kernel_xla as rpa_xla
from pallas_kernels.ragged_paged_attention.quant import KVPages, is_quantized
from sharding.mesh import make_mesh, validate_mesh_for_model
from sharding.rules import ShardingRules, named_sharding, param_shardings


def place(tree, shardings):
    """``jax.device_put(tree, shardings)``, except that in a multi-process job
    each process builds only its own devices' slices of a host array
    (``jax.make_array_from_callback``): ``device_put`` of a host array onto a
    sharding spanning processes first all-gathers it to check that every
    process holds the same value, moving every weight over the network.
    Arrays already spread over the job (restored from Orbax) are kept, or
    resharded on device when their sharding differs."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else jax.device_put(x, sharding)  # a reshard
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    leaves, treedef = jax.tree.flatten(tree)
    targets = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(targets) != len(leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(targets)} shardings")
    return jax.tree.unflatten(treedef, [put(x, s) for x, s in zip(leaves, targets)])


@dataclasses.dataclass
class StepResult:
    """One step's results on the host; row k is the step's k-th request.

    Attributes:
      token_ids: i32[n] sampled ids (meaningless for non-final chunks).
      logprobs, ranks: f32[n], i32[n] raw logprob and 1-based rank of each.
      top_ids, top_logprobs: i32[n, 20], f32[n, 20] top candidates, or [n, 0]
        when no request of the step asked for logprobs.
      prompt_logprobs: request row k -> (lo, hi, [target logprobs f32[m],
        target ranks i32[m], top ids i32[m, 20], top logprobs f32[m, 20]])
        for prompt positions lo..hi-1 (m = hi - lo).
      logits: f32[n, V] last-token logits when asked, else None.
      expert_load: i32[num_layers, E] real tokens routed to each expert in
        this step (an MoE model's; None for dense models).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt_logprobs: dict
    logits: np.ndarray | None = None
    expert_load: np.ndarray | None = None


@dataclasses.dataclass
class StepPlan:
    """One step as the host prepares it: everything the jitted functions take
    besides the params and caches. In a multi-host job process 0 broadcasts
    ``statics()`` and ``leaves()``; the others rebuild it with ``from_wire``.

    Attributes:
      decode: every row has one new token: the step runs ``decode_step``
        (``md.decode_only``), else ``prefill_step``.
      rows: S, padded rows (each samples one token).
      num_top: top-N logprobs to compute (0 or ``MAX_LOGPROBS``).
      md: ``AttentionMetadata`` of numpy i32 arrays (shapes in its docstring).
      sampling: ``SamplingTensors`` of numpy arrays, R rows.
      targets: i32[T] prompt-logprob target of each token (the prompt token
        after it; 0 where none), or i32[0] when no request of the step asks.
      prev_rows: i32[T] for each token, the row of the previous launched
        step whose sampled id is its input id (``md.input_ids`` holds 0
        there), or -1: the host's id (async scheduling).
      uses_prev: some ``prev_rows`` >= 0 (the step then waits for the
        previous step's sampling on device).
      num_requests: n real sampled positions ("slots": one per request,
        plus one per draft token of a speculating request), the first n
        rows of the results (host only, process 0).
      row_slots: per request, its first slot; a speculating request's slots
        follow it in order, one per draft plus the bonus (host only).
      plp_spans: request row -> (first token, lo, hi): its prompt logprobs
        for positions lo..hi-1 are those of tokens first..first+hi-lo-1 of
        the step (host only, process 0).
    """

    decode: bool
    rows: int
    num_top: int
    md: AttentionMetadata
    sampling: SamplingTensors
    targets: np.ndarray
    prev_rows: np.ndarray
    uses_prev: bool = False
    num_requests: int = 0
    plp_spans: dict = dataclasses.field(default_factory=dict)
    row_slots: list = dataclasses.field(default_factory=list)

    def statics(self) -> list[int]:
        return [int(self.decode), self.rows, self.num_top, int(self.uses_prev)]

    def leaves(self) -> list[np.ndarray]:
        return jax.tree.leaves((self.md, self.sampling, self.targets, self.prev_rows))

    @classmethod
    def from_wire(cls, statics, leaves, treedef) -> "StepPlan":
        md, st, targets, prev_rows = jax.tree.unflatten(treedef, leaves)
        decode, rows, num_top, uses_prev = statics[:4]
        md = dataclasses.replace(md, decode_only=bool(decode))
        return cls(bool(decode), rows, num_top, md, st, targets, prev_rows, bool(uses_prev))


class ModelRunner:
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
        self._warm_rows: set[int] = set()  # S whose penalised sampling a warm-up compiled
        # Programs made ready ahead of time (warmup), by name: run calls them.
        self._programs: dict[str, jax.stages.Compiled] = {}
        self._store: ExecutableStore | None | bool = None  # _executable_store; False: off
        self.num_loaded_programs = 0  # of them, deserialized from the store
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
        # KV handoff (read_pages / write_pages): replicated page buffers.
        self._replicated = replicated
        self._gather_pages = jax.jit(self._gather_pages_fn, out_shardings=replicated)
        self._scatter_pages = jax.jit(
            self._scatter_pages_fn, donate_argnums=(0, 1),
            in_shardings=(caches, caches, replicated, replicated, replicated),
            out_shardings=(caches, caches))
        # The latest launched step's sampled ids, i32[max_rows] on device
        # (what ``prev_rows`` index), and the launches so far.
        self._no_prev = jnp.zeros(self.max_rows, jnp.int32, device=replicated)
        self._prev_ids = self._no_prev
        self.num_launched = 0
        # Multi-host: process 0 broadcasts each plan, the others ``follow``.
        self.channel: multihost.StepChannel | None = None
        if jax.process_count() > 1:  # the Engine has checked that the mesh spans the job
            self.channel = multihost.StepChannel()
        empty_md = AttentionMetadata(*([np.zeros(1, np.int32)] * 10))
        empty_st = make_sampling_tensors([], 1)
        self._plan_treedef = jax.tree.structure((empty_md, empty_st, np.zeros(0, np.int32),
                                                 np.zeros(1, np.int32)))

    @staticmethod
    def kv_bytes_per_page(cfg, page_size: int, dtype) -> int:
        """Bytes of K and V for one page across all layers, int8/fp8 scales
        (f32, one per token per kv head) included. At SmolLM2's K = 3, H = 64,
        30 layers, L = 16: f32 737,280, bf16 368,640, int8/fp8 195,840, so
        1 GiB holds 1,456 / 2,912 / 5,482 pages (int8 3.76x f32, 1.88x bf16)."""
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
        out = sample(logits_RV[:rows], st, MAX_LOGPROBS, want_top)
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

    # ---- KV pages in and out (disaggregated prefill/decode) -----------------

    @staticmethod
    def page_pieces(n: int) -> list[int]:
        """How ``read_pages`` splits n pages: the powers of two of n's binary
        form, largest first (57 -> [32, 16, 8, 1]); each piece's gather and
        scatter is compiled once (``warmup_pages``) and the bytes moved are
        exactly the pages'."""
        return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]

    def read_pages(self, page_ids) -> list[tuple[KVPages, KVPages]]:
        """A copy of some pages' K and V, for a KV handoff (``jaxserve.disagg``).

        Args:
          page_ids: n page ids, in the sequence's order.

        Returns:
          one (k, v) pair of ``KVPages`` per piece of ``page_pieces(n)``, in
          order; their leaves are contiguous buffers over every layer,
          ``[num_layers, m, L, K, H]`` in the cache dtype (and f32
          ``[num_layers, m, L, K]`` scales when quantized) for a piece of m
          pages, each on one device (the mesh's first): the transfer layout,
          independent of this mesh's tp.
        """
        out, lo = [], 0
        for m in self.page_pieces(len(page_ids)):
            idx = jnp.asarray(np.asarray(page_ids[lo:lo + m], np.int32), device=self._replicated)
            out.append(jax.tree.map(lambda a: a.addressable_shards[0].data,
                                    self._gather_pages(self.k_stack, self.v_stack, idx)))
            lo += m
        return out

    def write_pages(self, page_ids, pieces: list[tuple[KVPages, KVPages]]) -> None:
        """Write pages read by ``read_pages`` (possibly by another worker,
        whose mesh may differ) into ``page_ids`` of this cache.

        Raises:
          ValueError: pieces whose shapes or dtypes do not match this cache
            for ``len(page_ids)`` pages (a mismatched model or cache dtype).
        """
        want = self.page_spec(len(page_ids))
        if jax.tree.structure(want) != jax.tree.structure(pieces) or any(
                a.shape != b.shape or a.dtype != b.dtype
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(pieces))):
            raise ValueError(f"KV pages of shapes {[(x.shape, str(x.dtype)) for x in jax.tree.leaves(pieces)]} "
                             f"do not fit this cache, which needs "
                             f"{[(x.shape, str(x.dtype)) for x in jax.tree.leaves(want)]}")
        lo = 0
        for k, v in pieces:
            m = jax.tree.leaves(k)[0].shape[1]
            idx = jnp.asarray(np.asarray(page_ids[lo:lo + m], np.int32), device=self._replicated)
            k, v = jax.device_put((k, v), self._replicated)
            self.k_stack, self.v_stack = self._scatter_pages(self.k_stack, self.v_stack, idx,
                                                             k, v)
            lo += m

    def warmup_pages(self) -> int:
        """Compile ``read_pages``' gather and ``write_pages``' scatter for
        every power-of-two piece up to a whole sequence's pages, so a KV
        handoff meets no compilation (the scatter writes nothing: every
        index is out of range). Returns the piece sizes compiled."""
        sizes = self.page_pieces(2 * next_pow2(self.max_pages_per_seq) - 1)
        for m in sizes:
            idx = jnp.asarray(np.zeros(m, np.int32), device=self._replicated)
            k, v = self._gather_pages(self.k_stack, self.v_stack, idx)
            drop = jnp.asarray(np.full(m, self.num_pages, np.int32), device=self._replicated)
            self.k_stack, self.v_stack = self._scatter_pages(self.k_stack, self.v_stack, drop,
                                                             k, v)
        jax.block_until_ready(self.k_stack)
        return len(sizes)

    def page_spec(self, num_pages: int) -> list[tuple[KVPages, KVPages]]:
        """``jax.ShapeDtypeStruct``s of ``read_pages`` for ``num_pages`` pages
        (no sharding): what a puller asks for."""
        return [jax.eval_shape(self._gather_pages_fn, self.k_stack, self.v_stack,
                               jax.ShapeDtypeStruct((m,), jnp.int32))
                for m in self.page_pieces(num_pages)]

    @staticmethod
    def _gather_pages_fn(k_cache, v_cache, idx):
        """Pages ``idx`` of every layer: [layers, m, L, K, H] (scales [layers, m, L, K])."""
        def take(c: KVPages) -> KVPages:
            return KVPages(c.pages_PLKH[:, idx],
                           None if c.scales_PLK is None else c.scales_PLK[:, idx])
        return take(k_cache), take(v_cache)

    @staticmethod
    def _scatter_pages_fn(k_cache, v_cache, idx, k, v):
        def put(c: KVPages, buf: KVPages) -> KVPages:
            return KVPages(c.pages_PLKH.at[:, idx].set(buf.pages_PLKH, mode="drop"),
                           None if c.scales_PLK is None else
                           c.scales_PLK.at[:, idx].set(buf.scales_PLK, mode="drop"))
        return put(k_cache, k), put(v_cache, v)

    # ---- host-side metadata -------------------------------------------------

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

    def launch(self, plan: StepPlan):
        """Start a plan's step on device without waiting for it (in a
        multi-host job, after broadcasting the plan); returns its device
        arrays for ``finish``.

        Raises:
          MultihostError: a multi-host step failed after its plan was sent.
        """
        if self.channel is None:
            return self.run(plan)
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
                   penalised: bool = False, prompt_logprobs: bool = False) -> "StepPlan":
        """A plan of ``num_tokens`` (a bucket value of ``decode_step`` when
        ``decode``, else of ``prefill_step``) padding tokens and no real
        row, in the shape a real step of that many tokens gets: running it
        compiles that program and changes nothing (its K/V writes are
        dropped). ``penalised``: sampling tensors of a step with a penalised
        row (``penalty_width``); ``prompt_logprobs``: a target per token and
        ``MAX_LOGPROBS`` top logprobs, as a step with prompt logprobs has."""
        T = num_tokens
        S = min(T, self.max_rows)
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        md = AttentionMetadata(z(T), z(T), np.full(T, self.num_pages, np.int32), z(T), z(S),
                               z(S, self.pages_per_row), z(S + 1), z(1), z(S), z(1), decode)
        return StepPlan(decode=decode, rows=S,
                        num_top=MAX_LOGPROBS if prompt_logprobs else num_top, md=md,
                        sampling=make_sampling_tensors([], S, self.penalty_width, penalised),
                        targets=z(T if prompt_logprobs else 0),
                        prev_rows=np.full(T, -1, np.int32))

    def step_buckets(self) -> list[tuple[bool, int]]:
        """Every step program this runner can reach, as (decode, T):
        ``decode_step`` for each row bucket up to ``max_rows``, then
        ``prefill_step`` for each token bucket up to ``max_tokens``
        (``shapes``)."""
        return ([(True, t) for t in shapes.decode_buckets(self.max_rows)]
                + [(False, t) for t in shapes.prefill_buckets(self.max_tokens)])

    def warmup(self, buckets=None, on_compiled=None, variants: bool = True) -> int:
        """Compile every program a step in ``buckets`` (default
        ``step_buckets()``) can need: its step program; sampling for its S
        rows, plain and penalised (``penalty_width``), each one program with
        and without top-N logprobs; and for a prefill bucket, prompt
        logprobs over its T tokens. In a one-process job the programs are
        compiled ahead of time (``jit(...).lower(...).compile()``: nothing
        runs, and a later call with those shapes finds them); in a
        multi-host job empty plans of those shapes run, so the other
        processes build them too. ``on_compiled(i, T, seconds)`` is called
        after each bucket. ``variants=False``: plain sampling only (no
        penalised sampling, no prompt logprobs). Returns the number of
        programs traced (each compiled, or loaded from the persistent cache).

        Raises:
          MultihostError: a multi-host warm-up step failed.
        """
        before = self.num_compilations + self.num_loaded_programs
        for i, (decode, T) in enumerate(self.step_buckets() if buckets is None else buckets):
            t0 = time.monotonic()
            plans = [self.empty_plan(T, 0, decode)]
            if variants and plans[0].rows not in self._warm_rows:
                self._warm_rows.add(plans[0].rows)
                plans.append(self.empty_plan(T, 0, decode, penalised=True))
            if variants and not decode:
                plans.append(self.empty_plan(T, 0, decode, prompt_logprobs=True))
            if self.channel is None:
                self._compile_plans(plans)
            else:
                for plan in plans:
                    self._execute_plan(plan)
            if on_compiled is not None:
                on_compiled(i, T, time.monotonic() - t0)
        return self.num_compilations + self.num_loaded_programs - before

    def _compile_plans(self, plans: list["StepPlan"]) -> None:
        """Make ready the programs ``run`` would launch for plans of one step
        shape without running them: the step once, then each plan's sampling
        and prompt logprobs (``empty_plan``'s variants). Each is loaded from
        the executable store when it has it, else lowered and compiled
        (``jit(...).lower(...).compile()``, which the persistent cache may
        serve) and saved there. Safe beside running steps (a background
        warm-up): the donated caches enter as their shapes and shardings."""
        md = plans[0].md
        T = md.input_ids.shape[0]
        step = self.decode_step if md.decode_only else self.prefill_step
        args = (self.state, *self._kv_specs, md, plans[0].prev_rows, self._no_prev)
        self._program(self._step_name(md.decode_only, T), lambda: step.lower(*args))
        outs = []  # the step's result shapes, traced only when a program below is missing

        def out_info():
            if not outs:
                outs.append(jax.eval_shape(step, *args))
            return outs[0]
        for plan in plans:
            self._program(self._sampling_name(plan.rows, plan.sampling),
                          lambda p=plan: self._postprocess.lower(
                              out_info()[0], p.sampling, p.rows, np.bool_(p.num_top > 0)))
            if plan.targets.shape[0]:
                self._program(f"prompt-logprobs-{T}-top{plan.num_top}",
                              lambda p=plan: self._prompt_logprobs.lower(
                                  self.state, out_info()[-1], p.targets, p.num_top))

    @staticmethod
    def _step_name(decode: bool, T: int) -> str:
        return f"{'decode' if decode else 'prefill'}-step-{T}"

    @staticmethod
    def _sampling_name(rows: int, st: SamplingTensors) -> str:
        return f"sampling-{rows}-m{st.output_ids.shape[1]}-mp{st.prompt_ids.shape[1]}"

    def _program(self, name: str, lower):
        """The ready program ``name``: made before, loaded from the store, or
        ``lower()``-ed and compiled (then saved to the store)."""
        exe = self._programs.get(name)
        if exe is not None:
            return exe
        store = self._executable_store()
        exe = store.load(name) if store is not None else None
        if exe is not None:
            self.num_loaded_programs += 1
        elif store is None:
            exe = lower().compile()
        else:
            # Save only what XLA compiled here and now: an executable JAX's
            # persistent cache returned (now or earlier in this process, then
            # kept in memory) serializes without its kernels on CPU.
            fresh = compile_cache.fresh_compiles_in_thread()
            with fresh_compile():
                exe = lower().compile()
            if compile_cache.fresh_compiles_in_thread() > fresh:
                store.save(name, exe)
        self._programs[name] = exe
        return exe

    def _executable_store(self) -> ExecutableStore | None:
        """This runner's store of serialized programs under the persistent
        cache folder (``executables``), or None: the cache is off, or a
        multi-host job (whose programs every process must build alike)."""
        if self._store is False:
            return None
        if self._store is None:
            folder = compile_cache.active_dir()
            if folder is None or self.channel is not None:
                self._store = False
                return None
            leaves = [(jax.tree_util.keystr(path), a.shape, str(a.dtype),
                       str(getattr(a.sharding, "spec", a.sharding)))
                      for path, a in jax.tree_util.tree_flatten_with_path(
                          (self.state, self._kv_specs))[0]]
            # The graph's static fields (attention path, windows, activations), without
            # the addresses its function reprs carry.
            graph = re.sub(r" at 0x[0-9a-f]+", "", str(self.graphdef))
            key = fingerprint(graph, dataclasses.asdict(self.model_config),
                              leaves, dict(self.mesh.shape),
                              [d.id for d in self.mesh.devices.flat], self.num_pages,
                              self.page_size, self.pages_per_row, self.max_rows,
                              self.max_tokens, self.penalty_width, self.has_expert_load)
            self._store = ExecutableStore(os.path.join(folder, "executables"), key,
                                          self.mesh.devices.flat)
        return self._store

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

    def run(self, plan: "StepPlan"):
        """Launch a plan's jitted step and sampling; returns device arrays
        ``(logits f32[R, V], SampleOutput, prompt logprobs or None,
        expert load or None)``. Every process of a job calls it with the same
        plans in the same order, so each one's previous sampled ids (what
        ``plan.prev_rows`` index) are the same."""
        prev_ids = self._prev_ids if plan.uses_prev else self._no_prev
        md, T = plan.md, plan.md.input_ids.shape[0]
        step = self._programs.get(self._step_name(md.decode_only, T))  # warmed up ahead
        out = (step or self.step_fn)(self.state, self.k_stack, self.v_stack, md, plan.prev_rows,
                                     prev_ids)
        logits, self.k_stack, self.v_stack, *load, x_DT = out
        want_top = np.bool_(plan.num_top > 0)
        sampling = self._programs.get(self._sampling_name(plan.rows, plan.sampling))
        so, self._prev_ids = sampling(logits, plan.sampling, want_top) if sampling else \
            self._postprocess(logits, plan.sampling, plan.rows, want_top)
        plp = None
        if plan.targets.shape[0]:
            fn = self._programs.get(f"prompt-logprobs-{T}-top{plan.num_top}")
            plp = fn(self.state, x_DT, plan.targets) if fn else \
                self._prompt_logprobs(self.state, x_DT, plan.targets, plan.num_top)
        self.num_launched += 1
        return logits, so, plp, (load[0] if load else None)

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

    def prepare(self, batch: ScheduledBatch, prev_rows_of: dict | None = None) -> "StepPlan":
        """Build a step's host arrays (padded to the buckets) from the batch.

        Args:
          batch: the scheduler's plan.
          prev_rows_of: {request: its row in the step launched just before},
            for the requests whose last token is that step's placeholder
            (async scheduling); None when no request holds one.
        """
        reqs, q_lens = batch.requests, batch.q_lens
        n, nd = len(reqs), batch.num_decode
        L = self.page_size
        plp_need = sum(max(0, min(r.num_computed_tokens + q, len(r.prompt_token_ids) - 1) + 1
                           - max(r.num_computed_tokens + 1, len(r.prompt_logprobs)))
                       for r, q in zip(reqs, q_lens) if r.wants_prompt_logprobs)
        top = MAX_LOGPROBS if any(r.params.logprobs or r.params.prompt_logprobs
                                  for r in reqs) else 0
        # Every row one token: decode_step, bucketed by rows. Prompt logprobs
        # take prefill_step's token buckets (their programs are per T, warmed
        # for the prefill ladder only).
        decode_only = batch.decode and not plp_need
        T = shapes.decode_bucket(n, self.max_rows) if decode_only else \
            shapes.prefill_bucket(sum(q_lens), self.max_tokens)
        rows = S = min(T, self.max_rows)
        # Prompt logprobs: every token's target (the prompt token after it), 0 elsewhere.
        targets = np.zeros(T if plp_need else 0, np.int32)
        input_ids = np.zeros(T, np.int32)
        prev_rows = np.full(T, -1, np.int32)
        positions = np.zeros(T, np.int32)
        slot_pages = np.full(T, self.num_pages, np.int32)  # out of range: dropped
        slot_offsets = np.zeros(T, np.int32)
        kv_lens = np.zeros(S, np.int32)
        page_indices = np.zeros((S, self.pages_per_row), np.int32)
        cu_q_lens = np.zeros(S + 1, np.int32)
        drafts = batch.drafts or [()] * n
        sample_rows: list[int] = []
        slot_views: list = []  # per slot: what its sampling row sees
        row_slots: list[int] = []
        plp_spans, num_plp = {}, 0
        t = 0
        for k, (r, q) in enumerate(zip(reqs, q_lens)):
            start = r.num_computed_tokens
            pos = np.arange(start, start + q, dtype=np.int32)
            pages = np.asarray(r.page_ids, np.int32)
            d = drafts[k]
            input_ids[t:t + q - len(d)] = r.all_token_ids[start:start + q - len(d)]
            input_ids[t + q - len(d):t + q] = d
            if r.num_placeholders:  # its last token is still on device: one decode token
                assert r.num_placeholders == 1 and q == 1 and start == r.num_tokens - 1, \
                    (r.request_id, r.num_placeholders, q, start, r.num_tokens)
                input_ids[t] = 0
                prev_rows[t] = prev_rows_of[r]
            positions[t:t + q] = pos
            slot_pages[t:t + q] = pages[pos // L]
            slot_offsets[t:t + q] = pos % L
            kv_lens[k] = start + q
            page_indices[k, :len(pages)] = pages
            row_slots.append(len(sample_rows))
            sample_rows.extend(range(t + q - 1 - len(d), t + q))
            slot_views.append(r)
            slot_views.extend(DraftSlot(r, d[:j]) for j in range(1, len(d) + 1))
            if r.wants_prompt_logprobs:
                # Position j predicts prompt token j + 1; collect the missing ones.
                P = len(r.prompt_token_ids)
                lo, hi = max(start + 1, len(r.prompt_logprobs)), min(start + q, P - 1) + 1
                if hi > lo:
                    i = t + lo - 1 - start  # the token whose logits predict prompt token lo
                    plp_spans[k] = (i, lo, hi)
                    targets[i:i + hi - lo] = r.prompt_token_ids[lo:hi]
                    num_plp += hi - lo
            t += q
            cu_q_lens[k + 1] = t
        cu_q_lens[n + 1:] = t
        assert num_plp == plp_need, (num_plp, plp_need)
        assert len(sample_rows) <= rows, (len(sample_rows), rows)
        logits_indices = np.zeros(rows, np.int32)
        logits_indices[:len(sample_rows)] = sample_rows
        md = AttentionMetadata(input_ids, positions, slot_pages, slot_offsets, kv_lens,
                               page_indices, cu_q_lens, np.array([n], np.int32),
                               logits_indices, np.array([nd], np.int32), decode_only)
        st = make_sampling_tensors(slot_views, rows, self.penalty_width)
        return StepPlan(decode=decode_only, rows=rows, num_top=top, md=md, sampling=st,
                        targets=targets, prev_rows=prev_rows,
                        uses_prev=bool((prev_rows >= 0).any()), num_requests=len(sample_rows),
                        plp_spans=plp_spans, row_slots=row_slots)


@dataclasses.dataclass(frozen=True)
class DraftSlot:
    """What the sampling row after a speculating request's j-th draft sees:
    the request with its first j drafts appended to its output (so the
    PRNG fold ``steps``, min_tokens bans and penalties are those of the
    output position the slot samples, exactly as a plain decode step there
    would have them). Duck-types the fields ``make_sampling_tensors`` reads."""

    request: object
    drafts: tuple | list

    @property
    def params(self):
        return self.request.params

    @property
    def seed(self):
        return self.request.seed

    @property
    def eos_token_ids(self):
        return self.request.eos_token_ids

    @property
    def prompt_token_ids(self):
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self):
        return self.request.output_token_ids + list(self.drafts)
