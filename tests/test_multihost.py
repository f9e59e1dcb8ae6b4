"""Multi-host jobs on one machine: two processes of 4 CPU devices each.

Each test starts ``python -m jaxserve.main --multihost`` twice on 127.0.0.1
(gloo collectives, a free coordinator port) so the job's mesh spans 8 devices
in two processes, exactly as two hosts of a pod would. Process 0 schedules
and broadcasts every step; process 1 follows. Checks:

* a batch (``--mode generate``) on ``tp=8`` (tiny random GGUF Llama) and on
  ``tp=2,ep=4`` (a tiny random Mixtral restored from Orbax into the
  two-process mesh) gives exactly the greedy tokens of one process on the
  same mesh, and both processes exit 0;
* ``--mode serve``: 16 concurrent gRPC requests of mixed shape (text, ids,
  chat; greedy and seeded sampling; n = 2) sent to process 0 equal
  ``LLM.generate`` in one process; SIGTERM to process 0 stops both, exit 0;
* processes started with different engine flags stop at once (exit 2)
  naming the differing fields, instead of compiling different steps;
* killing process 1 in the middle of a request ends the stream with INTERNAL
  naming the multi-host failure and process 0 exits 1; killing process 0
  mid-request makes process 1 stop with a clear error (jaxserve's, or JAX's
  own when its coordination service, hosted by process 0, goes first). Both
  within a time limit (the test fails rather than hangs).

The test process itself has 8 devices (``conftest``), for the references.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from conftest import XLA_CACHE

pytestmark = pytest.mark.slow

PROMPTS = ["hello world", "the other one is longer than this, and longer still, well well",
           "x", "tea or sun or cat"]
ENGINE_FLAGS = ["--num_pages", "256", "--page_size", "8", "--max_num_batched_tokens", "16",
                "--max_num_seqs", "32"]
LIMIT_S = 120  # any one wait; the whole job start-up included


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two ``jaxserve.main --multihost`` processes of 4 devices each.

    Output goes to files in ``tmp``; ``stderr(i)`` reads process i's.
    ``close`` kills whatever still runs.
    """

    def __init__(self, mode: str, args: list[str], tmp, heartbeat_timeout_s: int = 10,
                 extra: tuple[list[str], list[str]] = ([], [])):
        port = _free_port()
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "JAXSERVE_CACHE": os.path.dirname(XLA_CACHE)}
        self.tmp = tmp
        self.procs = []
        for i in range(2):
            cmd = [sys.executable, "-m", "jaxserve.main", "--mode", mode, "--multihost",
                   "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
                   "--process_id", str(i), "--heartbeat_timeout_s", str(heartbeat_timeout_s),
                   *args, *extra[i]]
            with open(tmp / f"p{i}.out", "w") as out, open(tmp / f"p{i}.err", "w") as err:
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))

    def stdout(self, i: int) -> str:
        return (self.tmp / f"p{i}.out").read_text()

    def stderr(self, i: int) -> str:
        return (self.tmp / f"p{i}.err").read_text()

    def wait(self, i: int, timeout_s: float = LIMIT_S) -> int:
        try:
            return self.procs[i].wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"process {i} still running after {timeout_s} s:\n"
                        f"{self.stderr(i)[-3000:]}")

    def wait_for(self, i: int, pattern: str, timeout_s: float = LIMIT_S) -> re.Match:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            m = re.search(pattern, self.stderr(i))
            if m:
                return m
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        self.close()
        pytest.fail(f"no {pattern!r} from process {i}:\n"
                    + "\n".join(f"--- process {j}:\n{self.stderr(j)[-3000:]}" for j in range(2)))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(mode, args, **kw):
        job = Job(mode, args, tmp_path / f"job{len(jobs)}", **kw)
        jobs.append(job)
        return job
    for i in range(8):
        (tmp_path / f"job{i}").mkdir()
    yield make
    for job in jobs:
        job.close()


