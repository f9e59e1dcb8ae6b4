"""Sampling unit tests: penalties, logprobs and the host-side builder, against
plain numpy versions of the definitions (no engine, small vocabularies)."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.sampling import (MAX_BANNED, SampleOutput, apply_penalties,
                                      make_sampling_tensors, prompt_logprobs, sample)



PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _params(**kw):
    """A real ``SamplingParams``. Penalties are set after validation so tests
    can use values beyond the API's range (e.g. frequency -5) for large effects."""
    pen = {k: kw.pop(k) for k in PENALTIES if k in kw}
    p = SamplingParams(**kw)
    for k, v in pen.items():
        object.__setattr__(p, k, float(v))
    return p


def _req(prompt=(), output=(), seed=0, eos=(), **kw):
    return types.SimpleNamespace(params=_params(**kw), seed=seed, output_token_ids=list(output),
                                 prompt_token_ids=list(prompt), eos_token_ids=set(eos))


def _np_penalties(logits, reqs):
    """The three definitions, written plainly from each request's token lists."""
    out = np.array(logits, np.float64)
    V = out.shape[1]
    for i, r in enumerate(reqs):
        p = r.params
        count = np.bincount(np.asarray(r.output_token_ids, np.int64), minlength=V)[:V]
        seen = count > 0
        seen[np.asarray(r.prompt_token_ids, np.int64)] = True
        for v in range(V):
            if seen[v]:
                out[i, v] = out[i, v] / p.repetition_penalty if out[i, v] > 0 \
                    else out[i, v] * p.repetition_penalty
        out[i] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _penalty_reqs():
    return [
        # every penalty; id 3 repeated in output and in prompt, ids 1, 2 prompt-only
        _req(prompt=[1, 2, 2, 3], output=[3, 3, 4, 5, 3, 0], temperature=0.0,
             repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.7),
        # no penalties, but output and prompt present: must stay unchanged
        _req(prompt=[1, 6], output=[6, 6, 7], temperature=0.0),
        # encouraging repetition (r < 1) and a negative frequency penalty
        _req(prompt=[7, 8, 11], output=[8, 9, 9, 15], temperature=0.0,
             repetition_penalty=0.8, frequency_penalty=-0.3),
        # presence only
        _req(prompt=[0], output=[2, 2, 2, 10], temperature=0.0, presence_penalty=-1.25),
    ]


def test_apply_penalties_matches_numpy():
    rng = np.random.default_rng(0)
    reqs = _penalty_reqs()
    rows, V = 6, 16
    logits = rng.normal(0.0, 2.0, (rows, V)).astype(np.float32)
    logits[:, 4] = 0.0  # the logit == 0 edge
    assert (logits > 0).any() and (logits < 0).any()
    t = make_sampling_tensors(reqs, rows)
    got = np.asarray(jax.jit(apply_penalties)(logits, t))
    want = _np_penalties(logits, reqs + [_req()] * (rows - len(reqs)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])  # unpenalised row
    np.testing.assert_array_equal(got[4:], logits[4:])  # padding rows
    for i in (0, 2, 3):
        assert np.abs(got[i] - logits[i]).max() > 0.1, i


@pytest.mark.parametrize("pen, prompt, output", [
    (dict(frequency_penalty=1.0), [], [3, 3]),        # 5 - 2 = 3 < 4
    (dict(presence_penalty=2.0), [], [3]),            # 5 - 2 = 3 < 4
    (dict(repetition_penalty=2.0), [3], []),          # 5 / 2 = 2.5 < 4
])
def test_greedy_picks_argmax_of_penalised_logits(pen, prompt, output):
    V = 16
    logits = np.zeros((2, V), np.float32)
    logits[:, 3], logits[:, 4] = 5.0, 4.0
    reqs = [_req(prompt=prompt, output=output, temperature=0.0, **pen),
            _req(prompt=prompt, output=output, temperature=0.0)]  # control
    out = jax.jit(sample)(logits, make_sampling_tensors(reqs, 2))
    np.testing.assert_array_equal(np.asarray(out.token_ids), [4, 3])
    lsm = _np_log_softmax(logits)
    # reported log probs and ranks are of the raw distribution
    np.testing.assert_allclose(np.asarray(out.logprobs), [lsm[0, 4], lsm[1, 3]], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.ranks), [2, 1])


