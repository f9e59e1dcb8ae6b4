"""On-device sampling, vectorised over per-request parameters.

Each row of a step carries its own temperature, top-k, top-p, min-p and PRNG
key. The key of a row is ``fold_in(PRNGKey(seed), num_generated)``, so a seeded
request draws the same numbers whatever its batch-mates are (vLLM's per-request
generators, done functionally). Sampling is the Gumbel-max trick over the
filtered, temperature-scaled logits; ``temperature == 0`` is greedy argmax.

Filters follow HF ``TopKLogitsWarper`` / ``TopPLogitsWarper`` / ``MinPLogitsWarper``
(applied after temperature, as vLLM does): tokens outside the filter get -inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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
      steps: i32[S] tokens generated so far (folded into the key).
      banned_ids: i32[S, MAX_BANNED] ids whose logit is forced to -inf; -1 pads.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    steps: jax.Array
    banned_ids: jax.Array


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


def sample(logits_SV, t: SamplingTensors):
    """Pick one token per row.

    Args:
      logits_SV: f32[S, V] raw next-token logits.
      t: the step's ``SamplingTensors``.

    Returns:
      (token_ids i32[S], logprobs f32[S]): the chosen ids and their log
      probability under the raw (unfiltered, temperature 1) distribution.
    """
    logits_SV = logits_SV.astype(jnp.float32)
    S, V = logits_SV.shape
    logprobs_SV = jax.nn.log_softmax(logits_SV, axis=-1)  # raw distribution
    rows = jnp.arange(S)[:, None]
    banned = jnp.where(t.banned_ids >= 0, t.banned_ids, V)
    logits_SV = logits_SV.at[rows, banned].set(NEG_INF, mode="drop")
    greedy_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)

    def sampled():
        scaled = logits_SV / jnp.maximum(t.temperature, 1e-6)[:, None]
        need_filter = jnp.any((t.top_k > 0) | (t.top_p < 1.0) | (t.min_p > 0))
        scaled = jax.lax.cond(need_filter, lambda x: _filter(x, t), lambda x: x, scaled)

        def gumbel(seed, step):
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.gumbel(key, (V,), jnp.float32)

        g_SV = jax.vmap(gumbel)(t.seeds, t.steps)
        drawn = jnp.argmax(scaled + g_SV, axis=-1).astype(jnp.int32)
        return jnp.where(t.temperature > 0, drawn, greedy_S)

    token_ids = jax.lax.cond(jnp.any(t.temperature > 0), sampled, lambda: greedy_S)
    token_logprobs = jnp.take_along_axis(logprobs_SV, token_ids[:, None], axis=-1)[:, 0]
    return token_ids, token_logprobs
