"""Step plans: what the host prepares for one step, and what comes back.

``prepare_plan`` turns the scheduler's ``ScheduledBatch`` into a
``StepPlan``: the ``AttentionMetadata`` (token ids, positions, the slot each
token's K/V goes to, kv lengths, page table, ``cu_q_lens``), the sampling
tensors of its sampled positions ("slots"), prompt-logprob targets and the
async ``prev_rows``, every varying dimension padded to a bucket of
``shapes`` (T tokens, S rows). ``padding_plan`` is a plan of the same shapes
with no real row (warm-up runs or compiles it). ``StepResult`` is what one
step's results become on the host.

All of it is plain numpy on the host; ``PlanLayout`` carries the runner's
fixed sizes (pages, page size, table width, bucket ceilings), so nothing here
touches a device.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.engine import shapes
from jaxserve.engine.constraints import SlotConstraint
from jaxserve.engine.sampling_params import MAX_LOGPROBS
from jaxserve.engine.sampling import SamplingTensors, make_sampling_tensors
from jaxserve.models.llama import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """The runner's fixed sizes a plan is padded to.

    Attributes:
      page_size: L, tokens per KV page.
      num_pages: P, pages of the cache (a slot page of P is dropped).
      pages_per_row: width of a page-table row (whole page blocks).
      max_rows: the largest row bucket S (``shapes.coarse_bucket``).
      max_tokens: the largest token bucket T of a prefill step.
      penalty_width: width of penalised steps' id tensors (``make_sampling_tensors``).
      vocab_size: V, the logits' width: every step's ``token_bitmask`` is
        [S, ``bitmask_width(V)``] (constrained rows or not: one program).
      lora: the model has LoRA slots: every step's ``md.lora_slots`` is
        i32[T] (0 for the base's tokens), else None.
    """

    page_size: int
    num_pages: int
    pages_per_row: int
    max_rows: int
    max_tokens: int
    penalty_width: int
    vocab_size: int
    lora: bool = False


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
      mask_slots: (slot, what its row sees) of each constrained slot whose
        ``sampling.token_bitmask`` row is still to be filled
        (``fill_token_masks``; ``prepare_plan(..., fill_masks=False)``), else
        [] (host only).
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
    mask_slots: list = dataclasses.field(default_factory=list)

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


@dataclasses.dataclass(eq=False)
class SeqView:
    """A sequence as one planned row sees it, duck-typing what
    ``prepare_plan`` and ``make_sampling_tensors`` read of a ``Request``:
    ``request``'s pages, prompt, seed and EOS ids, with ``tokens`` (prompt +
    outputs + drafts so far) as its ids, its own ``params`` and computed
    position. Two uses: the sampling row after a speculating request's j-th
    draft (its first j drafts appended to its output, so the PRNG fold
    ``steps``, min_tokens bans and penalties are those of the output position
    the slot samples, as a plain decode step there would have them; for a
    constrained sequence, whose drafts are its forced tokens, ``constraint``
    is ``constraints.SlotConstraint``: its mask there), and a draft-model
    step (``speculation.DraftModelProposer``: the draft's
    computed position, params without logprobs)."""

    request: object
    params: object
    tokens: list[int]
    num_computed_tokens: int = 0
    num_placeholders: int = 0
    wants_prompt_logprobs: bool = False
    constraint: object = None

    @property
    def page_ids(self):
        return self.request.page_ids

    @property
    def all_token_ids(self):
        return self.tokens

    @property
    def num_tokens(self):
        return len(self.tokens)

    @property
    def prompt_token_ids(self):
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self):
        return self.tokens[len(self.request.prompt_token_ids):]

    @property
    def seed(self):
        return self.request.seed

    @property
    def eos_token_ids(self):
        return self.request.eos_token_ids


def prepare_plan(batch, layout: PlanLayout, prev_rows_of: dict | None = None,
                 fill_masks: bool = True) -> StepPlan:
    """Build a step's host arrays (padded to the buckets) from the batch.

    Args:
      batch: the scheduler's ``ScheduledBatch``.
      layout: the runner's sizes.
      prev_rows_of: {request: its row in the step launched just before},
        for the requests whose last token is that step's placeholder
        (async scheduling); None when no request holds one.
      fill_masks: fill constrained slots' bitmask rows now; False leaves
        them to ``fill_token_masks`` (``StepPlan.mask_slots``), once the
        constraints have taken the tokens still in flight.
    """
    reqs, q_lens = batch.requests, batch.q_lens
    n, nd = len(reqs), batch.num_decode
    L = layout.page_size
    plp_need = sum(max(0, min(r.num_computed_tokens + q, len(r.prompt_token_ids) - 1) + 1
                       - max(r.num_computed_tokens + 1, len(r.prompt_logprobs)))
                   for r, q in zip(reqs, q_lens) if r.wants_prompt_logprobs)
    top = MAX_LOGPROBS if any(r.params.logprobs or r.params.prompt_logprobs
                              for r in reqs) else 0
    # Every row one token: decode_step, bucketed by rows. Prompt logprobs
    # take prefill_step's token buckets (their programs are per T, warmed
    # for the prefill ladder only).
    decode_only = batch.decode and not plp_need
    T = shapes.decode_bucket(n, layout.max_rows) if decode_only else \
        shapes.prefill_bucket(sum(q_lens), layout.max_tokens)
    rows = S = min(T, layout.max_rows)
    # Prompt logprobs: every token's target (the prompt token after it), 0 elsewhere.
    targets = np.zeros(T if plp_need else 0, np.int32)
    input_ids = np.zeros(T, np.int32)
    prev_rows = np.full(T, -1, np.int32)
    positions = np.zeros(T, np.int32)
    slot_pages = np.full(T, layout.num_pages, np.int32)  # out of range: dropped
    slot_offsets = np.zeros(T, np.int32)
    kv_lens = np.zeros(S, np.int32)
    page_indices = np.zeros((S, layout.pages_per_row), np.int32)
    cu_q_lens = np.zeros(S + 1, np.int32)
    lora_slots = np.zeros(T, np.int32) if layout.lora else None
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
        if lora_slots is not None and r.lora_slot:  # a draft model's plans: no LoRA
            lora_slots[t:t + q] = r.lora_slot
        slot_pages[t:t + q] = pages[pos // L]
        slot_offsets[t:t + q] = pos % L
        kv_lens[k] = start + q
        page_indices[k, :len(pages)] = pages
        row_slots.append(len(sample_rows))
        sample_rows.extend(range(t + q - 1 - len(d), t + q))
        slot_views.append(r)
        c = getattr(r, "constraint", None)
        slot_views.extend(SeqView(r, r.params, r.all_token_ids + list(d[:j]),
                                  constraint=None if c is None else SlotConstraint(c, d, j))
                          for j in range(1, len(d) + 1))
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
                           logits_indices, np.array([nd], np.int32), decode_only,
                           lora_slots=lora_slots)
    st = make_sampling_tensors(slot_views, rows, layout.penalty_width,
                               vocab_size=layout.vocab_size, fill_masks=fill_masks)
    mask_slots = [] if fill_masks else [
        (i, v) for i, v in enumerate(slot_views) if getattr(v, "constraint", None) is not None]
    return StepPlan(decode=decode_only, rows=rows, num_top=top, md=md, sampling=st,
                    targets=targets, prev_rows=prev_rows,
                    uses_prev=bool((prev_rows >= 0).any()), num_requests=len(sample_rows),
                    plp_spans=plp_spans, row_slots=row_slots, mask_slots=mask_slots)


def fill_token_masks(plan: StepPlan) -> None:
    """Fill the bitmask rows ``prepare_plan(..., fill_masks=False)`` left
    (``plan.mask_slots``), in place, from each slot's constraint as it is
    now; a slot whose sequence finished meanwhile keeps its all-allowed row
    (its token is dropped). Empties ``mask_slots``."""
    bitmask = plan.sampling.token_bitmask
    for i, view in plan.mask_slots:
        if not getattr(view, "request", view).finished:
            view.constraint.fill(bitmask[i])
    plan.mask_slots = []


def padding_plan(layout: PlanLayout, num_tokens: int, num_top: int = 0, decode: bool = False,
                 penalised: bool = False, prompt_logprobs: bool = False) -> StepPlan:
    """A plan of ``num_tokens`` (a bucket value of ``decode_step`` when
    ``decode``, else of ``prefill_step``) padding tokens and no real row, in
    the shape a real step of that many tokens gets: running it compiles that
    program and changes nothing (its K/V writes are dropped). ``penalised``:
    sampling tensors of a step with a penalised row (``penalty_width``);
    ``prompt_logprobs``: a target per token and ``MAX_LOGPROBS`` top
    logprobs, as a step with prompt logprobs has."""
    T = num_tokens
    S = min(T, layout.max_rows)
    z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    md = AttentionMetadata(z(T), z(T), np.full(T, layout.num_pages, np.int32), z(T), z(S),
                           z(S, layout.pages_per_row), z(S + 1), z(1), z(S), z(1), decode,
                           lora_slots=z(T) if layout.lora else None)
    return StepPlan(decode=decode, rows=S,
                    num_top=MAX_LOGPROBS if prompt_logprobs else num_top, md=md,
                    sampling=make_sampling_tensors([], S, layout.penalty_width, penalised,
                                                   layout.vocab_size),
                    targets=z(T if prompt_logprobs else 0),
                    prev_rows=np.full(T, -1, np.int32))


def plan_treedef():
    """The tree structure of ``StepPlan.leaves()`` (a multi-host follower
    rebuilds plans with it: ``StepPlan.from_wire``)."""
    empty_md = AttentionMetadata(*([np.zeros(1, np.int32)] * 10))
    return jax.tree.structure((empty_md, make_sampling_tensors([], 1), np.zeros(0, np.int32),
                               np.zeros(1, np.int32)))
