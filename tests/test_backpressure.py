"""Backpressure for streams nobody reads: the rule's unit behaviour (pause,
resume, cut), and a real server whose slots are all taken by HTTP and gRPC
streams that are never read: they are paused, other clients are served at
normal speed meanwhile, they are cut after the stall timeout, and memory
returns.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import socket
import statistics
import time
import urllib.request

import grpc
import pytest
from server_util import ServerProcess

from jaxserve.metrics import ServingMetrics
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.request_stream import StreamBackpressure, StreamState
from jaxserve.server.backpressure import StreamGuard, StreamLimits
from jaxserve.server.client import make_request


@pytest.mark.parametrize("kw, msg", [
    (dict(buffer_outputs=0), "stream_buffer_outputs must be an int >= 1, got 0"),
    (dict(buffer_outputs=True), "stream_buffer_outputs must be an int >= 1, got True"),
    (dict(stall_timeout_s=0.0), "stream_stall_timeout_s must be > 0 or None, got 0.0"),
    (dict(stall_timeout_s=float("nan")), "stream_stall_timeout_s must be > 0 or None, got nan"),
    (dict(pause_after_s=-1.0), "stream_pause_after_s must be > 0 or None, got -1.0"),
])
def test_limits_refuse_bad_values(kw, msg):
    with pytest.raises(ValueError) as e:
        StreamLimits(**kw)
    assert str(e.value) == msg


def test_server_config_checks_the_stream_limits():
    from jaxserve.server_config import ServerConfig
    assert ServerConfig(stream_stall_timeout_s=None).stream_stall_timeout_s is None
    with pytest.raises(ValueError) as e:
        ServerConfig(stream_stall_timeout_s=-1.0)
    assert str(e.value) == "stream_stall_timeout_s must be > 0 or None, got -1.0"
    with pytest.raises(ValueError) as e:
        ServerConfig(stream_buffer_outputs=0)
    assert str(e.value) == "stream_buffer_outputs must be an int >= 1, got 0"
    with pytest.raises(ValueError) as e:
        ServerConfig(stream_pause_after_s=0.0)
    assert str(e.value) == "stream_pause_after_s must be > 0 or None, got 0.0"
    limits = ServerConfig(stream_pause_after_s=0.5, stream_stall_timeout_s=None).stream_limits()
    assert (limits.pause_after_s, limits.stall_timeout_s, limits.check_interval_s) == \
        (0.5, None, 0.25)


def _guard(limits, paused=None, resumed=None):
    metrics, aborted = ServingMetrics(), []
    guard = StreamGuard(limits, metrics, aborted.append, StreamBackpressure,
                        None if paused is None else paused.append,
                        None if resumed is None else resumed.append)
    return guard, metrics, aborted


def _count(metrics, reason, action="aborted"):
    return metrics.registry.get_sample_value("jaxserve_stream_backpressure_total",
                                             {"action": action, "reason": reason})


def test_buffer_full_aborts_and_drops(caplog):
    async def run():
        guard, metrics, aborted = _guard(StreamLimits(buffer_outputs=3, stall_timeout_s=None))
        s = StreamState("s7", asyncio.Queue(), label="cmpl-x")
        for i in range(3):
            guard.deliver(s, i)
        assert s.outputs.qsize() == 3 and not aborted
        guard.read(s) if s.outputs.get_nowait() == 0 else None  # a read: 2 left
        guard.deliver(s, 3)
        guard.deliver(s, 4)  # 4 waiting > 3
        assert aborted == [s] and s.dropped
        assert s.outputs.qsize() == 1 and isinstance(s.outputs.get_nowait(), StreamBackpressure)
        guard.deliver(s, 5)  # the engine's later outputs are discarded
        assert s.outputs.qsize() == 0
        return metrics
    metrics = asyncio.run(run())
    assert _count(metrics, "buffer_full") == 1 and _count(metrics, "stalled") == 0
    lines = [r.getMessage() for r in caplog.records if "stream backpressure" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "stream backpressure: request cmpl-x (engine s7) aborted: buffer_full, unread ")
    assert lines[0].endswith(" s, 4 outputs buffered")


def test_stall_watch_aborts_only_unread_streams():
    async def run():
        # Stall timeout 10x the reader's pace: a loaded machine (the CI box
        # running the suite beside it) may hold the loop a few tenths of a second.
        guard, metrics, aborted = _guard(StreamLimits(stall_timeout_s=0.5, pause_after_s=None))
        unread, reader, idle = (StreamState(f"s{i}", asyncio.Queue()) for i in range(3))
        watch = asyncio.ensure_future(guard.watch(lambda: [unread, reader, idle]))
        guard.deliver(unread, "a")
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:  # the reader takes each output within 0.05 s
            guard.deliver(reader, "b")
            await asyncio.sleep(0.05)
            reader.outputs.get_nowait()
            guard.read(reader)
        watch.cancel()
        assert aborted == [unread] and not reader.dropped and not idle.dropped
        return metrics
    metrics = asyncio.run(run())
    assert _count(metrics, "stalled") == 1


def test_a_slow_heap_trim_after_a_cut_does_not_stall_readers(monkeypatch):
    """The heap trim after a cut runs off the event loop: in a process of a
    few GB ``malloc_trim`` took over a second, and on the loop it made a
    reader that keeps up look unread for that long, so it was cut too (the
    suite's own process showed it: the stall tests failed there, never alone)."""
    from jaxserve.server import backpressure
    monkeypatch.setattr(backpressure, "malloc_trim", lambda: time.sleep(1.0))

    async def run():
        guard, metrics, aborted = _guard(StreamLimits(stall_timeout_s=0.3, pause_after_s=None))
        unread, reader = StreamState("s5", asyncio.Queue()), StreamState("s6", asyncio.Queue())
        watch = asyncio.ensure_future(guard.watch(lambda: [unread, reader]))
        guard.deliver(unread, "a")
        t_end = time.monotonic() + 2.0  # the cut near 0.5 s, then a 1 s trim
        while time.monotonic() < t_end:
            guard.deliver(reader, "b")
            await asyncio.sleep(0.05)
            assert reader.outputs.get_nowait() == "b"
            guard.read(reader)
        watch.cancel()
        assert aborted == [unread] and not reader.dropped
    asyncio.run(run())


def test_unread_stream_is_paused_then_resumed_when_read_then_cut(caplog):
    """Unread past ``pause_after_s``: paused once; read empty: resumed; unread
    again past the stall timeout: cut (paused or not). A reader that keeps
    up is never paused."""
    caplog.set_level(logging.INFO, logger="jaxserve.server.backpressure")

    async def run():
        paused, resumed = [], []
        guard, metrics, aborted = _guard(
            StreamLimits(stall_timeout_s=0.9, pause_after_s=0.15), paused, resumed)
        s = StreamState("s3", asyncio.Queue(), label="cmpl-p")
        reader = StreamState("s4", asyncio.Queue())
        watch = asyncio.ensure_future(guard.watch(lambda: [s, reader]))

        async def keep_reading(seconds):
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                guard.deliver(reader, "r")
                await asyncio.sleep(0.03)
                reader.outputs.get_nowait()
                guard.read(reader)
        guard.deliver(s, 1)
        guard.deliver(s, 2)
        await keep_reading(0.4)
        assert paused == [s] and s.paused and not resumed and not aborted
        s.outputs.get_nowait()
        guard.read(s)  # one still waits: not yet
        assert not resumed and s.paused
        s.outputs.get_nowait()
        guard.read(s)  # all read: resumed at once
        assert resumed == [s] and not s.paused
        guard.deliver(s, 3)  # unread again: paused again, then cut at the stall timeout
        await keep_reading(1.3)
        watch.cancel()
        assert paused == [s, s] and aborted == [s] and s.dropped
        assert not reader.paused and not reader.dropped
        return metrics
    metrics = asyncio.run(run())
    assert _count(metrics, "unread", "paused") == 2 and _count(metrics, "read", "resumed") == 1
    assert _count(metrics, "stalled") == 1
    lines = [r.getMessage() for r in caplog.records if "stream backpressure" in r.getMessage()]
    assert [ln.split(":")[1].split(" ", 5)[-1].split(",")[0] for ln in lines] == [
        "paused", "resumed", "paused", "aborted"], lines
    assert lines[-1].endswith(" outputs buffered (paused)")


def test_a_reader_that_falls_behind_is_paused_at_a_quarter_of_the_buffer():
    async def run():
        paused, resumed = [], []
        guard, _, aborted = _guard(StreamLimits(buffer_outputs=8, stall_timeout_s=None),
                                   paused, resumed)
        s = StreamState("s2", asyncio.Queue())
        for i in range(3):
            guard.deliver(s, i)
        assert paused == [s] and s.outputs.qsize() == 3  # 3 > 8 // 4, no tick needed
        guard.deliver(s, 3)
        assert paused == [s] and not aborted
        while not s.outputs.empty():
            s.outputs.get_nowait()
            guard.read(s)
        assert resumed == [s]
    asyncio.run(run())


def test_pausing_off_without_a_pause_time():
    async def run():
        paused = []
        guard, _, aborted = _guard(StreamLimits(stall_timeout_s=0.3, pause_after_s=None),
                                   paused, [])
        s = StreamState("s1", asyncio.Queue())
        watch = asyncio.ensure_future(guard.watch(lambda: [s]))
        guard.deliver(s, 1)
        await asyncio.sleep(0.6)
        watch.cancel()
        return paused, aborted, s
    paused, aborted, s = asyncio.run(run())
    assert paused == [] and aborted == [s]


# ---- a real server ----------------------------------------------------------------

STALL_S = 12.0
PAUSE_S = 0.5
ENGINE_FLAGS = ["--num_pages", "2048", "--page_size", "8", "--max_num_seqs", "64",
                "--max_num_batched_tokens", "512", "--http_port", "0",
                "--stream_stall_timeout_s", str(STALL_S), "--stream_pause_after_s", str(PAUSE_S),
                "--stream_buffer_outputs", "64"]  # paused at 16 waiting, cut at 64
UNREAD = dict(n=16, logprobs=20, max_tokens=480, temperature=1.0, ignore_eos=True)


def _post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _short(server) -> float:
    """Seconds a 4-token completion takes; checks it got 4 tokens."""
    t0 = time.monotonic()
    out = _post(server.http_url + "/v1/completions",
                dict(prompt="hi", max_tokens=4, temperature=0, ignore_eos=True))
    assert out["usage"]["completion_tokens"] == 4, out
    return time.monotonic() - t0


def _unread_http(port: int) -> socket.socket:
    """A streamed completion posted on a socket that is never read (a small
    receive buffer, so the server's send blocks soon)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps(dict(prompt="tell me a story", stream=True, **UNREAD)).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return s


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def _wait(pred, timeout_s: float, what: str):
    t_end = time.monotonic() + timeout_s
    while not (v := pred()):
        assert time.monotonic() < t_end, what
        time.sleep(0.1)
    return v


def _counts(server) -> dict[str, float]:
    m = server.metrics()
    return {f"{a}/{r}": m[f'jaxserve_stream_backpressure_total{{action="{a}",reason="{r}"}}']
            for a, r in (("paused", "unread"), ("resumed", "read"), ("aborted", "stalled"),
                         ("aborted", "buffer_full"))}


def _unread_round(server, grpc_id: str, read_after: bool):
    """Three HTTP clients and one gRPC client (n 16 each: all 64 slots) post
    streams and read nothing. Once all four are paused (their 64 sequences
    hold no slot), three 4-token requests are timed while the four are still
    open and not yet cut; five more after the stall timeout cuts them; then
    the clients read what is left (``read_after``) or hang up without
    reading (a gRPC cancel while the server's write waits on flow control).
    Returns (latencies while paused s, latencies after the cut s, counts by
    action/reason of this round)."""
    before = _counts(server)
    socks = [_unread_http(server.http_port) for _ in range(3)]
    # No BDP probing: the HTTP/2 window stays at its 64 KiB default.
    channel = grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.GenerationStub(channel).Generate(
        make_request("tell me a story", request_id=grpc_id, **UNREAD))

    def counts():
        now = _counts(server)
        return {k: now[k] - before[k] for k in now}
    # A stream may be paused and resumed while its socket still drains
    # (kernel buffers); once nobody reads, all four stay paused.
    def all_paused():
        c = counts()
        return c["paused/unread"] - c["resumed/read"] == 4 and \
            server.metrics()["jaxserve_num_requests_running"] == 0
    _wait(all_paused, 60, f"the unread streams were not all paused: {counts()}\n"
          + "".join(server.lines[-20:]))
    while_paused = [_short(server) for _ in range(3)]
    c = counts()
    assert c["paused/unread"] - c["resumed/read"] == 4, c
    if read_after:  # (the first round may still wait for background compiles)
        assert c["aborted/stalled"] + c["aborted/buffer_full"] == 0, \
            f"cut before the requests beside them ended: {c}"
        assert server.metrics()["jaxserve_num_requests_paused"] > 0
    _wait(lambda: counts()["aborted/stalled"] >= 4, STALL_S + 10,
          "the unread streams were not all cut\n" + "".join(server.lines[-20:]))
    after_cut = [_short(server) for _ in range(5)]
    c = counts()
    assert c["aborted/stalled"] == 4 and c["aborted/buffer_full"] == 0, c
    assert server.metrics()["jaxserve_num_requests_paused"] == 0
    if not read_after:
        for s in socks:
            s.close()
        call.cancel()
        channel.close()
        _wait(lambda: server.metrics()["jaxserve_num_requests_running"] == 0, 30, "drain")
        return while_paused, after_cut, c
    # A client that reads after the cut gets what was in flight, then every
    # choice ends with finish_reason "abort" before its max_tokens.
    data = b""
    while b"data: [DONE]" not in data[-200:]:
        chunk = socks[0].recv(1 << 20)
        assert chunk, data[-500:]
        data += chunk
    tail = data.split(b"\r\n\r\n", 1)[1]
    reasons = re.findall(rb'"finish_reason": ?"?(\w+)', tail)
    assert sorted(set(reasons)) == [b"abort", b"null"] and reasons.count(b"abort") == 16, \
        collections.Counter(reasons)
    assert not re.findall(rb'"finish_reason": ?"length"', tail)
    for s in socks:
        s.close()
    last = list(call)[-1]
    assert last.finished and last.request_id == grpc_id
    assert [c.finish_reason for c in last.completions] == ["abort"] * 16, last
    assert 0 < last.usage.completion_tokens < 16 * UNREAD["max_tokens"], last.usage
    channel.close()
    _wait(lambda: server.metrics()["jaxserve_num_requests_running"] == 0, 30, "drain")
    m = server.metrics()
    assert m["jaxserve_kv_cache_pages_free"] == m["jaxserve_kv_cache_pages_total"]
    return while_paused, after_cut, c


def test_unread_streams_are_paused_then_cut_others_served_meanwhile(tiny_gguf):
    server = ServerProcess(["--model", tiny_gguf, *ENGINE_FLAGS], warmup=True)
    try:
        # Every step shape compiled (the background warm-up caps the rows
        # until then, so 64 sequences could not run at once).
        _wait(lambda: server.metrics()["jaxserve_startup_warmup_seconds"] > 0, 600,
              "the background warm-up did not end")
        # Warm-up: one whole round, so the step shapes are compiled and the
        # allocators have grown to the steady state before RSS is read.
        _unread_round(server, "grpc-unread-0", read_after=False)
        baseline = statistics.median(_short(server) for _ in range(5))
        time.sleep(1.0)
        rss_before = _rss_kib(server.proc.pid)
        compiled = server.metrics()["jaxserve_xla_compilations_total"]
        while_paused, after_cut, counts = _unread_round(server, "grpc-unread-1", read_after=True)
        time.sleep(1.0)
        rss_after = _rss_kib(server.proc.pid)
        print(f"baseline {baseline:.3f} s, while paused {max(while_paused):.3f} s, after the "
              f"cut {max(after_cut):.3f} s; RSS {rss_before} -> {rss_after} KiB; {counts}; "
              f"compiled {server.metrics()['jaxserve_xla_compilations_total'] - compiled}")
        # Normal speed beside the paused streams and after the cut.
        assert max(while_paused) < 3 * baseline + 0.5, (while_paused, baseline)
        assert max(after_cut) < 3 * baseline + 0.5, (after_cut, baseline)
        assert rss_after <= 1.05 * rss_before, (rss_before, rss_after)
        lines = [ln for ln in server.lines if "stream backpressure: request" in ln]
        aborted = [ln for ln in lines if ") aborted: " in ln]  # 4 a round
        assert len([ln for ln in aborted if "request grpc-unread-1 " in ln]) == 1, lines
        assert len([ln for ln in aborted if "request cmpl-" in ln]) == 6, lines
        paused = [ln for ln in lines if ") paused: " in ln]
        assert any("request grpc-unread-1 " in ln for ln in paused), lines
    finally:
        code = server.terminate()
    assert code == 0
    tb = [i for i, line in enumerate(server.lines) if "Traceback" in line]
    assert not tb, "".join(server.lines[tb[0] - 2:] if tb else [])