def test_min_tokens_ban_holds_under_penalties():
    """Penalties pulling towards a banned id (r < 1, negative frequency) must
    not lift the ban; without the ban id 3 would win."""
    V = 16
    logits = np.full((2, V), -2.0, np.float32)
    logits[:, 3], logits[:, 5] = -1.0, -1.5
    reqs = [_req(prompt=[3], output=[3], temperature=0.0, min_tokens=4, max_tokens=8,
                 stop_token_ids=[3], repetition_penalty=0.5, frequency_penalty=-5.0),
            _req(prompt=[3], output=[3], temperature=0.0,
                 repetition_penalty=0.5, frequency_penalty=-5.0)]  # no ban: control
    out = sample(logits, make_sampling_tensors(reqs, 2))
    np.testing.assert_array_equal(np.asarray(out.token_ids), [5, 3])


def test_sampled_distribution_follows_penalised_logits():
    V, n = 8, 400
    base = np.array([3.0, 3.0, 1.0, 0.0, 0.0, 0.0, -1.0, 0.0], np.float32)
    reqs = [_req(prompt=[5], output=[0, 0, 0, 2], seed=s, temperature=1.0,
                 frequency_penalty=1.0, presence_penalty=1.0) for s in range(n)]
    t = make_sampling_tensors(reqs, n)
    out = jax.jit(sample)(np.tile(base, (n, 1)), t)
    hist = np.bincount(np.asarray(out.token_ids), minlength=V) / n
    pen = _np_penalties(base[None], reqs[:1])[0]
    p_pen, p_raw = np.exp(_np_log_softmax(pen)), np.exp(_np_log_softmax(base))
    assert 0.5 * np.abs(p_pen - p_raw).sum() > 0.4  # the two really differ
    assert 0.5 * np.abs(hist - p_pen).sum() < 0.15, (hist, p_pen)
    assert 0.5 * np.abs(hist - p_raw).sum() > 0.25, (hist, p_raw)


