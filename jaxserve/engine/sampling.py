"""On-device sampling, vectorised over per-request parameters.

Each row of a step carries its own temperature, top-k, top-p, min-p, penalties
and PRNG key. The key of a row is ``fold_in(PRNGKey(seed), num_generated)``, so
a seeded request draws the same numbers whatever its batch-mates are (vLLM's
per-request generators, done functionally). Sampling is the Gumbel-max trick
over the filtered, temperature-scaled logits; ``temperature == 0`` is greedy
argmax.

Order per row, as vLLM v1 (the grammar bitmask in its model runner, the rest
in its ``Sampler``):

1. the token mask (``token_bitmask``, packed as ``token_mask`` describes:
   structured outputs, ``allowed_token_ids`` and ``bad_words`` in one row):
   tokens it does not allow get -inf. vLLM v1 applies the grammar bitmask
   to the logits before its sampler runs, so the log-probs it reports for a
   guided request are those of the masked distribution (renormalised over
   the allowed tokens; what ``guided_choice`` + ``logprobs`` classification
   reads); we do the same for the whole mask. (vLLM applies
   ``allowed_token_ids`` and ``bad_words`` after its raw log-probs, so there
   our log-probs differ from vLLM's: a masked token has log-prob -inf.) A
   row of all ones (every unconstrained and padding row) is unchanged, and
   bits at or past V are ignored. A row whose mask allows no token below V
   is left unmasked (never NaN): it is sampled as an unconstrained row, and
   the engine ends the sequence when the constraint rejects that token
   (``outputs.OutputProcessor.take_token``).
2. raw log-probs (what ``logprobs`` report): log_softmax of (1).
3. ``logit_bias`` (OpenAI's, a logits processor as vLLM's
   ``LogitBiasLogitsProcessor``, after the raw log-probs): each row's
   ``logit_bias_values`` added at its ``logit_bias_ids``.
4. min_tokens bans, then penalties
   (vllm/model_executor/layers/utils.py ``apply_penalties``), then greedy
   argmax or temperature, top-k/top-p/min-p and the draw. Filters follow HF
   ``TopKLogitsWarper`` / ``TopPLogitsWarper`` / ``MinPLogitsWarper`` (applied
   after temperature, as vLLM does): tokens outside the filter get -inf. A
   row left with no finite logit (min_tokens banning the one token its mask
   allows) takes the argmax of its masked logits, bans ignored.

The mask and bias tensors have fixed shapes (``[S, W]`` with W =
``token_mask.bitmask_width(V)``, ``[S, MAX_LOGIT_BIAS]``) and are always
present, so constrained and plain rows share one sampling program per S.

Letters: S rows (sequences), V vocab, W bitmask words per row, M unique output
ids per row, Mp unique prompt ids per row, R prompt positions, N top log-probs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import sampling_cpu

from jaxserve.engine.sampling_params import MAX_LOGIT_BIAS
from jaxserve.engine.scheduler import next_pow2
from jaxserve.engine.token_mask import bitmask_width

NEG_INF = -jnp.inf
# Most banned ids (stop/EOS ids held back by min_tokens) per row.
MAX_BANNED = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step; S rows (padding rows greedy).

    Attributes:
      temperature: f32[S]; 0 means greedy.
      top_k: i32[S]; 0 means off.
      top_p: f32[S] in (0, 1]; 1 means off.
      min_p: f32[S] in [0, 1]; 0 means off.
      seeds: u32[S] per-request seed.
      steps: i32[S] tokens generated so far, a token still in flight
        included (folded into the key).
      banned_ids: i32[S, MAX_BANNED] ids whose logit is forced to -inf; -1 pads.
      presence_penalty: f32[S]; 0 means off.
      frequency_penalty: f32[S]; 0 means off.
      repetition_penalty: f32[S] > 0; 1 means off.
      output_ids: i32[S, M] unique ids generated so far; -1 pads.
      output_counts: i32[S, M] how often each of ``output_ids`` was generated; 0 pads.
      prompt_ids: i32[S, Mp] unique prompt ids; -1 pads.
      token_bitmask: i32[S, W] packed allowed tokens (``token_mask``: bit j
        of word i allows token 32 i + j); all -1 (every token) for
        unconstrained and padding rows. W = ``bitmask_width(V)``, or 0 when
        built without a vocabulary size (no mask: unit tests).
      logit_bias_ids: i32[S, MAX_LOGIT_BIAS] token ids of ``logit_bias``;
        0 pads (with value 0).
      logit_bias_values: f32[S, MAX_LOGIT_BIAS] the bias added at each id.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    steps: jax.Array
    banned_ids: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    output_ids: jax.Array
    output_counts: jax.Array
    prompt_ids: jax.Array
    token_bitmask: jax.Array
    logit_bias_ids: jax.Array
    logit_bias_values: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    """What ``sample`` returns; log-probs are of the raw distribution
    (log_softmax of the model's logits after the token mask, before
    logit_bias, bans, penalties, temperature and filters: vLLM v1's default
    ``logprobs_mode`` with its grammar bitmask; module docstring).

    Attributes:
      token_ids: i32[S] chosen ids.
      logprobs: f32[S] log prob of each chosen id.
      ranks: i32[S] 1-based rank of each chosen id (1 + ids with a strictly
        larger log prob, as vLLM's ``batch_get_rank``).
      top_ids: i32[S, N] the N most likely ids, most likely first.
      top_logprobs: f32[S, N] their log probs.
    """

    token_ids: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def make_sampling_tensors(reqs, rows: int, penalty_width: int | None = None,
                          penalised: bool = False,
                          vocab_size: int | None = None,
                          fill_masks: bool = True) -> SamplingTensors:
    """Build one step's ``SamplingTensors`` on the host (numpy).

    Args:
      reqs: the step's requests, in row order; each has ``.params`` (a
        ``SamplingParams``), ``.seed``, ``.output_token_ids``,
        ``.prompt_token_ids`` and ``.eos_token_ids``. ``output_token_ids``
        may end in placeholders (-1, tokens of a step in flight): they count
        in ``steps`` and for min_tokens; the engine never launches a
        penalised row before its output history is on the host.
      rows: S, the padded row count (>= len(reqs)); later rows are greedy with
        no penalties.
      penalty_width: a fixed M = Mp for steps with a penalised row (a
        runner's: the most unique ids a row can hold, so such steps share
        one sampling program per S, compiled at warm-up); None rounds the
        most unique ids of any penalised row up to a power of two.
      penalised: give the ``penalty_width`` shapes even when no row is
        penalised (what a warm-up compiles).
      vocab_size: V, for the ``token_bitmask`` width W = ``bitmask_width(V)``
        (a runner always passes it, so every step has the same W); None
        gives W = 0 (no mask), allowed only when no row has a constraint.
        A row whose request has ``constraint`` (a
        ``token_mask.TokenConstraint``; ``getattr``, so duck-typed rows
        without the attribute are unconstrained) starts from all ones and
        its constraint's ``fill`` ANDs its allowed tokens in. Each row's
        ``params.logit_bias`` fills its bias columns.
      fill_masks: False leaves constrained rows all ones (``plan.
        fill_token_masks`` fills them later, once their constraints have
        taken the tokens still in flight).

    Returns:
      ``SamplingTensors`` of numpy arrays. M (Mp) is the most unique output
      (prompt) ids of any penalised row as above, and 1 when no row needs
      them, so the shapes, and compilations, stay few.

    Raises:
      ValueError: a row has more unique output or prompt ids than
        ``penalty_width``; a constrained row without ``vocab_size``.
    """
    temp = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    min_p = np.zeros(rows, np.float32)
    seeds = np.zeros(rows, np.uint32)
    steps = np.zeros(rows, np.int32)
    banned = np.full((rows, MAX_BANNED), -1, np.int32)
    presence = np.zeros(rows, np.float32)
    frequency = np.zeros(rows, np.float32)
    repetition = np.ones(rows, np.float32)
    outs, prompts = {}, {}  # row -> (unique ids, counts) / unique ids
    bitmask = np.full((rows, 0 if vocab_size is None else bitmask_width(vocab_size)), -1,
                      np.int32)
    bias_ids = np.zeros((rows, MAX_LOGIT_BIAS), np.int32)
    bias_values = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    for i, r in enumerate(reqs):
        p = r.params
        constraint = getattr(r, "constraint", None)
        if constraint is not None:
            if vocab_size is None:
                raise ValueError("make_sampling_tensors: a constrained row needs vocab_size")
            if fill_masks:
                constraint.fill(bitmask[i])
        if p.logit_bias:
            nb = len(p.logit_bias)
            bias_ids[i, :nb] = list(p.logit_bias)
            bias_values[i, :nb] = list(p.logit_bias.values())
        temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        seeds[i] = r.seed
        steps[i] = len(r.output_token_ids)
        if len(r.output_token_ids) < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(r.eos_token_ids))
            ids = ids[:MAX_BANNED]
            banned[i, :len(ids)] = ids
        presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
        repetition[i] = p.repetition_penalty
        if presence[i] != 0 or frequency[i] != 0 or repetition[i] != 1:
            outs[i] = np.unique(np.asarray(r.output_token_ids, np.int64), return_counts=True)
        if repetition[i] != 1:
            prompts[i] = np.unique(np.asarray(r.prompt_token_ids, np.int64))
    M = next_pow2(max((len(u) for u, _ in outs.values()), default=1))
    Mp = next_pow2(max((len(u) for u in prompts.values()), default=1))
    if penalty_width is not None and (outs or penalised):
        if max(M, Mp) > penalty_width:
            raise ValueError(f"make_sampling_tensors: {max(M, Mp)} unique penalised ids in a "
                             f"row, more than penalty_width={penalty_width}")
        M = Mp = penalty_width
    output_ids = np.full((rows, M), -1, np.int32)
    output_counts = np.zeros((rows, M), np.int32)
    prompt_ids = np.full((rows, Mp), -1, np.int32)
    for i, (u, c) in outs.items():
        output_ids[i, :len(u)], output_counts[i, :len(u)] = u, c
    for i, u in prompts.items():
        prompt_ids[i, :len(u)] = u
    return SamplingTensors(temp, top_k, top_p, min_p, seeds, steps, banned,
                           presence, frequency, repetition,
                           output_ids, output_counts, prompt_ids,
                           bitmask, bias_ids, bias_values)


def apply_penalties(logits_SV, t: SamplingTensors):
    """Apply repetition, frequency and presence penalties (vLLM v1 semantics).

    For each row, with ``count`` the times an id was generated so far:
      * repetition (CTRL, Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``):
        ids seen in the prompt or the output get ``logit / r`` if ``logit > 0``
        else ``logit * r``;
      * frequency (OpenAI): ``logit -= frequency_penalty * count``;
      * presence (OpenAI): ``logit -= presence_penalty * (count > 0)``.
    Skipped (``lax.cond``) when no row has a penalty.

    Args:
      logits_SV: f32[S, V] logits.
      t: the step's ``SamplingTensors``.

    Returns:
      f32[S, V] penalised logits; rows without penalties are unchanged.
    """
    logits_SV = jnp.asarray(logits_SV, jnp.float32)
    S, V = logits_SV.shape
    rows = jnp.arange(S)[:, None]

    def penalise(x_SV):
        out_ids = jnp.where(t.output_ids >= 0, t.output_ids, V)  # pads dropped
        counts_SV = jnp.zeros((S, V), jnp.float32).at[rows, out_ids].add(
            t.output_counts.astype(jnp.float32), mode="drop")
        in_output_SV = counts_SV > 0
        prompt_ids = jnp.where(t.prompt_ids >= 0, t.prompt_ids, V)
        in_prompt_SV = jnp.zeros((S, V), bool).at[rows, prompt_ids].set(True, mode="drop")
        r_SV = jnp.where(in_prompt_SV | in_output_SV, t.repetition_penalty[:, None], 1.0)
        x_SV = jnp.where(x_SV > 0, x_SV / r_SV, x_SV * r_SV)
        x_SV = x_SV - t.frequency_penalty[:, None] * counts_SV
        return x_SV - t.presence_penalty[:, None] * in_output_SV

    active = jnp.any((t.presence_penalty != 0) | (t.frequency_penalty != 0)
                     | (t.repetition_penalty != 1))
    return jax.lax.cond(active, penalise, lambda x: x, logits_SV)


def unpack_token_mask(bitmask_SW, vocab_size: int):
    """bool[S, V] of packed bitmask rows: True where a token may be sampled.

    Args:
      bitmask_SW: i32[S, W] rows (``token_mask`` layout: bit j of word i is
        token 32 i + j), W >= ceil(V / 32); bits at or past V are ignored.
      vocab_size: V (static).

    Raises:
      ValueError: W * 32 < V (the rows do not cover the vocabulary).
    """
    S, W = bitmask_SW.shape
    if W * 32 < vocab_size:
        raise ValueError(f"token_bitmask has {W} words per row; a vocabulary of "
                         f"{vocab_size} needs {bitmask_width(vocab_size)}")
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits_SW32 = (bitmask_SW.astype(jnp.uint32)[:, :, None] >> shifts) & jnp.uint32(1)
    return bits_SW32.reshape(S, W * 32)[:, :vocab_size].astype(bool)


def apply_token_mask(logits_SV, bitmask_SW):
    """Logits with the tokens each row's bitmask does not allow at -inf
    (step 1 of the module docstring). A row allowing no token below V is
    returned unchanged. A zero-width bitmask (W = 0) masks nothing; skipped
    (``lax.cond``) when every word is all ones.

    Args:
      logits_SV: f32[S, V].
      bitmask_SW: i32[S, W] packed rows (``unpack_token_mask``).

    Returns:
      f32[S, V].
    """
    if bitmask_SW.shape[1] == 0:
        return logits_SV

    def mask(x_SV):
        allowed_SV = unpack_token_mask(bitmask_SW, x_SV.shape[1])
        allowed_SV = allowed_SV | ~jnp.any(allowed_SV, axis=-1, keepdims=True)
        return jnp.where(allowed_SV, x_SV, NEG_INF)
    # Skipped when every row allows every word's tokens (no constrained row).
    return jax.lax.cond(jnp.any(bitmask_SW != -1), mask, lambda x: x, logits_SV)


def apply_logit_bias(logits_SV, ids_SB, values_SB):
    """``logits[s, ids[s, b]] += values[s, b]`` for every row s and entry b
    (OpenAI's ``logit_bias``); padding entries (id 0, value 0) add nothing
    and ids outside [0, V) are dropped. Skipped (``lax.cond``) when no row
    has a bias.

    Args:
      logits_SV: f32[S, V].
      ids_SB: i32[S, B] token ids.
      values_SB: f32[S, B] biases.
    """
    S = logits_SV.shape[0]

    def add(x_SV):
        return x_SV.at[jnp.arange(S)[:, None], ids_SB].add(values_SB, mode="drop")
    return jax.lax.cond(jnp.any(values_SB != 0), add, lambda x: x, logits_SV)


def _filter(logits_SV, t: SamplingTensors):
    """Apply top-k, top-p and min-p with one descending sort per row."""
    V = logits_SV.shape[-1]
    sorted_SV = jnp.sort(logits_SV, axis=-1)[:, ::-1]
    # top-k: keep logits >= the k-th largest.
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, V), V)
    kth = jnp.take_along_axis(sorted_SV, (k - 1)[:, None], axis=-1)
    sorted_SV = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_SV, NEG_INF)
    # top-p: smallest prefix whose probability mass reaches top_p (always >= 1 token).
    probs = jax.nn.softmax(sorted_SV, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = cum_before < t.top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_SV, (n_keep - 1)[:, None], axis=-1)
    # min-p: drop tokens with prob < min_p * max prob.
    mth = jnp.where(t.min_p[:, None] > 0,
                    sorted_SV[:, :1] + jnp.log(jnp.maximum(t.min_p[:, None], 1e-30)),
                    NEG_INF)
    threshold = jnp.maximum(jnp.maximum(kth, pth), mth)
    return jnp.where(logits_SV >= threshold, logits_SV, NEG_INF)


def _gather_logprobs(logprobs_RV, ids_R, num_top: int):
    """Log probs and 1-based ranks of ``ids_R`` plus the ``num_top`` best.

    Returns:
      (logprobs f32[R], ranks i32[R], top_ids i32[R, num_top],
      top_logprobs f32[R, num_top]).
    """
    lp_R = jnp.take_along_axis(logprobs_RV, ids_R[:, None], axis=-1)[:, 0]
    ranks_R = 1 + jnp.sum(logprobs_RV > lp_R[:, None], axis=-1, dtype=jnp.int32)
    top_lp_RN, top_ids_RN = jax.lax.top_k(logprobs_RV, num_top)
    return lp_R, ranks_R, top_ids_RN.astype(jnp.int32), top_lp_RN


def plain_greedy(t: SamplingTensors):
    """bool scalar: every row is greedy (temperature 0) with no token mask,
    logit bias, banned id or penalty, so each row's token is the argmax of
    its logits, with rank 1 (no log-prob is larger than the largest)."""
    return ~(jnp.any(t.temperature > 0) | jnp.any(t.token_bitmask != -1)
             | jnp.any(t.logit_bias_values != 0) | jnp.any(t.banned_ids >= 0)
             | jnp.any((t.presence_penalty != 0) | (t.frequency_penalty != 0)
                       | (t.repetition_penalty != 1)))


def sample(logits_SV, t: SamplingTensors, num_top: int = 0, want_top=None,
           cpu_kernel: bool = True) -> SampleOutput:
    """Pick one token per row.

    Args:
      logits_SV: f32[S, V] raw next-token logits.
      t: the step's ``SamplingTensors``.
      num_top: N, how many top log-probs to return per row (0 to
        ``MAX_LOGPROBS``); a Python int, static under ``jit``.
      want_top: None, or a bool scalar (a device value): the top N are
        computed only when it is true and are zeros otherwise, so one
        program serves steps with and without logprobs.
      cpu_kernel: a step of plain greedy rows (``plain_greedy``, no top
        log-probs wanted) takes ``pallas_kernels.sampling_cpu.greedy`` where
        it serves (CPU, one device): one pass per row for the argmax and its
        log-prob, in place of XLA's argmax, ``log_softmax`` and rank passes
        (32 rows x 49,152: 12.1 -> 0.74 ms measured on a 2-core AVX-512
        Xeon). The same tokens and ranks; log-probs within float rounding.
        False (a runner on a mesh of several devices): XLA's forms only.

    Returns:
      ``SampleOutput``: the chosen ids, and their log probs, ranks and the
      top-N ids and log probs under the raw (temperature 1, unbiased,
      unpenalised, unfiltered) distribution of the masked logits (module
      docstring).
    """
    logits_SV = jnp.asarray(logits_SV, jnp.float32)
    S = logits_SV.shape[0]
    if cpu_kernel and not (want_top is None and num_top > 0) and sampling_cpu.serves(logits_SV):
        def greedy():
            ids_S, lp_S = sampling_cpu.greedy(logits_SV)
            return SampleOutput(ids_S, lp_S, jnp.ones((S,), jnp.int32),
                                jnp.zeros((S, num_top), jnp.int32),
                                jnp.zeros((S, num_top), jnp.float32))
        fast = plain_greedy(t) if want_top is None else plain_greedy(t) & ~want_top
        return jax.lax.cond(fast, greedy, lambda: _sample(logits_SV, t, num_top, want_top))
    return _sample(logits_SV, t, num_top, want_top)


def _sample(logits_SV, t: SamplingTensors, num_top: int, want_top) -> SampleOutput:
    """``sample`` in XLA's forms (any rows)."""
    S, V = logits_SV.shape
    masked_SV = apply_token_mask(logits_SV, t.token_bitmask)
    logprobs_SV = jax.nn.log_softmax(masked_SV, axis=-1)  # raw distribution (masked)
    rows = jnp.arange(S)[:, None]
    logits_SV = apply_logit_bias(masked_SV, t.logit_bias_ids, t.logit_bias_values)
    banned = jnp.where(t.banned_ids >= 0, t.banned_ids, V)
    logits_SV = logits_SV.at[rows, banned].set(NEG_INF, mode="drop")
    logits_SV = apply_penalties(logits_SV, t)
    greedy_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
    # A row with no finite logit left (bans over a one-token mask; its argmax
    # is then -inf): the argmax of its masked logits, bans ignored.
    dead_S = jnp.take_along_axis(logits_SV, greedy_S[:, None], axis=-1)[:, 0] == NEG_INF
    greedy_S = jax.lax.cond(
        jnp.any(dead_S),
        lambda: jnp.where(dead_S, jnp.argmax(masked_SV, axis=-1).astype(jnp.int32), greedy_S),
        lambda: greedy_S)

    def sampled():
        scaled = logits_SV / jnp.maximum(t.temperature, 1e-6)[:, None]
        need_filter = jnp.any((t.top_k > 0) | (t.top_p < 1.0) | (t.min_p > 0))
        scaled = jax.lax.cond(need_filter, lambda x: _filter(x, t), lambda x: x, scaled)

        def gumbel(seed, step):
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.gumbel(key, (V,), jnp.float32)

        g_SV = jax.vmap(gumbel)(t.seeds, t.steps)
        drawn = jnp.argmax(scaled + g_SV, axis=-1).astype(jnp.int32)
        return jnp.where((t.temperature > 0) & ~dead_S, drawn, greedy_S)

    token_ids = jax.lax.cond(jnp.any(t.temperature > 0), sampled, lambda: greedy_S)
    if want_top is None:
        return SampleOutput(token_ids, *_gather_logprobs(logprobs_SV, token_ids, num_top))
    lp_S, ranks_S, _, _ = _gather_logprobs(logprobs_SV, token_ids, 0)
    top_ids_SN, top_lp_SN = jax.lax.cond(
        want_top, lambda: _gather_logprobs(logprobs_SV, token_ids, num_top)[2:],
        lambda: (jnp.zeros((S, num_top), jnp.int32), jnp.zeros((S, num_top), jnp.float32)))
    return SampleOutput(token_ids, lp_S, ranks_S, top_ids_SN, top_lp_SN)


def prompt_logprobs(logits_RV, target_ids_R, num_top: int):
    """Raw log probs of given next tokens, for ``prompt_logprobs``.

    Args:
      logits_RV: f32[R, V] logits at R prompt positions.
      target_ids_R: i32[R] the prompt token that follows each position.
      num_top: N, top log-probs per position (a Python int, static under jit).

    Returns:
      (target_logprobs f32[R], target_ranks i32[R], top_ids i32[R, N],
      top_logprobs f32[R, N]) under log_softmax of ``logits_RV``; ranks are
      1-based as in ``SampleOutput``.
    """
    logprobs_RV = jax.nn.log_softmax(jnp.asarray(logits_RV, jnp.float32), axis=-1)
    return _gather_logprobs(logprobs_RV, jnp.asarray(target_ids_R, jnp.int32), num_top)
