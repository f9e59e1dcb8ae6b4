"""Structured outputs and tool calling at the API: what clients send, what they get.

Three layers:

1. Translation, no server: OpenAI's ``response_format``, vLLM's
   ``structured_outputs`` / ``guided_*``, a forced ``tool_choice`` ->
   ``StructuredOutputsParams``; ``logit_bias`` / ``allowed_token_ids`` /
   ``bad_words`` -> ``SamplingParams``; the gRPC ``constraint`` oneof by the
   same rule; every refusal names its field.
2. A real server (``python -m jaxserve.main --mode serve --http_port 0`` on
   the tiny GGUF, gRPC beside it): the official ``openai`` client's
   ``chat.completions.create(response_format=..., tools=...)`` is accepted
   and answers OpenAI's shapes; streamed tool-call deltas reassemble to the
   non-streamed response of the same seed; a tool-call history round-trips
   into the prompt (``/tokenize``); bad requests are 400 naming ``param``
   and gRPC INVALID_ARGUMENT naming the field.
3. End to end (``tests/test_openai_structured_server.py``): every
   sampled output is valid for its schema / regex / choice / grammar, forced
   tool calls validate against the tool's parameters, ``logit_bias`` bans
   and forces, and ``openai``'s ``parse``, LangChain's
   ``with_structured_output`` / ``bind_tools`` and ``instructor`` work unchanged.
"""

from __future__ import annotations

import json
import re

import pytest

from jaxserve.engine.sampling_params import StructuredOutputsParams
from jaxserve.server import openai_protocol as oai
from jaxserve.server.chat_tools import prepare_chat, request_constraint
from jaxserve.server.checks import InvalidRequest

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer"}, "b": {"type": "integer"}},
                                            "required": ["a", "b"],
                                            "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}

def _chat(**body):
    return oai.parse(oai.ChatCompletionRequest, {"messages": HI, **body})


# ---- 1. translation ----------------------------------------------------------------

@pytest.mark.parametrize("body, expected, field", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True),
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": SCHEMA, "strict": True}}}, StructuredOutputsParams(json=SCHEMA),
     "response_format"),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA), "guided_json"),
    ({"guided_regex": r"\d{3}-\d{4}", "guided_decoding_backend": "xgrammar"},
     StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=("yes", "no")),
     "guided_choice"),
    ({"guided_grammar": 'root ::= "a" | "b"'}, StructuredOutputsParams(
        grammar='root ::= "a" | "b"'), "guided_grammar"),
    ({"structured_outputs": {"choice": ["x"], "disable_fallback": True}},
     StructuredOutputsParams(choice=("x",)), "structured_outputs.choice"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True),
     "structured_outputs.json_object"),
])
def test_constraint_translation(body, expected, field):
    assert request_constraint(_chat(**body)) == (expected, field)


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"tools": [ADD], "tool_choice": "required", "guided_json": SCHEMA}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice"),
])
def test_constraint_refusals_name_the_field(body, field):
    with pytest.raises(InvalidRequest) as e:
        prepare_chat(_chat(**body))
    assert str(e.value).split(":", 1)[0] == field, str(e.value)


def test_two_constraints_name_both():
    with pytest.raises(InvalidRequest, match="response_format, guided_regex"):
        request_constraint(_chat(response_format={"type": "json_object"}, guided_regex="a"))


