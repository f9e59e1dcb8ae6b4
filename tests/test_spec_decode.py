"""Speculative decoding (``jaxserve.engine.speculation``) changes no output:
greedy tokens with ``ngram`` and ``draft`` at k = 1, 3, 5 equal speculation
off (alone, batched, n > 1, prefix-cache hits, chunked prefill, tp=2, the
Pallas kernels in interpret mode); sampled tokens follow the target's
distribution (a total-variation test that catches an accept-everything
sampler); seeded requests are reproducible; logprobs are the target's;
stops, EOS and max_tokens inside an accepted run end the output at the right
token; preemption and random aborts leak no page; and the policy turns k off as the batch grows and back on when it
shrinks without compiling anything new.

The target is the tiny random HF Llama of ``conftest`` (varied greedy
outputs); the draft is the same model with Gaussian noise of 3% of each
tensor's std on its weights (greedy acceptance ~65%: both accepted and
rejected drafts are common). References are the same engine with its
speculator detached (``spec_off``), so both runs share compiled programs.
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
import pytest
from conftest import XLA_CACHE

from jaxserve import LLM, SamplingParams
from jaxserve.engine import outputs as engine_mod
from jaxserve.engine.spec_policy import SpecPolicy

RNG = np.random.default_rng(1)
# 8 prompts that repeat a 6-token motif (ngram finds matches), 8 random ones,
# two pairs sharing a 16-token prefix (prefix-cache hits across requests).
PROMPTS = ([list(map(int, RNG.integers(2, 256, 6))) * 3 for _ in range(8)]
           + [list(map(int, RNG.integers(2, 256, 12))) for _ in range(6)])
SHARED = list(map(int, RNG.integers(2, 256, 16)))
PROMPTS += [SHARED + [7, 8, 9], SHARED + [100, 101]]
assert len(PROMPTS) == 16


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def noisy(params, scale, seed):
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, scale * v.std(), v.shape)).astype(np.float32)
            for k, v in params.items()}


@pytest.fixture(scope="module")
def draft_parts(tiny_parts):
    return dict(model_config=tiny_parts["model_config"],
                params=noisy(tiny_parts["params"], 0.03, 1))


def spec(method, k, **kw):
    out = dict(method=method, num_speculative_tokens=k, adaptive=False, **kw)
    if method == "draft":
        out["model"] = "tiny-noisy"
    return out


def make(tiny_parts, draft_parts, method, k, **kw):
    kw.setdefault("num_pages", 256)
    kw.setdefault("page_size", 8)
    return LLM(compilation_cache_dir=XLA_CACHE, speculative_config=spec(method, k),
               draft_parts=draft_parts if method == "draft" else None, **kw, **tiny_parts)


@contextlib.contextmanager
def spec_off(llm):
    """The same engine with its speculator detached (plain decoding)."""
    e = llm.engine
    saved = e.speculator
    e.speculator = e._steps.speculator = None
    try:
        yield llm
    finally:
        e.speculator = e._steps.speculator = saved


def set_k(llm, k):
    s = llm.engine.speculator
    s.max_k = s.k = k


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_idle(engine):
    assert engine.num_free_pages == engine.num_pages
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module", params=["ngram", "draft"])
def llm(request, tiny_parts, draft_parts):
    return make(tiny_parts, draft_parts, request.param, 5)


@pytest.fixture(scope="module")
def reference(llm):
    with spec_off(llm):
        return tokens(llm.generate(PROMPTS, greedy(24)))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_batched_equals_speculation_off(llm, reference, k):
    set_k(llm, k)
    e = llm.engine
    before = e.stats()
    params = [greedy(24)] * 15 + [greedy(24, n=2)]
    got = tokens(llm.generate(PROMPTS, params))
    assert got[:15] == reference[:15]
    assert got[15] == reference[15] * 2  # both greedy choices
    st = e.stats()
    drafted = st.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # accepted and rejected drafts both ran
    assert st.prefix_cache_hits > before.prefix_cache_hits  # SHARED (and the second pass)
    assert_idle(e)


def test_greedy_alone_equals_speculation_off(llm, reference):
    set_k(llm, 3)
    for p, ref in zip(PROMPTS[::3], reference[::3]):
        assert tokens(llm.generate([p], greedy(24))) == [ref]
    assert_idle(llm.engine)


def test_logprobs_are_the_targets(llm):
    set_k(llm, 3)
    p = greedy(24, logprobs=2)
    with spec_off(llm):
        ref = llm.generate(PROMPTS, p)
    before = llm.engine.stats().spec_num_accepted_tokens
    got = llm.generate(PROMPTS, p)
    assert llm.engine.stats().spec_num_accepted_tokens > before
    for a, b in zip(got, ref):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        for la, lb in zip(ca.logprobs, cb.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].rank == lb[t].rank
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-5)


def test_preemption_under_speculation(tiny_parts, draft_parts):
    """14 pages of 8 tokens for five prompts of 32 new tokens (27 pages):
    sequences are preempted, drafts' pages included, and recomputed."""
    llm = make(tiny_parts, draft_parts, "draft", 3, num_pages=14)
    prompts = PROMPTS[:5]
    with spec_off(llm):
        ref = tokens(llm.generate(prompts, greedy(32)))
    before = llm.engine.stats().num_preemptions
    assert tokens(llm.generate(prompts, greedy(32))) == ref
    st = llm.engine.stats()
    assert st.num_preemptions > before and st.spec_num_accepted_tokens > 0
    assert_idle(llm.engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_chunked_prefill_and_tp2(tiny_parts, draft_parts, method):
    chunked = make(tiny_parts, draft_parts, method, 3, max_num_batched_tokens=16)
    with spec_off(chunked):
        ref = tokens(chunked.generate(PROMPTS, greedy(24)))
    assert tokens(chunked.generate(PROMPTS, greedy(24))) == ref
    assert chunked.engine.stats().spec_num_accepted_tokens > 0
    tp2 = make(tiny_parts, draft_parts, method, 3, mesh="tp=2", devices=jax.devices()[:2])
    assert tokens(tp2.generate(PROMPTS, greedy(24))) == ref
    assert tp2.engine.stats().spec_num_accepted_tokens > 0


def test_pallas_kernels_serve_verification_rows(tiny_parts, draft_parts):
    llm = make(tiny_parts, draft_parts, "draft", 3, attention_impl="pallas",
               attention_interpret=True)
    prompts = PROMPTS[:2]
    with spec_off(llm):
        ref = tokens(llm.generate(prompts, greedy(8)))
    assert tokens(llm.generate(prompts, greedy(8))) == ref
    st = llm.engine.stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens


# ---- sampling ------------------------------------------------------------------


def joint_distribution(engine, prompt, top_k):
    """Exact p(t1, t2, t3) of three tokens sampled at temperature 1 under
    top-k from the target (its logits, host-side softmax over the top k)."""
    def dist(prefixes):
        logits = engine.last_token_logits([prompt + list(p) for p in prefixes])
        out = []
        for row in logits:
            top = np.argsort(row)[::-1][:top_k]
            w = np.exp(row[top] - row[top].max())
            out.append(dict(zip(map(int, top), w / w.sum())))
        return out
    joint = {}
    (d1,) = dist([()])
    d2s = dist([(a,) for a in d1])
    pairs = [(a, b) for a, d2 in zip(d1, d2s) for b in d2]
    d3s = dist(pairs)
    for (a, b), d3 in zip(pairs, d3s):
        for c, p3 in d3.items():
            joint[(a, b, c)] = d1[a] * d2s[list(d1).index(a)][b] * p3
    return joint


def tv_bound(num_samples, support, delta=1e-6):
    """epsilon with P(TV(empirical, true) >= epsilon) <= delta for an
    empirical distribution of ``num_samples`` draws over ``support``
    categories: TV = max over the 2^support events of |P_hat(A) - P(A)|, and
    Hoeffding with a union bound gives 2^support exp(-2 n eps^2) <= delta."""
    return math.sqrt((support * math.log(2) + math.log(1 / delta)) / (2 * num_samples))


def empirical_tv(outs, joint):
    counts = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    n = len(outs)
    keys = set(counts) | set(joint)
    return 0.5 * sum(abs(counts.get(key, 0) / n - joint.get(key, 0.0)) for key in keys)


@pytest.fixture(scope="module")
def far_draft(tiny_parts):
    """A draft whose next-token distributions differ from the target's: noise
    of 50% of its std on the LM head only (~40% of sampled drafts accepted;
    noise on every weight flips this chaotic tiny model from ~all to ~none)."""
    params = dict(tiny_parts["params"])
    params["lm_head.weight"] = noisy({"w": params["lm_head.weight"]}, 0.5, 2)["w"]
    return dict(model_config=tiny_parts["model_config"], params=params)


def test_sampled_tokens_follow_the_target_distribution(tiny_parts, far_draft, monkeypatch):
    llm = make(tiny_parts, far_draft, "draft", 2, max_num_seqs=32)
    e = llm.engine
    prompt, top_k, n = PROMPTS[0], 2, 500
    joint = joint_distribution(e, prompt, top_k)
    eps = tv_bound(n, top_k ** 3)
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=i)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    st = e.stats()
    assert st.spec_num_draft_tokens == n  # max_tokens=3: one draft after the first token
    assert 0.1 * n < st.spec_num_accepted_tokens < 0.9 * n
    tv = empirical_tv(outs, joint)
    assert tv < eps, (tv, eps)
    # The bound catches a sampler that accepts every draft (the draft's
    # distribution in place of the target's).
    monkeypatch.setattr(engine_mod, "accept", lambda drafts, sampled: len(drafts))
    broken = llm.generate([prompt] * n, params)
    assert empirical_tv(broken, joint) > eps, (empirical_tv(broken, joint), eps)


