"""``python -m jaxserve.main`` with the speculation flags on the tiny random
GGUF: the generate table gains an acceptance column and a line of engine
totals, ``--json`` gains each request's draft counts, and the tokens are
those of the same run without speculation."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["--prompt", "the cat the cat the cat", "--prompt", "hello world hello"]
SPEC = ["--speculative_method", "ngram", "--num_speculative_tokens", "3",
        "--nospeculative_adaptive"]


def _cli(model: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "jaxserve.main", "--model", model,
                        "--max_tokens", "24", "--temperature", "0", *PROMPTS, *args],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_generate_reports_speculation(tiny_gguf):
    lines = _cli(tiny_gguf, *SPEC).splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("req "))
    assert lines[header].split()[-2:] == ["accept", "finish"], lines[header]
    for row in lines[header + 1:header + 3]:
        assert re.fullmatch(r"(\d+%|-)", row.split()[-2]), row
    totals = lines[header + 4]
    assert totals.startswith("speculation (ngram, k <= 3): "), totals
    assert "acceptance rate" in totals and "mean acceptance length" in totals, totals

    spec = [json.loads(line) for line in _cli(tiny_gguf, *SPEC, "--json").splitlines()]
    plain = [json.loads(line) for line in _cli(tiny_gguf, "--json").splitlines()]
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert "draft_tokens" not in plain[0]
    assert spec[0]["draft_tokens"] > 0
    for r in spec:
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
        rate = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else None
        assert r["acceptance_rate"] == rate
