"""Async scheduling (``jaxserve.engine.async_step``) changes nothing a client
sees: the same requests with ``async_scheduling`` on and off give the same
tokens, texts, logprobs and finish reasons (greedy, seeded, n > 1, stop
strings, stop ids, EOS, max_tokens), an abort between steps lets no token
through after it, preemption under a tiny KV cache and a failed step recover
to the same outputs, and afterwards every page is free and nothing runs.
Steps that need the previous step's tokens on the host (penalties, prompt
logprobs) run synchronously.

One engine per KV-cache size; each test runs its requests twice on it,
switching ``config.async_scheduling`` and emptying the prefix cache between
runs, so both runs compute the same steps from the same state.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import XLA_CACHE

from jaxserve import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], [200], list(range(10, 60)), [42] * 19,
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 3]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def seeded(n, seed, **kw):
    return SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=seed, **kw)


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    """A tiny random Llama with a tokenizer (texts, stop strings)."""
    return LLM(tiny_gguf, num_pages=128, page_size=8, max_num_batched_tokens=64,
               compilation_cache_dir=XLA_CACHE)


@pytest.fixture(scope="module")
def small_llm(tiny_parts):
    """The tiny Llama with 14 pages of 8 tokens: five prompts of 32 new tokens
    need 27, so sequences are preempted."""
    return LLM(page_size=8, num_pages=14, compilation_cache_dir=XLA_CACHE, **tiny_parts)


def set_async(engine, on: bool) -> None:
    engine.config = dataclasses.replace(engine.config, async_scheduling=on)
    engine.reset_prefix_cache()


def assert_idle(engine) -> None:
    """No page leaked, nothing running, waiting or in flight."""
    assert engine.num_free_pages == engine.num_pages
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not engine.has_unfinished_requests() and not engine._groups


def drain(engine, trace=None):
    """Step until idle; returns every output by request id, in order.
    ``trace`` collects each step's ``StepInfo``."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        last = engine.last_step
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
        if trace is not None and engine.last_step is not last:
            trace.append(engine.last_step)
    return seen


def generate(llm, prompts, params, on: bool, trace=None):
    engine = llm.engine
    set_async(engine, on)
    ids = [engine.add_request(None, p, sp) for p, sp in
           zip(prompts, params if isinstance(params, list) else [params] * len(prompts))]
    seen = drain(engine, trace)
    assert_idle(engine)
    return [seen[i][-1] for i in ids]


def summary(out):
    """What a client sees of a finished request (logprobs rounded: a row may
    sit in a differently padded step)."""
    comps = []
    for c in out.outputs:
        lps = None if c.logprobs is None else [
            {t: (round(lp.logprob, 4), lp.rank) for t, lp in d.items()} for d in c.logprobs]
        comps.append((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                      round(c.cumulative_logprob, 3), lps))
    plp = None if out.prompt_logprobs is None else [
        None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()}
        for d in out.prompt_logprobs]
    return out.finished, comps, plp


def both(llm, prompts, params):
    """(async outputs, sync outputs, async StepInfos, sync StepInfos)."""
    ta, ts = [], []
    a = generate(llm, prompts, params, True, ta)
    s = generate(llm, prompts, params, False, ts)
    return a, s, ta, ts


def test_same_outputs_greedy_and_seeded(llm):
    texts = ["hello world", "the other one is longer than this, and longer still", "x"]
    prompts = [llm.engine.encode(t) for t in texts] + PROMPTS
    params = [greedy(12), seeded(20, 3), greedy(1), seeded(7, 11, logprobs=3), greedy(24),
              seeded(2, 5), SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=9,
                                           min_tokens=5), greedy(5, logprobs=0)]
    a, s, ta, ts = both(llm, prompts, params)
    assert [summary(o) for o in a] == [summary(o) for o in s]
    for o, p in zip(a, params):  # max_tokens respected (EOS may stop one earlier)
        n = len(o.outputs[0].token_ids)
        assert n == p.max_tokens or (o.outputs[0].finish_reason == "stop" and n < p.max_tokens)
    assert any(o.outputs[0].text for o in a)
    # The async run overlapped its steps; the synchronous one never did.
    assert sum(i.overlapped for i in ta) >= len(ta) // 2 and not any(i.overlapped for i in ts)
    for i in ta + ts:
        assert i.device_ms > 0 and i.host_ms > 0 and i.idle_ms >= 0
        assert i.seconds == pytest.approx(i.device_ms / 1e3)


def test_n_choices_same_outputs(llm):
    params = [SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7),
              SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True)]
    a, s, _, _ = both(llm, PROMPTS[:2], params)
    assert [summary(o) for o in a] == [summary(o) for o in s]
    assert len({tuple(c.token_ids) for c in a[0].outputs}) > 1  # the choices differ


