"""Token masks and logit_bias in the jitted sampler, against a plain numpy
version of ``sampling``'s order (mask -> raw logprobs -> bias -> bans ->
penalties -> pick), and the host builder that fills them."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from jaxserve.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.engine.sampling import make_sampling_tensors, sample, unpack_token_mask
from jaxserve.engine.token_mask import bitmask_width, pack_token_ids, unpack_bitmask

V = 70  # W = 3 words: bits 70..95 of the last word lie past the vocabulary


class AllowedIds:
    """A test TokenConstraint: only ``ids`` may be sampled, forever."""

    def __init__(self, ids, vocab_size=V):
        self.ids = set(int(i) for i in ids)
        self.row = pack_token_ids(sorted(self.ids), vocab_size)
        self.taken: list[int] = []

    def fill(self, row):
        row &= self.row

    def advance(self, token_id):
        self.taken.append(token_id)
        return token_id in self.ids

    def rollback(self, n):
        del self.taken[len(self.taken) - n:]

    def forced_tokens(self):
        return sorted(self.ids) if len(self.ids) == 1 else []

    @property
    def is_done(self):
        return False


def _req(constraint=None, output=(), seed=0, eos=(), **kw):
    return types.SimpleNamespace(params=SamplingParams(**kw), seed=seed,
                                 output_token_ids=list(output), prompt_token_ids=[3],
                                 eos_token_ids=set(eos), constraint=constraint)


def _np_reference(logits, t):
    """(masked raw log-probs, processed logits) per the module docstring's order."""
    S = logits.shape[0]
    lp = np.zeros_like(logits, np.float64)
    x = np.zeros_like(logits, np.float64)
    for i in range(S):
        allowed = unpack_bitmask(t.token_bitmask[i], V)
        if not allowed.any():
            allowed[:] = True
        m = np.where(allowed, logits[i].astype(np.float64), -np.inf)
        mx = m.max()
        lp[i] = m - mx - np.log(np.exp(m - mx).sum())
        x[i] = m
        np.add.at(x[i], t.logit_bias_ids[i], t.logit_bias_values[i])
        banned = t.banned_ids[i][t.banned_ids[i] >= 0]
        x[i, banned] = -np.inf
    return lp, x


def _random_case(rng, S=6):
    sets = [range(V), [5], rng.choice(V, 9, replace=False), rng.choice(V, 30, replace=False),
            [0, 69], rng.choice(V, 2, replace=False)]
    reqs = []
    for i in range(S):
        bias = {int(k): float(rng.uniform(-100, 100)) for k in rng.choice(V, 4, replace=False)} \
            if i % 2 else None
        c = None if i == 0 else AllowedIds(sets[i % len(sets)])
        reqs.append(_req(c, temperature=0.0, logit_bias=bias))
    return reqs


@pytest.mark.parametrize("seed", range(4))
def test_greedy_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    reqs = _random_case(rng)
    t = make_sampling_tensors(reqs, 8, vocab_size=V)
    logits = rng.normal(0, 3, (8, V)).astype(np.float32)
    out = jax.jit(lambda lg, st: sample(lg, st, 5))(logits, t)
    lp, x = _np_reference(logits, t)
    np.testing.assert_array_equal(out.token_ids, x.argmax(-1))
    np.testing.assert_allclose(out.logprobs, lp[np.arange(8), x.argmax(-1)], rtol=1e-5, atol=1e-5)
    for i, r in enumerate(reqs):
        if r.constraint is not None:
            assert int(out.token_ids[i]) in r.constraint.ids
            # top log-probs are of the masked distribution: allowed ids only
            top = [int(j) for j, v in zip(out.top_ids[i], out.top_logprobs[i]) if v > -np.inf]
            assert set(top) <= r.constraint.ids and len(top) == min(5, len(r.constraint.ids))


def test_seeded_draws_never_pick_a_masked_token():
    rng = np.random.default_rng(7)
    allowed = [sorted(rng.choice(np.arange(1, V), k, replace=False).tolist())
               for k in (1, 2, 5, 40)]
    logits = rng.normal(0, 2, (4, V)).astype(np.float32)
    logits[:, 0] = 50.0  # the unmasked favourite, allowed nowhere
    fn = jax.jit(lambda lg, st: sample(lg, st))
    seen = [set() for _ in allowed]
    for step in range(60):
        reqs = [_req(AllowedIds(a), output=[2] * step, seed=11 + i, temperature=1.5,
                     top_k=(0, 3)[i % 2], top_p=(1.0, 0.95)[i % 2])
                for i, a in enumerate(allowed)]
        toks = np.asarray(fn(logits, make_sampling_tensors(reqs, 4, vocab_size=V)).token_ids)
        for i, a in enumerate(allowed):
            assert toks[i] in a, (step, i, toks[i], a)
            seen[i].add(int(toks[i]))
    assert len(seen[2]) >= 3  # it does sample among the allowed ids
    # top-k applies after the mask: the 3 best allowed ids (top-p 0.95 may trim one)
    top3 = set(sorted(allowed[3], key=lambda j: -logits[3, j])[:3])
    assert seen[3] <= top3 and len(seen[3]) >= 2


