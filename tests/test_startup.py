"""Start-up: the persistent compilation cache and the start-up report.

* Two ``--mode serve`` starts on one temporary cache folder (tiny GGUF, few
  step programs): the first compiles every program, the second loads every
  one, the warm-up's included, and compiles none (its start-up line and its
  warm-up line say so); ``/metrics`` has the same figures and the RSS.
* The CLI's generate mode warms up before its batch: no compilation during it.
* ``compile_cache`` in fresh processes (JAX's cache is process-wide): it
  counts programs compiled and loaded, writes programs that compile in
  milliseconds (thresholds at 0), keeps the first folder, and leaves a
  folder the user set (and their thresholds) alone.
* ``LLM``'s default folder is the CLI's.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import time

import pytest

from jaxserve.engine import compile_cache
from jaxserve.engine.compile_cache import ProgramCounts, parse_line

# Few step programs: decode rows 1 and 2, prefill 16 tokens (the smallest prefill step).
SMALL = ["--max_num_seqs", "2", "--max_num_batched_tokens", "16", "--num_pages", "64",
         "--page_size", "8"]


@pytest.fixture(scope="module")
def xla_dir(tmp_path_factory):
    """An empty compilation cache folder shared by this module's CLI runs."""
    return str(tmp_path_factory.mktemp("startup-xla"))


def _warmup_line(log: str) -> tuple[int, int]:
    """(loaded, compiled) of the server's warm-up line."""
    m = re.search(r"XLA programs traced: (\d+) loaded from cache, (\d+) compiled", log)
    assert m, log[-3000:]
    return int(m[1]), int(m[2])


@pytest.mark.slow
def test_second_start_loads_every_program(tiny_gguf, xla_dir):
    from server_util import ServerProcess
    reports, metrics = [], None
    for start in ("cold", "warm"):  # the warm-up in the background (the default)
        s = ServerProcess(["--model", tiny_gguf, *SMALL, "--compilation_cache_dir", xla_dir],
                          warmup=True, timeout_s=600)
        try:
            line = next(l for l in s.lines if l.startswith("jaxserve: serving"))
            report = parse_line(line)
            assert report is not None, line
            t_end = time.monotonic() + 600  # the warm-up line comes at its end
            while not re.search(r"compiled \d+ step shapes in", "".join(s.lines)):
                assert time.monotonic() < t_end and s.proc.poll() is None, "".join(s.lines)
                time.sleep(0.1)
            reports.append((report, _warmup_line("".join(s.lines))))
            if start == "warm":
                metrics = s.metrics()
        finally:
            assert s.terminate() == 0
    (cold, cold_warmup), (warm, warm_warmup) = reports
    assert cold["compiled"] > 0 and cold["loaded"] == 0  # the folder was empty
    assert cold_warmup[1] > 0
    # The second start compiled nothing, step programs or any other.
    assert warm["compiled"] == 0, warm
    assert warm["loaded"] == warm["programs"] > 0
    assert warm_warmup == (sum(cold_warmup), 0)
    assert warm["ready_s"] > 0 and warm["rss_bytes"] > 0
    # The same figures in /metrics, and the process's RSS.
    assert metrics["jaxserve_startup_xla_programs_compiled"] == 0
    assert metrics["jaxserve_startup_xla_programs_loaded"] == warm["programs"]
    assert metrics["jaxserve_startup_seconds"] > 0
    assert metrics["jaxserve_process_resident_memory_bytes"] > 0


