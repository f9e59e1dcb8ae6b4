"""Structured outputs and tool calling against a real server (see
``test_openai_structured.py`` for the layers): the tiny random GGUF served by
``python -m jaxserve.main --mode serve --http_port 0`` on 127.0.0.1.

What every client sends is accepted with OpenAI's shapes, streams reassemble
to the whole response of the same seed, a tool history reaches the prompt,
refusals name their field (HTTP ``param``, gRPC INVALID_ARGUMENT); every
constrained output is valid, and ``openai`` ``parse``, LangChain and
instructor work unchanged; the structured-output and vLLM metric names are
scraped.
"""

from __future__ import annotations

import json
import re
from typing import Literal, Optional

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from server_util import ServerProcess
from test_openai_structured import ADD, SCHEMA, WEATHER
from test_server import ENGINE_FLAGS

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
VOCAB = 320  # the tiny GGUF's


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """The suite's tiny GGUF (vocab 320, 2 layers) with 4096 positions: its
    byte-level tokenizer spends ~800 tokens on a Hermes tools prompt, ~1400
    with the schema instructor sends."""
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("tiny-gguf-4k") / "tiny.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=VOCAB, max_position_embeddings=4096,
                                      num_layers=2))
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_gguf):
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", *ENGINE_FLAGS])
    yield s
    assert s.terminate() == 0


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationStub(channel)


def _check_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI-shaped tool calls (client objects)."""
    out = []
    for c in calls or []:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.type == "function"
        out.append((c.function.name, json.loads(c.function.arguments)))
    return out


# ---- 2. acceptance and shapes --------------------------------------------------------

ACCEPTED = [  # (create kwargs, extra_body)
    (dict(response_format={"type": "json_object"}), {}),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}), {}),
    (dict(response_format={"type": "text"}), {}),
    (dict(logit_bias={"5": -100, "6": 100}), {}),
    ({}, {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}),
    ({}, {"guided_regex": r"\d{3}-\d{4}"}),
    ({}, {"guided_choice": ["yes", "no"]}),
    ({}, {"guided_grammar": 'root ::= "a" | "b"'}),
    ({}, {"structured_outputs": {"choice": ["red", "blue"]}}),
    ({}, {"allowed_token_ids": [5, 6, 7], "bad_words": ["the"]}),
]


@pytest.mark.parametrize("kw, extra", ACCEPTED)
def test_constrained_requests_are_accepted(server, client, tiny_gguf, kw, extra):
    resp = client.chat.completions.create(model=tiny_gguf, messages=HI, max_tokens=6,
                                          temperature=0, extra_body=extra, **kw)
    (choice,) = resp.choices
    assert resp.object == "chat.completion" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert 1 <= resp.usage.completion_tokens <= 6
    comp = client.completions.create(model=tiny_gguf, prompt="hello", max_tokens=4,
                                     temperature=0, extra_body=extra)
    assert comp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["auto", "none", "required",
                                         {"type": "function", "function": {"name": "add"}}])
def test_tools_are_accepted_with_openai_shapes(server, client, tiny_gguf, tool_choice):
    resp = client.chat.completions.create(model=tiny_gguf, messages=HI, tools=[ADD, WEATHER],
                                          tool_choice=tool_choice, max_tokens=12, seed=3,
                                          temperature=1.0)
    (choice,) = resp.choices
    calls = _check_calls(choice.message.tool_calls)
    if calls:
        assert choice.finish_reason in ("tool_calls", "length")
        assert all(name in ("add", "get_weather") for name, _ in calls)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)
    if tool_choice == "none":
        assert not calls


def _stream_result(client, **kw):
    """(content, [(name, args)], finish_reason) reassembled from a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.id:
                    assert tc.index == len(calls) and tc.function.name
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.function.name is None
                    calls[tc.index][1] += tc.function.arguments
            finish = ch.finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
