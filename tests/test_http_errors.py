"""The OpenAI-compatible HTTP API refuses bad input, missing tokens, a full
queue and requests while draining in OpenAI's error shape, and keeps
serving: a real ``python -m jaxserve.main --mode serve --http_port 0``
process serving a tiny random GGUF (fixtures and helpers from
``test_http``), the next good request checked against ``LLM.generate``.
"""
# ruff: noqa: F811 - test arguments name the fixtures imported from test_http

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import httpx
import openai
import pytest

from server_util import ServerProcess
from test_http import CHAT, _assert_error, _assert_serves, _sp
from test_http import client, http, reference, server  # noqa: F401 - the fixtures
from test_server import _wait_idle

pytestmark = pytest.mark.slow

# ---- bad input ------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
BAD = [  # (route, body, status, param)
    ("/v1/completions", dict(prompt=""), 400, "prompt"),
    ("/v1/completions", dict(prompt=[]), 400, "prompt"),
    ("/v1/completions", dict(max_tokens=3), 400, "prompt"),                       # missing
    ("/v1/completions", dict(prompt=[5, 320]), 400, "prompt"),                    # outside vocab
    ("/v1/completions", dict(prompt=list(range(3, 303)) * 2), 400, "prompt"),     # 600 > 511
    ("/v1/completions", dict(prompt="hi", max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", dict(prompt="hi", max_tokens=600), 400, "max_tokens"),    # > context
    ("/v1/completions", dict(prompt="hi", temperature=-1), 400, "temperature"),
    ("/v1/completions", dict(prompt="hi", temperature="hot"), 400, "temperature"),
    ("/v1/completions", dict(prompt="hi", n=0), 400, "n"),
    ("/v1/completions", dict(prompt="hi", logprobs=21), 400, "logprobs"),
    ("/v1/completions", dict(prompt="hi", top_p=0), 400, "top_p"),
    ("/v1/chat/completions", dict(messages=[]), 400, "messages"),
    ("/v1/chat/completions", dict(max_tokens=3), 400, "messages"),                # missing
    ("/v1/chat/completions", dict(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages"),
    ("/v1/chat/completions", dict(messages=HI, max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", dict(messages=HI, max_completion_tokens=600), 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", dict(messages=HI, temperature=-1), 400, "temperature"),
    ("/v1/chat/completions", dict(messages=HI, n=0), 400, "n"),
    ("/v1/chat/completions", dict(messages=HI, logprobs=True, top_logprobs=21), 400,
     "top_logprobs"),
    # stream_options without stream, and vLLM extras that would change the
    # output if honoured: refused, not ignored
    ("/v1/completions", dict(prompt="hi", stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("/v1/completions", dict(prompt="hi", logits_processors=["x"]), 400, "logits_processors"),
    ("/v1/chat/completions", dict(messages=HI, add_generation_prompt=False), 400,
     "add_generation_prompt"),
    ("/v1/chat/completions", dict(messages=HI, echo=True), 400, "echo"),
]


@pytest.mark.parametrize("route, body, status, param", BAD,
                         ids=[f"{r.split('/')[-1]}-{p}-{i}" for i, (r, _, _, p) in
                              enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(server, http, reference, tiny_gguf, route, body,
                                             status, param):
    _assert_error(http.post(route, json=dict(model=tiny_gguf, **body)), status, param)
    _assert_serves(http, tiny_gguf, reference)


def test_bad_bodies_and_unknown_fields(server, client, http, reference, tiny_gguf):
    # Malformed JSON, a body that is not an object, another content type.
    for route in ("/v1/completions", "/v1/chat/completions"):
        _assert_error(http.post(route, content=b'{"prompt": "hi",',
                                headers={"content-type": "application/json"}), 400)
        _assert_error(http.post(route, json=["hi"]), 400)
        _assert_error(http.post(route, content=json.dumps(dict(model=tiny_gguf, prompt="hi",
                                                               messages=HI)),
                                headers={"content-type": "text/plain"}), 400)
        _assert_serves(http, tiny_gguf, reference)
    # A body over 16 MiB.
    _assert_error(http.post("/v1/completions", json=dict(model=tiny_gguf,
                                                         prompt="a" * 20_000_000)), 413)
    _assert_serves(http, tiny_gguf, reference)
    # The openai client raises its BadRequestError with the server's object.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=tiny_gguf, prompt="hi", temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"
    # Unknown fields are ignored.
    want = reference.generate([[5, 6, 7]], _sp(max_tokens=4, temperature=0.0))[0].outputs[0]
    r = http.post("/v1/completions", json=dict(model=tiny_gguf, prompt=[5, 6, 7], max_tokens=4,
                                               temperature=0, frobnicate={"x": 1}, best_guess=2))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.text
    resp = client.chat.completions.create(model=tiny_gguf, messages=CHAT, max_tokens=4,
                                          temperature=0, extra_body={"frobnicate": True})
    assert resp.choices[0].message.content == reference.chat(
        CHAT, _sp(max_tokens=4, temperature=0.0))[0].outputs[0].text


# ---- auth, backpressure, draining -----------------------------------------------

def test_bearer_token(tiny_gguf, tmp_path, reference):
    from jaxserve.server.client import Client
    token = "s3cret-token"
    (tmp_path / "token").write_text(token + "\n")
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", "--num_pages", "64",
                       "--page_size", "8", "--auth_token_file", str(tmp_path / "token")])
    try:
        base = s.http_url
        for key in ("wrong", token + "x"):
            bad = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            for call, kw in ((bad.completions.create, dict(prompt="hi", max_tokens=2)),
                             (bad.chat.completions.create, dict(messages=CHAT, max_tokens=2))):
                with pytest.raises(openai.AuthenticationError) as err:
                    call(model=tiny_gguf, **kw)
                assert err.value.status_code == 401
                assert set(err.value.body) >= {"message", "type", "param", "code"}
            with pytest.raises(openai.AuthenticationError) as err:
                bad.models.list()
            assert err.value.status_code == 401
            bad.close()
        with httpx.Client(base_url=base, timeout=60) as h:
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": token}):
                for method, route, body in (
                        ("POST", "/v1/completions", dict(model=tiny_gguf, prompt="hi")),
                        ("POST", "/v1/chat/completions", dict(model=tiny_gguf, messages=CHAT)),
                        ("GET", "/v1/models", None),
                        ("POST", "/tokenize", dict(prompt="hi")),
                        ("POST", "/detokenize", dict(tokens=[5, 6]))):
                    _assert_error(h.request(method, route, json=body, headers=headers), 401)
            assert h.get("/health").status_code == 200  # open without the token
            assert h.get("/metrics").status_code == 200
            auth = {"authorization": f"Bearer {token}"}
            r = h.post("/tokenize", json=dict(prompt="hi"), headers=auth)
            assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
            # the scheme is case-insensitive (RFC 9110); HEAD /health for load balancers
            r = h.post("/tokenize", json=dict(prompt="hi"), headers={"authorization":
                                                                      f"bearer {token}"})
            assert r.status_code == 200, r.text
            assert h.head("/health").status_code == 200
        good = openai.OpenAI(base_url=base + "/v1", api_key=token, max_retries=0)
        assert [m.id for m in good.models.list().data] == [tiny_gguf]
        resp = good.completions.create(model=tiny_gguf, prompt=[5, 6, 7], max_tokens=4,
                                       temperature=0)
        want = reference.generate([[5, 6, 7]], _sp(max_tokens=4, temperature=0.0))[0]
        assert resp.choices[0].text == want.outputs[0].text
        good.close()
        with Client(s.target, token=token) as c:  # the same token opens gRPC
            assert c.health() == "SERVING"
        with Client(s.target, token="wrong") as c:
            with pytest.raises(grpc.RpcError) as err:
                c.health()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        assert s.terminate() == 0


def test_queue_full_is_429_and_draining_503(tiny_gguf, reference):
    """One running sequence and two waiting: three more streams get 429 (and
    the server serves once the load is gone). After SIGTERM, /health and new
    requests are 503 while the admitted streams finish; then it exits 0."""
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", "--num_pages", "256",
                       "--page_size", "8", "--max_num_seqs", "1", "--max_waiting_requests", "2",
                       "--grace_period_s", "20"])
    long = dict(model=tiny_gguf, max_tokens=480, temperature=0, ignore_eos=True, stream=True)

    async def read(h: httpx.AsyncClient, i: int, running: list):
        """(status, error body or the stream's events); appends ``i`` to
        ``running`` at its first chunk."""
        async with h.stream("POST", "/v1/completions", json=dict(prompt=[7, i + 3], **long)) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            events = []
            async for line in r.aiter_lines():
                if line.strip():
                    events.append(line)
                if line.startswith("data: {") and i not in running:
                    running.append(i)
            return 200, events

    async def queue_full():
        async with httpx.AsyncClient(base_url=s.http_url, timeout=60) as h:
            running: list[int] = []
            tasks = [asyncio.create_task(read(h, 0, running))]
            t_end = time.monotonic() + 60
            while not running and time.monotonic() < t_end:  # the first one runs
                await asyncio.sleep(0.01)
            tasks += [asyncio.create_task(read(h, i, running)) for i in range(1, 6)]
            refused = lambda: [t.result() for t in tasks if t.done() and not t.exception()
                               and t.result()[0] != 200]
            t_end = time.monotonic() + 30
            while len(refused()) < 3 and time.monotonic() < t_end:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            got = refused()
            # The running stream ends after 480 tokens; had it ended already, a
            # waiting one took its slot and a later stream was rightly let in.
            first_ended = tasks[0].done()
            for t in tasks:  # hang up: the admitted ones are aborted
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return got, first_ended

    async def drain():
        async with httpx.AsyncClient(base_url=s.http_url, timeout=60) as h:
            running: list[int] = []
            tasks = [asyncio.create_task(read(h, i, running)) for i in range(3)]
            t_end = time.monotonic() + 60
            while not running and time.monotonic() < t_end:
                await asyncio.sleep(0.01)
            s.proc.send_signal(signal.SIGTERM)
            t_end = time.monotonic() + 10  # until the server has seen the signal
            while (health := (await h.get("/health")).status_code) == 200 \
                    and time.monotonic() < t_end:
                await asyncio.sleep(0.01)
            late = await h.post("/v1/completions", json=dict(model=tiny_gguf, prompt="hi",
                                                              max_tokens=2))
            return running[0], health, late, await asyncio.gather(*tasks)

    try:
        for _ in range(3):  # a fast machine may finish the running stream first
            got, first_ended = asyncio.run(queue_full())
            if not first_ended:
                break
            _wait_idle(s)
        assert not first_ended, "the running stream kept ending before the refusals"
        assert len(got) == 3, got  # 6 streams: 1 running, 2 waiting, 3 refused
        for status, body in got:
            assert status == 429 and set(body["error"]) >= {"message", "type", "param", "code"}
        _wait_idle(s)
        with httpx.Client(base_url=s.http_url, timeout=60) as h:
            _assert_serves(h, tiny_gguf, reference)
        first, health, late, streams = asyncio.run(drain())
        assert health == 503
        _assert_error(late, 503)
        reasons = []
        for status, events in streams:  # admitted before SIGTERM: each ends properly
            assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
            reasons.append(json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"])
        assert reasons[first] == "length", reasons  # the running one ran to its end
        assert set(reasons) <= {"length", "abort"}, reasons
        assert s.proc.wait(30) == 0
    finally:
        s.kill()
