"""The bounded set of compiled step shapes (``jaxserve.engine.shapes``): a
step always runs in a shape that holds it, compilation stops past the bound,
and running in a larger shape changes no token."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import SamplingParams
from jaxserve.engine.shapes import StepShapes

dims = st.tuples(st.sampled_from([0, 4, 8, 16, 32]), st.sampled_from([4, 8, 16]),
                 st.sampled_from([16, 32, 64, 128, 256, 512]), st.sampled_from([4, 6, 8, 12, 16]),
                 st.sampled_from([1, 2, 8, 64, 512]), st.sampled_from([0, 16, 32]),
                 st.sampled_from([0, 20]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(dims, min_size=1, max_size=200), st.integers(1, 12))
def test_every_step_fits_and_compilation_stops(needs, cap):
    shapes = StepShapes(cap)
    for need in needs:
        got = shapes.choose(False, need)
        assert all(a >= b for a, b in zip(got, need)), (got, need)
        assert got in shapes.shapes[False]
    # Past the bound a new shape is built only when none holds the step, and
    # it then holds every earlier one: at most one per bucket value beyond it.
    distinct_values = sum(len({n[i] for n in needs}) for i in range(len(needs[0])))
    assert len(shapes.shapes[False]) <= cap + 1 + distinct_values
    assert not shapes.shapes[True]


def test_cost_counts_the_padded_attention():
    shapes = StepShapes(8, page_size=16, attention_weight=1 / 256)
    assert shapes.cost(True, (8, 8, 0)) == 16 + 8 + 8 * 8 / 16
    # 4 decode rows + 8 prefill rows x a 32-token window, against 16 pages each
    assert shapes.cost(False, (4, 8, 64, 16, 32, 0, 0)) == 16 + 68 + (4 + 8 * 32) * 16 / 16
    small = shapes.cost(False, (0, 4, 16, 4, 16, 0, 0))
    assert shapes.cost(False, (0, 4, 16, 64, 512, 0, 0)) > 100 * small


def test_near_shape_reused_before_the_bound():
    shapes = StepShapes(8, page_size=16, attention_weight=1 / 256)
    assert shapes.choose(True, (8, 8, 0)) == (8, 8, 0)
    assert shapes.choose(True, (8, 6, 0)) == (8, 8, 0)      # 28 <= 1.5 x 27: no new program
    assert shapes.choose(True, (16, 6, 0)) == (16, 6, 0)    # does not fit: compiled
    assert shapes.choose(True, (8, 16, 20)) == (8, 16, 20)  # nothing holds top 20: compiled
    assert shapes.choose(True, (8, 4, 20)) == (8, 16, 20)   # 32 <= 1.5 x 26
    assert shapes.choose(True, (8, 96, 0)) == (8, 96, 0)
    assert shapes.choose(True, (8, 24, 0)) == (8, 24, 0)    # (8, 96): 72 > 1.5 x 36
    assert shapes.num_reused == 2 and len(shapes.shapes[True]) == 5


def test_past_the_bound_steps_share_one_shape():
    shapes = StepShapes(1)
    assert shapes.choose(True, (8, 4, 0)) == (8, 4, 0)
    assert shapes.choose(True, (64, 4, 0)) == (64, 4, 0)    # nothing holds it: max of all
                                                            # (here also the step's own)
    assert shapes.choose(True, (8, 96, 0)) == (64, 96, 0)
    assert shapes.choose(True, (32, 48, 20)) == (64, 96, 20)
    for need in [(8, 4, 0), (16, 12, 20), (64, 96, 20), (32, 8, 0)]:
        assert shapes.choose(True, need) in [(8, 4, 0), (64, 4, 0), (64, 96, 0), (64, 96, 20)]
    assert len(shapes.shapes[True]) == 4


def test_bad_bound():
    with pytest.raises(ValueError, match="max_step_shapes"):
        StepShapes(0)
    from jaxserve.config import EngineConfig
    with pytest.raises(ValueError, match="max_step_shapes"):
        EngineConfig(max_step_shapes=0)


def test_tokens_equal_with_one_shape_per_kind(make_tiny_llm):
    """max_step_shapes=1: every step after the first of its kind runs padded
    in a larger shape; greedy tokens, seeded samples and logprobs equal the
    default engine's, and few programs are built."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, int(L)).tolist() for L in (5, 40, 3, 90, 17, 61, 8, 30)]
    params = [SamplingParams(max_tokens=int(m), temperature=t, seed=7, logprobs=lp,
                             prompt_logprobs=plp, ignore_eos=True)
              for m, t, lp, plp in zip((6, 12, 3, 9, 20, 5, 14, 7), (0, 0.8, 0, 1.0) * 2,
                                       (None, 3, None, None, 2, None, None, 1),
                                       (None, None, 2, None, None, None, 1, None))]
    want = make_tiny_llm(max_num_batched_tokens=64).generate(prompts, params)
    llm = make_tiny_llm(max_num_batched_tokens=64, max_step_shapes=1)
    got = llm.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.outputs[0].logprobs is not None:
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.keys() == b.keys()
                np.testing.assert_allclose([a[k].logprob for k in a], [b[k].logprob for k in a],
                                           atol=1e-4)
        if w.prompt_logprobs is not None:
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
    runner = llm.engine.runner
    assert runner.shapes.num_reused > 0
    assert len(runner.shapes.shapes[True]) + len(runner.shapes.shapes[False]) <= 12