def test_stop_strings_and_stop_ids_stop_at_the_same_token(llm):
    engine = llm.engine
    prompts = [engine.encode("tea or sun or cat"), engine.encode("hello world")]
    ref = generate(llm, prompts, greedy(24), False)
    stops, params = [], []
    for o in ref:
        text, ids = o.outputs[0].text, o.outputs[0].token_ids
        stops.append(text[len(text) // 3:len(text) // 3 + 2])
        params.append(greedy(24, stop=[stops[-1]]))
        params.append(greedy(24, stop_token_ids=[ids[len(ids) // 2]]))
    a, s, _, _ = both(llm, [p for p in prompts for _ in range(2)], params)
    assert [summary(o) for o in a] == [summary(o) for o in s]
    for o, stop in zip(a[::2], stops):
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop
        assert stop not in o.outputs[0].text
    for o in a[1::2]:
        assert o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) < 24


def test_eos_stops_at_the_same_token(llm):
    engine = llm.engine
    ref = generate(llm, PROMPTS[:3], greedy(24), False)
    eos = ref[0].outputs[0].token_ids[6]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset([eos])  # taken by requests added from now on
    try:
        params = [SamplingParams(max_tokens=24, temperature=0.0),
                  SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10),
                  SamplingParams(max_tokens=24, temperature=1.0, seed=1)]
        a, s, _, _ = both(llm, [PROMPTS[0]] * 2 + [PROMPTS[2]], params)
    finally:
        engine.eos_token_ids = saved
    assert [summary(o) for o in a] == [summary(o) for o in s]
    first = a[0].outputs[0]
    k = ref[0].outputs[0].token_ids.index(eos)
    assert first.finish_reason == "stop" and first.token_ids == ref[0].outputs[0].token_ids[:k + 1]
    assert eos not in a[1].outputs[0].token_ids[:10]


@pytest.mark.parametrize("steps_before", [0, 1, 4])
def test_abort_between_steps_lets_no_token_through(llm, steps_before):
    engine = llm.engine
    results = {}
    for on in (True, False):
        set_async(engine, on)
        rids = [engine.add_request(None, p, greedy(24)) for p in PROMPTS[:3]]
        seen: dict[str, list] = {}
        for _ in range(steps_before):
            for o in engine.step():
                seen.setdefault(o.request_id, []).append(o)
        victim = rids[1]
        before = [t for o in seen.get(victim, []) for t in o.outputs[0].delta_token_ids]
        engine.abort(victim)
        after = drain(engine)
        assert_idle(engine)
        outs = after[victim]
        assert len(outs) == 1 and outs[0].finished  # the abort's own output, nothing later
        c = outs[0].outputs[0]
        assert c.finish_reason == "abort" and c.token_ids == before and not c.delta_token_ids
        assert len(before) == steps_before
        results[on] = ([summary(after[r][-1]) for r in rids], before)
    assert results[True] == results[False]


def test_abort_everything_in_flight(llm):
    engine = llm.engine
    set_async(engine, True)
    rids = [engine.add_request(None, p, greedy(24)) for p in PROMPTS[:3]]  # one prefill step
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.abort(rids)
    seen = drain(engine)
    assert_idle(engine)
    for r in rids:
        assert [o.outputs[0].finish_reason for o in seen[r]] == ["abort"]
        assert len(seen[r][0].outputs[0].token_ids) == 2


def test_preemption_same_outputs_and_no_page_leaked(small_llm):
    params = [greedy(32), seeded(32, 4, ignore_eos=True), greedy(32), greedy(20),
              seeded(32, 8, ignore_eos=True)]
    engine = small_llm.engine
    p0 = engine.scheduler.num_preemptions
    a = generate(small_llm, PROMPTS, params, True)
    p1 = engine.scheduler.num_preemptions
    s = generate(small_llm, PROMPTS, params, False)
    assert p1 > p0 and engine.scheduler.num_preemptions > p1
    assert [summary(o) for o in a] == [summary(o) for o in s]


@pytest.mark.parametrize("on", [True, False])
def test_pause_and_resume_same_outputs_and_no_page_leaked(llm, on):
    """``Engine.pause`` (a stream nobody reads) sets a request aside with no
    page and no slot while the others go on; after ``resume`` its outputs are
    those of an uninterrupted run (greedy, seeded, n > 1)."""
    engine = llm.engine
    prompts = PROMPTS[:4]
    params = [greedy(20), seeded(20, 5, ignore_eos=True),
              SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=3, ignore_eos=True),
              greedy(18, logprobs=2)]
    ref = generate(llm, prompts, params, False)
    set_async(engine, on)
    rids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    seen: dict[str, list] = {}

    def step():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    for _ in range(3):
        step()
    paused = [rids[0], rids[2]]  # greedy and the n = 2 seeded one, mid-decode
    free_before = engine.num_free_pages
    assert all(engine.pause(r) for r in paused)
    assert not engine.pause("no-such-request")
    seqs = [r for rid in paused for r in engine.get_sequences(rid)]
    assert engine.stats().num_paused == 3 and all(not r.page_ids for r in seqs)
    assert engine.num_free_pages > free_before
    step()  # a token in flight when they paused lands now
    held = [len(r.host_output_ids) for r in seqs]
    for _ in range(4):  # the others go on; the paused ones do not move
        step()
        assert [len(r.host_output_ids) for r in seqs] == held
        assert all(r not in engine.scheduler.running for r in seqs)
    assert len(seen[rids[1]]) > 5
    assert all(engine.resume(r) for r in paused) and not engine.resume(rids[1])
    assert engine.stats().num_paused == 0
    rest = drain(engine)
    assert_idle(engine)
    out = [(rest.get(r) or seen[r])[-1] for r in rids]
    assert [summary(o) for o in out] == [summary(o) for o in ref]


def test_penalties_and_prompt_logprobs_fall_back_to_sync(llm):
    penalised = [SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.5),
                 SamplingParams(max_tokens=12, temperature=1.0, seed=2, frequency_penalty=1.0),
                 SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8,
                                ignore_eos=True)]
    a, s, ta, _ = both(llm, PROMPTS[:3], penalised)
    assert [summary(o) for o in a] == [summary(o) for o in s]
    assert not any(i.overlapped for i in ta)  # every step had a penalised row
    mixed = [greedy(10), SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=2),
             penalised[0], seeded(10, 3)]
    a, s, ta, _ = both(llm, PROMPTS[:4], mixed)
    assert [summary(o) for o in a] == [summary(o) for o in s]
    assert a[1].prompt_logprobs is not None and len(a[1].prompt_logprobs) == len(PROMPTS[1])


