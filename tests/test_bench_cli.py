"""The serving benchmark end to end on a tiny random GGUF (``python -m
jaxserve.bench serve --workload ...``, which runs ``python -m jaxserve.main
--mode bench``): the JSON holds every figure, the
Markdown report has the side-by-side table with HF transformers, the PNGs are
written; bad options fail before the model loads; the GPU script refuses a
CPU without ``--smoke`` (its smoke run: ``test_bench_device.py``)."""

import json
import os
import subprocess
import sys

import pytest

from jaxserve.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxserve.bench", "serve", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_bench_cli_writes_every_figure_with_hf_beside(tiny_gguf, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out = tmp_path / "res"
    res = _cli("--model", tiny_gguf, "--workload", "mixed", "--concurrency", "1,2",
               "--num_prompts", "4", "--scale", "0.05", "--peers", "hf,llama_cpp",
               "--slo", "ttft_ms=60000,tpot_ms=10000", "--num_pages", "128", "--page_size", "8",
               "--max_num_seqs", "4", "--output", str(out))  # 4 slots: 3 decode widths to warm
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["concurrency"] == [1, 2] and r["config"]["scale"] == 0.05
    assert r["env"]["versions"]["jax"] and r["env"]["devices"]
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    for lv in r["levels"]:
        s = lv["summary"]
        assert s["completed"] == 4 and s["failed"] == 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "prefill_ms"):
            assert set(s[key]) == {"n", "mean", "p50", "p90", "p99"}, key
            assert s[key]["p99"] >= s[key]["p50"] > 0, key
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous SLO
        assert s["output_tokens"] == sum(req["output_tokens"] for req in lv["requests"])
        assert lv["kv"]["series"] and lv["kv"]["peak_pages"] > 0
        assert set(lv["prefix_cache"]) == {"hits", "queries", "hit_rate"}
        assert lv["preemptions"] == 0 and lv["compilations"] == 0  # the warm-up compiled all
        assert set(lv["by_workload"]) == {"chat", "rag", "creative", "shared-prefix"}
        assert lv["roofline"]["decode"]["steps"] > 0
    roof = r["roofline"]
    for phase in ("prefill", "decode"):
        assert roof[phase]["bound"] in ("compute", "bandwidth")
        assert 0 < roof[phase]["mfu"] and 0 < roof[phase]["mbu"]
    assert roof["ceilings"]["flops_per_s"] > 0
    hf = r["peers"]["hf"]
    assert [lv["concurrency"] for lv in hf["levels"]] == [1, 2]
    assert hf["levels"][1]["mode"] == "static batches of 2"
    assert hf["token_agreement"] is not None
    assert "llama_cpp" in r["peers"]  # run, or skipped with the reason
    md = (out / "report.md").read_text()
    assert "| 2 | HF transformers | static batches of 2 |" in md
    assert "## Roofline per phase" in md and "| decode |" in md
    for png in ("latency_throughput.png", "timeline.png", "roofline.png", "kv_pages.png"):
        assert (out / png).read_bytes()[:8] == PNG, png


def test_bench_cli_rejects_bad_options_before_loading(tmp_path):
    res = _cli("--model", "no-such-model", "--workload", "chat", "--slo", "ttft=1",
               "--output", str(tmp_path), timeout=120)
    assert res.returncode == 2 and "error: --slo" in res.stderr, res.stderr[-2000:]
    res = _cli("--model", "no-such-model", "--workload", "nope", timeout=120)
    assert res.returncode == 2 and "error: flag --workload=nope" in res.stderr, res.stderr
    (tmp_path / "old.png").write_bytes(b"x")  # never mix two runs' files
    res = _cli("--model", "no-such-model", "--workload", "chat", "--output", str(tmp_path),
               timeout=120)
    assert res.returncode == 2 and "not an empty folder" in res.stderr, res.stderr[-2000:]
    from jaxserve.bench import peers
    from jaxserve.bench import serving_options as suite
    with pytest.raises(ValueError, match="--concurrency"):
        suite.parse_levels("0,2")
    with pytest.raises(ValueError, match="unknown peer"):
        peers.parse_peers("hf,vllm")
    with pytest.raises(ValueError, match="twice"):
        peers.parse_peers("hf,hf")
    with pytest.raises(ValueError, match="--scale"):
        suite.BenchOptions(scale=-1)
    with pytest.raises(ValueError, match="--request_rate"):
        suite.BenchOptions(request_rate=0)
    assert suite.BenchOptions(num_prompts=None, concurrency=(1, 8)).prompts_per_level() == [4, 8]


