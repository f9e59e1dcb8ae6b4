"""The speculative decoding benchmark (``python -m jaxserve.bench latency``)
in ``--quick`` mode on a tiny random model given as engine parts: every
workload and configuration runs, the JSON and the report carry the figures,
and every ratio to ``off`` is finite and positive."""

import json
import math

import pytest
from conftest import XLA_CACHE

from jaxserve.config import ModelConfig

TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=())

SPEC_KEYS = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
             "mean_acceptance_length", "accepted_per_position", "drafts_per_position",
             "per_position_acceptance", "final_k", "policy_acceptance", "draft_model_share"}


@pytest.mark.slow
def test_spec_bench_quick(tmp_path, capsys):
    from jaxserve.bench.__main__ import main
    out = tmp_path / "spec"
    assert main(["latency", "--quick", "--warmup", "request", "--output", str(out),
                 "--chat_drafts", "int8", "--compilation_cache_dir", XLA_CACHE],
                parts=dict(model_config=TINY, params=None)) == 0
    r = json.loads((out / "result.json").read_text())
    assert r["quick"] and r["machine"]["cpu_model"] and r["machine"]["jax"]
    assert "avx_flags" in r["machine"]
    wl = r["workloads"]
    assert list(wl) == ["copy", "chat", "rare"]
    assert list(wl["copy"]["configs"]) == ["off", "ngram-k3", "ngram-k5"]
    assert list(wl["chat"]["configs"]) == ["off", "ngram-k3", "draft-int8", "draft-int8-forced"]
    assert list(wl["rare"]["configs"]) == ["off", "ngram-k3", "ngram-k3-forced"]
    assert wl["copy"]["kinds"] == ["repeat", "edit"]
    for w, res in wl.items():
        n = len(res["prompt_tokens"])
        assert n == (4 if w == "rare" else 2)
        for label, e in res["configs"].items():
            fig = e["tok_per_s_ratio"] if w == "rare" else e["tpot_ratio"]
            assert math.isfinite(fig) and fig > 0, (w, label, fig)
            assert e["tok_per_s"] > 0 and e["output_tokens"] > 0
            assert len(e["requests"]) == n and 0 <= e["outputs_equal_off"] <= n
            if label == "off":
                assert e["spec"] is None and fig == 1.0
                continue
            sp = e["spec"]
            assert SPEC_KEYS <= set(sp), (w, label)
            k = e["speculative_config"]["num_speculative_tokens"]
            assert len(sp["per_position_acceptance"]) == len(sp["policy_acceptance"]) == k
            assert 0 <= sp["final_k"] <= k
            if label == "draft-int8-forced":  # k drafts every step, all verified
                assert sp["num_drafts"] > 0 and sp["mean_acceptance_length"] >= 1
                assert 0 <= sp["acceptance_rate"] <= 1
    assert {t["target"] for t in r["targets"]} == {
        "W_copy TPOT ngram-k3 / off", "W_copy TPOT ngram-k5 / off",
        "W_chat TPOT draft-int8 / off", "W_rare tok/s ngram-k3 / off"}
    for t in r["targets"]:
        assert math.isfinite(t["value"]) and t["value"] > 0 and t["met"] in (True, False)
    md = (out / "report.md").read_text()
    assert md.startswith("# jaxserve speculative decoding benchmark on ")
    assert r["machine"]["cpu_model"] in md and "AVX flags" in md and "## Targets" in md
    for title in ("## W_copy", "## W_chat", "## W_rare"):
        assert title in md
    assert "## Targets" in capsys.readouterr().out


def test_spec_bench_flags_refused():
    from jaxserve.bench.__main__ import main
    for argv in (["--workloads", "copy,nope"], ["--chat_drafts", "gguf"],
                 ["--num_requests", "0"]):
        with pytest.raises(SystemExit):
            main(["latency", *argv])