def test_last_token_logits_between_async_steps(llm):
    engine = llm.engine
    want = generate(llm, PROMPTS[:3], greedy(8), False)
    set_async(engine, True)
    rids = [engine.add_request(None, p, greedy(8)) for p in PROMPTS[:3]]
    seen: dict[str, list] = {}
    for i in range(3):
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
        logits = engine.last_token_logits([PROMPTS[3]])  # runs a step between two of ours
        assert logits.shape == (1, engine.model_config.vocab_size)
    for rid, outs in drain(engine).items():
        seen.setdefault(rid, []).extend(outs)
    assert_idle(engine)
    assert [summary(seen[r][-1]) for r in rids] == [summary(o) for o in want]


def test_failed_step_requeues_and_recovers(llm, monkeypatch):
    engine = llm.engine
    want = generate(llm, PROMPTS[:3], greedy(10), False)
    set_async(engine, True)
    rids = [engine.add_request(None, p, greedy(10)) for p in PROMPTS[:3]]
    real, calls = engine.runner.finish, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*args, **kw)
    monkeypatch.setattr(engine.runner, "finish", flaky)
    seen: dict[str, list] = {}
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(5):
            for o in engine.step():
                seen.setdefault(o.request_id, []).append(o)
    for r in engine.scheduler.waiting:  # re-queued with only the host's tokens
        assert r.num_placeholders == 0 and -1 not in r.output_token_ids
    for rid, outs in drain(engine).items():
        seen.setdefault(rid, []).extend(outs)
    assert_idle(engine)
    assert [summary(seen[r][-1]) for r in rids] == [summary(o) for o in want]
    # Streamed deltas add up to the final tokens: nothing doubled, nothing lost.
    for r in rids:
        deltas = [t for o in seen[r] for t in o.outputs[0].delta_token_ids]
        assert deltas == seen[r][-1].outputs[0].token_ids


def test_streamed_deltas_match_final_outputs(llm):
    engine = llm.engine
    set_async(engine, True)
    rids = [engine.add_request(None, p, seeded(15, i)) for i, p in enumerate(PROMPTS)]
    seen = drain(engine)
    assert_idle(engine)
    for r in rids:
        final = seen[r][-1].outputs[0]
        assert [t for o in seen[r] for t in o.outputs[0].delta_token_ids] == final.token_ids
        assert "".join(o.outputs[0].delta_text for o in seen[r]) == final.text
        assert all(t >= 0 for o in seen[r] for t in o.outputs[0].token_ids)
    assert np.all([len(seen[r]) >= 1 for r in rids])
