"""The serving benchmark with ``--lora_mix`` (``jaxserve.bench.serving_lora``)
on the tiny random GGUF, in-process: every level run on the base alone and
with the adapters round-robin, both output tok/s, their ratio and the slot
swaps in the JSON and the report; bad combinations refused before the model
loads (exit 2, the option named)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxserve.bench", "serve", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_lora_mix_random_runs_base_and_mix_per_level(tiny_gguf, tmp_path):
    out = tmp_path / "res"
    # --nowarmup: the first mix pass (C=1) fills the two empty slots, C=2 swaps nothing.
    res = _cli("--model", tiny_gguf, "--workload", "chat", "--concurrency", "1,2",
               "--num_prompts", "2", "--scale", "0.05", "--peers", "none",
               "--lora_mix", "random:2", "--max_lora_rank", "4", "--num_pages", "128",
               "--page_size", "8", "--nowarmup", "--peak_tflops", "1", "--peak_gbps", "10",
               "--output", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["lora_mix"] == "random:2"
    assert r["lora_mix"]["adapters"] == ["random0", "random1"]
    assert r["lora_mix"]["rank"] == 4 and r["lora_mix"]["max_loras"] == 4
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    for lv in r["levels"]:
        p = lv["lora_mix"]
        base, mix = lv["summary"], p["mix_summary"]
        assert base["completed"] == mix["completed"] == 2 and mix["failed"] == 0
        # The same requests, greedy with EOS ignored: the same token counts.
        assert mix["output_tokens"] == base["output_tokens"] > 0
        assert p["base_output_tok_s"] == base["output_throughput"] > 0
        assert p["mix_output_tok_s"] == mix["output_throughput"] > 0
        assert p["ratio"] == pytest.approx(p["mix_output_tok_s"] / p["base_output_tok_s"])
    assert [lv["lora_mix"]["swaps"] for lv in r["levels"]] == [2, 0]
    md = (out / "report.md").read_text()
    assert "## LoRA adapter mix (" in md and "CPUs)" in md
    assert "| concurrency | base output tok/s | mix output tok/s | mix / base | slot swaps |" in md
    p1 = r["levels"][0]["lora_mix"]
    assert f"| 1 | {p1['base_output_tok_s']:.1f} | {p1['mix_output_tok_s']:.1f} | " \
           f"{p1['ratio']:.2f}x | 2 |" in md


def test_lora_mix_refuses_peers_and_unknown_adapters(tmp_path):
    base = ("--model", "no-such-model", "--workload", "chat", "--output", str(tmp_path / "o"))
    res = _cli(*base, "--lora_mix", "random:2", "--peers", "hf", timeout=120)
    assert res.returncode == 2 and "error: --lora_mix" in res.stderr, res.stderr[-2000:]
    assert "peers (hf)" in res.stderr
    res = _cli(*base, "--lora_mix", "nope", "--peers", "none", timeout=120)
    assert res.returncode == 2 and "error: --lora_mix" in res.stderr, res.stderr[-2000:]
    assert "nope" in res.stderr and "registered: none" in res.stderr
    res = _cli(*base, "--lora_mix", "random:0", "--peers", "none", timeout=120)
    assert res.returncode == 2 and "random:N wants an integer N >= 1" in res.stderr


def test_lora_mix_options():
    from jaxserve.bench import serving_lora
    from jaxserve.bench.serving_options import BenchOptions
    from jaxserve.bench.workloads import BenchRequest
    assert serving_lora.parse_lora_mix("a, b") == (("a", "b"), 0)
    assert serving_lora.parse_lora_mix("random:3") == ((), 3)
    assert serving_lora.parse_lora_mix(None) == ((), 0)
    with pytest.raises(ValueError, match="twice"):
        serving_lora.parse_lora_mix("a,a")
    opts = BenchOptions(peers=(), lora_mix="b,a", lora_modules=("a", "b", "c"))
    assert opts.lora_names() == ["b", "a"]
    with pytest.raises(ValueError, match="not registered with --lora_modules.*c"):
        BenchOptions(peers=(), lora_mix="a,zz", lora_modules=("a", "c"))
    with pytest.raises(ValueError, match="--target"):
        BenchOptions(peers=(), lora_mix="random:1", backend="grpc", target="h:1")
    reqs = [BenchRequest("chat", [1, 2], 3) for _ in range(5)]
    assert [r.lora for r in serving_lora.assign(reqs, ["x", "y"])] == ["x", "y", "x", "y", "x"]
    assert all(r.lora is None for r in reqs)  # the base pass's requests are left alone


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_lora_mix_over_a_spawned_server(tiny_gguf, tmp_path, backend):
    """gRPC (``lora_name``) and HTTP (the ``model`` field): the adapters are
    written for the spawned server's ``--lora_modules``, every mix request
    succeeds, and the swaps come from its ``jaxserve_lora_swaps_total``."""
    out = tmp_path / "res"
    res = _cli("--model", tiny_gguf, "--workload", "chat", "--concurrency", "1,2",
               "--num_prompts", "2", "--scale", "0.05", "--peers", "none",
               "--lora_mix", "random:2", "--max_lora_rank", "4", "--max_loras", "3",
               "--num_pages", "128", "--page_size", "8", "--nowarmup", "--backend", backend,
               "--output", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["lora_mix"]["rank"] == 4 and r["lora_mix"]["max_loras"] == 3
    assert any(f.startswith("--lora_modules=random0=") for f in r["config"]["engine_flags"])
    for lv in r["levels"]:
        mix = lv["lora_mix"]["mix_summary"]
        assert mix["completed"] == 2 and mix["failed"] == 0
        assert mix["output_tokens"] == lv["summary"]["output_tokens"] > 0
        assert lv["lora_mix"]["ratio"] > 0
    assert [lv["lora_mix"]["swaps"] for lv in r["levels"]] == [2, 0]


def test_lora_mix_turns_lora_on_for_the_bench_only():
    from jaxserve import flags as cli
    cli.FLAGS.unparse_flags()
    try:
        cli.FLAGS(["jaxserve", "--mode", "bench", "--workload", "chat", "--peers=none",
                   "--lora_mix", "random:2", "--max_loras", "2", "--max_lora_rank", "8"])
        lc = cli.lora_config()
        assert (lc.max_loras, lc.max_lora_rank) == (2, 8)
        from jaxserve.bench import suite
        opts = suite.options_from_flags({n: getattr(cli.FLAGS, n) for n in suite.FLAG_NAMES})
        assert opts.lora_mix == "random:2" and opts.max_lora_rank == 8
        assert {"--enable_lora=True", "--max_loras=2", "--max_lora_rank=8"} <= set(
            opts.engine_flags)
        cli.FLAGS.unparse_flags()
        cli.FLAGS(["jaxserve", "--lora_mix", "random:2"])  # --mode generate: no LoRA
        assert cli.lora_config() is None
    finally:
        cli.FLAGS.unparse_flags()