@pytest.mark.parametrize("seed", [1, 2])
def test_streamed_tool_deltas_equal_the_whole_response(server, client, tiny_gguf, tool_choice,
                                                       seed):
    kw = dict(model=tiny_gguf, messages=HI, tools=[ADD, WEATHER], tool_choice=tool_choice,
              max_tokens=24, seed=seed, temperature=1.0)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish = _stream_result(client, **kw)
    assert calls == _check_calls(whole.message.tool_calls)
    assert (content.strip() or None) == (whole.message.content.strip() or None
                                         if whole.message.content else None)
    assert finish == whole.finish_reason


def test_tool_history_round_trips_into_the_prompt(server, http):
    messages = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_a", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_a", "content": "3"}]
    r = http.post("/tokenize", json={"messages": messages, "tools": [ADD]})
    assert r.status_code == 200, r.text
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert '"name": "add"' in text and "# Tools" in text  # the tools, Hermes style
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    without = http.post("/tokenize", json={"messages": messages[:1]}).json()["tokens"]
    assert len(r.json()["tokens"]) > len(without)


def _grpc_chat(arguments: str = '{"a": 1, "b": 2}') -> pb.ChatMessages:
    """The tool history of ``test_tool_history_round_trips_into_the_prompt`` in
    gRPC's ``ChatMessage`` / ``ToolCall``."""
    return pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="1+2?"),
        pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="call_a", name="add", arguments=arguments)]),
        pb.ChatMessage(role="tool", tool_call_id="call_a", content="3")])


