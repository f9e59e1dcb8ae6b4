"""A hostile client against a real server process (issue 15): odd request
ids, huge prompts, cumulative streams heavy with logprobs, ``n`` beyond the
engine, bytes that are no request, invalid UTF-8, a burst into a small queue.
Each gets a clear status, and the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.parse

import grpc
import pytest
from server_util import ServerProcess

from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server.checks import MAX_REQUEST_ID_CHARS
from jaxserve.server.client import AsyncClient, Client

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--num_pages", "1024", "--page_size", "8", "--max_num_seqs", "64",
                "--max_num_batched_tokens", "512"]

# Health checks from another process, timed; prints the slowest in seconds.
HEALTH_PROBE = """
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
ch = grpc.insecure_channel(sys.argv[1])
stub = health_pb2_grpc.HealthStub(ch)
stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected
print("ready", flush=True)
worst, t_end = 0.0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < t_end:
    t0 = time.monotonic()
    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    worst = max(worst, time.monotonic() - t0)
    time.sleep(0.02)
print(worst, flush=True)
"""


@pytest.fixture(scope="module")
def server(tiny_gguf):
    s = ServerProcess(["--model", tiny_gguf, *ENGINE_FLAGS])
    yield s
    workers = _children(s.proc.pid, "multiprocessing.spawn")
    assert s.terminate() == 0
    # A clean exit: nothing leaked by the tokenizer workers, none left running.
    t_end = time.monotonic() + 5
    while [p for p in workers if os.path.exists(f"/proc/{p}")] and time.monotonic() < t_end:
        time.sleep(0.1)
    assert workers and not [p for p in workers if os.path.exists(f"/proc/{p}")], workers
    assert not any("leaked" in line or "Traceback" in line for line in s.lines), s.lines[-10:]


def _children(pid: int, marker: str) -> list[int]:
    """Pids of ``pid``'s child processes whose command line contains ``marker``."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and marker in cmd:
            out.append(int(d))
    return out


def _code(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _still_serves(c: Client) -> None:
    assert c.health() == "SERVING"
    assert len(c.complete(token_ids=[5, 6, 7], max_tokens=3, temperature=0.0).token_ids) == 3


# ---- request ids -------------------------------------------------------------

@pytest.mark.parametrize("rid", [
    "caf\u00e9-\u65e5\u672c-\U0001F600",                  # non-ASCII
    "tab\there\nnewline\x00nul\x7fdel\r",                  # control characters
    "100%-sure, a=b&c",                                     # % and punctuation
    "\U0001F600" * MAX_REQUEST_ID_CHARS,                   # the longest, 4 bytes a character
    "x" * MAX_REQUEST_ID_CHARS,
])
def test_request_ids_round_trip(server, rid):
    with Client(server.target) as c:
        call = c.stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6]), request_id=rid,
            sampling=pb.SamplingParams(max_tokens=2, temperature=0.0)))
        responses = list(call)
        header = dict(call.initial_metadata())["x-request-id"]
        assert header.isascii() and header.isprintable()
        assert urllib.parse.unquote(header) == rid
        assert [r.request_id for r in responses] == [rid] * len(responses)
        assert responses[-1].finished
        _still_serves(c)


@pytest.mark.parametrize("size", [MAX_REQUEST_ID_CHARS + 1, 9_000, 16_000])
def test_long_request_id_is_invalid_argument(server, size):
    with Client(server.target) as c:
        code, details = _code(lambda: c.complete(token_ids=[5], max_tokens=1,
                                                 request_id="\u00e9" * size))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "request_id" in details and str(MAX_REQUEST_ID_CHARS) in details
        _still_serves(c)


# ---- big prompts -------------------------------------------------------------

