"""Serving-benchmark arithmetic on synthetic timestamps (``jaxserve.bench.stats``),
arrival processes (``serving.arrival_offsets``) and workload shapes
(``workloads.make_requests``), every expected figure worked out by hand."""

import math

import numpy as np
import pytest

from jaxserve.bench import serving, stats, workloads
from jaxserve.bench.stats import RequestRecord


def rec(send, chunks, end=None, workload="chat", prompt=10, tokens=None, **kw):
    """A record sent at ``send`` whose outputs arrive at ``chunks`` (1 token each
    unless ``tokens`` says), finishing at the last one unless ``end`` says."""
    return RequestRecord("r", workload, prompt, send, chunk_times=list(chunks),
                         chunk_tokens=tokens or [1] * len(chunks),
                         end_time=chunks[-1] if end is None and chunks else end, **kw)


def test_per_request_ttft_tpot_itl_e2e():
    r = rec(10.0, [10.5, 10.7, 11.0, 11.6])
    assert r.ttft_ms == pytest.approx(500.0)
    assert r.e2e_ms == pytest.approx(1600.0)
    assert r.tpot_ms == pytest.approx((1600.0 - 500.0) / 3)  # vLLM: (E2E - TTFT) / (n - 1)
    assert r.itl_ms == pytest.approx([200.0, 300.0, 600.0])
    assert r.output_tokens == 4


def test_a_message_with_several_tokens_is_one_itl_gap():
    r = rec(0.0, [1.0, 1.5, 2.5], tokens=[1, 3, 2])  # 6 tokens in 3 messages
    assert r.output_tokens == 6
    assert r.itl_ms == pytest.approx([500.0, 1000.0])
    assert r.tpot_ms == pytest.approx((2500.0 - 1000.0) / 5)


def test_one_token_has_no_tpot_and_unfinished_is_not_ok():
    assert rec(0.0, [0.2]).tpot_ms is None
    r = rec(0.0, [0.2, 0.3], end=None)
    r.end_time = None
    assert not r.ok and r.e2e_ms is None and r.tpot_ms is None


