"""The soak benchmark end to end, briefly (``python -m jaxserve.bench soak``
for 30 s on the tiny GGUF, one gRPC and one HTTP client process): both APIs
ran, every case kind of each API and every hostile sub-case has a status
count (the coverage pass), every call is accounted for, no lost or hanging
call, every KV page free at the end, the server stopped by SIGTERM with
status 0, and the three output files written.

Statuses other than issue 33's rule are allowed only in the ``hostile``
case: there the report must show them as unexpected (today's server answers
some with 200, 429 or 500; the server fixes of issue 33 turn them expected)."""

import json
import os
import subprocess
import sys

import pytest

from jaxserve.bench.soak_hostile import GRPC_HOSTILE, HTTP_HOSTILE
from jaxserve.bench.soak_http import CASES as HTTP_CASES
from jaxserve.bench.soak_report import expected, summarize
from jaxserve.bench.soak_traffic import CASES as GRPC_CASES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_summarize_counts_per_api_and_flags_hostile_statuses():
    recs = [{"api": "http", "case": "hostile", "sub": "prompts_1000", "expect": ["400"],
             "code": "429", "t0": 0, "t1": 1},
            {"api": "http", "case": "generate", "code": "200", "t0": 0, "t1": 1},
            {"api": "grpc", "case": "generate", "code": "OK", "t0": 0, "t1": 1, "lost": True},
            {"api": "grpc", "case": "unread", "code": "CANCELLED", "t0": 0, "t1": 1}]
    c = summarize(recs)
    assert c["by_case"]["http"]["hostile"]["unexpected"] == {"429": 1}
    assert c["by_case"]["http"]["generate"]["expected"] == {"200": 1}
    assert c["by_case"]["grpc"]["unread"]["expected"] == {"CANCELLED": 1}
    assert c["per_api"]["http"] == {"calls": 2, "lost": 0, "hanging": 0, "unexpected": 1}
    assert c["per_api"]["grpc"] == {"calls": 2, "lost": 1, "hanging": 0, "unexpected": 0}
    assert c["sub_cases"]["http:hostile:prompts_1000"] == {"expected": ["400"],
                                                           "codes": {"429": 1}}
    assert [expected(r) for r in recs] == [False, True, True, True]


@pytest.mark.slow
def test_soak_smoke_both_apis_every_case(tiny_gguf, tmp_path):
    out = tmp_path / "soak"
    # The drift limit is generous: a 30 s run is all warm-up (each new shape
    # compiles and holds its executable), which is not what this checks.
    res = subprocess.run(
        [sys.executable, "-m", "jaxserve.bench", "soak", "--minutes", "0.5", "--clients", "1",
         "--http_clients", "1", "--model", tiny_gguf, "--sample_s", "2", "--settle_s", "10",
         "--burst", "24", "--max_rss_drift", "10", "--output", str(out), "--",
         "--num_pages", "128", "--page_size", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    assert "## Calls by API, case and status code" in res.stdout  # report.md is printed
    r = json.loads((out / "soak.json").read_text())
    c = r["counters"]
    by = c["by_case"]
    assert set(by) == {"grpc", "http"}
    for api, cases in (("grpc", GRPC_CASES), ("http", HTTP_CASES)):
        for case, _ in cases:
            d = by[api][case]
            assert sum(d["expected"].values()) + sum(d["unexpected"].values()) >= 1, (api, case)
            if case != "hostile":
                assert d["unexpected"] == {}, (api, case, r["anomalies"][:5])
    subs = {k.rsplit(":", 1)[1] for k in c["sub_cases"] if k.startswith("grpc:hostile:")}
    assert subs == set(GRPC_HOSTILE)  # the spawned server has a token: auth cases too
    subs = {k.rsplit(":", 1)[1] for k in c["sub_cases"] if k.startswith("http:hostile:")}
    assert subs == set(HTTP_HOSTILE)
    counted = sum(sum(d["expected"].values()) + sum(d["unexpected"].values())
                  for cases in by.values() for d in cases.values())
    assert counted == c["totals"]["calls"] == c["totals"]["started"] > 50
    assert c["totals"]["lost"] == c["totals"]["hanging"] == 0
    assert c["totals"]["client_faults"] == 0
    assert r["latency"]["grpc"]["calls"] > 0 and r["latency"]["http"]["calls"] > 0
    assert r["end"]["pages_free"] == r["end"]["pages_total"] == 128
    assert r["end"]["running"] == r["end"]["waiting"] == 0
    assert r["server"]["exit_status"] == 0
    assert r["client_processes_missing"] == []
    assert r["rss"]["start_mb"] > 0 and r["rss"]["peak_mb"] >= r["rss"]["end_mb"]
    assert len(r["samples"]) >= 5 and len(r["windows"]) == len(r["samples"]) - 1
    assert max(w["in_flight"]["http"] for w in r["windows"]) > 0
    # Only unexpected hostile statuses (and the tracebacks of today's 500s
    # behind them) may fail the run.
    assert isinstance(r["server"]["tracebacks"], int)
    assert all("status code not expected" in f or "tracebacks in the server's log" in f
               for f in r["failed"]), r["failed"]
    assert (res.returncode == 0) == (r["failed"] == [])
    report = (out / "report.md").read_text()
    assert report.startswith("# Soak") and "| http | hostile |" in report
    pytest.importorskip("matplotlib")
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