def test_device_script_refuses_cpu_without_smoke(capsys, tmp_path):
    import jax
    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("an accelerator is present")
    from jaxserve.bench.__main__ import main
    out = tmp_path / "x.json"
    assert main(["device", "--output", str(out)]) == 1
    assert "no GPU" in capsys.readouterr().out
    doc = json.loads(out.read_text())  # the refusal is on record, every section skipped
    assert "no GPU" in doc["refused"] and doc["workers"] == 1
    assert {s["status"] for s in doc["sections"].values()} == {"skipped"}


def test_inprocess_driver_open_loop_records_every_token_and_step():
    from conftest import XLA_CACHE
    from jaxserve import LLM
    from jaxserve.bench import serving, stats
    from jaxserve.bench.workloads import make_requests
    engine = LLM(model_config=ModelConfig(vocab_size=256), params=None, page_size=8,
                 num_pages=128, compilation_cache_dir=XLA_CACHE).engine  # random weights
    reqs = make_requests(None, 256, "chat", 5, seed=1, scale=0.1)  # ~10 prompt, 20 out
    offsets = serving.arrival_offsets(5, 40.0, seed=2)
    run = serving.run_inprocess(engine, reqs, concurrency=2, request_rate=40.0, seed=2)
    assert [r.output_tokens for r in run.records] == [q.output_len for q in reqs]
    for r, off in zip(run.records, offsets):
        assert r.send_time >= run.t0 + off - 1e-9  # never before its Poisson arrival
        assert r.ok and len(r.itl_ms) == r.output_tokens - 1
        assert r.queue_ms is not None and r.prefill_ms is not None
    # At most 2 in flight: the third is sent no earlier than the first finish.
    ends = sorted(r.end_time for r in run.records[:2])
    assert run.records[2].send_time >= ends[0] - 1e-9
    # Every computed token shows up in exactly one recorded step: each prompt,
    # then one decode token per output token after the first.
    assert sum(s.num_tokens for s in run.steps) == sum(
        len(q.prompt_ids) + q.output_len - 1 for q in reqs)
    assert all(max(s.kv_lens) <= 10 * 1.1 + 20 for s in run.steps)
    assert run.kv_series[0][1] == 0 and max(p for _, p, _, _ in run.kv_series) > 0
    assert stats.summarize(run.records)["completed"] == 5
    # The engine's own per-request breakdown: TTFT = queue + prefill.
    for r in run.records:
        assert r.queue_ms >= 0 and r.prefill_ms > 0
        assert r.ttft_ms >= r.queue_ms + r.prefill_ms - 1e-6
    last = engine.last_step
    assert last.num_decode == len(last.q_lens) and last.seconds > 0


