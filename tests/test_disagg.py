"""Disaggregated prefill/decode: a decode worker and a prefill worker as real
``python -m jaxserve.main --mode serve --role ...`` processes on 127.0.0.1,
the KV pulled over ``jax.experimental.transfer``, against a colocated
engine (``LLM``) in this process on the same tiny random GGUF."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import numpy as np
import pytest

from server_util import ServerProcess

pytestmark = pytest.mark.slow

PAGE = 16
PAGES = 1024
ENGINE = ["--num_pages", str(PAGES), "--page_size", str(PAGE), "--max_num_seqs", "32",
          "--max_num_batched_tokens", "512"]
MIN_PREFILL = 256


@pytest.fixture(scope="module")
def tiny2k(tmp_path_factory):
    """A tiny random Llama GGUF with 2,048 positions and 4 kv heads (so tp=4 splits them)."""
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("disagg") / "tiny2k.gguf"
    cfg = ModelConfig(vocab_size=320, max_position_embeddings=2048, num_layers=2,
                      hidden_size=128, num_heads=8, num_kv_heads=4, head_dim=16)
    write_tiny_gguf(path, cfg)
    return str(path), cfg


@pytest.fixture(scope="module")
def reference(tiny2k):
    from conftest import XLA_CACHE
    from jaxserve import LLM
    return LLM(tiny2k[0], num_pages=PAGES, page_size=PAGE, max_num_seqs=32,
               max_num_batched_tokens=512, compilation_cache_dir=XLA_CACHE)


def _pair(model: str, prefill_args=(), decode_args=(), env=None):
    prefill = ServerProcess(["--model", model, *ENGINE, "--role", "prefill", *prefill_args],
                            env=env)
    try:
        decode = ServerProcess(["--model", model, *ENGINE, "--role", "decode",
                                "--prefill_workers", prefill.target,
                                "--disagg_min_prefill_tokens", str(MIN_PREFILL),
                                *decode_args], env=env)
    except BaseException:
        prefill.kill()
        raise
    return prefill, decode


@pytest.fixture(scope="module")
def pair(tiny2k):
    prefill, decode = _pair(tiny2k[0], ["--kv_lease_s", "4"])
    yield prefill, decode
    assert decode.terminate() == 0
    assert prefill.terminate() == 0


def _ids(rng, n):
    return [int(i) for i in rng.integers(3, 320, size=n)]


def _greedy(llm, prompts, max_tokens=8):
    from jaxserve import SamplingParams
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


async def _complete(target, prompts, max_tokens=8, timeout=None):
    from jaxserve.server.client import AsyncClient
    async with AsyncClient(target) as c:
        return await asyncio.gather(*(c.complete(token_ids=p, max_tokens=max_tokens,
                                                 temperature=0, ignore_eos=True,
                                                 timeout=timeout) for p in prompts))


def _wait_healthy_worker(decode, timeout_s=30.0):
    """Until the decode worker's first health poll of its prefill worker
    has passed (a request before it would run locally as no_worker)."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        res = asyncio.run(_complete(decode.target, [[5] * (MIN_PREFILL + PAGE)], max_tokens=1))
        if res[0].disagg.route == "handoff":
            return
        time.sleep(0.5)
    raise AssertionError("the decode worker never saw its prefill worker healthy")


def _counter(metrics, name, label):
    return metrics.get(f'{name}{{{label}}}', 0.0)


def _wait_pages_free(server, timeout_s=30.0):
    t_end = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["jaxserve_kv_cache_pages_free"] == m["jaxserve_kv_cache_pages_total"] == PAGES \
                or time.monotonic() > t_end:
            return m
        time.sleep(0.25)


