"""The soak benchmark end to end, briefly (``python -m jaxserve.bench soak``
for ~20 s on the tiny GGUF, 2 client processes): every call is accounted for
in the counters, only expected status codes, no lost or hanging stream, every
KV page free at the end, the server stopped by SIGTERM with status 0, and the
three output files written."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_soak_smoke_accounts_for_every_call(tiny_gguf, tmp_path):
    out = tmp_path / "soak"
    # The drift limit is generous: a 20 s run is all warm-up (each new shape
    # compiles and holds its executable), which is not what this checks.
    res = subprocess.run(
        [sys.executable, "-m", "jaxserve.bench", "soak", "--minutes", "0.33", "--clients", "2",
         "--model", tiny_gguf, "--sample_s", "2", "--settle_s", "10", "--burst", "24",
         "--max_rss_drift", "10", "--output", str(out), "--",
         "--num_pages", "128", "--page_size", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "## Calls by case and status code" in res.stdout  # report.md is printed
    r = json.loads((out / "soak.json").read_text())
    c = r["counters"]
    counted = sum(sum(d["expected"].values()) + sum(d["unexpected"].values())
                  for d in c["by_case"].values())
    assert counted == c["totals"]["calls"] == c["totals"]["started"] > 10
    assert c["totals"]["unexpected"] == 0, r["anomalies"][:5]
    assert c["totals"]["lost"] == c["totals"]["hanging"] == 0
    assert c["totals"]["ok_streams"] > 0
    assert {"generate", "bad"} <= set(c["by_case"])
    assert set(c["by_case"]["bad"]["expected"]) == {"INVALID_ARGUMENT"}
    assert r["end"]["pages_free"] == r["end"]["pages_total"] == 128
    assert r["server"]["exit_status"] == 0
    assert r["client_processes_missing"] == []
    assert r["rss"]["start_mb"] > 0 and r["rss"]["peak_mb"] >= r["rss"]["end_mb"]
    assert len(r["samples"]) >= 5 and len(r["windows"]) == len(r["samples"]) - 1
    assert r["failed"] == []
    assert (out / "report.md").read_text().startswith("# Soak")
    pytest.importorskip("matplotlib")
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
