"""Serving semantics on the tiny random Llama (issue 3): chunked prefill,
prefix caching, preemption, abort in every state, n choices, logprobs,
penalties and edge values.

The tiny model has no tokenizer (prompts are token ids) and EOS id 1. Greedy
references come from HF transformers on the same weights (``tiny_hf``; those
tests are slow: they import torch).
"""

import dataclasses

import numpy as np
import pytest
from tiny_models import hf_greedy

from jaxserve import LLM, SamplingParams
from conftest import XLA_CACHE
from test_engine_tiny import PROMPTS, drain, first_new, greedy

L = 16  # page size of these tests


@pytest.fixture(scope="module")
def long_parts(tiny_parts):
    """``tiny_parts`` with a 2,048-token context (RoPE has no length limit)."""
    cfg = dataclasses.replace(tiny_parts["model_config"], max_position_embeddings=2048)
    return dict(tiny_parts, model_config=cfg)


def make(parts, **kw):
    kw.setdefault("page_size", L)
    kw.setdefault("num_pages", 256)
    kw.setdefault("compilation_cache_dir", XLA_CACHE)
    return LLM(**kw, **parts)


def long_prompt(n, seed=0):
    return np.random.default_rng(seed).integers(2, 256, size=n).tolist()


def assert_all_pages_free(engine):
    a = engine.allocator
    assert a.num_free_pages == a.num_pages, (a.num_free_pages, a.num_pages)
    assert not any(a._ref), "a page still holds a reference"
    assert engine.num_running == 0 and engine.num_waiting == 0


# ---- 1. chunked prefill -------------------------------------------------------