def test_mixed_batch_matches_colocated_and_routes_by_shape(pair, reference, tiny2k):
    prefill, decode = pair
    cfg = tiny2k[1]
    _wait_healthy_worker(decode)
    rng = np.random.default_rng(1)
    shorts = [_ids(rng, n) for n in (12, 30, 45, 60, 80, 120)]
    longs = [_ids(rng, n) for n in (1000, 950, 1100)]
    system = _ids(rng, 640)
    chats = [system + _ids(rng, 10) for _ in range(3)]
    before_d, before_p = decode.metrics(), prefill.metrics()

    first = asyncio.run(_complete(decode.target, shorts + longs + chats[:1]))
    later = asyncio.run(_complete(decode.target, chats[1:]))  # the system prompt is cached now
    got = first + later
    prompts = shorts + longs + chats
    want = _greedy(reference, prompts)
    assert [r.token_ids for r in got] == want
    routes = [r.disagg.route for r in got]
    assert routes == ["short"] * 6 + ["handoff"] * 4 + ["cached"] * 2

    page_bytes = 2 * cfg.num_layers * PAGE * cfg.num_kv_heads * cfg.head_dim * 4  # f32 K and V
    for r, p in zip(got, prompts):
        if r.disagg.route == "handoff":
            assert r.disagg.kv_transfer_bytes == -(-len(p) // PAGE) * page_bytes
            assert r.disagg.kv_transfer_ms > 0
            assert r.timing.queue_ms < r.timing.ttft_ms  # the handoff counts as prefill
            assert r.usage.cached_tokens == 0
        else:
            assert r.disagg.kv_transfer_bytes == 0
    assert got[-1].usage.cached_tokens == 640 // PAGE * PAGE

    after_d = _wait_pages_free(decode)
    after_p = _wait_pages_free(prefill)
    delta = lambda m0, m1, k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    for route, n in (("handoff", 4), ("short", 6), ("cached", 2)):
        k = f'jaxserve_disagg_routed_total{{route="{route}"}}'
        assert delta(before_d, after_d, k) == n, route
    assert delta(before_d, after_d, "jaxserve_kv_transfer_bytes_total") == sum(
        r.disagg.kv_transfer_bytes for r in got)
    assert delta(before_d, after_d, "jaxserve_kv_transfer_seconds_count") == 4
    assert not any(k.startswith("jaxserve_disagg_fallbacks_total") for k in after_d)
    # The prefill worker ran exactly the handed-off prompts, one token each.
    assert delta(before_p, after_p, 'jaxserve_request_success_total{finish_reason="length"}') == 4
    assert delta(before_p, after_p, "jaxserve_generation_tokens_total") == 4
    assert after_p["jaxserve_kv_cache_pages_free"] == PAGES  # every held page was pulled
    assert after_d["jaxserve_kv_cache_pages_free"] == PAGES


def test_random_aborts_leave_every_page_free_on_both_workers(pair, reference):
    """100 requests (half long enough to be handed off), each cancelled by
    its client at a random time: during routing, prefill, transfer or
    decode. Once the 4 s lease has passed, both workers hold no page, and
    the pair still answers like the colocated engine."""
    prefill, decode = pair
    rng = np.random.default_rng(2)
    prompts = [_ids(rng, int(n)) for n in rng.choice([40, 300, 700, 1200], size=100)]
    rnd = random.Random(3)

    async def one(c, p):
        try:
            await asyncio.wait_for(c.complete(token_ids=p, max_tokens=30, temperature=0,
                                              ignore_eos=True), rnd.uniform(0.0, 4.0))
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            pass

    async def run():
        from jaxserve.server.client import AsyncClient
        async with AsyncClient(decode.target) as c:
            await asyncio.gather(*(one(c, p) for p in prompts))

    asyncio.run(run())
    time.sleep(4.5)  # the lease of any page a cancelled handoff left behind
    after_p = _wait_pages_free(prefill, 30.0)
    after_d = _wait_pages_free(decode, 30.0)
    assert after_p["jaxserve_kv_cache_pages_free"] == PAGES
    assert after_d["jaxserve_kv_cache_pages_free"] == PAGES
    assert after_d["jaxserve_num_requests_running"] == 0
    check = [_ids(rng, 900), _ids(rng, 50)]
    got = asyncio.run(_complete(decode.target, check))
    assert [r.token_ids for r in got] == _greedy(reference, check)
    assert got[0].disagg.route == "handoff"


def test_prefill_and_decode_meshes_of_different_sizes(tiny2k, reference):
    """Prefill on tp=4, decode on tp=2 (each process with 4 fake CPU devices,
    8 in all; the decode worker's mesh uses 2 of its 4): the KV travels in
    the one-device transfer layout and the tokens are the one-device
    colocated engine's."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    prefill, decode = _pair(tiny2k[0], ["--mesh", "tp=4"],
                            ["--mesh", "tp=2", "--num_devices", "2"], env=env)
    try:
        _wait_healthy_worker(decode)
        rng = np.random.default_rng(4)
        prompts = [_ids(rng, 1000), _ids(rng, 600), _ids(rng, 40)]
        got = asyncio.run(_complete(decode.target, prompts))
        assert [r.token_ids for r in got] == _greedy(reference, prompts)
        assert [r.disagg.route for r in got] == ["handoff", "handoff", "short"]
    finally:
        assert decode.terminate() == 0
        prefill.kill()


def test_prefill_worker_that_hangs_then_dies_loses_nothing(tiny2k, reference):
    """The prefill worker freezes (SIGSTOP) with handoffs in flight, then is
    killed: every request completes with the colocated engine's tokens
    through local recompute within the deadlines, the fallbacks are counted,
    and later long prompts run locally as ``no_worker``."""
    prefill, decode = _pair(tiny2k[0], decode_args=["--disagg_prefill_timeout_s", "6",
                                                    "--disagg_transfer_timeout_s", "4"])
    try:
        _wait_healthy_worker(decode)
        before = decode.metrics().get("jaxserve_kv_transfer_seconds_count", 0.0)
        rng = np.random.default_rng(5)
        prompts = [_ids(rng, n) for n in (1000, 900, 800, 1100, 700, 600, 1000, 950)]

        async def run():
            task = asyncio.ensure_future(_complete(decode.target, prompts, timeout=120))
            t_end = time.monotonic() + 60
            while decode.metrics().get("jaxserve_kv_transfer_seconds_count", 0.0) <= before:
                assert time.monotonic() < t_end, "no handoff finished"
                await asyncio.sleep(0.02)
            os.kill(prefill.proc.pid, signal.SIGSTOP)  # the rest in prefill, Pull or transfer
            t0 = time.monotonic()
            res = await task
            return res, time.monotonic() - t0

        got, waited = asyncio.run(run())
        assert [r.token_ids for r in got] == _greedy(reference, prompts)
        assert waited < 60, waited
        m = decode.metrics()
        fallbacks = sum(v for k, v in m.items()
                        if k.startswith("jaxserve_disagg_fallbacks_total"))
        routes = [r.disagg.route for r in got]
        print("routes after the freeze:", routes)
        assert fallbacks >= 1
        assert fallbacks == sum(r.startswith("fallback:") for r in routes)
        os.kill(prefill.proc.pid, signal.SIGKILL)
        time.sleep(3.0)  # the next health poll finds it gone
        later = asyncio.run(_complete(decode.target, [_ids(rng, 900)], timeout=60))
        assert later[0].disagg.route == "no_worker"
        assert _wait_pages_free(decode)["jaxserve_kv_cache_pages_free"] == PAGES
    finally:
        assert decode.terminate() == 0
        prefill.kill()


def test_prefill_worker_killed_mid_flight_loses_nothing(tiny2k, reference):
    """SIGKILL the prefill worker as soon as its first KV pull has landed,
    with the other handoffs in prefill, Pull or transfer: every request
    completes with the colocated engine's tokens (local recompute) within a
    bounded time, and the failed handoffs are counted by reason."""
    prefill, decode = _pair(tiny2k[0])
    try:
        _wait_healthy_worker(decode)
        before = decode.metrics().get("jaxserve_kv_transfer_seconds_count", 0.0)
        rng = np.random.default_rng(6)
        prompts = [_ids(rng, n) for n in (1000, 950, 900, 1100, 850, 1050, 800, 1000)]

        async def run():
            task = asyncio.ensure_future(_complete(decode.target, prompts, timeout=120))
            t_end = time.monotonic() + 60
            while decode.metrics().get("jaxserve_kv_transfer_seconds_count", 0.0) <= before:
                assert time.monotonic() < t_end, "no handoff finished"
                await asyncio.sleep(0.02)
            prefill.proc.kill()
            t0 = time.monotonic()
            res = await task
            return res, time.monotonic() - t0

        got, waited = asyncio.run(run())
        assert [r.token_ids for r in got] == _greedy(reference, prompts)
        assert waited < 60, waited
        routes = [r.disagg.route for r in got]
        print("routes after the kill:", routes)
        assert "handoff" in routes and any(r.startswith("fallback:") for r in routes), routes
        m = decode.metrics()
        for reason in {r.split(":", 1)[1] for r in routes if r.startswith("fallback:")}:
            assert _counter(m, "jaxserve_disagg_fallbacks_total", f'reason="{reason}"') >= 1
        assert _wait_pages_free(decode)["jaxserve_kv_cache_pages_free"] == PAGES
    finally:
        assert decode.terminate() == 0
        prefill.kill()


def test_prefill_worker_with_other_weights_is_never_used(tiny2k, reference, tmp_path):
    """A prefill worker serving a model of the same shapes but other weights
    fails the decode worker's fingerprint check: it is logged, long prompts
    run locally (``no_worker``) with the right tokens, none is handed off."""
    from tiny_gguf import write_tiny_gguf
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, tiny2k[1], seed=1)
    prefill = ServerProcess(["--model", str(other), *ENGINE, "--role", "prefill"])
    try:
        decode = ServerProcess(["--model", tiny2k[0], *ENGINE, "--role", "decode",
                                "--prefill_workers", prefill.target])
        try:
            time.sleep(2.5)  # a couple of health polls
            rng = np.random.default_rng(7)
            prompts = [_ids(rng, 900)]
            got = asyncio.run(_complete(decode.target, prompts))
            assert [r.token_ids for r in got] == _greedy(reference, prompts)
            assert got[0].disagg.route == "no_worker"
            assert "Engine.kv_fingerprint differs" in "".join(decode.lines)
        finally:
            assert decode.terminate() == 0
    finally:
        assert prefill.terminate() == 0


def test_role_with_multihost_is_refused_before_joining_a_job(tiny2k):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "jaxserve.main", "--mode", "serve", "--model",
                        tiny2k[0], "--role", "decode", "--prefill_workers", "127.0.0.1:1",
                        "--multihost", "--coordinator_address", "127.0.0.1:1",
                        "--num_processes", "2", "--process_id", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--role decode runs in one-process workers" in r.stderr
