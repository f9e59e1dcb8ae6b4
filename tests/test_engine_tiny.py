"""Engine properties on the tiny random Llama (seconds): stopping rules, abort,
request validation, preemption, and sampling (seeded, filtered, distribution).

Greedy references come from HF transformers (``tiny_hf``; those tests are
slow: they import torch). The tiny model has no tokenizer, so prompts are
token ids; its EOS id is 1.
"""

import numpy as np
import pytest
from tiny_models import hf_greedy

from jaxserve import SamplingParams

PROMPT = [5, 17, 99, 3, 250, 7, 7, 31]
PROMPTS = [PROMPT, [200], list(range(10, 60)), [42] * 19, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 3]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def first_new(ref, lo, hi):
    """The first index k in [lo, hi) whose token does not occur earlier in ``ref``."""
    return next(k for k in range(lo, hi) if ref[k] not in ref[:k])


def drain(engine):
    """Step until idle; the final output of each request, by id."""
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return final


@pytest.mark.slow
def test_stop_token_id_stops_with_stop_reason(tiny_hf, make_tiny_llm):
    ref = hf_greedy(tiny_hf, PROMPT, 24)
    k = first_new(ref, 4, 20)
    out = make_tiny_llm().generate(PROMPT, greedy(24, stop_token_ids=[ref[k]]))[0].outputs[0]
    assert out.token_ids == ref[:k + 1]  # the stop id is kept in token_ids
    assert (out.finish_reason, out.stop_reason) == ("stop", ref[k])


@pytest.mark.slow
def test_max_tokens_finishes_with_length(tiny_hf, make_tiny_llm):
    out = make_tiny_llm().generate(PROMPT, greedy(5))[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny_hf, PROMPT, 5)
    assert (out.finish_reason, out.stop_reason) == ("length", None)


@pytest.mark.parametrize("prompt, min_tokens, finish", [
    ([200], 4, "stop"),  # the stop id comes back after min_tokens
    (PROMPT, 6, "length"),  # it never comes back
])
@pytest.mark.slow
def test_min_tokens_holds_back_stop_id(tiny_hf, make_tiny_llm, prompt, min_tokens, finish):
    stop = hf_greedy(tiny_hf, prompt, 1)[0]  # greedy's first token
    # HF bans its EOS for the first min_new_tokens steps, as min_tokens does.
    want = hf_greedy(tiny_hf, prompt, 24, min_new_tokens=min_tokens, eos_token_id=stop,
                     pad_token_id=0)
    params = greedy(24, stop_token_ids=[stop], min_tokens=min_tokens)
    out = make_tiny_llm().generate(prompt, params)[0].outputs[0]
    assert out.token_ids == want
    assert stop not in out.token_ids[:min_tokens]
    assert out.finish_reason == finish
    assert out.stop_reason == (stop if finish == "stop" else None)


@pytest.mark.slow
def test_abort_finishes_with_abort_and_frees_pages(tiny_hf, make_tiny_llm):
    llm = make_tiny_llm()
    engine, alloc = llm.engine, llm.engine.allocator
    rids = [engine.add_request(None, p, greedy(24)) for p in PROMPTS[:3]]
    for _ in range(4):  # one prefill, three decodes
        assert not any(o.finished for o in engine.step())
    held = len(engine.get_sequences(rids[1])[0].page_ids)
    free = alloc.num_free_pages
    engine.abort(rids[1])
    assert alloc.num_free_pages == free + held > free
    queued = engine.add_request("queued", PROMPT, greedy(24))
    engine.abort(queued)  # aborted before it ever ran
    final = drain(engine)
    assert sorted(final) == sorted(rids + [queued])
    a = final[rids[1]].outputs[0]
    assert a.finish_reason == "abort" and a.token_ids == hf_greedy(tiny_hf, PROMPTS[1], 4)
    assert final[queued].outputs[0].finish_reason == "abort"
    assert final[queued].outputs[0].token_ids == []
    for r, p in ((rids[0], PROMPTS[0]), (rids[2], PROMPTS[2])):
        assert final[r].outputs[0].finish_reason == "length"
        assert final[r].outputs[0].token_ids == hf_greedy(tiny_hf, p, 24)
    assert alloc.num_free_pages == alloc.num_pages and not engine._groups


def test_duplicate_request_id_rejected(make_tiny_llm):
    engine = make_tiny_llm().engine
    engine.add_request("x", PROMPT, greedy(2))
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request("x", [9, 9], greedy(2))
    assert drain(engine)["x"].prompt_token_ids == PROMPT


@pytest.mark.slow
def test_preemption_keeps_greedy_exact(tiny_hf, make_tiny_llm):
    n = 32
    refs = [hf_greedy(tiny_hf, p, n) for p in PROMPTS]
    # 8-token pages; the longest sequence (50 + 32 tokens) needs 11, all five need 27.
    llm = make_tiny_llm(page_size=8, num_pages=14)
    engine = llm.engine
    rids = [engine.add_request(None, p, greedy(n)) for p in PROMPTS]
    reqs = [engine.get_sequences(r)[0] for r in rids]
    final = drain(engine)
    assert sum(r.num_preemptions for r in reqs) > 0
    for rid, ref in zip(rids, refs):
        assert final[rid].outputs[0].token_ids == ref
    assert engine.num_free_pages == engine.num_pages


def test_sequence_larger_than_cache_rejected(make_tiny_llm):
    engine = make_tiny_llm(page_size=8, num_pages=4).engine  # 32 token slots
    with pytest.raises(ValueError, match="33 tokens needs more than the 4 pages"):
        engine.add_request(None, list(range(20)), greedy(13))
    assert not engine.has_unfinished_requests()
    engine.add_request(None, list(range(20)), greedy(12))  # exactly fits
    assert drain(engine)


@pytest.mark.parametrize("bad", [256, -1, 10**6])
def test_token_ids_outside_vocab_rejected(make_tiny_llm, bad):
    engine = make_tiny_llm().engine
    with pytest.raises(ValueError, match=rf"\[{bad}\] are outside the vocabulary"):
        engine.add_request(None, [5, bad, 7], greedy(2))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=1, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
    SamplingParams(top_p=1e-6, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
], ids=["top_k=1", "top_p=1e-6"])
@pytest.mark.slow
def test_degenerate_filters_equal_greedy(tiny_hf, make_tiny_llm, params):
    outs = make_tiny_llm().generate(PROMPTS[:3], params)
    for p, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_hf, p, 24)


def test_first_token_distribution_matches_softmax(make_tiny_llm):
    llm = make_tiny_llm(max_num_seqs=128, num_pages=256)
    prompt = [42] * 19
    probs = np.exp(llm.engine.last_token_logits([prompt])[0].astype(np.float64))
    probs /= probs.sum()
    n = 400
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=1)
                                       for s in range(n)])
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=len(probs))
    # Bins: the 8 likeliest tokens one by one, then everything else.
    top = np.argsort(probs)[::-1][:8]
    p_bins = np.append(probs[top], 1 - probs[top].sum())
    e_bins = np.append(counts[top], n - counts[top].sum()) / n
    tv = lambda a, b: 0.5 * np.abs(a - b).sum()
    assert tv(p_bins, e_bins) < 0.15, (tv(p_bins, e_bins), p_bins.round(3), e_bins.round(3))
    # The check has teeth: always-greedy or uniform sampling would be this far off.
    uniform = np.append(np.full(8, 1 / len(probs)), 1 - 8 / len(probs))
    assert tv(p_bins, np.eye(9)[0]) > 0.3 and tv(p_bins, uniform) > 0.2
