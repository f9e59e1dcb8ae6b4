"""Speculative decoding host units: the n-gram proposer against hand-worked
cases and a pure-Python reference, SpecStats' figures, and SpecPolicy's
choice of k under a fake roofline cost (flat to 16 tokens, then linear) and
under the cost it learns from step timings."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxserve.engine.shapes import bucket
from jaxserve.engine.spec_decode import SpecStats, ngram_propose
from jaxserve.engine.spec_policy import SpecPolicy


def ref_propose(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, directly: longest n first, earliest start first."""
    L = len(seq)
    if k == 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = seq[L - n:]
        for s in range(L - n):  # the copy ends at s + n - 1 <= L - 2
            if seq[s:s + n] == suffix:
                return seq[s + n:s + n + k]
    return []


def one(seq, k, min_n, max_n):
    return ngram_propose([seq], [k], min_n, max_n)[0]


# -- ngram_propose -----------------------------------------------------------

def test_ngram_longest_match_wins():
    seq = [2, 3, 7, 1, 2, 3, 9, 1, 2, 3]
    assert one(seq, 3, 2, 3) == [9, 1, 2]  # [1, 2, 3] at 3
    assert one(seq, 3, 2, 2) == [7, 1, 2]  # [2, 3] first at 0


def test_ngram_earliest_occurrence_of_the_longest():
    seq = [6, 9, 5, 6, 100, 5, 6, 200, 5, 6]
    assert one(seq, 2, 2, 2) == [100, 5]  # [5, 6] at 2, 5 and 8: the first
    assert one(seq, 2, 1, 1) == [9, 5]  # token 6 first at 0
    assert one(seq, 2, 1, 3) == [100, 5]  # [200, 5, 6] never repeats: n = 2


def test_ngram_min_and_max_n_bounds():
    seq = [1, 2, 3, 4, 1, 2, 3]
    assert one(seq, 2, 4, 4) == []  # no earlier 4-gram
    assert one(seq, 2, 3, 4) == [4, 1]
    # Only the last max_n ids form the suffix: the 4-gram's copy is at 5,
    # the 3-gram's earliest at 1.
    seq = [9, 2, 3, 4, 6, 1, 2, 3, 4, 5, 1, 2, 3, 4]
    assert one(seq, 2, 1, 4) == [5, 1]
    assert one(seq, 2, 1, 3) == [6, 1]
    assert one(seq, 2, 4, 9) == [5, 1]


def test_ngram_truncation_overlap_and_empty():
    assert one([1, 2, 3, 1, 2], 5, 1, 2) == [3, 1, 2]  # the sequence ends first
    assert one([1, 1, 1, 1], 4, 1, 3) == [1]  # copy [0..2] overlaps the suffix
    assert one([1, 2, 3, 4, 1, 2, 3], 0, 1, 3) == []
    assert one([1, 2, 3, 4, 5], 3, 1, 3) == []
    assert one([], 3, 1, 3) == []
    assert one([7], 3, 1, 3) == []
    assert one([7, 7], 3, 1, 3) == [7]
    assert one([7, 7], 3, 2, 3) == []  # a 2-gram needs 3 ids to repeat


def test_ngram_batch_mixes_arrays_lists_and_num_tokens():
    seqs = [np.array([1, 2, 3, 4, 1, 2, 3], np.int32), [1, 2, 3, 4, 1, 2, 3],
            np.array([5, 6, 5], np.int64), [8, 9]]
    assert ngram_propose(seqs, [3, 1, 2, 2], 1, 3) == [[4, 1, 2], [4], [6, 5], []]
    out = ngram_propose(seqs[:1], [2], 1, 3)
    assert all(type(t) is int for t in out[0])