def test_serving_bench_json_names_quantization_and_weight_bytes(tmp_path):
    """In-process ``serving_run.run`` of an int8-weight, int8-KV engine: the JSON's
    config names both (from the engine), the env holds the weight bytes as
    stored and the KV bytes per token, and the report names the format."""
    from conftest import XLA_CACHE
    from jaxserve import LLM
    from jaxserve.bench import formats as quant_bench
    from jaxserve.bench import serving_options, serving_run
    engine_args = {"model_config": ModelConfig(vocab_size=256), "params": None, "page_size": 8,
                   "num_pages": 64, "max_num_seqs": 2, "max_num_batched_tokens": 32,
                   "compilation_cache_dir": XLA_CACHE}
    llm = LLM(**engine_args, quantization="int8", kv_cache_dtype="int8")
    opts = serving_options.BenchOptions(workload="chat", concurrency=(1,), num_prompts=1,
                                        peers=(), scale=0.05, warmup=False, peak_flops=1e12,
                                        peak_bytes=1e10)
    r, paths = serving_run.run(opts, str(tmp_path / "res"), llm)
    assert r["config"]["quantization"] == "int8" and r["config"]["kv_cache_dtype"] == "int8"
    wb = r["env"]["weight_bytes"]
    f32 = LLM(**engine_args).engine
    ref = quant_bench.weight_bytes(f32)
    assert 0 < wb["projections"] < 0.27 * ref["projections"] and wb["total"] < ref["total"]
    assert r["env"]["kv_bytes_per_token"] < quant_bench.kv_bytes_per_token(f32) / 3
    assert r["levels"][0]["summary"]["completed"] == 1
    assert r["roofline"]["decode"]["mbu"] > 0
    with open(paths[1]) as f:
        md = f.read()
    assert "weights int8, KV cache int8: " in md and "MB of weights as stored" in md


def test_inprocess_driver_reports_speculation():
    from conftest import XLA_CACHE
    from jaxserve import LLM
    from jaxserve.bench import serving
    from jaxserve.bench import serving_levels as suite
    from jaxserve.bench.workloads import make_requests
    engine = LLM(model_config=ModelConfig(vocab_size=256), params=None, page_size=8,
                 num_pages=128, compilation_cache_dir=XLA_CACHE,  # random weights: loops
                 speculative_config=dict(method="ngram", num_speculative_tokens=3,
                                         adaptive=False)).engine
    reqs = make_requests(None, 256, "chat", 4, seed=1, scale=0.1)
    s0 = engine.stats()
    run = serving.run_inprocess(engine, reqs, concurrency=4)
    s1 = engine.stats()
    assert [r.output_tokens for r in run.records] == [q.output_len for q in reqs]
    sp = run.spec_dict()
    assert sp["draft_tokens"] == s1.spec_num_draft_tokens - s0.spec_num_draft_tokens > 0
    assert sp["accepted_tokens"] == s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    assert sp["acceptance_rate"] == sp["accepted_tokens"] / sp["draft_tokens"]
    assert sp["mean_acceptance_length"] == 1 + sp["accepted_tokens"] / sp["drafts"]
    lv = suite.level_dict(run, {})
    assert lv["speculation"] == sp
    assert serving.LevelRun(1, 1.0, [], [], [], 0, 0, 0, 0, None, 0.0).spec_dict() is None


def test_structured_bench_writes_its_figures(tiny_gguf, tmp_path, capsys):
    """``python -m jaxserve.bench structured`` on the tiny model: both passes
    measured, constrained rows compile nothing, forced drafts are counted
    only when on, and the report names the machine and both ratios."""
    from jaxserve.bench.__main__ import main
    out = tmp_path / "structured"
    assert main(["structured", "--model", tiny_gguf, "--output", str(out), "--batch", "3",
                 "--max_tokens", "24", "--single", "1", "--fields", "2", "--repeats", "1",
                 "--max_num_seqs", "4"]) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["batch_plain"]["output_tokens"] > 0 and res["batch_constrained"]["tok_s"] > 0
    assert res["batch_constrained"]["compilations"] == 0
    assert res["batch_constrained"]["mask_fills"] > 0 and res["batch_plain"]["mask_fills"] == 0
    single = res["single"]
    assert single["plain_constrained"]["forced_tokens"] == 0
    assert single["forced_drafts"]["forced_tokens"] > 0
    assert single["forced_drafts"]["steps"] < single["plain_constrained"]["steps"]
    text = (out / "report.md").read_text()
    assert "Machine: " in text and "the unconstrained time" in text and "Forced drafting" in text
    with pytest.raises(SystemExit) as e:  # refused before the model loads
        main(["structured", "--model", tiny_gguf, "--output", str(tmp_path / "o2"),
              "--batch", "3", "--max_num_seqs", "2"])
    assert e.value.code == 2
    assert "--max_num_seqs 2 is less than --batch 3" in capsys.readouterr().err
