"""The OpenAI HTTP API and gRPC under load on one server process: 100 HTTP
streams (``openai.AsyncOpenAI``) and 100 gRPC streams at once, each equal to
its ``LLM.generate`` result; then 30 HTTP clients that hang up mid-stream,
each aborted in the engine within one step, every page freed.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from jaxserve.server.client import AsyncClient
from server_util import ServerProcess
from test_server import ENGINE_FLAGS, _expected, _mixed_requests, _wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_gguf):
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", *ENGINE_FLAGS])
    yield s
    assert s.terminate() == 0


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    from jaxserve import LLM
    from conftest import XLA_CACHE
    return LLM(tiny_gguf, num_pages=1024, page_size=8, compilation_cache_dir=XLA_CACHE)


async def _http_stream(client: openai.AsyncOpenAI, model: str, r: dict):
    """One ``_mixed_requests`` request as an OpenAI stream; returns
    ({index: text}, {index: finish_reason}, usage)."""
    kw = dict(model=model, max_tokens=r["max_tokens"], temperature=r["temperature"],
              stream=True, stream_options={"include_usage": True})
    for name in ("top_p", "seed", "n"):
        if name in r:
            kw[name] = r[name]
    if "messages" in r:
        stream = await client.chat.completions.create(messages=r["messages"], **kw)
    else:
        stream = await client.completions.create(prompt=r.get("prompt") or r["token_ids"], **kw)
    texts, finish, usage = {}, {}, None
    async for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content or "") if "messages" in r else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def _deltas(before: dict, after: dict, prefix: str) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if k.startswith(prefix)}


def test_100_http_and_100_grpc_streams_match_llm_generate(server, reference, tiny_gguf):
    http_reqs = _mixed_requests(100, seed=10)
    grpc_reqs = [dict(r, request_id=f"grpc-{i}") for i, r in
                 enumerate(_mixed_requests(100, seed=11))]
    before = server.metrics()

    async def run():
        oai = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused",
                                 max_retries=0, timeout=300)
        async with AsyncClient(server.target) as c:
            jobs = [_http_stream(oai, tiny_gguf, r) for r in http_reqs] + \
                [c.complete(**r) for r in grpc_reqs]
            out = await asyncio.gather(*jobs)
        await oai.close()
        return out[:100], out[100:]

    http_got, grpc_got = asyncio.run(run())
    for r, (texts, finish, usage), exp in zip(http_reqs, http_got,
                                              _expected(reference, http_reqs)):
        want = sorted(exp.outputs, key=lambda o: o.index)
        assert texts == {i: o.text for i, o in enumerate(want)}, r
        assert finish == {i: o.finish_reason for i, o in enumerate(want)}, r
        assert usage.prompt_tokens == len(exp.prompt_token_ids), r
        assert usage.completion_tokens == sum(len(o.token_ids) for o in want), r
    for r, got, exp in zip(grpc_reqs, grpc_got, _expected(reference, grpc_reqs)):
        assert got.request_id == r["request_id"]
        assert [c.token_ids for c in got.completions] == [o.token_ids for o in exp.outputs], r
        assert [c.text for c in got.completions] == [o.text for o in exp.outputs], r
    after = _wait_idle(server)
    assert after["jaxserve_kv_cache_pages_free"] == after["jaxserve_kv_cache_pages_total"]
    assert after["jaxserve_kv_cache_pages_used"] == 0
    done = sum(_deltas(before, after, "jaxserve_request_success_total").values())
    assert done == 200


def test_30_http_clients_hanging_up_are_aborted_within_one_step(server, tiny_gguf):
    """Long streams (400 tokens, ignore_eos) closed after 1..5 chunks: raw
    httpx streams, openai completion streams and openai chat streams."""
    rng = random.Random(3)
    long = dict(model=tiny_gguf, max_tokens=400, temperature=0, stream=True)
    before = _wait_idle(server)

    async def raw(h: httpx.AsyncClient, i: int, stop_after: int):
        seen = 0
        async with h.stream("POST", "/v1/completions",
                            json=dict(prompt=[9, i + 3, 5], ignore_eos=True, **long)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == stop_after:
                        break  # leaving the block closes the connection
        return seen

    async def sdk(client: openai.AsyncOpenAI, i: int, stop_after: int, chat: bool):
        extra = dict(extra_body={"ignore_eos": True})
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"tea {i}"}], **long, **extra)
        else:
            stream = await client.completions.create(prompt=f"hello {i}", **long, **extra)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == stop_after:
                break
        await stream.close()
        return seen

    async def run():
        oai = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused",
                                 max_retries=0, timeout=300)
        async with httpx.AsyncClient(base_url=server.http_url, timeout=300) as h:
            jobs = [raw(h, i, rng.randint(1, 5)) for i in range(10)] + \
                [sdk(oai, i, rng.randint(1, 5), chat=False) for i in range(10)] + \
                [sdk(oai, i, rng.randint(1, 5), chat=True) for i in range(10)]
            seen = await asyncio.gather(*jobs)
        await oai.close()
        return seen

    seen = asyncio.run(run())
    assert all(1 <= s <= 5 for s in seen), seen
    t_end = time.monotonic() + 30  # the server sees the last hang-ups a moment later
    while True:
        after = _wait_idle(server)
        aborted = after["jaxserve_request_aborted_total"] - before["jaxserve_request_aborted_total"]
        if aborted >= 30 or time.monotonic() > t_end:
            break
        time.sleep(0.1)
    assert aborted == 30
    delays = _deltas(before, after, "jaxserve_abort_delay_steps")
    assert delays["jaxserve_abort_delay_steps_count"] == 30
    assert delays['jaxserve_abort_delay_steps_bucket{le="1.0"}'] == 30  # within one step
    success = sum(_deltas(before, after, "jaxserve_request_success_total").values())
    assert success == 0  # none of the 400-token streams ran to its end
    assert after["jaxserve_num_requests_running"] == after["jaxserve_num_requests_waiting"] == 0
    assert after["jaxserve_kv_cache_pages_used"] == 0
    assert after["jaxserve_kv_cache_pages_free"] == after["jaxserve_kv_cache_pages_total"]