def test_ngram_matches_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    seqs, ks, cases = [], [], []
    for _ in range(200):
        seq = rng.integers(0, int(rng.integers(2, 5)), int(rng.integers(0, 60))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(0, 7))
        cases.append((seq, k, min_n, max_n))
        assert one(seq, k, min_n, max_n) == ref_propose(seq, k, min_n, max_n), (seq, k, min_n,
                                                                                 max_n)
        seqs.append(seq)
        ks.append(k)
    # One batch of all 200 at (1, 3) gives the same as one at a time.
    assert ngram_propose(seqs, ks, 1, 3) == [ref_propose(s, k, 1, 3) for s, k in zip(seqs, ks)]
    assert sum(bool(ref_propose(*c)) for c in cases) > 100  # most cases do propose


def test_ngram_errors():
    with pytest.raises(ValueError, match="min_n"):
        ngram_propose([[1, 2]], [1], 0, 2)
    with pytest.raises(ValueError, match="max_n"):
        ngram_propose([[1, 2]], [1], 3, 2)
    with pytest.raises(ValueError, match="2 sequences but 1"):
        ngram_propose([[1, 2], [3]], [1], 1, 2)
    with pytest.raises(ValueError, match=r"num_tokens\[1\] must be >= 0, got -1"):
        ngram_propose([[1, 2], [3]], [1, -1], 1, 2)
    with pytest.raises(ValueError, match="1-D"):
        ngram_propose([np.zeros((2, 2), np.int32)], [1], 1, 2)


def test_ngram_64_sequences_of_2000_ids_is_fast():
    rng = np.random.default_rng(1)
    seqs = []
    for _ in range(64):
        ids = rng.integers(0, 32000, 2000).astype(np.int32)
        ids[1500:] = ids[200:700]  # a copied span, so every row proposes
        seqs.append(ids)
    drafts = ngram_propose(seqs, [4] * 64, 1, 5)
    assert drafts == [s[700:704].tolist() for s in seqs]
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        ngram_propose(seqs, [4] * 64, 1, 5)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.05  # ~0.7 ms on a 2-core EPYC; 50 ms leaves room for a busy CI box


# -- SpecStats ---------------------------------------------------------------

def test_spec_stats_figures():
    s = SpecStats(4)
    assert (s.acceptance_rate, s.mean_acceptance_length) == (0.0, 0.0)
    assert s.per_position_acceptance_rate() == [0.0] * 4
    for drafted, accepted in [(4, 4), (4, 1), (2, 0), (0, 0), (3, 2)]:
        s.record(drafted, accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 13, 7)
    assert s.accepted_per_position == [3, 2, 1, 1]
    assert s.drafted_per_position == [4, 4, 3, 2]
    assert s.acceptance_rate == 7 / 13
    assert s.mean_acceptance_length == 1 + 7 / 4
    assert s.per_position_acceptance_rate() == [3 / 4, 2 / 4, 1 / 3, 1 / 2]


def test_spec_stats_errors():
    with pytest.raises(ValueError, match="max_k"):
        SpecStats(0)
    s = SpecStats(4)
    for bad in [(5, 0), (2, 3), (-1, 0), (1, -1)]:
        with pytest.raises(ValueError, match="num_accepted"):
            s.record(*bad)
    assert s.num_drafts == 0


# -- SpecPolicy ----------------------------------------------------------------

def roofline(T: int) -> float:
    """Fake target step seconds: flat (bandwidth-bound) to 16 tokens, then
    linear (compute-bound)."""
    return 1.0 + max(0, T - 16) / 16


def feed(policy, rate, rows, *, seed=0, shadow=False):
    """``rows`` rows of max_k drafts, each position accepted with probability
    ``rate`` given the previous ones were."""
    rng = np.random.default_rng(seed)
    observe = policy.observe_shadow if shadow else policy.observe_acceptance
    for _ in range(rows):
        accepted = 0
        while accepted < policy.max_k and rng.random() < rate:
            accepted += 1
        observe(policy.max_k, accepted)


