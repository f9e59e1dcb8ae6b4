"""Token constraints and logit_bias through the engine on the tiny random
Llama (vocab 256, EOS 1): greedy under a mask is the argmax over the allowed
ids of the model's own logits (``Engine.prompt_logits``); logit_bias +100
forces a token and -100 bans it; plain rows batched with constrained ones get
exactly their tokens alone, and nothing compiles after warm-up; async
scheduling on and off agree (steps after a constrained row run synchronously);
a constraint that completes ends the sequence with "stop", one that rejects
its token ends it too; forced tokens ride as free drafts (fewer steps, the
same tokens); preemption does not advance a constraint twice; speculation
leaves constrained rows undrafted and exact; no page leaks.

The constraints here are test-local ``TokenConstraint``s, installed by
replacing the engine's ``ConstraintFactory.build`` (the grammar backend is
another module's): a request whose params need a mask gets ``make(params)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import XLA_CACHE

from jaxserve import LLM, SamplingParams
from jaxserve.engine.token_mask import pack_token_ids
from jaxserve.engine.spec_policy import ForcedDraftPolicy

VOCAB = 256
RNG = np.random.default_rng(5)
PROMPTS = [list(map(int, RNG.integers(2, VOCAB, n))) for n in (5, 11, 3, 17, 8, 25, 9)]
ALLOWED = [5, 17, 42, 99, 200, 201]


class AllowedIds:
    """Only ``ids`` may be sampled; records every token it is advanced with."""

    def __init__(self, ids):
        self.ids = set(ids)
        self.row = pack_token_ids(sorted(self.ids), VOCAB)
        self.taken: list[int] = []

    def fill(self, row):
        row &= self.row

    def advance(self, tok):
        self.taken.append(tok)
        return tok in self.ids

    def rollback(self, n):
        del self.taken[len(self.taken) - n:]

    def forced_tokens(self):
        return []

    @property
    def is_done(self):
        return False


class Template(AllowedIds):
    """Output position i allows ``sets[i]``; then done (allows nothing but
    EOS 1). Runs of one-token sets are forced tokens."""

    def __init__(self, sets):
        super().__init__(set().union(*sets))
        self.sets = [sorted(x) for x in sets]

    def fill(self, row):
        n = len(self.taken)
        row &= pack_token_ids(self.sets[n] if n < len(self.sets) else [1], VOCAB)

    def advance(self, tok):
        n = len(self.taken)
        self.taken.append(tok)
        return n < len(self.sets) and tok in self.sets[n]

    def forced_tokens(self):
        out = []
        for x in self.sets[len(self.taken):]:
            if len(x) != 1:
                break
            out.append(x[0])
        return out

    @property
    def is_done(self):
        return len(self.taken) == len(self.sets)


def Forced(seq):
    """Exactly ``seq``, then done."""
    return Template([[t] for t in seq])


class Nothing(AllowedIds):
    """Allows no token at all (its row is all zeros)."""

    def fill(self, row):
        row[:] = 0


def install(llm, make):
    """Constrained requests of ``llm`` get ``make(params)``; returns the list
    of constraints built, in order."""
    built = []

    def build(params, eos):
        if not params.has_token_mask:
            return None
        built.append(make(params))
        return built[-1]
    llm.engine._intake.constraints.build = build
    return built


def by_allowed(params):
    """``allowed_token_ids`` [0] means the ``TEMPLATE`` (forced runs), others
    an ``AllowedIds`` of them."""
    if params.allowed_token_ids == [0]:
        return Template(TEMPLATE)
    return AllowedIds(params.allowed_token_ids)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(engine):
    assert engine.num_free_pages == engine.num_pages
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(tiny_parts):
    out = LLM(num_pages=128, page_size=8, max_num_seqs=8, max_num_batched_tokens=32,
              compilation_cache_dir=XLA_CACHE, **tiny_parts)
    # Steps of any size cost the same: forced drafts always pay, whatever
    # this machine's step times (ForcedDraftPolicy's own tests price them).
    out.engine.set_forced_draft_policy(ForcedDraftPolicy(cost_fn=lambda t: 1.0))
    return out


def set_async(llm, on):
    e = llm.engine
    e.config = dataclasses.replace(e.config, async_scheduling=on)
    e.reset_prefix_cache()


def test_greedy_under_a_mask_is_the_argmax_over_allowed_ids(llm):
    built = install(llm, by_allowed)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]],
                        greedy(8, allowed_token_ids=ALLOWED))
    for p, toks, c in zip(PROMPTS, tokens(outs), built):
        assert len(toks) == 8 and set(toks) <= set(ALLOWED)
        logits = llm.engine.prompt_logits(p + toks[:-1])[len(p) - 1:]
        assert toks == [ALLOWED[int(np.argmax(row[ALLOWED]))] for row in logits]
        assert c.taken == toks  # advanced once per kept token
    plain = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy(8)))
    assert any(not set(t) <= set(ALLOWED) for t in plain)  # the mask did something
    assert_idle(llm.engine)


def test_logit_bias_forces_and_bans(llm):
    p = {"prompt_token_ids": PROMPTS[1]}
    ref = tokens(llm.generate([p], greedy(6)))[0]
    assert tokens(llm.generate([p], greedy(6, logit_bias={77: 100.0})))[0] == [77] * 6
    first = tokens(llm.generate([p], greedy(1, logit_bias={ref[0]: -100.0})))[0][0]
    row = np.array(llm.engine.prompt_logits(PROMPTS[1])[-1])
    row[ref[0]] -= 100.0
    assert first != ref[0] and first == int(np.argmax(row))
    assert_idle(llm.engine)


def _mixed_params():
    """(plain params, constrained params): seeded and greedy of each."""
    plain = [greedy(10), SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True),
             greedy(7, logprobs=2)]
    constrained = [greedy(9, allowed_token_ids=ALLOWED),
                   SamplingParams(max_tokens=9, temperature=1.0, seed=4, ignore_eos=True,
                                  allowed_token_ids=ALLOWED[:3], logit_bias={5: 3.0}),
                   greedy(9, logit_bias={40: 100.0}), greedy(30, allowed_token_ids=[0])]
    return plain, constrained


@pytest.mark.parametrize("async_on", [True, False])
def test_plain_rows_unchanged_beside_constrained_ones_and_nothing_compiles(llm, async_on):
    install(llm, by_allowed)
    set_async(llm, async_on)
    e = llm.engine
    e.warmup()
    plain, constrained = _mixed_params()
    plain_prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    alone = tokens(llm.generate(plain_prompts, plain))
    before = e.num_compilations
    forced = e.stats().num_forced_tokens
    outs = llm.generate(plain_prompts + [{"prompt_token_ids": p} for p in PROMPTS[3:]],
                        plain + constrained)
    assert e.num_compilations == before, "a constrained row compiled a program"
    got = tokens(outs)
    assert got[:3] == alone
    assert set(got[3]) <= set(ALLOWED) and set(got[4]) <= set(ALLOWED[:3])
    assert got[5] == [40] * 9
    assert len(got[6]) == len(TEMPLATE) and e.stats().num_forced_tokens > forced
    set_async(llm, True)
    assert_idle(e)


def test_async_on_and_off_agree_and_constrained_steps_overlap(llm):
    install(llm, by_allowed)
    plain, constrained = _mixed_params()
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for on in (False, True):
        set_async(llm, on)
        runs[on] = tokens(llm.generate(prompts, plain + constrained))
        assert_idle(llm.engine)
    assert runs[True] == runs[False]
    # Constrained rows overlap too: the next step's model is launched before
    # this step's tokens are read, its masks filled after (deferred sampling).
    e = llm.engine

    def overlaps(params):
        for i, p in enumerate(params):
            e.add_request(f"ov{i}", PROMPTS[i], p)
        seen = []
        while e.has_unfinished_requests():
            e.step()
            seen.append(e.last_step.overlapped)
        return seen
    assert overlaps([greedy(6, allowed_token_ids=ALLOWED)] * 2) == [True] * 5 + [False]
    assert overlaps([greedy(6)] * 2) == [True] * 5 + [False]
    # A forced run ahead: the step whose token starts it is synchronous, so
    # the next plan drafts the rest from the host's state (5 steps, 6 tokens).
    built = install(llm, lambda p: Template([[5, 17]] * 3 + [[42]] * 3))
    assert overlaps([greedy(6, allowed_token_ids=ALLOWED)] * 2) == [True] * 3 + [False] * 2
    for c in built:  # each mask was the constraint's own at its position
        assert set(c.taken[:3]) <= {5, 17} and c.taken[3:] == [42] * 3
    assert_idle(e)


def test_a_completed_constraint_ends_with_stop(llm):
    install(llm, lambda p: Forced(p.allowed_token_ids))
    seq = [10, 11, 12, 200]
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       greedy(20, allowed_token_ids=seq))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (seq, "stop")  # no EOS step after it
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       greedy(2, allowed_token_ids=seq))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (seq[:2], "length")
    assert_idle(llm.engine)


def test_a_row_allowing_nothing_samples_unmasked_and_ends(llm):
    install(llm, lambda p: Nothing(p.allowed_token_ids))
    ref = tokens(llm.generate([{"prompt_token_ids": PROMPTS[2]}], greedy(5)))[0]
    out = llm.generate([{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[1]}],
                       [greedy(5, allowed_token_ids=[3], logprobs=1), greedy(5)])
    c = out[0].outputs[0]
    assert (c.token_ids, c.finish_reason) == (ref[:1], "stop")
    assert all(np.isfinite(lp.logprob) for d in c.logprobs for lp in d.values())
    assert len(out[1].outputs[0].token_ids) == 5
    assert_idle(llm.engine)


def test_intake_checks_token_ids_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match="logit_bias: token id 256 is outside"):
        llm.engine.add_request(None, PROMPTS[0], greedy(2, logit_bias={256: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids: token id 300 is outside"):
        llm.engine.add_request(None, PROMPTS[0], greedy(2, allowed_token_ids=[3, 300]))
    assert not llm.engine.has_unfinished_requests()


def test_preemption_keeps_each_constraint_advanced_once(tiny_parts):
    # 14 pages of 8 tokens: six sequences of up to 25 + 24 tokens preempt each other.
    small = LLM(page_size=8, num_pages=14, compilation_cache_dir=XLA_CACHE, **tiny_parts)
    big = LLM(page_size=8, num_pages=128, compilation_cache_dir=XLA_CACHE, **tiny_parts)
    runs = {}
    for name, m in (("small", small), ("big", big)):
        built = install(m, by_allowed)
        outs = m.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]],
                          [greedy(24, allowed_token_ids=ALLOWED), greedy(24)] * 3)
        runs[name] = tokens(outs)
        for c, o in zip(built, outs[::2]):
            assert c.taken == o.outputs[0].token_ids
        assert_idle(m.engine)
    assert small.engine.stats().num_preemptions > 0
    assert runs["small"] == runs["big"]


def test_speculation_skips_constrained_rows_and_stays_exact(tiny_parts):
    spec = LLM(num_pages=256, page_size=8, compilation_cache_dir=XLA_CACHE,
               speculative_config=dict(method="ngram", num_speculative_tokens=4,
                                       adaptive=False), **tiny_parts)
    motif = [list(map(int, RNG.integers(2, VOCAB, 6))) * 3 for _ in range(4)]
    # A biased row repeats 77 (ngram drafts it, its slots carry the bias); a
    # row constrained to {77, 78} would be drafted alike, but is not.
    params = [greedy(20), greedy(20, logit_bias={77: 100.0}),
              greedy(20, allowed_token_ids=[77, 78], logit_bias={77: 100.0}),
              greedy(20, allowed_token_ids=sorted(set(motif[3])))]
    prompts = [{"prompt_token_ids": m} for m in motif]
    e = spec.engine
    built = install(spec, by_allowed)
    outs = spec.generate(prompts, params)
    got = tokens(outs)
    saved = e.speculator
    e.speculator = e._steps.speculator = None
    try:
        ref = tokens(spec.generate(prompts, params))
    finally:
        e.speculator = e._steps.speculator = saved
    assert got == ref and got[1] == got[2] == [77] * 20
    assert outs[1].metrics.num_accepted_tokens > 0
    assert outs[2].metrics.num_draft_tokens == outs[3].metrics.num_draft_tokens == 0
    assert built[0].taken == got[2] and built[1].taken == got[3]
    assert set(got[3]) <= set(motif[3])
    assert_idle(e)


# A schema-like template: runs of forced tokens between free positions.
TEMPLATE = [[10], [11], [12], ALLOWED, [13], [14], ALLOWED, ALLOWED, [15], [16], [17], [18],
            [19], [20], [21], [22], [23], [24], ALLOWED, [25]]


def set_max_forced(monkeypatch, engine, k: int) -> None:
    """``SchedulerConfig.max_forced_drafts`` = k for this test."""
    monkeypatch.setattr(engine.scheduler, "config", dataclasses.replace(
        engine.scheduler.config, max_forced_drafts=k))


def _template_run(llm, monkeypatch, max_forced):
    set_max_forced(monkeypatch, llm.engine, max_forced)
    built = install(llm, lambda p: Template(TEMPLATE))
    e = llm.engine
    steps, forced = e.stats().num_steps, e.stats().num_forced_tokens
    params = [greedy(30, allowed_token_ids=[0]), greedy(4),
              SamplingParams(max_tokens=30, temperature=1.0, seed=9, ignore_eos=True,
                             allowed_token_ids=[0]),
              SamplingParams(max_tokens=4, temperature=1.0, seed=9, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params)
    for c, o in zip(built, outs[::2]):
        assert c.taken == o.outputs[0].token_ids
    assert_idle(e)
    return outs, e.stats().num_steps - steps, e.stats().num_forced_tokens - forced


def test_forced_tokens_ride_as_drafts_same_tokens_fewer_steps(llm, monkeypatch):
    ref, ref_steps, ref_forced = _template_run(llm, monkeypatch, 0)
    got, got_steps, got_forced = _template_run(llm, monkeypatch, 8)
    assert tokens(got) == tokens(ref) and ref_forced == 0
    for o in got[::2]:
        c = o.outputs[0]
        assert len(c.token_ids) == len(TEMPLATE) and c.finish_reason == "stop"
        assert all(t in x for t, x in zip(c.token_ids, TEMPLATE))
    # 16 of each 20 tokens are forced: the first is sampled at the prefill, and
    # the one after a run of 8 drafts in the run's bonus slot; the rest ride
    # as drafts (up to 9 tokens a step instead of one). With async scheduling
    # a run after a free token is seen one step late (the step after the free
    # token was launched before it was known): 9 steps here, 8 synchronously.
    assert 2 * 12 <= got_forced <= 2 * 14, got_forced
    assert ref_steps == 20 and got_steps <= 9, (got_steps, ref_steps)
    assert [len(o.outputs[0].token_ids) for o in got[1::2]] == [4, 4]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_forced_drafts_in_a_speculating_engine(tiny_parts, method):
    # method "draft": a draft model with the target's own weights
    extra = dict(model="tiny-same") if method == "draft" else {}
    spec = LLM(num_pages=256, page_size=8, compilation_cache_dir=XLA_CACHE,
               speculative_config=dict(method=method, num_speculative_tokens=4,
                                       adaptive=False, **extra),
               draft_parts=tiny_parts if method == "draft" else None, **tiny_parts)
    e = spec.engine
    # Forced runs ride as drafts whatever this machine's step times say (as ``llm``'s).
    e.set_forced_draft_policy(ForcedDraftPolicy(cost_fn=lambda t: 1.0))
    install(spec, lambda p: Template(TEMPLATE))
    params = [greedy(30, allowed_token_ids=[0]), greedy(16, logit_bias={77: 100.0})]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    outs = spec.generate(prompts, params)
    got = tokens(outs)
    st = e.stats()
    assert st.num_forced_tokens >= 12 and st.spec_num_accepted_tokens > 0
    # the speculation statistics count the proposer's drafts only
    assert outs[0].metrics.num_draft_tokens == 0
    assert st.spec_num_draft_tokens == outs[1].metrics.num_draft_tokens
    saved = e.speculator
    e.speculator = e._steps.speculator = None
    old = e.scheduler.config
    try:
        e.scheduler.config = dataclasses.replace(old, max_forced_drafts=0)
        ref = tokens(spec.generate(prompts, params))
    finally:
        e.speculator = e._steps.speculator = saved
        e.scheduler.config = old
    assert got == ref and got[1] == [77] * 16
    assert_idle(e)


def test_constraints_built_off_the_engine_thread(llm):
    import threading
    built = install(llm, by_allowed)
    e = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2,
                            allowed_token_ids=ALLOWED)
    got = []
    t = threading.Thread(target=lambda: got.append(e.build_constraints(params)))
    t.start()
    t.join()
    cs = got[0]
    assert len(cs) == 2 and cs[0] is not cs[1] and len(built) == 2
    assert e.build_constraints(greedy(4)) == [None]
    with pytest.raises(ValueError, match="1 constraints for a request of n=2"):
        e.add_request(None, PROMPTS[0], params, constraints=cs[:1])
    rid = e.add_request(None, PROMPTS[0], params, constraints=cs)
    assert len(built) == 2  # used as given, not built again
    last = None
    while e.has_unfinished_requests():
        for o in e.step():
            if o.request_id == rid:
                last = o
    assert last.finished
    for c, comp in zip(cs, last.outputs):
        assert len(comp.token_ids) == 4 and set(comp.token_ids) <= set(ALLOWED)
        assert c.taken == comp.token_ids
    assert_idle(e)


class Claims(Template):
    """A ``Template`` whose ``forced_tokens`` claim each position's first id
    even where another is allowed too (as a grammar allowing two
    tokenizations of its forced text): such drafts can be refused."""

    def forced_tokens(self):
        return [x[0] for x in self.sets[len(self.taken):len(self.taken) + 3]]


def test_refused_forced_drafts_keep_the_models_token(llm, monkeypatch):
    sets = [[10], [11, 12], [13, 14], [15], [16, 17], [18, 19], [20, 21], [22], [23, 24]] * 2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    params = [greedy(30, allowed_token_ids=[0]),
              SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True,
                             allowed_token_ids=[0])] * 2
    runs = {}
    for k in (0, 8):
        set_max_forced(monkeypatch, llm.engine, k)
        built = install(llm, lambda p: Claims(sets))
        runs[k] = tokens(llm.generate(prompts, params))
        for c, t in zip(built, runs[k]):
            assert c.taken == t and len(t) == len(sets)
        assert_idle(llm.engine)
    assert runs[8] == runs[0]
    # some outputs take a position's second id: a claimed draft was refused there
    assert any(t != x[0] for out in runs[8] for t, x in zip(out, sets))