def test_forced_tool_choice_becomes_the_json_constraint():
    setup = prepare_chat(_chat(tools=[ADD, WEATHER], tool_choice="required",
                               parallel_tool_calls=False))
    assert setup.constraint_field == "tool_choice" and setup.tools == [ADD, WEATHER]
    schema = setup.structured.json
    assert [s["properties"]["name"]["enum"] for s in schema["anyOf"]] == [["add"],
                                                                          ["get_weather"]]
    named = prepare_chat(_chat(tools=[ADD, WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert named.structured.json["properties"]["arguments"] == WEATHER["function"]["parameters"]
    auto = prepare_chat(_chat(tools=[ADD]))
    assert auto.structured is None and auto.plan.choice == "auto"


def test_tool_history_messages_keep_calls_with_object_arguments():
    setup = prepare_chat(_chat(messages=[
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_a", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "3"}]))
    assert setup.messages == [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_a", "type": "function",
            "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_a"}]
    with pytest.raises(InvalidRequest, match=r"^messages\.0\.tool_calls\.0\.function\.arguments"):
        prepare_chat(_chat(messages=[{"role": "assistant", "tool_calls": [{
            "type": "function", "function": {"name": "add", "arguments": "{bad"}}]}]))


def test_logit_bias_allowed_and_bad_words_reach_sampling_params():
    req = oai.parse(oai.CompletionRequest, {
        "prompt": "hi", "logit_bias": {"5": 100, "7": -100.0}, "allowed_token_ids": [5, 7, 9],
        "bad_words": ["foo"], "guided_choice": ["a", "b"]})
    structured, _ = request_constraint(req)
    p = oai.sampling_params(req, 8, None, {}, structured)
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == ({5: 100.0, 7: -100.0},
                                                                [5, 7, 9], ["foo"])
    assert p.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    for body, param in (({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"logit_bias": {"-1": 1}}, "logit_bias"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"bad_words": [""]}, "bad_words")):
        with pytest.raises(oai.APIError) as e:
            oai.sampling_params(oai.parse(oai.CompletionRequest, {"prompt": "hi", **body}), 8,
                                None, {})
        assert (e.value.status, e.value.param) == (400, param), e.value.message


def test_grpc_constraint_oneof_uses_the_same_rule():
    from jaxserve.server import jaxserve_pb2 as pb
    from jaxserve.server.servicer import constraint_from_proto, sampling_params_from_proto
    cases = [(pb.SamplingParams(json_schema=json.dumps(SCHEMA)),
              StructuredOutputsParams(json=SCHEMA), "sampling.json_schema"),
             (pb.SamplingParams(regex="a+"), StructuredOutputsParams(regex="a+"),
              "sampling.regex"),
             (pb.SamplingParams(choice=pb.Choices(choices=["x", "y"])),
              StructuredOutputsParams(choice=("x", "y")), "sampling.choice"),
             (pb.SamplingParams(grammar='root ::= "a"'),
              StructuredOutputsParams(grammar='root ::= "a"'), "sampling.grammar"),
             (pb.SamplingParams(json_object=True), StructuredOutputsParams(json_object=True),
              "sampling.json_object"),
             (pb.SamplingParams(), None, None)]
    for msg, expected, field in cases:
        assert constraint_from_proto(msg) == (expected, field)
    p = sampling_params_from_proto(pb.SamplingParams(
        regex="a+", logit_bias={5: -100, 6: 2.5}, allowed_token_ids=[5, 6], bad_words=["x"]))
    assert (p.structured_outputs, p.logit_bias, p.allowed_token_ids, p.bad_words) == (
        StructuredOutputsParams(regex="a+"), {5: -100.0, 6: 2.5}, [5, 6], ["x"])
    assert sampling_params_from_proto(pb.SamplingParams()).logit_bias is None
    for msg, field in ((pb.SamplingParams(json_schema="{"), "sampling.json_schema"),
                       (pb.SamplingParams(json_schema="[1]"), "sampling.json_schema"),
                       (pb.SamplingParams(choice=pb.Choices()), "sampling.choice"),
                       (pb.SamplingParams(regex=""), "sampling.regex")):  # set, but empty
        with pytest.raises(InvalidRequest, match=f"^{re.escape(field)}:"):
            constraint_from_proto(msg)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        sampling_params_from_proto(pb.SamplingParams(logit_bias={5: 101}))


def test_compile_constraint_runs_off_the_loop_and_names_the_field():
    """``Frontend.compile_constraint`` calls ``Engine.compile_structured`` on
    a worker thread; a ValueError is an InvalidRequest naming the API field."""
    import asyncio
    import threading
    import types

    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.server.frontend import Frontend

    seen = []

    def compile_structured(spec):
        seen.append((spec, threading.current_thread()))
        if spec.regex == "(":
            raise ValueError("structured_outputs.regex: unbalanced parenthesis at 0")

    fe = Frontend("m")
    fe.engine = types.SimpleNamespace(engine=types.SimpleNamespace(
        compile_structured=compile_structured))
    ok = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    asyncio.run(fe.compile_constraint(ok, "guided_regex"))
    assert seen[0][0] == ok.structured_outputs and seen[0][1] is not threading.main_thread()
    asyncio.run(fe.compile_constraint(SamplingParams(), "guided_regex"))  # nothing to compile
    assert len(seen) == 1
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(fe.compile_constraint(bad, "guided_regex"))
    assert str(e.value) == "guided_regex: unbalanced parenthesis at 0"
    fe.engine = types.SimpleNamespace(engine=object())  # an engine without a compiler
    asyncio.run(fe.compile_constraint(bad, "guided_regex"))


def test_python_grpc_client_builds_constraints():
    from jaxserve.server.client import make_request
    from jaxserve.server.servicer import constraint_from_proto
    req = make_request("hi", choice=["a", "b"], logit_bias={3: 1.0}, max_tokens=3)
    assert constraint_from_proto(req.sampling) == (StructuredOutputsParams(choice=("a", "b")),
                                                   "sampling.choice")
    assert dict(req.sampling.logit_bias) == {3: 1.0}
    req = make_request("hi", json_schema=json.dumps(SCHEMA))
    assert constraint_from_proto(req.sampling)[0] == StructuredOutputsParams(json=SCHEMA)