def best_gain(policy, rows):
    tps0 = policy.tokens_per_second(0, rows)
    return max(policy.tokens_per_second(k, rows) for k in range(1, policy.max_k + 1)) / tps0


def test_expected_tokens_are_leviathan_sums():
    p = SpecPolicy(3, method="ngram", cost_fn=roofline, prior_acceptance=0.5)
    assert p.acceptance == [0.5, 0.5, 0.5]
    assert [p.expected_accepted(k) for k in range(4)] == [0.0, 0.5, 0.75, 0.875]
    # 2 rows at k = 2: 6 tokens cost 1.0 and yield 2 * 1.75 tokens.
    assert p.tokens_per_second(2, 2) == 3.5
    assert p.tokens_per_second(2, 2, num_other_tokens=26) == 3.5 / 2.0
    # One row verified with 0 drafts is a rejection at position 0; (3, 1)
    # tests positions 0 and 1: (a + 4p) / (n + 4).
    p.observe_acceptance(0, 0)
    p.observe_acceptance(3, 1)
    f = 1 - 1 / 256
    assert p.acceptance == pytest.approx([(1 + 2) / (f + 1 + 4), 2 / 5, 0.5])


def test_k_falls_as_rows_grow_and_returns():
    p = SpecPolicy(4, method="ngram", cost_fn=roofline)
    feed(p, 0.8, 2000)
    assert p.acceptance == pytest.approx([0.8] * 4, abs=0.03)
    rows = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64]
    ks = [p.choose_k(r) for r in rows]
    assert ks == [4, 4, 4, 3, 2, 2, 1, 1, 1, 0, 0, 0, 0]
    assert p.choose_k(1) == 4 and p.k == 4
    assert p.choose_k(0) == 0 and p.k == 0 and p.speculating  # no rows: state kept


def test_hysteresis_band():
    p = SpecPolicy(4, method="ngram", cost_fn=roofline)
    feed(p, 0.8, 2000)
    assert 1.0 <= best_gain(p, 14) < p.min_gain  # 14 rows: k = 1, 28 tokens, gain ~1.02
    assert p.choose_k(8) == 1
    assert p.choose_k(14) == 1  # on: stays on
    assert p.choose_k(32) == 0
    assert p.choose_k(14) == 0  # off: stays off
    assert p.choose_k(12) == 1  # gain 1.19 switches it on again


def test_low_acceptance_off_and_shadow_brings_it_back():
    p = SpecPolicy(4, method="ngram", cost_fn=roofline)
    feed(p, 0.02, 4000)
    # At one row the cost is flat, so any acceptance gains: 2% gains ~2.5%,
    # under min_gain (5% would gain ~5.3% and rightly switch on).
    assert 1.0 < best_gain(p, 1) < p.min_gain
    assert p.choose_k(1) == 0
    feed(p, 0.9, 300, seed=1, shadow=True)
    assert p.acceptance[0] > 0.6
    assert p.choose_k(1) == 4


def test_draft_that_never_pays_stays_off():
    # A draft token costs a whole target step: at best (all accepted) k
    # drafts buy k tokens for k steps, gain 1.0 < min_gain.
    p = SpecPolicy(4, method="draft", cost_fn=roofline, draft_cost_fn=lambda rows: 1.0)
    feed(p, 1.0, 500)
    assert best_gain(p, 1) == pytest.approx(1.0, abs=0.02)
    assert [p.choose_k(r) for r in [1, 2, 4, 8, 16, 64] for _ in range(100)] == [0] * 600


def test_draft_off_decays_toward_prior_and_probes_again():
    p = SpecPolicy(4, method="draft", cost_fn=lambda T: 1.0, draft_cost_fn=lambda rows: 0.05)
    feed(p, 0.0, 2000)
    calls = 0
    while p.choose_k(1) == 0:
        calls += 1
        assert calls < 1000
    assert 100 < calls < 400  # slowly: 0.99 per call, ~225 calls here
    assert p.k >= 1
    rejected = 0
    while p.choose_k(1):  # the probe still sees nothing accepted: off again
        p.observe_acceptance(p.k, 0)
        rejected += 1
    assert 0 < rejected < 100