def _generate_args(model: str, mesh: str, max_tokens: int = 12) -> list[str]:
    args = ["--model", model, "--mesh", mesh, *ENGINE_FLAGS, "--temperature", "0",
            "--max_tokens", str(max_tokens), "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args


def _json_lines(text: str) -> list[dict]:
    import json
    # gloo prints "[Gloo] ..." lines on stdout; the results are the JSON ones.
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _reference_tokens(model: str, mesh: str | None, max_tokens: int = 12) -> list[list[int]]:
    from jaxserve import LLM, SamplingParams
    llm = LLM(model, mesh=mesh, num_pages=256, page_size=8, max_num_batched_tokens=16,
              max_num_seqs=32, compilation_cache_dir=XLA_CACHE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model,mesh", [("gguf", "tp=8"), ("orbax-moe", "tp=2,ep=4")])
def test_batch_on_two_processes_equals_one_process(job_factory, tiny_gguf, mixtral_folders,
                                                   model, mesh):
    path = tiny_gguf if model == "gguf" else str(mixtral_folders[1])
    # The GGUF job compiles its steps before the first request (the CLI's
    # warm-up); the MoE job each step on its first use, in both processes.
    job = job_factory("generate", _generate_args(path, mesh)
                      + ([] if model == "gguf" else ["--nowarmup"]))
    assert job.wait(0) == 0, job.stderr(0)[-3000:]
    assert job.wait(1) == 0, job.stderr(1)[-3000:]
    got = [r["token_ids"] for r in _json_lines(job.stdout(0))]
    assert len(got) == len(PROMPTS)
    assert all(len(t) == 12 for t in got)
    assert got == _reference_tokens(path, mesh)
    assert "multihost: process 1 of 2, 4 local / 8 global devices" in job.stderr(1)
    # Process 1 ran every step process 0 scheduled (chunked prefill included).
    steps = int(re.search(r"process 1 done after (\d+) steps", job.stderr(1)).group(1))
    assert steps >= 12 + 1
    assert job.stdout(1).count("{") == 0  # only process 0 reports


def test_grpc_to_process_zero(job_factory, tiny_gguf):
    from test_server import _expected, _mixed_requests

    from jaxserve import LLM
    from jaxserve.server.client import AsyncClient, Client
    # 8 slots for the 16 requests' 17 sequences: the warm-up compiles 4 decode
    # widths instead of 6; the rest queue.
    flags = [*ENGINE_FLAGS[:-1], "8"]
    job = job_factory("serve", ["--model", tiny_gguf, "--mesh", "tp=8", *flags,
                                "--port", "0", "--metrics_port", "-1"])
    port = int(job.wait_for(0, r"gRPC on [\d.]+:(\d+)").group(1))
    job.wait_for(0, r"jaxserve: serving")
    job.wait_for(1, r"following process 0")
    target = f"127.0.0.1:{port}"
    reqs = _mixed_requests(16, seed=7)

    async def run():
        async with AsyncClient(target) as c:
            return await asyncio.gather(*(c.complete(**r) for r in reqs))

    results = asyncio.run(run())
    reference = LLM(tiny_gguf, num_pages=256, page_size=8, compilation_cache_dir=XLA_CACHE)
    want = _expected(reference, reqs)
    for r, got, exp in zip(reqs, results, want):
        assert [c.token_ids for c in got.completions] == [o.token_ids for o in exp.outputs], r
        assert [c.text for c in got.completions] == [o.text for o in exp.outputs], r
    with Client(target) as c:
        info = c.model_info()
    assert info.num_devices == 8 and dict(info.mesh) == {"dp": 1, "tp": 8, "ep": 1}
    job.procs[0].send_signal(signal.SIGTERM)
    assert job.wait(0) == 0, job.stderr(0)[-3000:]
    assert job.wait(1) == 0, job.stderr(1)[-3000:]
    steps = int(re.search(r"process 1 done after (\d+) steps", job.stderr(1)).group(1))
    assert steps > max(r.get("max_tokens", 0) for r in reqs)


def _serve_and_kill(job_factory, tiny_gguf, victim: int):
    """Serve on tp=8, stream a long request, kill process ``victim`` after 5
    tokens; returns (job, the stream's RpcError, kill time)."""
    from jaxserve.server.client import Client
    job = job_factory("serve", ["--model", tiny_gguf, "--mesh", "tp=8", *ENGINE_FLAGS,
                                "--port", "0", "--metrics_port", "-1", "--nowarmup"])
    port = int(job.wait_for(0, r"gRPC on [\d.]+:(\d+)").group(1))
    job.wait_for(0, r"jaxserve: serving")
    job.wait_for(1, r"following process 0")
    t_kill = None
    with Client(f"127.0.0.1:{port}") as c:
        with pytest.raises(grpc.RpcError) as err:
            n = 0
            for _ in c.generate("hello", max_tokens=500, temperature=0, ignore_eos=True,
                                timeout=LIMIT_S):
                n += 1
                if n == 5:  # streaming: kill a process mid-request
                    job.procs[victim].kill()
                    t_kill = time.monotonic()
    assert t_kill is not None
    return job, err.value, t_kill


def test_killed_follower_fails_the_job(job_factory, tiny_gguf):
    job, err, t_kill = _serve_and_kill(job_factory, tiny_gguf, victim=1)
    assert err.code() == grpc.StatusCode.INTERNAL, err
    assert "multihost job failed" in err.details()
    assert job.wait(0, timeout_s=60) == 1
    assert time.monotonic() - t_kill < 60
    assert "multihost job failed" in job.stderr(0)


def test_killed_leader_fails_the_follower(job_factory, tiny_gguf):
    job, err, t_kill = _serve_and_kill(job_factory, tiny_gguf, victim=0)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    code = job.wait(1, timeout_s=60)
    assert time.monotonic() - t_kill < 60
    text = job.stderr(1)
    # Either jaxserve's own error (the broadcast failed: exit 1) or JAX's
    # (the coordination service on process 0 is gone: abort), whichever
    # comes first; jaxserve's first line comes out in both cases.
    assert code in (1, -signal.SIGABRT), (code, text[-3000:])
    assert ("process 1: multi-host step" in text and "failed" in text) or \
        "Terminating process because the JAX distributed service detected fatal errors" \
        in text, text[-3000:]


def test_processes_with_different_flags_refuse_to_start(job_factory, tiny_gguf):
    """Different cache sizes would compile different steps whose collectives
    never match (a hang): both processes must stop at start with exit 2."""
    args = [a for a in _generate_args(tiny_gguf, "tp=8") if a not in ("--num_pages", "256")]
    job = job_factory("generate", args, extra=(["--num_pages", "256"], ["--num_pages", "128"]))
    for i in range(2):
        assert job.wait(i, timeout_s=60) == 2, job.stderr(i)[-3000:]
        err = job.stderr(i)
        assert "were started with a different engine setup" in err, err[-3000:]
        assert "differ in ['engine.cache']" in err, err[-3000:]
