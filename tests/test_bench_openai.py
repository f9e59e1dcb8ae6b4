"""The serving benchmark over OpenAI's HTTP API (``--backend openai``,
``jaxserve.bench.openai_load``): SSE parsing and token counting on recorded
streams (jaxserve's and llama_cpp.server's shapes), then a real jaxserve
server on the tiny GGUF driven by ``run_openai`` (texts equal
``LLM.generate``'s) and by ``suite.run`` with ``target`` (every request
complete, output tokens as asked, the report naming the backend), with the
``llama_cpp_server`` peer beside it when llama_cpp.server is installed."""

import asyncio
import json

import pytest
from conftest import XLA_CACHE

from jaxserve.bench import openai_load as ol
from jaxserve.bench.stats import RequestRecord

ENGINE_FLAGS = ["--num_pages", "256", "--page_size", "8", "--max_num_seqs", "8",
                "--max_num_batched_tokens", "128", "--nowarmup"]


def _feed(lines, times):
    """Run recorded SSE lines through the parser, one arrival time per line
    (an event is dispatched, and stamped, at the blank line ending it)."""
    st, parser = ol.StreamState(), ol.SSEParser()
    for line, t in zip(lines, times):
        if (data := parser.feed(line)) is not None:
            ol.on_event(st, data, t)
    if (data := parser.flush()) is not None:
        ol.on_event(st, data, times[-1])
    return st


def _chunk(text, finish=None):
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})


def test_sse_jaxserve_stream_with_usage_spreads_tokens():
    # jaxserve: one chunk per step that gained text (two tokens held back as one
    # UTF-8 character in the second), the finish on the last text, usage, [DONE].
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 4}}
    lines = [_chunk(" a"), "", _chunk("é"), "", _chunk(" b"), "", _chunk(" c", "length"), "",
             "data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}), "",
             "data: [DONE]", ""]
    st = _feed(lines, [float(i) for i in range(len(lines))])
    assert st.times == [1.0, 3.0, 5.0, 7.0] and st.text == " aé b c"
    assert st.finish_reason == "length" and st.end == 7.0 and st.done
    rec = RequestRecord("0", "chat", 9, send_time=0.0)
    assert ol.finish_record(rec, st, asked=5) == "usage"
    assert rec.ok and rec.error is None
    assert rec.chunk_tokens == [2, 1, 1, 1] and rec.output_tokens == 5
    assert rec.prompt_tokens == 7 and rec.cached_tokens == 4
    assert rec.ttft_ms == 1000.0 and rec.itl_ms == [2000.0, 2000.0, 2000.0]


def test_sse_llama_cpp_stream_without_usage():
    # llama_cpp.server: "\n"-separated events, ping comments, an empty-text
    # token, the finish in a chunk of its own, no usage.
    lines = [_chunk("x"), "", ": ping - 2025-01-01 00:00:00", "", _chunk(""), "", _chunk("y"),
             "", _chunk("", "length"), "", "data: [DONE]", ""]
    st = _feed(lines, [float(i) for i in range(len(lines))])
    assert st.times == [1.0, 7.0] and st.finish_reason == "length" and st.end == 9.0
    rec = RequestRecord("0", "chat", 3, send_time=0.0)
    assert ol.finish_record(rec, st, asked=3) == "length"  # finished at max_tokens: exact
    assert rec.chunk_tokens == [2, 1] and rec.prompt_tokens == 3 and rec.ok
    st = _feed(lines[:8] + [_chunk("", "stop"), ""], [float(i) for i in range(10)])
    rec = RequestRecord("1", "chat", 3, send_time=0.0)
    assert ol.finish_record(rec, st, asked=8, text_tokens=2) == "tokenizer"
    assert rec.output_tokens == 2  # short: it stopped at EOS
    rec = RequestRecord("2", "chat", 3, send_time=0.0)
    assert ol.finish_record(rec, st, asked=8) == "chunks" and rec.output_tokens == 2


def test_sse_errors_and_parser_rules():
    p = ol.SSEParser()
    assert [p.feed(x) for x in ("event: x", "data: a", "data:b", "id: 3", "")] == \
        [None, None, None, None, "a\nb"]
    assert p.feed("") is None and p.flush() is None
    st = _feed([_chunk("x"), "", 'data: {"error": {"message": "boom", "code": 500}}', "",
                "data: [DONE]", ""], [0.0] * 6)
    rec = RequestRecord("0", "chat", 1, 0.0)
    ol.finish_record(rec, st, asked=4)
    assert rec.error == "stream error: boom" and not rec.ok
    st = _feed([_chunk("x"), ""], [1.0, 1.0])  # cut off: no finish, no [DONE]
    rec = RequestRecord("1", "chat", 1, 0.0)
    ol.finish_record(rec, st, asked=4)
    assert "without a finish_reason" in rec.error
    st = _feed([_chunk("", "abort"), "", "data: [DONE]", ""], [1.0] * 4)
    rec = RequestRecord("2", "chat", 1, 0.0)
    ol.finish_record(rec, st, asked=4)
    assert rec.error == "aborted"
    assert ol.spread(7, 3) == [3, 2, 2] and ol.spread(2, 3) == [1, 1, 1]
    assert ol._error_message(b'{"error": {"message": "no"}}') == "no"
    assert ol._error_message(b'{"detail": [1]}') == "[1]"