def test_learned_cost_matches_given_cost():
    def device_seconds(T):  # a step costs what its padded program costs
        return 0.01 * roofline(bucket(T))

    given = SpecPolicy(4, method="ngram", cost_fn=device_seconds)
    learned = SpecPolicy(4, method="ngram")
    for T in list(range(1, 257)) * 3:  # every bucket trusted (>= 3 samples)
        learned.observe_step(T, device_seconds(T))
    for p in (given, learned):
        feed(p, 0.8, 2000)
    rows = list(range(1, 41)) + list(range(40, 0, -1))
    ks = [given.choose_k(r) for r in rows]
    assert [learned.choose_k(r) for r in rows] == ks
    assert ks[0] == 4 and 0 in ks
    assert learned.predicted_cost(100) == device_seconds(100) == 0.01 * roofline(112)


def test_learned_cost_explores_both_options():
    p = SpecPolicy(4, method="ngram")
    assert p.choose_k(64) == 4  # no data: cost flat in T, speculation tried
    p.observe_step(5, 1.0)  # one row at k = 4 seen; k = 0's 1 token not yet
    assert p.predicted_cost(1) == pytest.approx(0.2)  # below the data: proportional
    assert p.predicted_cost(500) == 1.0  # above the data: flat
    assert p.choose_k(1) == 0  # so k = 0 gets measured ...
    p.observe_step(1, 1.0)  # ... and costs the same (bandwidth-bound)
    assert p.choose_k(1) == 4


def test_one_slow_sample_does_not_price_speculation_out():
    p = SpecPolicy(3, method="ngram")
    feed(p, 0.9, 200)
    for _ in range(20):
        p.observe_step(1, 0.035)
    p.observe_step(4, 0.14)  # one stray slow verification step (seen on SmolLM2)
    assert p.predicted_cost(4) == 0.035 and p.choose_k(1) == 3  # so it is measured again
    for _ in range(3):
        p.observe_step(4, 0.14)  # truly slow: trusted after 3 samples
    assert p.predicted_cost(4) == pytest.approx(0.14) and p.choose_k(1) == 0


def test_learned_cost_is_monotone_and_robust():
    p = SpecPolicy(2, method="ngram")
    p.observe_step(8, 2.0)
    p.observe_step(16, 1.0)  # fewer seconds for more tokens: pooled
    assert p.predicted_cost(8) == p.predicted_cost(16) == 1.5
    p.observe_step(32, 4.0)
    assert p.predicted_cost(24) == 1.5 + 2.5 * (24 - 16) / 16  # linear between buckets
    for _ in range(10):
        p.observe_step(32, 4.0)
    p.observe_step(32, 400.0)  # a stray slow step moves the bucket by <= 1/8
    assert p.predicted_cost(32) == 4.0 + (8.0 - 4.0) / 8
    for T in range(1, 300, 7):
        assert p.predicted_cost(T) <= p.predicted_cost(T + 1)


def test_learned_draft_cost():
    p = SpecPolicy(4, method="draft")
    p.observe_draft_step(4, 0.5)
    assert p.predicted_draft_cost(4) == 0.0  # no target sample yet: both optimistic
    p.observe_step(4, 1.0)
    assert p.predicted_draft_cost(4) == 0.5
    # Target flat at 1.0, each draft token half a step: k = 1 at alpha 0.7
    # gains 1.7 / 1.5 = 1.13; larger k gain less.
    assert p.choose_k(4) == 1