def test_logit_bias_moves_the_argmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (4, V)).astype(np.float32)
    best = logits.argmax(-1)
    second = np.argsort(logits, -1)[:, -2]
    reqs = [_req(temperature=0.0, logit_bias={int(best[0]): -100.0}),
            _req(temperature=0.0, logit_bias={13: 100.0}),
            _req(temperature=0.0, logit_bias={int(best[2]): -100.0, 13: 100.0, 14: 100.0}),
            _req(temperature=0.0)]
    t = make_sampling_tensors(reqs, 4, vocab_size=V)
    out = sample(logits, t, 1)
    expect_2 = 13 if logits[2, 13] >= logits[2, 14] else 14
    np.testing.assert_array_equal(out.token_ids, [second[0], 13, expect_2, best[3]])
    # bias is after the raw log-probs: they are the model's own
    lsm = logits - logits.max(-1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs[1], lsm[1, 13], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids[:, 0], best)


def test_bits_past_the_vocabulary_are_ignored():
    logits = np.zeros((3, V), np.float32)
    logits[:, 40] = 5.0
    logits[:, 7] = 1.0
    bm = np.full((3, bitmask_width(V)), -1, np.int32)
    bm[0] = pack_token_ids([7], V)
    bm[0, 2] |= np.int32(-1 << 6)  # bits 70..95: past V, ignored -> only 7 allowed
    bm[1] = 0
    bm[1, 2] = np.int32(-1 << 6)  # nothing below V: the row is left unmasked
    t = make_sampling_tensors([_req(), _req(), _req()], 3, vocab_size=V)
    t.token_bitmask = bm
    np.testing.assert_array_equal(np.asarray(unpack_token_mask(bm, V))[0].nonzero()[0], [7])
    out = sample(logits, t)
    np.testing.assert_array_equal(out.token_ids, [7, 40, 40])
    assert np.isfinite(np.asarray(out.logprobs)).all()
    assert float(out.logprobs[0]) == 0.0  # the one allowed token has all the mass


def test_bans_over_a_one_token_mask_fall_back_without_nan():
    # min_tokens bans EOS 9, the only token the mask allows: no finite logit is left.
    r = _req(AllowedIds([9]), eos=[9], min_tokens=3, max_tokens=5, temperature=0.8, seed=1)
    t = make_sampling_tensors([r, _req(temperature=0.8, seed=2)], 2, vocab_size=V)
    logits = np.random.default_rng(0).normal(size=(2, V)).astype(np.float32)
    out = sample(logits, t)
    assert int(out.token_ids[0]) == 9 and float(out.logprobs[0]) == 0.0


def test_make_sampling_tensors_fills_masks_and_bias():
    c = AllowedIds([3, 33, 64])
    reqs = [_req(), _req(c, logit_bias={5: 2.5, 69: -100.0})]
    t = make_sampling_tensors(reqs, 4, vocab_size=V)
    assert t.token_bitmask.shape == (4, 3) and t.token_bitmask.dtype == np.int32
    assert t.logit_bias_ids.shape == t.logit_bias_values.shape == (4, MAX_LOGIT_BIAS)
    assert t.logit_bias_ids.dtype == np.int32 and t.logit_bias_values.dtype == np.float32
    np.testing.assert_array_equal(t.token_bitmask[[0, 2, 3]], -1)  # plain and padding rows
    assert unpack_bitmask(t.token_bitmask[1], V).nonzero()[0].tolist() == [3, 33, 64]
    assert t.logit_bias_ids[1, :2].tolist() == [5, 69]
    np.testing.assert_allclose(t.logit_bias_values[1, :2], [2.5, -100.0])
    assert not t.logit_bias_ids[[0, 2, 3]].any() and not t.logit_bias_values[[0, 2, 3]].any()
    assert not t.logit_bias_ids[1, 2:].any() and not t.logit_bias_values[1, 2:].any()
    # the same shapes without any constrained or biased row: one program
    plain = make_sampling_tensors([_req()], 4, vocab_size=V)
    assert jax.tree.map(np.shape, plain) == jax.tree.map(np.shape, t)
    with pytest.raises(ValueError, match="constrained row needs vocab_size"):
        make_sampling_tensors(reqs, 4)


def test_one_program_for_constrained_and_plain_steps():
    traces = []

    @jax.jit
    def fn(lg, st):
        traces.append(1)
        return sample(lg, st, 2).token_ids
    logits = np.random.default_rng(1).normal(size=(4, V)).astype(np.float32)
    fn(logits, make_sampling_tensors([_req()], 4, vocab_size=V))
    fn(logits, make_sampling_tensors([_req(AllowedIds([1, 2]), logit_bias={3: 1.0}),
                                      _req(temperature=1.0)], 4, vocab_size=V))
    assert len(traces) == 1


def test_narrow_bitmask_is_rejected():
    t = make_sampling_tensors([_req()], 2, vocab_size=V)
    t.token_bitmask = np.full((2, 2), -1, np.int32)  # 64 bits < 70 tokens
    with pytest.raises(ValueError, match="needs 3"):
        sample(np.zeros((2, V), np.float32), t)
