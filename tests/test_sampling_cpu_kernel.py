"""The greedy sampling kernel (``pallas_kernels.sampling_cpu``) against its numpy
reference, and ``sampling.sample`` with it against XLA's forms: the same ids and
ranks, log-probs within float rounding, and every non-plain step still on XLA's
path. Skipped where the library was not built (the suite's fallback run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine import sampling
from jaxserve.engine.sampling import make_sampling_tensors, plain_greedy, sample
from pallas_kernels import quant_matmul_cpu, sampling_cpu
from pallas_kernels.sampling_cpu import reference
from tests.test_sampling import _req

needs_kernel = pytest.mark.skipif(not quant_matmul_cpu.available(),
                                  reason="quant_matmul_cpu not built")


def _logits(S, V, seed=0):
    return np.random.default_rng(seed).normal(0.0, 3.0, (S, V)).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("isa", [0, 2])
@pytest.mark.parametrize("S, V", [(1, 49152), (5, 1000), (3, 17), (2, 5), (40, 333)])
def test_greedy_matches_the_reference(isa, S, V):
    x = _logits(S, V, seed=S * V)
    x[0, V - 1] = x.max() + 1.0  # the largest value in the ragged tail
    if S > 2:
        x[2, 3] = x[2, 9 % V] = x[2].max() + 2.0  # a tie: the first index wins
    ids, lp = jax.jit(lambda x: sampling_cpu.greedy(x, isa=isa))(x)
    want_ids, want_lp = reference.greedy(x)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    assert ids[0] == V - 1 and (S <= 2 or ids[2] == min(3, 9 % V))
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-6, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("isa", [0, 2])
def test_greedy_nan_and_infinite_rows_follow_jnp_argmax(isa):
    x = np.zeros((4, 40), np.float32)
    x[0, 5] = x[0, 30] = np.nan  # first NaN wins
    x[1, :] = -np.inf  # id 0
    x[2, 3], x[2, 35] = 7.0, np.nan  # a NaN in the tail beats any number
    x[3, 20] = np.inf
    ids, lp = jax.jit(lambda x: sampling_cpu.greedy(x, isa=isa))(x)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(np.asarray(ids), [5, 0, 35, 20])
    assert np.isnan(np.asarray(lp)[:3]).all()


def _both(logits, reqs, num_top, want_top):
    t = make_sampling_tensors(reqs, logits.shape[0], vocab_size=logits.shape[1])
    run = jax.jit(lambda x, t, w, k: sample(x, t, num_top, w, cpu_kernel=k), static_argnums=3)
    return run(logits, t, want_top, True), run(logits, t, want_top, False), t


@needs_kernel
@pytest.mark.parametrize("rows", [1, 32])
def test_plain_greedy_steps_equal_xla_sampling(rows):
    V = 49152
    logits = _logits(rows, V, seed=rows)
    got, want, t = _both(logits, [_req(temperature=0.0)] * rows, 5, jnp.bool_(False))
    assert bool(plain_greedy(t))
    np.testing.assert_array_equal(np.asarray(got.token_ids), np.asarray(want.token_ids))
    np.testing.assert_array_equal(np.asarray(got.ranks), np.asarray(want.ranks))
    np.testing.assert_array_equal(np.asarray(got.ranks), 1)
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs),
                               rtol=1e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(want.top_ids))


@needs_kernel
@pytest.mark.parametrize("case", ["sampled_row", "penalty", "bias", "top_wanted"])
def test_steps_that_are_not_plain_greedy_take_xla_sampling(case):
    rows, V = 4, 300
    logits = _logits(rows, V, seed=7)
    reqs = [_req(temperature=0.0) for _ in range(rows)]
    want_top = jnp.bool_(case == "top_wanted")
    if case == "sampled_row":
        reqs[1] = _req(temperature=0.8, seed=3)
    elif case == "penalty":
        reqs[2] = _req(temperature=0.0, prompt=[int(np.argmax(logits[2]))],
                       repetition_penalty=50.0)
    elif case == "bias":
        reqs[3] = _req(temperature=0.0, logit_bias={7: 100.0})
    got, want, t = _both(logits, reqs, 3, want_top)
    assert case == "top_wanted" or not bool(plain_greedy(t))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if case == "penalty":  # the penalised argmax, not the kernel's
        assert int(got.token_ids[2]) != int(np.argmax(logits[2]))
    if case == "bias":
        assert int(got.token_ids[3]) == 7
    if case == "top_wanted":
        assert np.asarray(got.top_ids).any()


def test_without_the_kernel_sample_is_xla_sampling(monkeypatch):
    monkeypatch.setattr(sampling.sampling_cpu, "serves", lambda x: False)
    logits = _logits(2, 64, seed=1)
    t = make_sampling_tensors([_req(temperature=0.0)] * 2, 2, vocab_size=64)
    text = jax.jit(lambda x: sample(x, t, 0, jnp.bool_(False))).lower(logits).as_text()
    assert "jaxserve_greedy_f32" not in text
    out = jax.jit(lambda x: sample(x, t, 0, jnp.bool_(False)))(logits)
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.argmax(logits, axis=-1))