def test_percentiles_are_numpy_linear():
    d = stats.describe([4, 1, 10, 3, 2])
    # sorted 1 2 3 4 10: p90 at rank 0.9 * 4 = 3.6 -> 4 + 0.6 * 6; p99 at 3.96 -> 4 + 0.96 * 6
    assert d == pytest.approx({"n": 5, "mean": 4.0, "p50": 3.0, "p90": 7.6, "p99": 9.76})
    assert stats.describe([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert stats.describe([None, 2.0])["n"] == 1


def test_summary_throughput_goodput_and_pooled_itl():
    records = [
        rec(0.0, [0.4, 0.6, 0.8], prompt=100),   # TTFT 400, TPOT 200, E2E 800
        rec(0.5, [1.5, 1.6, 1.7], prompt=50),    # TTFT 1000, TPOT 100, E2E 1200
        rec(1.0, [1.3], prompt=20),              # one token: TTFT 300, TPOT counted as 0
        rec(1.0, [], prompt=30, error="boom"),   # failed
    ]
    records[3].end_time = 2.0  # the failure ends last: the duration is 0 -> 2.0 s
    s = stats.summarize(records, slo={"ttft_ms": 500, "tpot_ms": 150})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["input_tokens"] == 170 and s["output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_throughput"] == pytest.approx(85.0)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(88.5)
    # good: only the one-token request (TTFT 300, TPOT 0); request 1 misses TPOT,
    # request 2 misses TTFT.
    assert s["goodput"] == pytest.approx(0.5)
    assert s["good_fraction"] == pytest.approx(1 / 3)
    assert s["ttft_ms"]["mean"] == pytest.approx((400 + 1000 + 300) / 3)
    assert s["tpot_ms"]["n"] == 2 and s["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert s["itl_ms"]["n"] == 4  # 2 + 2 + 0 gaps, pooled
    assert s["itl_ms"]["mean"] == pytest.approx((200 + 200 + 100 + 100) / 4)
    assert s["e2e_ms"]["p50"] == pytest.approx(800.0)
    # No SLO: every completed request is good.
    assert stats.summarize(records)["goodput"] == pytest.approx(1.5)
    # An E2E SLO alone.
    assert stats.summarize(records, slo={"e2e_ms": 1000})["goodput"] == pytest.approx(1.0)


def test_by_workload_uses_the_whole_level_duration():
    records = [rec(0.0, [1.0, 2.0], workload="rag"), rec(0.0, [4.0], workload="chat")]
    per = stats.by_workload(records)
    assert set(per) == {"chat", "rag"}
    assert per["rag"]["output_throughput"] == pytest.approx(2 / 4.0)


def test_parse_slo():
    assert stats.parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert stats.parse_slo(None) == {} == stats.parse_slo("")
    for bad in ("ttft=5", "ttft_ms", "tpot_ms=-1", "e2e_ms=abc", "ttft_ms=inf"):
        with pytest.raises(ValueError, match="slo"):
            stats.parse_slo(bad)


def test_arrivals_closed_loop_and_poisson():
    assert serving.arrival_offsets(3, math.inf, 0).tolist() == [0.0, 0.0, 0.0]
    a = serving.arrival_offsets(4001, 5.0, seed=1)
    assert a[0] == 0.0 and np.all(np.diff(a) > 0)
    assert np.mean(np.diff(a)) == pytest.approx(0.2, rel=0.05)  # mean gap 1 / rate
    assert np.array_equal(a, serving.arrival_offsets(4001, 5.0, seed=1))


class WordTokenizer:
    """One token per whitespace-separated word."""

    def __init__(self):
        self.vocab = {}

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def test_workload_shapes_lengths_and_prefix_sharing():
    tok = WordTokenizer()
    reqs = workloads.make_requests(tok, 0, "mixed", 12, seed=3)
    assert [r.workload for r in reqs[:4]].count("rag") == 1  # every 4 holds one of each
    assert sorted(r.workload for r in reqs) == sorted(list(workloads.SHAPES) * 3)
    for r in reqs:
        shape = workloads.SHAPES[r.workload]
        assert r.output_len == shape.output_len
        if r.workload != "shared-prefix":
            assert 0.9 * shape.input_len - 1 <= len(r.prompt_ids) <= 1.1 * shape.input_len
    shared = [r.prompt_ids for r in reqs if r.workload == "shared-prefix"]
    assert len({tuple(p[:1000]) for p in shared}) == 1  # one system prompt
    assert len({tuple(p[1000:]) for p in shared}) >= 1
    others = [r.prompt_ids for r in reqs if r.workload in ("chat", "rag", "creative")]
    assert len({tuple(p[:4]) for p in others}) == len(others)  # unique openings
    again = workloads.make_requests(tok, 0, "mixed", 12, seed=3)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]


def test_workload_scale_and_random_ids():
    reqs = workloads.make_requests(None, 50, "rag", 3, seed=0, scale=0.1)
    for r in reqs:
        assert r.output_len == 5 and 108 <= len(r.prompt_ids) <= 132
        assert all(0 <= t < 50 for t in r.prompt_ids)
    with pytest.raises(ValueError, match="workload"):
        workloads.make_requests(None, 50, "nope", 3)
    with pytest.raises(ValueError, match="scale"):
        workloads.make_requests(None, 50, "chat", 3, scale=0)


def test_client_view_of_a_sequential_run():
    from jaxserve.bench.peers import client_view
    # Served one at a time: (start, first token, end) per request.
    served = [RequestRecord(str(k), "chat", 5, start, chunk_times=[first, end],
                            chunk_tokens=[1, 1], end_time=end)
              for k, (start, first, end) in enumerate([(0, 1, 2), (2, 2.5, 3), (3, 3.2, 4),
                                                       (4, 5, 6)])]
    two = client_view(served, 2)  # closed loop: request k sent when request k - 2 ended
    assert [r.send_time for r in two] == [0, 0, 2, 3]
    assert [r.queue_ms for r in two] == pytest.approx([0, 2000, 1000, 1000])
    assert [r.ttft_ms for r in two] == pytest.approx([1000, 2500, 1200, 2000])
    assert [r.prefill_ms for r in two] == pytest.approx([1000, 500, 200, 1000])
    one = client_view(served, 1)  # one client: no waiting
    assert [r.queue_ms for r in one] == [0, 0, 0, 0]
    assert served[1].send_time == 2  # the input is not changed


def test_client_view_of_static_batches():
    from jaxserve.bench.peers import client_view
    # Batch 0 (requests 0, 1) starts at 0; batch 1 (2, 3) when batch 0 ends at 2.
    served = [RequestRecord(str(k), "chat", 5, start, chunk_times=[first, end],
                            chunk_tokens=[1, 1], end_time=end)
              for k, (start, first, end) in enumerate([(0, 1, 1.5), (0, 1, 2), (2, 3, 3.5),
                                                       (2, 3, 4)])]
    v = client_view(served, 2)
    assert [r.send_time for r in v] == [0, 0, 1.5, 2]  # client 0 waited 0.5 s for the batch
    assert [r.queue_ms for r in v] == pytest.approx([0, 0, 500, 0])
    assert [r.e2e_ms for r in v] == pytest.approx([1500, 2000, 2000, 2000])


def test_request_metrics_phase_breakdown():
    """RequestOutput.metrics: TTFT = queue + prefill; decode ms/token = TPOT."""
    from jaxserve.engine.request import RequestMetrics
    m = RequestMetrics(arrival_time=10.0)
    assert m.queue_ms is None and m.prefill_ms is None and m.decode_ms_per_token is None
    m.first_scheduled_time = 10.25
    assert m.queue_ms == pytest.approx(250.0) and m.prefill_ms is None
    m.first_token_time = 10.75
    m.finished_time, m.num_output_tokens = 11.75, 5
    assert m.prefill_ms == pytest.approx(500.0)
    assert m.ttft_ms == pytest.approx(m.queue_ms + m.prefill_ms)
    assert m.decode_ms_per_token == pytest.approx(250.0) == m.tpot_ms  # 1 s over 4 tokens
    assert m.e2e_ms == pytest.approx(1750.0)


def test_client_view_open_loop_places_service_at_arrivals():
    from jaxserve.bench.peers import client_view
    served = [RequestRecord(str(k), "chat", 5, start, chunk_times=[first, end],
                            chunk_tokens=[1, 1], end_time=end)
              for k, (start, first, end) in enumerate([(0, 1, 2), (2, 2.5, 3), (3, 3.2, 4),
                                                       (4, 5, 6)])]
    # Sequential: request 1 arrives while 0 runs (waits 1.5 s); 2 arrives at 5
    # after the engine went idle (its 1 s of service moves to 5..6); 3 arrives
    # at 5.1 and starts when 2 ends at 6.
    v = client_view(served, 4, arrivals=[0, 0.5, 5, 5.1])
    assert [r.send_time for r in v] == [0, 0.5, 5, 5.1]
    assert [r.queue_ms for r in v] == pytest.approx([0, 1500, 0, 900])
    assert [r.ttft_ms for r in v] == pytest.approx([1000, 2000, 200, 1900])
    assert [r.e2e_ms for r in v] == pytest.approx([2000, 2500, 1000, 2900])
    assert [r.prefill_ms for r in v] == pytest.approx([1000, 500, 200, 1000])
    # At most one in flight: request 1 is sent only when request 0 ends (2 s).
    assert [r.send_time for r in client_view(served, 1, arrivals=[0, 0.5, 5, 5.1])][1] == 2
    # A static batch (requests 0 and 1 started together) starts when its last
    # request has arrived (1.0), the next batch when that one has ended.
    batches = [RequestRecord(str(k), "chat", 5, start, chunk_times=[start + 1],
                             chunk_tokens=[1], end_time=start + 1)
               for k, start in enumerate([0, 0, 1, 1])]
    b = client_view(batches, 4, arrivals=[0, 1.0, 1.2, 1.3])  # the cap does not bind
    assert [r.queue_ms for r in b] == pytest.approx([1000, 0, 800, 700])
    assert [r.end_time for r in b] == pytest.approx([2, 2, 3, 3])
    with pytest.raises(ValueError, match="arrival"):
        client_view(served, 2, arrivals=[0, 1])