# ---- a real server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_gguf):
    from jaxserve.bench import serving
    proc, target, metrics, base = serving.spawn_server(tiny_gguf, ENGINE_FLAGS, timeout_s=300,
                                                       http=True)
    assert base.startswith("http://127.0.0.1:") and metrics and target
    yield base, metrics
    serving.stop_server(proc)
    assert proc.returncode == 0


@pytest.mark.slow
def test_run_openai_matches_llm_generate(server, tiny_gguf):
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.workloads import make_requests
    base, metrics = server
    model = ol.server_model(base)
    assert model["id"] == tiny_gguf and model["owned_by"] == "jaxserve"
    assert ol.jaxserve_metrics(base) == base + "/metrics"
    tok = ol.HttpTokenizer(base)
    assert tok.available() and tok.shape == "vllm"
    reqs = make_requests(tok, 320, "chat", 4, seed=3, scale=0.08)
    assert ol.accepts_token_ids(base, model["id"], reqs[0].prompt_ids)
    runs = {pa: asyncio.run(ol.run_openai(base, model["id"], reqs, 2, metrics_url=metrics,
                                          prompt_as=pa, tokenizer=tok))
            for pa in ("ids", "text")}
    llm = LLM(tiny_gguf, num_pages=256, page_size=8, compilation_cache_dir=XLA_CACHE)
    want = llm.generate([r.prompt_ids for r in reqs],
                        [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                                        skip_special_tokens=False) for r in reqs])
    for pa, run in runs.items():
        assert run.http["prompt_as"] == pa and run.http["token_count"] == {"usage": 4}
        assert run.http["short_outputs"] == 0 and run.pages_total == 256
        for rec, req, text, w in zip(run.records, reqs, run.texts, want):
            assert rec.ok, rec.error
            assert rec.output_tokens == req.output_len == len(w.outputs[0].token_ids)
            assert rec.ttft_ms > 0 and rec.end_time >= rec.chunk_times[-1]
            assert rec.chunk_times == sorted(rec.chunk_times)
            assert rec.prompt_tokens == len(req.prompt_ids)  # ids and text alike
            assert text == w.outputs[0].text, (pa, text, w.outputs[0].text)
    tok.close()


@pytest.mark.slow
def test_suite_openai_target_with_llama_cpp_server_peer(server, tiny_gguf, tmp_path):
    from jaxserve.bench import peers
    from jaxserve.bench import serving_options, serving_run
    base, _ = server
    with_peer = peers.available("llama_cpp_server") is None
    opts = serving_options.BenchOptions(
        workload="chat", concurrency=(1, 3), num_prompts=3, backend="openai", target=base,
        model=tiny_gguf, scale=0.05, warmup=False,
        peers=("llama_cpp_server",) if with_peer else ())
    r, paths = serving_run.run(opts, str(tmp_path / "res"))
    assert r["config"]["backend"] == "openai" and r["config"]["target"] == base
    assert r["env"]["server"]["prompt_as"] == "ids" and r["env"]["server"]["owned_by"] == \
        "jaxserve"
    for lv in r["levels"]:
        assert lv["summary"]["completed"] == 3 and lv["summary"]["failed"] == 0
        assert lv["http"]["token_count"] == {"usage": 3} and lv["http"]["short_outputs"] == 0
        for q in lv["requests"]:
            assert q["ttft_ms"] > 0 and q["chunk_times_s"] == sorted(q["chunk_times_s"])
    asked = [q["output_tokens"] for q in r["levels"][0]["requests"]]
    assert asked == [max(1, round(200 * 0.05))] * 3
    with open(paths[1]) as f:
        md = f.read()
    assert f"## jaxserve (HTTP at {base}) per level" in md
    assert "prompts as ids; TTFT and ITL from each SSE chunk" in md
    if with_peer:
        p = r["peers"]["llama_cpp_server"]
        assert p["prompt_as"] == "text" and [lv["concurrency"] for lv in p["levels"]] == [1, 3]
        for lv in p["levels"]:
            assert sum(lv["http"]["finish_reasons"].values()) == 3
        assert "| 3 | llama.cpp server (HTTP) | HTTP, up to 3 streams open" in md