@pytest.mark.parametrize("which", ["server", "tool_server"])
def test_grpc_tool_history_renders_as_http(request, which):
    """An assistant turn's ``tool_calls`` and a "tool" reply sent over gRPC
    render into the very prompt the HTTP API renders from the same OpenAI
    messages, with the ChatML template (calls as text blocks) and with the
    tool-aware Qwen one (the template renders them); bad arguments JSON is
    INVALID_ARGUMENT naming the flat ToolCall field."""
    s = request.getfixturevalue(which)
    s = s[0] if isinstance(s, tuple) else s
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call_a", "type": "function",
                   "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_a", "content": "3"}]
    with grpc.insecure_channel(s.target) as channel, \
            httpx.Client(base_url=s.http_url, timeout=120) as http:
        stub = pb_grpc.GenerationStub(channel)
        ids = list(stub.Tokenize(pb.TokenizeRequest(chat=_grpc_chat()), timeout=60).token_ids)
        assert ids == http.post("/tokenize", json={"messages": history}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
        assert "<tool_response>\n3\n</tool_response>" in text
        (out,) = stub.Generate(pb.GenerateRequest(
            chat=_grpc_chat(), sampling=pb.SamplingParams(max_tokens=2),
            output_kind=pb.OUTPUT_KIND_FINAL_ONLY), timeout=60)
        assert out.finished and out.usage.prompt_tokens == len(ids)
        for call, field in ((lambda: stub.Tokenize(pb.TokenizeRequest(chat=_grpc_chat("{")),
                                                   timeout=60), "input.chat"),
                            (lambda: list(stub.Generate(pb.GenerateRequest(
                                chat=_grpc_chat('{"a": '), output_kind=pb.OUTPUT_KIND_FINAL_ONLY),
                                timeout=60)), "prompt.chat")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(
                f"{field}.messages.1.tool_calls.0.arguments: is not valid JSON"), \
                e.value.details()


BAD = [  # (route, body, param)
    ("/v1/chat/completions", dict(response_format={"type": "json_object"},
                                  guided_regex="a+"), "guided_regex"),
    ("/v1/chat/completions", dict(guided_json=SCHEMA, structured_outputs={"regex": "a"}),
     "guided_json"),
    ("/v1/chat/completions", dict(response_format={"type": "yaml"}), "response_format.type"),
    ("/v1/chat/completions", dict(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", dict(tools=[ADD], tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice"),
    ("/v1/chat/completions", dict(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", dict(tools=[{"type": "function", "function": {}}]),
     "tools.0.function.name"),
    ("/v1/chat/completions", dict(tools=[ADD], tool_choice="required", guided_choice=["a"]),
     "tool_choice"),
    ("/v1/chat/completions", dict(logit_bias={"1000": 1}), "logit_bias"),
    ("/v1/chat/completions", dict(logit_bias={"5": 200}), "logit_bias"),
    ("/v1/completions", dict(allowed_token_ids=[1, VOCAB]), "allowed_token_ids"),
    ("/v1/completions", dict(guided_choice=[]), "guided_choice"),
    ("/v1/completions", dict(guided_json="{oops"), "guided_json"),
    ("/v1/completions", dict(structured_outputs={"structural_tag": "x"}),
     "structured_outputs.structural_tag"),
    ("/v1/chat/completions", dict(messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "add", "arguments": "{"}}]}]),
     "messages.0.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("route, body, param", BAD, ids=[p for _, _, p in BAD])
def test_refusals_are_400_naming_the_param(server, http, tiny_gguf, route, body, param):
    body = {"model": tiny_gguf, "max_tokens": 2, **body}
    body.setdefault("messages" if "chat" in route else "prompt", HI if "chat" in route else "hi")
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (400, param, "invalid_request_error"), err
    ok = http.post("/v1/completions", json={"model": tiny_gguf, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # and the server serves on


def _generate(stub, **sampling):
    req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=3, **sampling),
                             output_kind=pb.OUTPUT_KIND_FINAL_ONLY)
    return list(stub.Generate(req, timeout=60))


def test_grpc_constraints(server, stub):
    for sampling in (dict(regex="[ab]+"), dict(json_schema=json.dumps(SCHEMA)),
                     dict(choice=pb.Choices(choices=["x", "y"])), dict(json_object=True),
                     dict(logit_bias={5: -100}, allowed_token_ids=[5, 6], bad_words=["a"])):
        (out,) = _generate(stub, **sampling)
        assert out.finished and out.completions[0].finish_reason in ("stop", "length")
    for sampling, field in ((dict(json_schema="{"), "sampling.json_schema"),
                            (dict(choice=pb.Choices()), "sampling.choice"),
                            (dict(logit_bias={VOCAB: 1.0}), "sampling.logit_bias"),
                            (dict(allowed_token_ids=[VOCAB + 5]), "sampling.allowed_token_ids"),
                            (dict(logit_bias={5: 150.0}), "logit_bias")):
        with pytest.raises(grpc.RpcError) as e:
            _generate(stub, **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details(), e.value.details()


# ---- 3. end to end, once the engine applies constraints -------------------------------

class Address(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    zip_code: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    tags: list[Literal["a", "b", "c"]] = Field(min_length=1, max_length=3)
    address: Address
    nickname: Optional[str] = Field(default=None, max_length=6)


def test_parse_pydantic_model_always_valid(server, client, tiny_gguf):
    schema = Person.model_json_schema()
    for seed in range(20):
        resp = client.chat.completions.parse(model=tiny_gguf, messages=HI, response_format=Person,
                                             temperature=1.0, seed=seed, max_tokens=400)
        msg = resp.choices[0].message
        jsonschema.validate(json.loads(msg.content), schema)
        assert isinstance(msg.parsed, Person)


def test_json_object_regex_choice_and_grammar_always_match(server, client, tiny_gguf):
    stopped = 0
    for seed in range(10):
        kw = dict(model=tiny_gguf, messages=HI, temperature=1.0, seed=seed, max_tokens=200)
        out = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
        # A random model may write a string until max_tokens ("length": a
        # prefix); every output that ended is one JSON object.
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
            stopped += 1
        for regex in (r"\(\d{3}\) \d{3}-\d{4}", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"):
            out = client.chat.completions.create(extra_body={"guided_regex": regex}, **kw)
            assert re.fullmatch(regex, out.choices[0].message.content)
        out = client.chat.completions.create(extra_body={"guided_choice": ["yes", "no"]}, **kw)
        assert out.choices[0].message.content in ("yes", "no")
        grammar = 'root ::= "(" digit "+" digit ")"\ndigit ::= [0-9]'
        out = client.chat.completions.create(extra_body={"guided_grammar": grammar}, **kw)
        assert re.fullmatch(r"\(\d\+\d\)", out.choices[0].message.content)
    assert stopped >= 3, stopped


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_forced_tool_calls_always_validate(server, client, tiny_gguf, tool_choice):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, WEATHER)}
    finished = 0
    for seed in range(10):
        resp = client.chat.completions.create(model=tiny_gguf, messages=HI, tools=[ADD, WEATHER],
                                              tool_choice=tool_choice, temperature=1.0,
                                              seed=seed, max_tokens=200)
        choice = resp.choices[0]
        if choice.finish_reason == "length":  # a random model's endless number or string
            continue
        finished += 1
        calls = _check_calls(choice.message.tool_calls)
        assert calls and choice.finish_reason == "tool_calls" and choice.message.content is None
        for name, args in calls:
            jsonschema.validate(args, params[name])
            if isinstance(tool_choice, dict):
                assert name == "get_weather"
    assert finished >= 5, finished


def test_logit_bias_bans_and_forces(server, stub):
    """+100 makes one token the only one sampled; -100 bans the greedy choice."""
    (forced,) = _generate(stub, temperature=1.0, seed=0, ignore_eos=True, logit_bias={65: 100})
    assert list(forced.completions[0].token_ids) == [65, 65, 65]
    (plain,) = _generate(stub, temperature=0.0, ignore_eos=True)
    first = plain.completions[0].token_ids[0]
    (banned,) = _generate(stub, temperature=0.0, ignore_eos=True, logit_bias={first: -100})
    assert first not in banned.completions[0].token_ids


def _langchain(server, tiny_gguf):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=server.http_url + "/v1", api_key="unused", model=tiny_gguf,
                      temperature=1.0, max_tokens=300, seed=0, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, tiny_gguf, method):
    out = _langchain(server, tiny_gguf).with_structured_output(Person, method=method).invoke(
        "Make up a person.")
    assert isinstance(out, Person)


def test_langchain_bind_tools(server, tiny_gguf):
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b
    msg = _langchain(server, tiny_gguf).bind_tools([add], tool_choice="add").invoke(
        "What is 1+2?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "add"
    assert {k: type(v) for k, v in msg.tool_calls[0]["args"].items()} == {"a": int, "b": int}


class Note(BaseModel):
    """What instructor's JSON mode can check on a random model: it sends
    ``response_format: json_object`` and the schema only in the prompt, so
    the server guarantees an object, not its keys; extra keys are ignored."""
    note: Optional[str] = None


@pytest.mark.parametrize("mode, model", [("TOOLS", Person), ("JSON", Note)])
def test_instructor_modes(server, tiny_gguf, mode, model):
    import instructor
    oa = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    ic = instructor.from_openai(oa, mode=getattr(instructor.Mode, mode))
    done = 0
    for seed in range(6):
        try:
            out = ic.chat.completions.create(
                model=tiny_gguf, response_model=model, max_retries=0, max_tokens=1000,
                seed=seed, temperature=1.0, messages=[{"role": "user", "content": "Fill it in."}])
        except Exception as e:  # noqa: BLE001 - instructor has two classes of this name
            if type(e).__name__ != "IncompleteOutputException":
                raise
            continue  # a random model's endless string: cut by max_tokens, not invalid
        assert isinstance(out, model)
        done += 1
    assert done >= 2, done


def test_vllm_metric_names_are_scraped(server, client, tiny_gguf):
    """Dashboards built for vLLM read the same figures under vLLM's names
    (with its ``model_name`` label) beside ours."""
    client.completions.create(model=tiny_gguf, prompt="hi", max_tokens=3, temperature=0)
    m = server.metrics()
    label = next(k for k in m if k.startswith("vllm:num_requests_waiting{")).split("{")[1]
    assert 'model_name="' in label and 'engine="0"' in label
    ours = {k: v for k, v in m.items() if k.startswith("jaxserve_")}
    for vllm, mine in (("vllm:num_requests_running", "jaxserve_num_requests_running"),
                       ("vllm:num_requests_waiting", "jaxserve_num_requests_waiting"),
                       ("vllm:kv_cache_usage_perc", "jaxserve_kv_cache_usage_ratio"),
                       ("vllm:generation_tokens_total", "jaxserve_generation_tokens_total"),
                       ("vllm:prompt_tokens_total", "jaxserve_prompt_tokens_total"),
                       ("vllm:time_to_first_token_seconds_count",
                        "jaxserve_time_to_first_token_seconds_count"),
                       ("vllm:e2e_request_latency_seconds_count",
                        "jaxserve_e2e_request_latency_seconds_count")):
        assert m[f"{vllm}{{{label}"] == ours[mine], vllm
    assert m["vllm:generation_tokens_total{" + label] >= 3
    assert any(k.startswith('vllm:request_success_total{') and 'finished_reason="length"' in k
               for k in m)


def test_structured_output_metrics(server, client, tiny_gguf):
    """Constrained requests, grammar compiles, mask fills and their time are
    counted on /metrics."""
    before = server.metrics()
    kw = dict(model=tiny_gguf, messages=HI, temperature=0, max_tokens=20)
    for _ in range(2):  # the second compile of the same regex is a cache hit
        client.chat.completions.create(extra_body={"guided_regex": r"[ab]{4}c"}, **kw)
    m = server.metrics()

    def grew(name):
        return m[name] - before.get(name, 0.0)
    assert grew("jaxserve_structured_output_requests_total") == 2
    assert grew("jaxserve_grammar_compiled_total") >= 1
    assert grew("jaxserve_grammar_cache_hits_total") >= 1
    assert grew("jaxserve_token_mask_fills_total") >= 2
    assert grew("jaxserve_token_mask_fill_seconds_total") > 0
    assert grew("jaxserve_grammar_compile_seconds_total") > 0


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A tiny random Qwen3 (q/k norms, head_dim 32 != D/N; an HF folder,
    ``tiny_models.write_tiny_qwen3``) with a tool-aware chat template (the
    tool parts of Qwen 2.5's, which reads ``tools`` and renders
    ``tool_calls`` itself)."""
    from test_tool_parsers import QWEN_TOOLS
    from tiny_models import write_tiny_qwen3
    path = str(tmp_path_factory.mktemp("tiny-qwen3-tools"))
    write_tiny_qwen3(path, chat_template=QWEN_TOOLS)
    s = ServerProcess(["--model", path, "--http_port", "0", *ENGINE_FLAGS])
    yield s, path
    assert s.terminate() == 0


def test_tool_server_is_a_qwen3(tool_server):
    """The tool-aware model really is served as a Qwen3 (a llama would fail)."""
    server, model = tool_server
    with grpc.insecure_channel(server.target) as channel:
        info = pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest())
    assert (info.name, info.architecture, info.vocab_size) == (model, "qwen3", VOCAB)


def test_tool_aware_template_renders_tools_and_serves_all_choices(tool_server):
    """A template that reads ``tools`` gets them itself (no Hermes system
    prompt is added); "auto" returns content or calls, "required" and a named
    function return calls whose arguments validate; the call and a tool reply
    continue the conversation."""
    server, model = tool_server
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused")
    http = httpx.Client(base_url=server.http_url, timeout=60)
    r = http.post("/tokenize", json={"messages": HI, "tools": [ADD, WEATHER]})
    text = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and "# Tools" in text
    assert text.count("# Tools") == 1 and '"name": "get_weather"' in text
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, WEATHER)}
    called, last = 0, None
    for seed in range(3):
        kw = dict(model=model, messages=HI, tools=[ADD, WEATHER], temperature=1.0, seed=seed,
                  max_tokens=60)
        auto = client.chat.completions.create(tool_choice="auto", **kw).choices[0]
        assert auto.message.tool_calls or isinstance(auto.message.content, str)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            out = client.chat.completions.create(tool_choice=choice, **kw).choices[0]
            if out.finish_reason == "length":
                continue  # a random model may write a string to max_tokens
            assert out.finish_reason == "tool_calls", out
            for call in out.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments),
                                    params[call.function.name])
                if isinstance(choice, dict):
                    assert call.function.name == "get_weather"
            called, last = called + 1, out
    assert called >= 3, called  # of 6 forced calls, most end before max_tokens
    call = last.message.tool_calls[0]
    follow = HI + [last.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=[ADD, WEATHER],
                                           max_tokens=5, temperature=0)
    assert again.choices[0].message.content is not None or again.choices[0].message.tool_calls