def test_policy_errors():
    for kwargs, name in [({"max_k": 0, "method": "ngram"}, "max_k"),
                         ({"max_k": 2.0, "method": "ngram"}, "max_k"),
                         ({"max_k": 2, "method": "eagle"}, "method"),
                         ({"max_k": 2, "method": "ngram", "prior_acceptance": 1.5},
                          "prior_acceptance"),
                         ({"max_k": 2, "method": "ngram", "min_gain": 0.9}, "min_gain"),
                         ({"max_k": 2, "method": "ngram", "cost_fn": 3.0}, "cost_fn")]:
        with pytest.raises(ValueError, match=name):
            SpecPolicy(**kwargs)
    p = SpecPolicy(2, method="ngram")
    with pytest.raises(ValueError, match="drafted=3"):
        p.observe_acceptance(3, 0)
    with pytest.raises(ValueError, match="accepted=2"):
        p.observe_shadow(1, 2)
    with pytest.raises(ValueError, match="num_tokens"):
        p.observe_step(0, 1.0)
    with pytest.raises(ValueError, match="seconds"):
        p.observe_draft_step(1, float("nan"))
    with pytest.raises(ValueError, match="num_decode_rows=-1"):
        p.choose_k(-1)
    with pytest.raises(ValueError, match="k must be in 0..2, got 3"):
        p.tokens_per_second(3, 1)


# --- forced tokens as drafts (constraints.forced_drafts) -----------------------

def test_forced_drafts_taken_while_steps_are_flat_and_dropped_when_compute_bound():
    """tps(D) = (R + D) / cost(R + D): a flat cost takes every forced token; a
    cost linear in T above 32 tokens (compute-bound there) takes none at 32
    rows, and at 30 rows the smallest cap that fills the step past the knee."""
    from jaxserve.engine.spec_policy import ForcedDraftPolicy
    flat = ForcedDraftPolicy(cost_fn=lambda t: 0.05)
    forced = {"a": [1, 2, 3, 4, 5], "b": [7, 8]}
    assert flat.choose(1, forced) == forced and flat.on
    # Cost 0.05 s up to 32 tokens, then 0.05 * T / 32.
    knee = ForcedDraftPolicy(cost_fn=lambda t: 0.05 * max(1.0, t / 32))
    rows32 = {i: [1] * 8 for i in range(32)}
    assert knee.best_cap(32, [8] * 32) == 0 and knee.choose(32, rows32) == {}
    assert not knee.on
    # 30 rows + 10 forced rows of 8: a cap of 1 gives 40 tokens for 1.25x the
    # cost (gain 1.07); larger caps gain no more.
    assert knee.best_cap(30, [8] * 10) == 1
    assert knee.choose(30, {i: [5] * 8 for i in range(10)}) == {i: [5] for i in range(10)}


def test_forced_drafts_hysteresis_and_learned_cost():
    from jaxserve.engine.spec_policy import ForcedDraftPolicy
    p = ForcedDraftPolicy(min_gain=1.2, cost_fn=lambda t: 1.0 if t <= 10 else 1.1)
    # 10 rows + 2 drafts: gain 12 / 1.1 / 10 = 1.09: below 1.2 while off ...
    assert p.best_cap(10, [2]) == 0
    p.on = True  # ... but kept once on (>= 1.0)
    assert p.best_cap(10, [2]) == 2
    with pytest.raises(ValueError, match="min_gain"):
        ForcedDraftPolicy(min_gain=0.5)
    learned = ForcedDraftPolicy()
    assert learned.predicted_cost(64) == 1.0  # before a sample: flat, drafts tried
    for _ in range(4):
        learned.observe_step(32, 0.16)
        learned.observe_step(64, 0.34)
    assert learned.predicted_cost(64) == pytest.approx(0.34)
    assert learned.best_cap(32, [1] * 32) == 0  # 64 / 0.34 < 32 / 0.16
    for _ in range(4):
        learned.observe_step(1, 0.05)
        learned.observe_step(9, 0.055)
    assert learned.best_cap(1, [8]) == 8  # 9 tokens for 1.1x the cost of 1