@pytest.mark.slow
def test_chunked_prefill_same_tokens_and_decodes_never_stall(tiny_hf, long_parts):
    prompt = long_prompt(1000)
    want = hf_greedy(tiny_hf, prompt, 12)
    got = {}
    for chunk in (64, 128, None):
        llm = make(long_parts, max_num_batched_tokens=chunk or 1024,
                   enable_chunked_prefill=chunk is not None, enable_prefix_caching=False)
        got[chunk] = llm.generate([prompt], greedy(12))[0].outputs[0].token_ids
        if chunk:  # the prompt really ran in chunks: one step per chunk
            assert llm.engine.stats().num_steps >= 12 - 1 + -(-1000 // chunk)
    assert got[64] == got[128] == got[None] == want

    # A decode stream keeps producing one token per step while the long prompt
    # prefills in chunks of at most 64 - 1 tokens beside it.
    engine = make(long_parts, max_num_batched_tokens=64).engine
    engine.add_request("stream", PROMPTS[0], greedy(40))
    assert [o.request_id for o in engine.step()] == ["stream"]  # prefill + first token
    engine.add_request("long", prompt, greedy(4))
    steps_until_long = 0
    stream_tokens = 1
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps_until_long += 1
        assert "stream" in outs, f"decode stalled at step {steps_until_long}"
        assert len(outs["stream"].outputs[0].token_ids) == stream_tokens + 1
        stream_tokens += 1
        if "long" in outs:
            break
    # 16 chunks of <= 63 tokens; with async scheduling the request added after
    # a step joins after the step already in flight, one step later.
    assert steps_until_long == -(-1000 // 63) + engine.config.async_scheduling
    final = drain(engine)
    assert final["stream"].outputs[0].token_ids == hf_greedy(tiny_hf, PROMPTS[0], 40)
    assert final["long"].outputs[0].token_ids == want[:4]
    assert_all_pages_free(engine)


# ---- 2. prefix caching ------------------------------------------------------------

@pytest.mark.slow
def test_prefix_cache_hits_are_exact_and_page_aligned(tiny_hf, long_parts):
    llm = make(long_parts)
    engine = llm.engine
    prompts = [long_prompt(n, seed=n) for n in (40, 100, 161)]
    cold = llm.generate(prompts, greedy(10))
    assert [o.metrics.num_cached_tokens for o in cold] == [0, 0, 0]
    for p, o in zip(prompts, cold):
        assert o.outputs[0].token_ids == hf_greedy(tiny_hf, p, 10)
    s_cold = engine.stats()
    assert (s_cold.prompt_tokens, s_cold.generation_tokens) == (40 + 100 + 161, 30)
    warm = llm.generate(prompts, greedy(10))
    s_warm = engine.stats()
    assert s_warm.prompt_tokens - s_cold.prompt_tokens == \
        sum(len(p) - (len(p) - 1) // L * L for p in prompts)  # only the uncached tails
    assert s_warm.pages_cached > 0 and (s_warm.num_running, s_warm.num_waiting) == (0, 0)
    for p, c, w in zip(prompts, cold, warm):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        # Every full page but the one holding the last prompt token is reused.
        assert w.num_cached_tokens == w.metrics.num_cached_tokens == (len(p) - 1) // L * L
    # A shared 500-token prefix with different tails.
    prefix = long_prompt(500, seed=7)
    tails = [long_prompt(k, seed=100 + k) for k in (3, 20, 45)]
    first = llm.generate(prefix + tails[0], greedy(8))[0]
    assert first.metrics.num_cached_tokens == 0
    s0 = engine.stats()
    rest = llm.generate([prefix + t for t in tails[1:]], greedy(8))
    for t, o in zip(tails[1:], rest):
        assert o.metrics.num_cached_tokens == 500 // L * L  # 496: the page holding
        assert o.outputs[0].token_ids == hf_greedy(tiny_hf, prefix + t, 8)  # 496..511 differs
    s1 = engine.stats()
    assert s1.prefix_cache_hits - s0.prefix_cache_hits == 2 * 496
    assert s1.prefix_cache_queries - s0.prefix_cache_queries == sum(500 + len(t) for t in tails[1:])
    assert 0 < s1.prefix_cache_hit_rate < 1
    assert_all_pages_free(engine)

    off = make(long_parts, enable_prefix_caching=False)
    off.generate(prompts, greedy(2))
    again = off.generate(prompts, greedy(10))
    assert [o.metrics.num_cached_tokens for o in again] == [0, 0, 0]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in cold]


def test_prefix_cache_evicts_least_recently_used(long_parts):
    # 20 pages: room for one 150-token sequence (10 pages) plus change.
    llm = make(long_parts, num_pages=20)
    a, b, c = (long_prompt(150, seed=s) for s in (1, 2, 3))
    llm.generate(a, greedy(2))
    llm.generate(b, greedy(2))  # evicts part of a (freed earlier than b)
    assert llm.generate(b, greedy(2))[0].metrics.num_cached_tokens == 144
    llm.generate(c, greedy(2))
    # c needed 10 pages: 10 of the 18 evictable ones go, oldest-freed (a's) first.
    assert llm.generate(b, greedy(2))[0].metrics.num_cached_tokens == 144
    assert llm.generate(a, greedy(2))[0].metrics.num_cached_tokens < 144
    assert_all_pages_free(llm.engine)


@pytest.mark.slow
def test_prompt_logprobs_same_cold_warm_and_any_order(tiny_hf, long_parts):
    llm = make(long_parts)
    p1, p2 = long_prompt(70, seed=11), long_prompt(33, seed=12)
    params = greedy(3, prompt_logprobs=2)
    cold = llm.generate([p1, p2], params)
    llm.generate([p1, p2], greedy(3))  # fills the prefix cache
    warm = llm.generate([p2, p1], params)[::-1]  # other arrival order, warm cache
    import torch
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([p1])).logits[0].double(), -1).numpy()
    for c, w in zip(cold, warm):
        assert w.metrics.num_cached_tokens == 0  # prompt_logprobs skip the cache
        assert len(c.prompt_logprobs) == len(c.prompt_token_ids) and c.prompt_logprobs[0] is None
        for dc, dw in zip(c.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert dc.keys() == dw.keys()
            for k in dc:
                assert dc[k].rank == dw[k].rank
                assert dc[k].logprob == dw[k].logprob  # bit-identical
        assert c.outputs[0].token_ids == w.outputs[0].token_ids
    # Against HF: the prompt token's logprob and the top-2 candidates.
    for j, d in enumerate(cold[0].prompt_logprobs[1:], start=1):
        tok = p1[j]
        assert d[tok].logprob == pytest.approx(ref[j - 1, tok], abs=2e-4)
        top2 = np.argsort(-ref[j - 1])[:2]
        assert {k for k, v in d.items() if v.rank <= 2} >= set(top2.tolist())
        assert len(d) in (2, 3)


@pytest.mark.slow
def test_prompt_logprobs_of_a_chunked_prompt_beside_a_decode(tiny_hf, long_parts):
    llm = make(long_parts, max_num_batched_tokens=64)
    engine = llm.engine
    prompt = long_prompt(300, seed=21)
    engine.add_request("beside", PROMPTS[0], greedy(30))
    engine.step()
    engine.add_request("plp", prompt, greedy(2, prompt_logprobs=1))
    out = drain(engine)["plp"]
    assert engine.stats().num_steps >= 1 + 300 // 63
    import torch
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    plp = out.prompt_logprobs
    assert len(plp) == 300 and plp[0] is None
    for j in range(1, 300):
        assert plp[j][prompt[j]].logprob == pytest.approx(ref[j - 1, prompt[j]], abs=2e-4), j
        top1 = int(np.argmax(ref[j - 1]))
        assert plp[j][top1].rank == 1


# ---- 3. preemption ---------------------------------------------------------------

@pytest.mark.slow
def test_preemption_of_several_sequences_is_exact(tiny_hf, long_parts):
    prompts = [long_prompt(n, seed=n) for n in (30, 45, 60, 20, 75, 38)]
    n = 40
    want = [hf_greedy(tiny_hf, p, n) for p in prompts]
    # 24 pages of 16 tokens: the six sequences need 6 + 6 + 7 + 4 + 8 + 5 = 36.
    llm = make(long_parts, num_pages=24, enable_prefix_caching=False)
    engine = llm.engine
    rids = [engine.add_request(None, p, greedy(n)) for p in prompts]
    seqs = [engine.get_sequences(r)[0] for r in rids]
    final = drain(engine)
    for rid, w in zip(rids, want):
        assert final[rid].outputs[0].token_ids == w
    assert sum(s.num_preemptions > 0 for s in seqs) >= 2, [s.num_preemptions for s in seqs]
    assert engine.stats().num_preemptions == sum(s.num_preemptions for s in seqs)
    assert_all_pages_free(engine)


# ---- 4. abort ------------------------------------------------------------------

def test_abort_in_each_state_frees_pages(long_parts):
    llm = make(long_parts, max_num_batched_tokens=64, max_num_seqs=2)
    engine = llm.engine
    engine.add_request("dec", PROMPTS[0], greedy(50))
    engine.step()
    engine.add_request("chunked", long_prompt(400), greedy(5))
    engine.add_request("waiting", long_prompt(50), greedy(5))  # max_num_seqs=2: waits
    engine.step()
    engine.step()
    states = {r: engine.get_sequences(r)[0] for r in ("dec", "chunked", "waiting")}
    assert states["dec"].output_token_ids and states["dec"].page_ids
    assert 0 < states["chunked"].num_computed_tokens < 400  # mid-prefill
    assert states["waiting"].status.value == "waiting" and not states["waiting"].page_ids
    before = engine.num_free_pages
    held = len(states["dec"].page_ids) + len(states["chunked"].page_ids)
    for rid in ("chunked", "dec", "waiting"):
        engine.abort(rid)
    assert engine.num_free_pages == before + held  # at once, not next step
    outs = drain(engine)
    assert {r: o.outputs[0].finish_reason for r, o in outs.items()} == \
        {"dec": "abort", "chunked": "abort", "waiting": "abort"}
    assert outs["dec"].outputs[0].delta_token_ids == []
    assert_all_pages_free(engine)


def test_random_aborts_leak_no_page(long_parts):
    rng = np.random.default_rng(0)
    llm = make(long_parts, num_pages=30, max_num_batched_tokens=48, max_num_seqs=6)
    engine = llm.engine
    plans = []  # (request id, step to add at, step to abort at)
    for i in range(100):
        add = int(rng.integers(0, 60))
        plans.append((f"r{i}", add, add + int(rng.integers(0, 25))))
    aborted_at: dict[str, int] = {}
    seen_after_abort = []
    step = 0
    while step < 400 and (step <= 85 or engine.has_unfinished_requests()):
        for rid, add, abort in plans:
            if add == step:
                n = int(rng.integers(1, 120))
                engine.add_request(rid, long_prompt(n, seed=step * 1000 + n), greedy(
                    int(rng.integers(5, 60))))
            if abort == step and rid in engine._groups:
                engine.abort(rid)
                aborted_at[rid] = step
        for o in engine.step():
            if o.request_id in aborted_at and (o.outputs[0].finish_reason != "abort"
                                               or o.outputs[0].delta_token_ids):
                seen_after_abort.append((o.request_id, step))
        step += 1
    assert not engine.has_unfinished_requests()
    assert len(aborted_at) > 30
    assert not seen_after_abort
    assert engine.stats().num_preemptions > 0  # the pool was under pressure too
    assert_all_pages_free(engine)


def test_abort_many_ids_and_dict_prompts(long_parts):
    llm = make(long_parts)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, greedy(20))
    engine.add_request("b", PROMPTS[2], SamplingParams(n=2, max_tokens=20, seed=1))
    engine.step()
    engine.abort(["a", "b", "unknown"])
    outs = {o.request_id: o for o in engine.step()}
    assert {r: [c.finish_reason for c in o.outputs] for r, o in outs.items()} == \
        {"a": ["abort"], "b": ["abort", "abort"]}
    assert_all_pages_free(engine)
    for bad in ({"prompt": "x", "prompt_token_ids": [1]}, {"text": "x"}, 3.5, None):
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request(None, bad, greedy(2))