def test_top_logprobs_are_raw():
    rng = np.random.default_rng(2)
    S, V, N = 6, 32, 5
    logits = rng.normal(0.0, 3.0, (S, V)).astype(np.float32)
    top_raw = logits.argmax(-1)
    reqs = [
        _req(temperature=0.0),
        _req(temperature=0.0, seed=1),
        # greedy flipped by a penalty on the raw argmax: chosen rank > 1
        _req(temperature=0.0, output=[int(top_raw[2])] * 4, frequency_penalty=10.0),
        _req(temperature=0.5, seed=3, top_k=4, repetition_penalty=1.3,
             prompt=list(range(8)), output=[1, 1]),
        _req(temperature=2.0, seed=4, presence_penalty=0.5, output=[int(top_raw[4])]),
        _req(temperature=1.0, seed=5, top_p=0.7, min_p=0.05),
    ]
    t = make_sampling_tensors(reqs, S)
    out = jax.jit(sample, static_argnames="num_top")(logits, t, num_top=N)
    assert isinstance(out, SampleOutput)
    ids = np.asarray(out.token_ids)
    lsm = _np_log_softmax(logits)
    order = np.argsort(-lsm, axis=-1, kind="stable")[:, :N]
    assert out.top_ids.shape == (S, N) and out.top_ids.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs),
                               np.take_along_axis(lsm, order, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.logprobs), lsm[np.arange(S), ids],
                               rtol=1e-5, atol=1e-5)
    want_ranks = 1 + (lsm > lsm[np.arange(S), ids][:, None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(out.ranks), want_ranks)
    # greedy without penalties: the top entry is the chosen token, rank 1
    np.testing.assert_array_equal(ids[:2], np.asarray(out.top_ids)[:2, 0])
    np.testing.assert_array_equal(np.asarray(out.ranks)[:2], [1, 1])
    assert ids[2] != top_raw[2] and np.asarray(out.ranks)[2] == 2


def test_num_top_zero_shapes():
    logits = np.zeros((4, 16), np.float32)
    out = sample(logits, make_sampling_tensors([_req(temperature=0.0)], 4))
    assert out.top_ids.shape == (4, 0) and out.top_logprobs.shape == (4, 0)
    assert out.token_ids.shape == out.logprobs.shape == out.ranks.shape == (4,)


def test_prompt_logprobs_matches_numpy():
    rng = np.random.default_rng(3)
    R, V, N = 7, 24, 3
    logits = rng.normal(0.0, 2.0, (R, V)).astype(np.float32)
    logits[6] = 0.0  # all tied: every target has rank 1
    targets = rng.integers(0, V, R).astype(np.int32)
    fn = jax.jit(prompt_logprobs, static_argnames="num_top")
    lp, ranks, top_ids, top_lp = map(np.asarray, fn(logits, targets, num_top=N))
    lsm = _np_log_softmax(logits)
    np.testing.assert_allclose(lp, lsm[np.arange(R), targets], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ranks, 1 + (lsm > lsm[np.arange(R), targets][:, None]).sum(-1))
    assert ranks[6] == 1 and ranks[:6].max() > 1
    order = np.argsort(-lsm[:6], axis=-1)[:, :N]
    np.testing.assert_array_equal(top_ids[:6], order)
    np.testing.assert_allclose(top_lp, np.sort(lsm, -1)[:, ::-1][:, :N], rtol=1e-5, atol=1e-5)


def test_make_sampling_tensors_buckets_and_padding():
    reqs = [
        _req(output=[5, 5, 7, 5, 9], frequency_penalty=0.5, seed=11, temperature=0.7),
        _req(prompt=[1, 2, 3, 4, 5, 1], output=[2], repetition_penalty=1.2, temperature=0.0),
        _req(prompt=list(range(40)), output=list(range(20)), top_k=3, top_p=0.9, min_p=0.1,
             min_tokens=30, max_tokens=40, stop_token_ids=[6], eos=[2]),
    ]
    t = make_sampling_tensors(reqs, 8)
    assert t.output_ids.shape == t.output_counts.shape == (8, 4)  # 3 unique -> 4
    assert t.prompt_ids.shape == (8, 8)  # 5 unique -> 8; unpenalised row 2 not counted
    assert t.output_ids.dtype == t.output_counts.dtype == t.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(t.output_ids[0], [5, 7, 9, -1])
    np.testing.assert_array_equal(t.output_counts[0], [3, 1, 1, 0])
    np.testing.assert_array_equal(t.output_ids[1], [2, -1, -1, -1])
    np.testing.assert_array_equal(t.prompt_ids[1], [1, 2, 3, 4, 5, -1, -1, -1])
    np.testing.assert_array_equal(t.prompt_ids[0], -1)  # r == 1: prompt not needed
    np.testing.assert_allclose(t.frequency_penalty[:3], [0.5, 0.0, 0.0])
    np.testing.assert_allclose(t.repetition_penalty[:3], [1.0, 1.2, 1.0])
    np.testing.assert_array_equal(t.banned_ids[2], [6, 2] + [-1] * (MAX_BANNED - 2))
    assert (t.top_k[2], t.steps[2], t.seeds[0]) == (3, 20, 11)
    # padding rows: greedy, no filters, no penalties, nothing counted
    np.testing.assert_array_equal(t.temperature[3:], 0.0)
    np.testing.assert_array_equal(t.top_k[3:], 0)
    np.testing.assert_array_equal(t.top_p[3:], 1.0)
    np.testing.assert_array_equal(t.presence_penalty[3:], 0.0)
    np.testing.assert_array_equal(t.frequency_penalty[3:], 0.0)
    np.testing.assert_array_equal(t.repetition_penalty[3:], 1.0)
    np.testing.assert_array_equal(t.output_ids[3:], -1)
    np.testing.assert_array_equal(t.output_counts[3:], 0)
    np.testing.assert_array_equal(t.prompt_ids[3:], -1)
    np.testing.assert_array_equal(t.banned_ids[3:], -1)


def test_make_sampling_tensors_without_penalties_is_minimal():
    reqs = [_req(prompt=list(range(30)), output=list(range(9)), temperature=0.5)]
    t = make_sampling_tensors(reqs, 4)
    assert t.output_ids.shape == t.output_counts.shape == t.prompt_ids.shape == (4, 1)
    t = make_sampling_tensors(reqs + [_req(output=list(range(9)), presence_penalty=0.1)], 4)
    assert t.output_ids.shape == (4, 16) and t.prompt_ids.shape == (4, 1)