def _probe(target: str, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, target, str(seconds)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_big_prompts_do_not_stall_health(server):
    """8 concurrent 5 MB prompts: refused on their size before tokenizing,
    while health checks from another process stay under 0.5 s."""
    probe = _probe(server.target, 4.0)
    big = "lorem ipsum " * (5_000_000 // 12)

    async def run():
        async with AsyncClient(server.target, max_message_bytes=64 << 20) as c:
            async def one(i):
                try:
                    await c.complete(big, max_tokens=1, request_id=f"big-{i}")
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()
                return grpc.StatusCode.OK, ""
            t0 = time.monotonic()
            out = await asyncio.gather(*(one(i) for i in range(8)))
            return out, time.monotonic() - t0

    results, took = asyncio.run(run())
    worst = float(probe.communicate(timeout=60)[0].strip())
    for code, details in results:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "prompt.text" in details and "bytes" in details
    assert worst < 0.5, worst
    with Client(server.target) as c:
        _still_serves(c)


def test_tokenizer_workers_serve_and_recover(server):
    """Texts under the byte bound but over the inline size go to the worker
    processes (then fail on their token count); after a worker is killed, the
    pool is replaced and large texts still work; no traceback in the log."""
    long_text = "hello world " * 500  # 6,000 characters: pooled, ~1,000+ tokens > 511
    workers = _children(server.proc.pid, "multiprocessing.spawn")
    assert len(workers) >= 2, workers
    with Client(server.target) as c:
        code, details = _code(lambda: c.complete(long_text, max_tokens=1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "tokens is more than max_prompt_len=511" in details
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(0.5)
        for _ in range(3):
            code, details = _code(lambda: c.complete(long_text, max_tokens=1))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "tokens is more than max_prompt_len=511" in details
        assert len(c.tokenize(long_text[:3000])) > 400  # Tokenize takes the pool too
        _still_serves(c)
    assert not any("Traceback" in line for line in server.lines), "".join(server.lines[-30:])


# ---- output size -------------------------------------------------------------

def test_cumulative_logprobs_bounded(server):
    """n=64, logprobs=20 as CUMULATIVE: refused up front when its messages
    could grow past the limit; a smaller one streams the same tokens and
    logprobs as DELTA does, quickly."""
    with Client(server.target) as c:
        code, details = _code(lambda: c.complete(
            token_ids=[5, 6, 7], n=64, logprobs=20, max_tokens=256, temperature=1.0, seed=3,
            output_kind=pb.OUTPUT_KIND_CUMULATIVE))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "output_kind" in details and "OUTPUT_KIND_DELTA" in details
        code, details = _code(lambda: c.complete(
            token_ids=[5, 6, 7], n=64, logprobs=20, max_tokens=256,
            output_kind=pb.OUTPUT_KIND_FINAL_ONLY))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "FINAL_ONLY" in details, details

        kw = dict(token_ids=[5, 6, 7], n=64, logprobs=20, max_tokens=12, temperature=1.0,
                  seed=3, ignore_eos=True)
        t0 = time.monotonic()
        responses = list(c.generate(output_kind=pb.OUTPUT_KIND_CUMULATIVE, **kw))
        took = time.monotonic() - t0
        delta = c.complete(**kw)
    assert took < 30, took
    last = {comp.index: comp for comp in responses[-1].completions}
    assert sorted(last) == list(range(64))
    for d in delta.completions:
        comp = last[d.index]
        assert list(comp.token_ids) == d.token_ids and len(d.token_ids) == 12
        assert comp.text == d.text and comp.finish_reason == "length"
        assert list(comp.logprobs) == d.logprobs
        assert all(len(p.top) >= 20 for p in comp.logprobs)  # the top 20, and the chosen
    # Every message is cumulative: token counts never shrink, all choices present.
    counts = [[len(comp.token_ids) for comp in r.completions] for r in responses]
    assert all(len(cs) == 64 for cs in counts)
    assert all(a <= b for prev, cur in zip(counts, counts[1:]) for a, b in zip(prev, cur))
    assert responses[-1].usage.completion_tokens == 64 * 12


# ---- fields against the engine's limits -------------------------------------

def test_n_above_max_num_seqs_is_invalid_argument(server):
    with Client(server.target) as c:
        for n in (65, 10_000):
            code, details = _code(lambda: c.complete(token_ids=[5], max_tokens=1, n=n))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "sampling.n" in details and "max_num_seqs=64" in details
        _still_serves(c)


def test_undecodable_bytes_are_invalid_argument(server):
    good = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=1))
    cases = {
        b"\x0a\xff\xff\xff\xff": "GenerateRequest",                  # length past the end
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01": "GenerateRequest",  # bad varint tag
        good.SerializeToString().replace(b"hello", b"he\xffo"): "text: invalid UTF-8 at byte 2",
    }
    with Client(server.target) as c:
        raw = c.channel.unary_stream("/jaxserve.v1.Generation/Generate")
        for body, want in cases.items():
            code, details = _code(lambda: list(raw(body, timeout=10)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (body, details)
            assert want in details, details
        raw_tok = c.channel.unary_unary("/jaxserve.v1.Generation/Tokenize")
        code, details = _code(lambda: raw_tok(b"\x0a\x05ab", timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        _still_serves(c)
    assert not any("Traceback" in line for line in server.lines), "".join(server.lines[-30:])


def test_queue_bound_counts_only_requests_that_cannot_start(tiny_gguf):
    """--max_waiting_requests 4 and 64 free running slots: a burst of 80
    admits at least the 64 that can start plus the 4 that may wait."""
    s = ServerProcess(["--model", tiny_gguf, *ENGINE_FLAGS, "--max_waiting_requests", "4"])
    try:
        async def one(c, i, n=1):
            try:
                r = await c.complete(token_ids=[5, i % 300 + 3], max_tokens=64, temperature=0.0,
                                     ignore_eos=True, n=n)
            except grpc.aio.AioRpcError as e:
                return e.code()
            assert [len(x.token_ids) for x in r.completions] == [64] * n
            return grpc.StatusCode.OK

        async def run():
            async with AsyncClient(s.target) as c:
                await c.complete(token_ids=[5], max_tokens=1)  # warm
                # n above the waiting bound, into an idle engine: its choices start at once.
                alone = await one(c, 0, n=8)
                return alone, await asyncio.gather(*(one(c, i) for i in range(80)))
        alone, codes = asyncio.run(run())
        assert alone == grpc.StatusCode.OK
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes.count(grpc.StatusCode.OK) >= 68, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes  # the bound holds
        m = s.metrics()
        assert m["jaxserve_kv_cache_pages_used"] == 0
        assert m["jaxserve_xla_compilations_total"] >= 2  # at least a prefill and a decode
    finally:
        assert s.terminate() == 0


@pytest.mark.real_model
def test_big_prompts_tokenize_off_the_event_loop(smollm2_path):
    """SmolLM2 (max_prompt_len 8191): 8 concurrent ~1.2 MB texts and chats
    pass the size check, tokenize on the worker pool (about a second each on
    the dev machine), and are then refused on their token count, while
    health checks from another process stay under 0.5 s."""
    from jaxserve.bench.workloads import CORPUS
    s = ServerProcess(["--model", str(smollm2_path), "--num_pages", "256",
                       "--max_num_seqs", "8"])
    try:
        text = (CORPUS * (1_200_000 // len(CORPUS) + 1))[:1_200_000]
        probe = _probe(s.target, 5.0)

        async def run():
            async with AsyncClient(s.target) as c:
                async def one(i):
                    kw = dict(prompt=text) if i % 2 else dict(
                        messages=[{"role": "user", "content": text}])
                    try:
                        await c.complete(max_tokens=1, **kw)
                    except grpc.aio.AioRpcError as e:
                        return e.code(), e.details()
                    return grpc.StatusCode.OK, ""
                return await asyncio.gather(*(one(i) for i in range(8)))
        results = asyncio.run(run())
        worst = float(probe.communicate(timeout=120)[0].strip())
        for code, details in results:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "tokens is more than max_prompt_len=8191" in details, details
        assert worst < 0.5, worst
        with Client(s.target) as c:
            assert c.health() == "SERVING"
            assert len(c.complete("Hello", max_tokens=2, temperature=0.0).token_ids) == 2
    finally:
        assert s.terminate() == 0
