"""The gRPC server under load, cancellation, bad input, shutdown, auth and
TLS: real ``python -m jaxserve.main --mode serve`` processes on 127.0.0.1
serving a tiny random GGUF, real gRPC clients (``jaxserve.server.client``).

Expected outputs come from an in-process ``LLM`` over the same file:
greedy and seeded sampling do not depend on batch-mates, so each streamed
request must equal its ``LLM.generate`` result token for token.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time

import grpc
import pytest

from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server.client import AsyncClient, Client
from server_util import ServerProcess

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ["--num_pages", "1024", "--page_size", "8", "--max_num_seqs", "64",
                "--max_num_batched_tokens", "512"]


@pytest.fixture(scope="module")
def server(tiny_gguf):
    s = ServerProcess(["--model", tiny_gguf, *ENGINE_FLAGS])
    yield s
    assert s.terminate() == 0


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    from jaxserve import LLM
    from conftest import XLA_CACHE
    return LLM(tiny_gguf, num_pages=1024, page_size=8, compilation_cache_dir=XLA_CACHE)


def _params(**kw):
    from jaxserve import SamplingParams
    return SamplingParams(**kw)


def _mixed_requests(n: int, seed: int = 0) -> list[dict]:
    """Requests of varied shape: text / token-id / chat prompts of 1..60
    tokens, 1..24 output tokens, greedy or seeded sampling, n = 1 or 2."""
    rng = random.Random(seed)
    words = ["the", "world", "hello", "tea", "or", "well", "bright", "cat", "sun", "lo"]
    reqs = []
    for i in range(n):
        kind = rng.choice(["text", "ids", "ids", "chat"])
        sampling = dict(max_tokens=rng.randint(1, 24))
        if rng.random() < 0.5:
            sampling["temperature"] = 0.0
        else:
            sampling.update(temperature=0.9, top_p=0.95, seed=rng.randrange(2**32))
            if rng.random() < 0.3:
                sampling["n"] = 2
        if kind == "text":
            prompt = dict(prompt=" ".join(rng.choice(words) for _ in range(rng.randint(1, 20))))
        elif kind == "ids":
            prompt = dict(token_ids=[rng.randrange(3, 320) for _ in range(rng.randint(1, 60))])
        else:
            prompt = dict(messages=[{"role": "user", "content": " ".join(
                rng.choice(words) for _ in range(rng.randint(1, 10)))}])
        reqs.append(dict(request_id=f"mix-{i}", **prompt, **sampling))
    return reqs


def _expected(llm, reqs: list[dict]) -> list:
    """``LLM.generate`` of the same requests (chat rendered by the template)."""
    prompts, params = [], []
    for r in reqs:
        r = dict(r)
        r.pop("request_id")
        if "prompt" in r:
            prompts.append(r.pop("prompt"))
        elif "token_ids" in r:
            prompts.append(r.pop("token_ids"))
        else:
            prompts.append(llm.apply_chat_template(r.pop("messages")))
        params.append(_params(**r))
    return llm.generate(prompts, params)


def _wait_idle(server, timeout_s: float = 30.0) -> dict:
    """Poll /metrics until nothing runs or waits; returns the last scrape."""
    t_end = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if (m["jaxserve_num_requests_running"] == 0 and m["jaxserve_num_requests_waiting"] == 0
                and m["jaxserve_kv_cache_pages_used"] == 0) or time.monotonic() > t_end:
            return m


def test_200_concurrent_streams_match_llm_generate(server, reference):
    reqs = _mixed_requests(200)
    before = server.metrics()

    async def run():
        async with AsyncClient(server.target) as c:
            return await asyncio.gather(*(c.complete(**r) for r in reqs))

    results = asyncio.run(run())
    want = _expected(reference, reqs)
    for r, got, exp in zip(reqs, results, want):
        assert got.request_id == r["request_id"]
        assert len(got.completions) == len(exp.outputs)
        for g, e in zip(got.completions, exp.outputs):
            assert g.token_ids == e.token_ids, r
            assert g.text == e.text, r
            assert g.finish_reason == e.finish_reason, r
        assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert got.usage.completion_tokens == sum(len(o.token_ids) for o in exp.outputs)
        assert got.timing.e2e_ms >= got.timing.ttft_ms > 0
    after = _wait_idle(server)
    assert after["jaxserve_kv_cache_pages_free"] == after["jaxserve_kv_cache_pages_total"] == 1024
    assert after["jaxserve_kv_cache_pages_used"] == 0
    done = sum(v for k, v in after.items() if k.startswith("jaxserve_request_success_total")) \
        - sum(v for k, v in before.items() if k.startswith("jaxserve_request_success_total"))
    assert done == 200
    assert after["jaxserve_generation_tokens_total"] - before.get(
        "jaxserve_generation_tokens_total", 0) == sum(
        len(c.token_ids) for res in results for c in res.completions)


def test_cancels_and_deadlines_abort_within_one_step(server, reference):
    """50 streams cancelled at random points, 10 with expiring deadlines, 40
    that run to the end; every cancelled one is freed within one engine step."""
    rng = random.Random(1)
    long = dict(max_tokens=400, ignore_eos=True, temperature=0.0)
    before = server.metrics()
    keep = [dict(request_id=f"keep-{i}", token_ids=[rng.randrange(3, 320) for _ in range(20)],
                 max_tokens=rng.randint(5, 30), temperature=0.0) for i in range(40)]

    async def cancelled(c, i):
        call = c.generate(request_id=f"cancel-{i}", token_ids=[5 + i, 7, 9], **long)
        stop_after = rng.randint(0, 6)  # 0: cancel before the first token
        if stop_after == 0:
            # The server sends initial metadata once the request is in the engine.
            assert dict(await call.initial_metadata())["x-request-id"] == f"cancel-{i}"
            call.cancel()
        else:
            seen = 0
            async for _ in call:
                seen += 1
                if seen == stop_after:
                    call.cancel()
                    break
        assert await call.code() == grpc.StatusCode.CANCELLED
        return "cancelled"

    async def deadline(c, i):
        try:
            async for resp in c.generate(request_id=f"deadline-{i}", token_ids=[9, i + 3],
                                         timeout=rng.uniform(0.3, 1.0), **long):
                assert not resp.finished
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return "deadline"
        raise AssertionError("a 400-token request beat its deadline")

    async def run():
        async with AsyncClient(server.target) as c:
            jobs = [cancelled(c, i) for i in range(50)] + [deadline(c, i) for i in range(10)] \
                + [c.complete(**r) for r in keep]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    assert results[:50] == ["cancelled"] * 50 and results[50:60] == ["deadline"] * 10
    for r, got, exp in zip(keep, results[60:], _expected(reference, keep)):
        assert got.token_ids == exp.outputs[0].token_ids, r
    d = lambda m, k: m.get(k, 0.0) - before.get(k, 0.0)
    success = lambda m: sum(d(m, k) for k in m if k.startswith("jaxserve_request_success_total"))
    t_end = time.monotonic() + 30
    while True:  # the server sees the last cancels a moment after the client
        after = _wait_idle(server)
        received = d(after, "jaxserve_request_received_total")
        n_aborted = d(after, "jaxserve_request_aborted_total")
        if n_aborted + success(after) >= received or time.monotonic() > t_end:
            break
        time.sleep(0.1)
    # Every request the server received was either one of the 40 kept ones
    # (finished) or aborted: no cancelled request ran on to its end. A
    # deadline can expire before the server's handler runs (nothing to abort).
    assert success(after) == 40
    assert n_aborted == received - 40
    assert 50 <= n_aborted <= 60
    delays = {k: after[k] - before.get(k, 0.0) for k in after
              if k.startswith("jaxserve_abort_delay_steps")}
    assert delays["jaxserve_abort_delay_steps_count"] == n_aborted
    assert delays['jaxserve_abort_delay_steps_bucket{le="1.0"}'] == n_aborted  # within one step
    assert after["jaxserve_kv_cache_pages_free"] == after["jaxserve_kv_cache_pages_total"]
    assert after["jaxserve_kv_cache_pages_used"] == 0


@pytest.mark.parametrize("request_kw, field", [
    (dict(prompt=""), "prompt.text"),
    (dict(token_ids=[]), "prompt.token_ids"),
    (dict(token_ids=list(range(3, 303)) * 2), "prompt"),            # 600 > 511 tokens
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", output_kind=7), "output_kind"),             # unknown enum value
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    (dict(token_ids=[5, -1, 7]), "prompt.token_ids"),               # malformed ids
    (dict(token_ids=[5, 320]), "prompt.token_ids"),
    (dict(prompt="hi", stop_token_ids=[999]), "stop_token_ids"),
    (dict(prompt="hi", logprobs=21), "logprobs"),
    (dict(prompt="hi", seed=2**40), "seed"),
])
def test_bad_requests_get_invalid_argument(server, reference, request_kw, field):
    with Client(server.target) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.complete(**request_kw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        assert c.health() == "SERVING"
        assert c.health("jaxserve.v1.Generation") == "SERVING"
        got = c.complete(token_ids=[5, 6, 7], max_tokens=4, temperature=0.0)
    want = reference.generate([[5, 6, 7]], _params(max_tokens=4, temperature=0.0))[0]
    assert got.token_ids == want.outputs[0].token_ids


def test_no_prompt_and_duplicate_id(server):
    with Client(server.target) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(pb.GenerateRequest()))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in err.value.details()
        # LoRA: off on this server; another model name is NOT_FOUND, the
        # adapter RPCs FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            c.complete(token_ids=[5], max_tokens=2, lora_name="other")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "lora_name" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.load_lora_adapter("x", "/tmp")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert c.model_info().max_loras == 0
        first = c.generate(request_id="dup", token_ids=[5], max_tokens=300, ignore_eos=True)
        next(first)  # the first request is running
        with pytest.raises(grpc.RpcError) as err:
            c.complete(request_id="dup", token_ids=[5], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first.cancel()
        # The id is free again once the first stream has ended.
        t_end = time.monotonic() + 10
        while True:
            try:
                assert len(c.complete(request_id="dup", token_ids=[5], max_tokens=2,
                                      temperature=0.0).token_ids) == 2
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.ALREADY_EXISTS
                assert time.monotonic() < t_end
                time.sleep(0.05)


def test_output_kinds_logprobs_and_unary_methods(server, reference):
    with Client(server.target) as c:
        info = c.model_info()
        assert (info.architecture, info.vocab_size, info.max_model_len) == ("llama", 320, 512)
        assert (info.page_size, info.num_pages, info.max_prompt_len) == (8, 1024, 511)
        ids = c.tokenize("hello world")
        assert ids == reference.get_tokenizer().encode("hello world", add_special_tokens=False)
        assert c.detokenize(ids) == "hello world"
        chat = [{"role": "user", "content": "hello"}]
        assert c.tokenize(messages=chat) == reference.apply_chat_template(chat)
        kw = dict(token_ids=[5, 6, 7, 8], max_tokens=6, temperature=0.0, logprobs=3,
                  prompt_logprobs=2)
        want = reference.generate([kw["token_ids"]], _params(
            max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2))[0]
        final = list(c.generate(output_kind=pb.OUTPUT_KIND_FINAL_ONLY, **kw))
        assert len(final) == 1 and final[0].finished
        comp = final[0].completions[0]
        assert list(comp.token_ids) == want.outputs[0].token_ids
        assert comp.text == want.outputs[0].text
        for pos, tok, lp in zip(comp.logprobs, comp.token_ids, want.outputs[0].logprobs):
            assert pos.chosen.token_id == tok
            assert pos.chosen.logprob == pytest.approx(lp[tok].logprob, abs=1e-5)
            assert len(pos.top) == 3
        assert len(final[0].prompt_logprobs) == 3
        cum = list(c.generate(output_kind=pb.OUTPUT_KIND_CUMULATIVE, **kw))
        assert list(cum[-1].completions[0].token_ids) == want.outputs[0].token_ids
        assert [len(r.completions[0].token_ids) for r in cum] == list(range(1, 7))


def test_metrics_page_lists_and_moves(server):
    names = ["jaxserve_time_to_first_token_seconds_count",
             "jaxserve_time_per_output_token_seconds_count",
             "jaxserve_inter_token_latency_seconds_count",
             "jaxserve_request_queue_time_seconds_count",
             "jaxserve_e2e_request_latency_seconds_count",
             "jaxserve_num_requests_running", "jaxserve_num_requests_waiting",
             "jaxserve_kv_cache_pages_used", "jaxserve_kv_cache_pages_free",
             "jaxserve_prompt_tokens_total", "jaxserve_generation_tokens_total",
             "jaxserve_cached_prompt_tokens_total", "jaxserve_num_preemptions_total",
             "jaxserve_request_aborted_total", "jaxserve_request_failure_total",
             "jaxserve_kv_cache_pages_total", "jaxserve_abort_delay_steps_count",
             "jaxserve_request_received_total", "jaxserve_engine_steps_total"]
    before = _wait_idle(server)
    for n in names:
        assert n in before, n
    prompt = [11 + i % 200 for i in range(40)]  # 5 full pages of 8
    with Client(server.target) as c:
        stream = c.generate(token_ids=prompt, max_tokens=300, ignore_eos=True, temperature=0.0)
        for _ in range(5):
            next(stream)
        during = server.metrics()  # while it runs (gauges move after each step)
        for _ in stream:
            pass
        c.complete(token_ids=prompt, max_tokens=10, ignore_eos=True, temperature=0.0)
    after = _wait_idle(server)
    assert during["jaxserve_num_requests_running"] >= 1
    assert during["jaxserve_kv_cache_pages_used"] >= 5
    d = lambda k: after[k] - before.get(k, 0.0)
    assert d("jaxserve_generation_tokens_total") == 310
    assert d("jaxserve_cached_prompt_tokens_total") == 32  # (40 - 1) // 8 pages of 8 reused
    assert d("jaxserve_prompt_tokens_total") == 40 + 8
    for n in ("jaxserve_time_to_first_token_seconds_count",
              "jaxserve_time_per_output_token_seconds_count",
              "jaxserve_e2e_request_latency_seconds_count",
              "jaxserve_request_queue_time_seconds_count"):
        assert d(n) == 2, n
    assert d("jaxserve_inter_token_latency_seconds_count") == 299 + 9
    assert d('jaxserve_request_success_total{finish_reason="length"}') == 2


def test_backpressure_and_sigterm_during_load(tiny_gguf):
    """A bounded queue answers RESOURCE_EXHAUSTED; SIGTERM under load ends
    every stream with a status and the process exits 0 within the grace period."""
    grace = 3.0
    # One running sequence and 12 waiting: the 13 admitted streams need
    # 13 x 480 steps one after another (~6 s at the ~1 ms a step of this tiny
    # model takes on a quiet CPU), more than the grace period, so some are
    # aborted; 3 of the 16 are refused.
    streams, waiting = 16, 12
    s = ServerProcess(["--model", tiny_gguf, "--num_pages", "256", "--page_size", "8",
                       "--max_num_seqs", "1", "--max_waiting_requests", str(waiting),
                       "--grace_period_s", str(grace)])
    try:
        first_token, refused = [], []

        async def stream(c, i):
            got = []
            try:
                async for resp in c.generate(token_ids=[7, i + 3], max_tokens=480,
                                             ignore_eos=True, temperature=0.0):
                    if not got:
                        first_token.append(i)
                    got.append(resp)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused.append(i)
                return e.code(), got
            return grpc.StatusCode.OK, got

        async def run():
            async with AsyncClient(s.target) as c:
                tasks = [asyncio.create_task(stream(c, i)) for i in range(streams)]
                # Load is running: every stream admitted or refused (a busy
                # machine may need more than a fixed sleep to get there).
                deadline = time.monotonic() + 60
                while (len(refused) < streams - waiting - 1 or not first_token) \
                        and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                s.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = await stream(c, 99)  # refused: the server is shutting down
                results = await asyncio.gather(*tasks)
                return results, late, t0

        results, late, t0 = asyncio.run(run())
        rc = s.proc.wait(grace + 5)
        elapsed = time.monotonic() - t0
    finally:
        s.kill()
    assert rc == 0
    assert elapsed < grace, (elapsed, "".join(s.lines[-8:]))  # SIGTERM to process exit
    codes = [code for code, _ in results]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
    # Every admitted stream ends with a final message, finished or aborted
    # (the abort is sent at once, even while the engine is inside a step).
    admitted = [got for code, got in results if code == grpc.StatusCode.OK]
    assert len(admitted) + codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == streams, codes
    assert len(admitted) >= 4, (codes, "".join(s.lines[-6:]))
    reasons = []
    for got in admitted:
        assert got and got[-1].finished and got[-1].HasField("usage")
        reasons.append(got[-1].completions[0].finish_reason)
    assert set(reasons) <= {"length", "abort"} and "abort" in reasons, reasons
    assert late[0] == grpc.StatusCode.UNAVAILABLE
    assert "jaxserve: stopped" in "".join(s.lines)


def test_bearer_token_and_tls(tiny_gguf, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    s = ServerProcess(["--model", tiny_gguf, "--num_pages", "64", "--page_size", "8",
                       "--tls_cert", str(cert), "--tls_key", str(key)],
                      env={"JAXSERVE_AUTH_TOKEN": "s3cret"})
    ca = cert.read_bytes()
    try:
        for token in (None, "wrong"):
            with Client(s.target, root_certificates=ca, token=token) as c:
                for call in (lambda: c.complete(prompt="hi", max_tokens=2), c.model_info,
                             c.health):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(s.target, token="s3cret") as plain:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError) as err:
                plain.model_info()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with Client(s.target, root_certificates=ca, token="s3cret") as c:
            assert c.health() == "SERVING"
            assert len(c.complete(prompt="hi", max_tokens=3, ignore_eos=True).token_ids) == 3
            assert c.model_info().vocab_size == 320
    finally:
        assert s.terminate() == 0


SPEC = dict(method="ngram", num_speculative_tokens=3, adaptive=False)


def test_speculating_server_reports_drafts_in_usage(tiny_gguf, reference):
    """A server started with the speculation flags (ngram, k = 3 every step)
    streams the tokens a plain engine makes, and each final message's usage
    carries the request's draft and accepted token counts: those of an
    in-process ``LLM(speculative_config=...)`` over the same file and
    requests, run one at a time (so k and every draft are the same). The
    ``/metrics`` counters add up to them."""
    from jaxserve import LLM
    from conftest import XLA_CACHE
    reqs = [dict(request_id="rep", token_ids=[11, 12, 13, 14] * 6, max_tokens=24,
                 temperature=0.0, ignore_eos=True),
            dict(request_id="seeded", token_ids=[40, 41, 42] * 5, max_tokens=20,
                 temperature=0.5, seed=8, ignore_eos=True),  # sampled: most drafts rejected
            dict(request_id="short", token_ids=[5, 6, 7], max_tokens=16, temperature=0.0)]
    spec_llm = LLM(tiny_gguf, num_pages=1024, page_size=8, compilation_cache_dir=XLA_CACHE,
                   speculative_config=SPEC)
    want_spec = [_expected(spec_llm, [r])[0] for r in reqs]
    want_plain = _expected(reference, reqs)
    s = ServerProcess(["--model", tiny_gguf, *ENGINE_FLAGS, "--speculative_method", "ngram",
                       "--num_speculative_tokens", "3", "--nospeculative_adaptive"])
    try:
        with Client(s.target) as c:
            got = [c.complete(**r) for r in reqs]
        metrics = _wait_idle(s)
    finally:
        assert s.terminate() == 0
    for r, g, ws, wp in zip(reqs, got, want_spec, want_plain):
        assert g.token_ids == ws.outputs[0].token_ids == wp.outputs[0].token_ids, r
        assert (g.usage.num_draft_tokens, g.usage.num_accepted_tokens) == (
            ws.metrics.num_draft_tokens, ws.metrics.num_accepted_tokens), r
        assert 0 <= g.usage.num_accepted_tokens <= g.usage.num_draft_tokens
    assert all(g.usage.num_draft_tokens > 0 for g in got)  # each one speculated
    assert got[0].usage.num_accepted_tokens > 0
    assert metrics["jaxserve_spec_decode_num_draft_tokens_total"] == sum(
        g.usage.num_draft_tokens for g in got)
    assert metrics["jaxserve_spec_decode_num_accepted_tokens_total"] == sum(
        g.usage.num_accepted_tokens for g in got)
    assert metrics["jaxserve_spec_decode_k"] == 3