@pytest.mark.slow
def test_generate_warms_up_before_its_batch(tiny_gguf, xla_dir):
    r = subprocess.run([sys.executable, "-m", "jaxserve.main", "--model", tiny_gguf, *SMALL,
                        "--compilation_cache_dir", xla_dir, "--prompt", "hello there",
                        "--prompt", "abc", "--max_tokens", "4", "--temperature", "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert parse_line(r.stderr) is not None, r.stderr[-3000:]
    total = next(l for l in r.stdout.splitlines() if l.startswith("total: 2 requests"))
    assert "0 XLA compilations during the batch" in total, total


_COUNT = """
import json, sys
import jax, jax.numpy as jnp
from jaxserve.engine import compile_cache
used = compile_cache.enable(sys.argv[1])
again = compile_cache.enable(sys.argv[2])  # a second folder: the first stays
f = jax.jit(lambda x: jnp.cos(x) * 3 + 1)
for n in (3, 5, 7):
    f(jnp.arange(n, dtype=jnp.float32)).block_until_ready()
c = compile_cache.counts()
print(json.dumps({"used": used, "again": again, "programs": c.programs, "loaded": c.loaded,
                  "compiled": c.compiled, "written": c.written,
                  "min_time": jax.config.jax_persistent_cache_min_compile_time_secs,
                  "names": dict(c.compiled_names)}))
"""


def _count(*args: str, env: dict | None = None) -> dict:
    import os
    r = subprocess.run([sys.executable, "-c", _COUNT, *args], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_counts_compiled_then_loaded(tmp_path):
    folder, other = str(tmp_path / "xla"), str(tmp_path / "other")
    cold = _count(folder, other)
    assert cold["used"] == cold["again"] == folder
    assert cold["min_time"] == 0.0
    # 3 jitted shapes plus jnp.arange's and the like; each compiled in
    # milliseconds and still written (JAX's 1 s threshold would skip them all).
    assert cold["programs"] >= 3 and cold["compiled"] == cold["programs"]
    assert cold["written"] == cold["programs"] and cold["names"]["jit(<lambda>)"] == 3
    warm = _count(folder, other)
    assert warm["loaded"] == warm["programs"] == cold["programs"]
    assert warm["compiled"] == warm["written"] == 0 and warm["names"] == {}


def test_a_folder_the_user_set_is_kept(tmp_path):
    theirs = str(tmp_path / "theirs")
    got = _count(str(tmp_path / "ours"), str(tmp_path / "other"),
                 env={"JAX_COMPILATION_CACHE_DIR": theirs})
    assert got["used"] == theirs and got["min_time"] == 1.0  # their settings, JAX's default
    assert not (tmp_path / "ours").exists()


def test_llm_default_is_the_cli_folder(monkeypatch, tmp_path):
    from jaxserve import LLM
    assert inspect.signature(LLM).parameters["compilation_cache_dir"].default == "auto"
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    assert compile_cache.resolve_dir("auto") == str(tmp_path / "xla")
    assert compile_cache.resolve_dir(None) is None and compile_cache.resolve_dir("") is None
    assert compile_cache.resolve_dir("./auto") == "./auto"


def test_report_line_round_trips():
    p = ProgramCounts(programs=27, loaded=25, compiled_names=(("jit(_step)", 2),))
    report = compile_cache.StartupReport(12.34, p, None, 1_020_000_000, "/x")
    line = report.line()
    assert line == "ready in 12.3 s: 27 programs (25 loaded from cache, 2 compiled), RSS 1.02 GB"
    assert parse_line("jaxserve: serving m: " + line) == {
        "ready_s": 12.3, "programs": 27, "loaded": 25, "compiled": 2, "rss_bytes": 1_020_000_000}
    later = ProgramCounts(programs=30, loaded=26, compiled_names=(("jit(_step)", 4),))
    d = later - p
    assert (d.programs, d.loaded, d.compiled, d.compiled_names) == (3, 1, 2, (("jit(_step)", 2),))
    assert compile_cache.process_rss_bytes() > 0 and compile_cache.process_age_s() > 0


def test_a_second_engine_loads_serialized_programs_without_tracing(make_tiny_llm):
    """The executable store: a second engine of the same config loads every
    warm-up program (no trace, no lowering) and generates the same greedy
    and seeded tokens as the first; another config misses the store."""
    from jaxserve import SamplingParams
    kw = dict(max_num_seqs=5, max_num_batched_tokens=20, num_pages=97)
    first = make_tiny_llm(**kw)
    first.engine.warmup()
    assert first.engine.runner._executable_store() is not None
    second = make_tiny_llm(**kw)
    r = second.engine.runner
    traced = r.num_compilations
    ready = second.engine.warmup()
    # Every warm-up program loaded, untraced: the steps, two sampling
    # programs per warm row count, and the prompt-logprob programs. This
    # holds whether or not JAX's persistent cache already held them (a warm
    # cache, another test's engine): the store compiles past that cache.
    num_prompt_logprob = sum(1 for name in r._programs if name.startswith("prompt-logprobs-"))
    assert num_prompt_logprob >= 1
    assert r.num_loaded_programs == (len(r.step_buckets()) + 2 * len(r._warm_rows)
                                     + num_prompt_logprob)
    assert len(r._programs) == r.num_loaded_programs
    assert r.num_compilations == traced
    assert ready == r.num_loaded_programs
    traced = r.num_compilations
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 9, 23)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1,
                             ignore_eos=True)]
    a = [[c.token_ids for c in o.outputs] for o in first.generate(prompts, params)]
    b = [[c.token_ids for c in o.outputs] for o in second.generate(prompts, params)]
    assert a == b
    assert r.num_compilations == traced  # the traffic ran the loaded programs
    other = make_tiny_llm(max_num_seqs=2, max_num_batched_tokens=20, num_pages=97).engine.runner
    assert other._executable_store().folder != r._executable_store().folder
