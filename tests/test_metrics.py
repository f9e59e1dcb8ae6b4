"""``jaxserve.metrics.ServingMetrics`` fed hand-made ``EngineStats`` snapshots:
gauges take the snapshot's value, counters advance by the change since the
previous snapshot (the speculation ones included)."""

from __future__ import annotations

from jaxserve.engine.engine import EngineStats
from jaxserve.metrics import ServingMetrics


def stats(**kw) -> EngineStats:
    base = dict(num_running=2, num_waiting=1, pages_total=100, pages_used=10, pages_free=90,
                pages_cached=0, prefix_cache_queries=0, prefix_cache_hits=0,
                prefix_cache_hit_rate=0.0, num_preemptions=0, prompt_tokens=50,
                generation_tokens=20, num_steps=5)
    return EngineStats(**{**base, **kw})


def test_speculation_counters_advance_by_the_delta():
    m = ServingMetrics()
    v = lambda name, **labels: m.registry.get_sample_value(name, labels)
    m.observe_stats(stats())  # speculation off: zeros, no per-position series
    assert v("jaxserve_spec_decode_num_drafts_total") == 0
    assert v("jaxserve_spec_decode_num_draft_tokens_total") == 0
    assert v("jaxserve_spec_decode_num_accepted_tokens_total") == 0
    assert v("jaxserve_spec_decode_k") == 0
    assert "jaxserve_spec_decode_num_accepted_tokens_per_pos_total{" not in m.render().decode()

    m.observe_stats(stats(spec_num_drafts=4, spec_num_draft_tokens=12,
                          spec_num_accepted_tokens=7, spec_accepted_per_position=(4, 2, 1),
                          spec_mean_acceptance_length=2.75, spec_k=3))
    assert v("jaxserve_spec_decode_num_drafts_total") == 4
    assert v("jaxserve_spec_decode_num_draft_tokens_total") == 12
    assert v("jaxserve_spec_decode_num_accepted_tokens_total") == 7
    assert [v("jaxserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
            for j in range(3)] == [4, 2, 1]
    assert v("jaxserve_spec_decode_k") == 3

    m.observe_stats(stats(spec_num_drafts=10, spec_num_draft_tokens=27,
                          spec_num_accepted_tokens=16, spec_accepted_per_position=(9, 5, 2),
                          spec_mean_acceptance_length=2.6, spec_k=1, generation_tokens=45))
    assert v("jaxserve_spec_decode_num_drafts_total") == 10
    assert v("jaxserve_spec_decode_num_draft_tokens_total") == 27
    assert v("jaxserve_spec_decode_num_accepted_tokens_total") == 16
    assert [v("jaxserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
            for j in range(3)] == [9, 5, 2]
    assert v("jaxserve_spec_decode_k") == 1  # a gauge: the latest choice, even when lower
    assert v("jaxserve_generation_tokens_total") == 45  # the other totals as before

    m.observe_stats(stats(spec_num_drafts=10, spec_num_draft_tokens=27,
                          spec_num_accepted_tokens=16, spec_accepted_per_position=(9, 5, 2),
                          spec_k=0, generation_tokens=45))  # no new drafts: counters hold
    assert v("jaxserve_spec_decode_num_draft_tokens_total") == 27
    assert v("jaxserve_spec_decode_num_accepted_tokens_per_pos_total", position="2") == 2
    assert v("jaxserve_spec_decode_k") == 0