def test_closing_a_stream_aborts_it(long_parts):
    llm = make(long_parts)
    engine = llm.engine
    stream = llm.stream(long_prompt(90), greedy(30))
    outs = [next(stream) for _ in range(3)]
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert engine.num_free_pages < engine.num_pages
    stream.close()
    assert_all_pages_free(engine)
    assert not engine.has_unfinished_requests()


# ---- 7. seeds and batches ----------------------------------------------------------

def test_seeded_request_independent_of_batch_mates(long_parts):
    llm = make(long_parts)
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True)
    target = PROMPTS[2]
    alone = llm.generate(target, seeded)[0].outputs[0].token_ids
    with_unseeded = llm.generate([PROMPTS[0], target, PROMPTS[3]], [
        SamplingParams(temperature=1.0, max_tokens=30), seeded,
        SamplingParams(temperature=0.5, max_tokens=7)])[1].outputs[0].token_ids
    with_seeded = llm.generate([target, PROMPTS[4], PROMPTS[1]], [
        seeded, SamplingParams(temperature=0.8, seed=1, max_tokens=24),
        SamplingParams(temperature=1.2, seed=1235, max_tokens=12)])[0].outputs[0].token_ids
    assert alone == with_unseeded == with_seeded
    greedy_out = llm.generate(target, greedy(24))[0].outputs[0].token_ids
    assert alone != greedy_out  # really sampled