def test_seeded_sampling_is_reproducible_and_drafter_invariant(tiny_parts, draft_parts):
    llm = make(tiny_parts, draft_parts, "draft", 3)
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tokens(llm.generate([PROMPTS[0]], p))[0]
    others = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)] * 3
    beside = tokens(llm.generate(PROMPTS[:4], [p] + others))[0]
    again = tokens(make(tiny_parts, draft_parts, "draft", 3).generate([PROMPTS[0]], p))[0]
    assert alone == beside == again
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    with spec_off(llm):  # Gumbel-max coupling: the same tokens as without speculation
        assert tokens(llm.generate([PROMPTS[0]], p))[0] == alone
    ngram = make(tiny_parts, draft_parts, "ngram", 3)
    assert tokens(ngram.generate([PROMPTS[0]], p))[0] == alone


# ---- stops, lengths, aborts -----------------------------------------------------


def test_stop_ids_eos_and_max_tokens_inside_accepted_runs(tiny_parts, draft_parts):
    llm = make(tiny_parts, draft_parts, "draft", 5)
    e = llm.engine
    with spec_off(llm):
        ref = [t[0] for t in tokens(llm.generate(PROMPTS, greedy(24)))]
    cases, params = [], []
    for i, r in enumerate(ref):  # stop at the first new token at or after position 4 + i % 12
        k = next((j for j in range(4 + i % 12, 24) if r[j] not in r[:j]), None)
        if k is not None:
            cases.append((i, k))
            params.append(greedy(24, stop_token_ids=[r[k]]))
    outs = llm.generate([PROMPTS[i] for i, _ in cases], params)
    for (i, k), o in zip(cases, outs):
        c = o.outputs[0]
        assert c.token_ids == ref[i][:k + 1]
        assert (c.finish_reason, c.stop_reason) == ("stop", ref[i][k])
    lengths = [1 + i for i in range(16)]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths])
    for o, r, n in zip(outs, ref, lengths):
        assert o.outputs[0].token_ids == r[:n] and o.outputs[0].finish_reason == "length"
    i, k = cases[0]
    saved = e.eos_token_ids
    e.eos_token_ids = frozenset([ref[i][k]])
    try:
        out = llm.generate([PROMPTS[i]], SamplingParams(max_tokens=24, temperature=0.0))[0]
    finally:
        e.eos_token_ids = saved
    assert out.outputs[0].token_ids == ref[i][:k + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert e.stats().spec_num_accepted_tokens > 0
    assert_idle(e)


def test_stop_strings_inside_accepted_runs(tiny_gguf):
    llm = LLM(tiny_gguf, num_pages=128, page_size=8, compilation_cache_dir=XLA_CACHE,
              speculative_config=spec("ngram", 4))
    prompts = [llm.engine.encode("tea or sun or cat tea or sun"), llm.engine.encode("hello world")]
    with spec_off(llm):
        ref = llm.generate(prompts, greedy(32))
    for o, p in zip(ref, prompts):
        text = o.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        got = llm.generate([p], greedy(32, stop=[stop]))[0].outputs[0]
        assert got.text == text[:text.index(stop)]
        assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert_idle(llm.engine)


def test_random_aborts_leak_no_page(tiny_parts, draft_parts):
    llm = make(tiny_parts, draft_parts, "draft", 2, num_pages=64, max_num_seqs=8)
    e = llm.engine
    rng = np.random.default_rng(7)
    live, aborted, n = [], 0, 0
    while aborted < 100:
        while len(live) < 8:
            p = list(map(int, rng.integers(2, 256, int(rng.integers(4, 24)))))
            live.append(e.add_request(None, p, greedy(int(rng.integers(4, 32)))))
            n += 1
        for o in e.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        for _ in range(min(2, len(live))):  # mid-speculation: between a verify and the next
            rid = live.pop(int(rng.integers(len(live))))
            e.abort(rid)
            aborted += 1
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().spec_num_draft_tokens > 0
    assert e.speculator.draft.runner.num_pages == e.num_pages  # one page table
    assert_idle(e)


# ---- the policy ------------------------------------------------------------------


def test_policy_turns_k_off_as_the_batch_grows_without_recompiling(tiny_parts, draft_parts):
    # A fake device: flat (bandwidth-bound) up to 8 tokens, then linear; drafting is cheap.
    policy = SpecPolicy(3, method="draft", cost_fn=lambda T: 1.0 + max(0, T - 8) / 8,
                        draft_cost_fn=lambda rows: 0.02)
    llm = LLM(compilation_cache_dir=XLA_CACHE, num_pages=256, page_size=8, max_num_seqs=12,
              max_num_batched_tokens=32, spec_policy=policy, draft_parts=draft_parts,
              speculative_config=dict(method="draft", model="tiny-noisy",
                                      num_speculative_tokens=3), **tiny_parts)
    e = llm.engine
    e.warmup()  # every step program of both models
    llm.generate(PROMPTS[:2], greedy(8))  # first use of anything else (e.g. fresh host state)
    compiled = (e.num_compilations, e.speculator.draft.runner.num_compilations)

    def ks_while_decoding(num_requests):
        rng = np.random.default_rng(num_requests)
        for _ in range(num_requests):
            e.add_request(None, list(map(int, rng.integers(2, 256, 8))), greedy(40))
        seen = []
        while e.has_unfinished_requests():
            e.step()
            decoding = sum(1 for r in e.scheduler.running
                           if r.num_tokens - r.num_computed_tokens <= 1)
            seen.append((decoding, e.speculator.k))
        return seen

    small = ks_while_decoding(1)
    assert all(k > 0 for rows, k in small if rows == 1)
    big = ks_while_decoding(12)
    assert any(rows == 12 for rows, k in big)
    assert all(k == 0 for rows, k in big if rows >= 10), big
    again = ks_while_decoding(1)
    assert all(k > 0 for rows, k in again if rows == 1)
    assert (e.num_compilations, e.speculator.draft.runner.num_compilations) == compiled
    assert_idle(e)
