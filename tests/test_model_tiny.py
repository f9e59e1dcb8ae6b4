"""Tiny random Llama: jaxserve vs HF transformers, logits and greedy tokens.

Every test compares with transformers (``tiny_hf``), so the module is slow.
"""

import numpy as np
import pytest
import torch
from tiny_models import hf_greedy

from jaxserve import SamplingParams

pytestmark = pytest.mark.slow  # torch and transformers are the reference

PROMPTS = [
    [5, 17, 99, 3, 250, 7, 7, 31],
    [200],
    list(range(10, 60)),
    [42] * 19,
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7],
]


def hf_last_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def test_last_token_logits_match_hf_batched(tiny_hf, make_tiny_llm):
    llm = make_tiny_llm()
    ours = llm.engine.last_token_logits(PROMPTS)  # one ragged prefill for all
    for ids, row in zip(PROMPTS, ours):
        ref = hf_last_logits(tiny_hf, ids)
        np.testing.assert_allclose(row, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
def test_greedy_matches_hf_alone_and_batched(tiny_hf, make_tiny_llm, page_size):
    n = 24
    refs = [hf_greedy(tiny_hf, p, n) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) == len(refs)  # the test can tell outputs apart
    llm = make_tiny_llm(page_size=page_size, num_pages=2048 // page_size)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    for ref, b, a in zip(refs, batched, alone):
        assert b.outputs[0].token_ids == ref
        assert a.outputs[0].token_ids == ref
        assert b.outputs[0].finish_reason == "length"