def test_greedy_16_prompts_alone_equal_batched(long_parts):
    prompts = [long_prompt(int(n), seed=int(n)) for n in
               np.random.default_rng(3).integers(1, 200, size=16)]
    llm = make(long_parts, enable_prefix_caching=False)
    alone = [llm.generate(p, greedy(12))[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12))]
    assert alone == batched


# ---- 8. n, ignore_eos, min_tokens, logprobs -----------------------------------------

def test_n_choices_share_prompt_pages(long_parts):
    prompt = long_prompt(200, seed=5)
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)

    def peak_pages(llm, rids_fn):
        engine = llm.engine
        rids_fn(engine)
        peak, final = 0, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
            peak = max(peak, engine.stats().pages_used)
        return peak, final

    llm = make(long_parts, enable_prefix_caching=False)
    shared, final = peak_pages(llm, lambda e: e.add_request("g", prompt, params))
    out = final["g"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent draws
    # Choice i is the request with seed 42 + i.
    for c in out.outputs:
        one = llm.generate(prompt, dataclasses.replace(params, n=1, seed=42 + c.index))[0]
        assert one.outputs[0].token_ids == c.token_ids
    separate, _ = peak_pages(llm, lambda e: [e.add_request(f"s{i}", prompt, dataclasses.replace(
        params, n=1, seed=42 + i)) for i in range(4)])
    assert shared < separate, (shared, separate)
    assert_all_pages_free(llm.engine)


@pytest.mark.slow
def test_ignore_eos_and_min_tokens(tiny_hf, tiny_parts):
    prompt = [200]
    ref = hf_greedy(tiny_hf, prompt, 30)
    k = first_new(ref, 3, 20)
    eos = ref[k]  # a model copy whose EOS is greedy's k-th token
    parts = dict(tiny_parts, model_config=dataclasses.replace(
        tiny_parts["model_config"], eos_token_ids=(eos,)))
    llm = make(parts)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert out.token_ids == ref[:k + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                              ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                              min_tokens=k + 3))[0].outputs[0]
    want = hf_greedy(tiny_hf, prompt, 30, min_new_tokens=k + 3, eos_token_id=eos, pad_token_id=0)
    assert out.token_ids == want and eos not in out.token_ids[:k + 3]


@pytest.mark.slow
def test_logprobs_top5_under_greedy(tiny_hf, make_tiny_llm):
    llm = make_tiny_llm()
    prompt = PROMPTS[0]
    out = llm.generate(prompt, greedy(6, logprobs=5))[0].outputs[0]
    assert len(out.logprobs) == 6
    ids = prompt + out.token_ids
    import torch
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(d) == 5  # greedy: the sampled token is one of the top 5
        top = max(d.items(), key=lambda kv: kv[1].logprob)
        assert top[0] == tok and d[tok].rank == 1
        row = ref[len(prompt) + i - 1]
        assert sorted(d) == sorted(np.argsort(-row)[:5].tolist())
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(row[t], abs=2e-4)
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in
                                                       zip(out.token_ids, out.logprobs)), abs=1e-4)
    # logprobs=0: only the sampled token's entry.
    out0 = llm.generate(prompt, greedy(3, logprobs=0))[0].outputs[0]
    assert [list(d) for d in out0.logprobs] == [[t] for t in out0.token_ids]


# ---- 9. edge values ----------------------------------------------------------------

@pytest.mark.slow
def test_edge_lengths(tiny_hf, make_tiny_llm):
    llm = make_tiny_llm(max_model_len=64)
    out = llm.generate(PROMPTS[0], greedy(1))[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny_hf, PROMPTS[0], 1) and out.finish_reason == "length"
    p63 = long_prompt(63, seed=63)
    out = llm.generate(p63, greedy(10))[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny_hf, p63, 1) and out.finish_reason == "length"
    for n in (64, 65, 500):
        with pytest.raises(ValueError, match=f"prompt has {n} tokens.*max_model_len=64"):
            llm.generate(long_prompt(n), greedy(1))
    assert_all_pages_free(llm.engine)


@pytest.mark.parametrize("kw", [dict(top_p=1.0, top_k=0), dict(top_p=1.0, top_k=-1)])
def test_untruncated_sampling_matches_softmax(make_tiny_llm, kw):
    llm = make_tiny_llm(max_num_seqs=128, num_pages=256)
    prompt = [42] * 19
    probs = np.exp(llm.engine.last_token_logits([prompt])[0].astype(np.float64))
    probs /= probs.sum()
    n = 400
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=1, **kw)
                                       for s in range(n)])
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=len(probs))
    # The tail beyond the 8 likeliest tokens is sampled as often as it should be.
    top = np.argsort(probs)[::-1][:8]
    tail_p, tail_e = 1 - probs[top].sum(), 1 - counts[top].sum() / n
    assert tail_p > 0.2 and abs(tail_e - tail_p) < 0.08, (tail_p, tail_e)


def _penalised(logits, prompt, out, rep=1.0, freq=0.0, pres=0.0):
    x = logits.astype(np.float64).copy()
    seen = set(prompt) | set(out)
    for t in seen:
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        c = out.count(t)
        x[t] -= freq * c + pres
    return x


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
                                dict(presence_penalty=2.0),
                                dict(repetition_penalty=1.3, frequency_penalty=0.5,
                                     presence_penalty=0.5)])
def test_penalties_follow_their_definitions(make_tiny_llm, kw):
    """Greedy under penalties equals argmax of the penalised logits, step by step,
    where the logits come from the model itself (``last_token_logits``)."""
    llm = make_tiny_llm()
    prompt = [42] * 6 + [7, 9]
    n = 12
    out = llm.generate(prompt, greedy(n, **kw))[0].outputs[0].token_ids
    plain = llm.generate(prompt, greedy(n))[0].outputs[0].token_ids
    assert out != plain  # the penalty changed something
    rep, freq, pres = (kw.get("repetition_penalty", 1.0), kw.get("frequency_penalty", 0.0),
                       kw.get("presence_penalty", 0.0))
    for i in range(n):
        logits = llm.engine.last_token_logits([prompt + out[:i]])[0]
        x = _penalised(logits, prompt, out[:i], rep, freq, pres)
        assert out[i] == int(np.argmax(x)), f"step {i}"
