"""Tool calling without a model: ``jaxserve.server.tool_parsers`` (the request's
``ToolPlan``, the forced-call JSON schema, the parsers of each format, the
streamed ``delta.tool_calls``) and the chat template's tools
(``checkpoints.chat_template.tool_messages``): pure functions, checked on
exact inputs and outputs; schemas checked with ``jsonschema``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from checkpoints.chat_template import render_chat_template, tool_messages
from jaxserve.server.checks import InvalidRequest
from jaxserve.server.tool_parsers import (ARGUMENT_PIECE_CHARS, ToolCallStream, ToolPlan,
                                          apply_to_choice, forced_tool_schema, parse_output,
                                          parse_tool_calls, plan_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
NAMES = ["get_weather", "add"]
AUTO = ToolPlan(TOOLS, "auto")


def _calls(calls):
    """(name, decoded arguments) of each call, after checking the call's shape."""
    out = []
    for c in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function"
        assert isinstance(c["function"]["arguments"], str)
        out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
    return out


# ---- parsing finished outputs ---------------------------------------------------------

HERMES_CASES = [  # (text, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
     '"unit": "c"}}</tool_call>', "Let me check.", [("get_weather", {"city": "Oslo",
                                                                     "unit": "c"})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
     '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call> and done',
     "and done", [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    # arguments as JSON text (some models), an unclosed last tag at the end
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}</tool_call>',
     None, [("add", {"a": 5, "b": 6})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}', None,
     [("add", {"a": 1, "b": 1})]),
    # a malformed call is no call: the text is kept whole
    ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', None, []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', None, []),
    # one good and one malformed: the good one is the call, the bad text stays
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
     '<tool_call>oops</tool_call>', "<tool_call>oops</tool_call>", [("add", {"a": 1, "b": 2})]),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert _calls(got_calls) == calls
    if calls:
        assert got_content == content
    else:
        assert got_content == text  # nothing parsed: the text is the content, unchanged


JSON_CASES = [  # Llama 3.x JSON and the JSON fallback: (text, calls)
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [("get_weather",
                                                                  {"city": "Rome"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', [("add", {"a": 1,
                                                                              "b": 2})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
     '"parameters": {"city": "x"}}', [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "x"})]),
    ('  {"name": "add", "arguments": {"a": 0, "b": 0}}\n', [("add", {"a": 0, "b": 0})]),
    ('[{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "add", "arguments": '
     '{"a": 2, "b": 2}}]', [("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2})]),
    ('```json\n{"name": "add", "arguments": {"a": 9, "b": 9}}\n```', [("add", {"a": 9, "b": 9})]),
    # not calls: an unknown name, a JSON answer, text, broken JSON, a list with a non-call
    ('{"name": "launch_rocket", "parameters": {}}', []),
    ('{"name": "Bob", "age": 3}', []),
    ("The weather in Paris is sunny.", []),
    ('{"name": "add", "parameters": {"a": 1', []),
    ('[{"name": "add", "arguments": {}}, 5]', []),
]


@pytest.mark.parametrize("text, calls", JSON_CASES)
def test_json_calls(text, calls):
    content, got = parse_tool_calls(text, NAMES)
    assert _calls(got) == calls
    assert content == (None if calls else text)


def test_ids_are_fresh_and_none_plan_does_not_parse():
    _, a = parse_tool_calls('{"name": "add", "arguments": {}}', NAMES)
    _, b = parse_tool_calls('{"name": "add", "arguments": {}}', NAMES)
    assert a[0]["id"] != b[0]["id"]
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse_output(text, ToolPlan(TOOLS, "none")) == (text, [])


def test_apply_to_choice_sets_tool_calls_and_finish_reason():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    choice = apply_to_choice({"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": "stop"}, AUTO)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
    assert _calls(choice["message"]["tool_calls"]) == [("add", {"a": 1, "b": 2})]
    # cut by max_tokens: calls parsed, the reason stays "length"
    cut = apply_to_choice({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": "length"}, AUTO)
    assert cut["finish_reason"] == "length" and len(cut["message"]["tool_calls"]) == 1
    plain = apply_to_choice({"index": 0, "message": {"role": "assistant", "content": "hi"},
                             "finish_reason": "stop"}, AUTO)
    assert plain == {"index": 0, "message": {"role": "assistant", "content": "hi"},
                     "finish_reason": "stop"}


# ---- the request -------------------------------------------------------------------

def test_plan_tools_choices():
    assert plan_tools(None, None, None) is None
    assert plan_tools([], "none", None) is None
    assert plan_tools(TOOLS, None, None) == ToolPlan(TOOLS, "auto", True)
    p = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert (p.choice, p.forced, p.parallel, p.names) == ("add", True, False, NAMES)
    assert plan_tools(TOOLS, "none", None).parses is False
    assert plan_tools(TOOLS, "required", None).forced


@pytest.mark.parametrize("tools, choice, field", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "retrieval"}], None, "tools.0.type"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None,
     "tools.0.function.parameters"),
    ([ADD, ADD], None, "tools"),
])
def test_plan_tools_refusals_name_the_field(tools, choice, field):
    with pytest.raises(InvalidRequest) as e:
        plan_tools(tools, choice, None)
    assert str(e.value).split(":", 1)[0] == field
    if choice and isinstance(choice, dict) and choice.get("function"):
        assert "nope" in str(e.value) and "get_weather, add" in str(e.value)


def test_forced_schema_accepts_exactly_valid_calls():
    named = forced_tool_schema(ToolPlan(TOOLS, "get_weather"))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, named)
    for bad in ({"name": "add", "arguments": {"a": 1, "b": 2}},
                {"name": "get_weather", "arguments": {"city": 3}},
                {"name": "get_weather", "arguments": {"city": "x", "wind": 1}},
                {"name": "get_weather"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    required = forced_tool_schema(ToolPlan(TOOLS, "required", parallel=True))
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}},
                         {"name": "get_weather", "arguments": {"city": "x"}}], required)
    for bad in ([], [{"name": "add", "arguments": {"city": "x"}}],
                {"name": "add", "arguments": {"a": 1, "b": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = forced_tool_schema(ToolPlan(TOOLS, "required", parallel=False))
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], single)


def test_forced_output_parses_as_json():
    plan = ToolPlan(TOOLS, "required")
    content, calls = parse_output('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', plan)
    assert content is None and _calls(calls) == [("add", {"a": 1, "b": 2})]
    # cut short (max_tokens): no call, the text is kept
    cut = '[{"name": "add", "argu'
    assert parse_output(cut, plan) == (cut, [])


# ---- streaming ---------------------------------------------------------------------

def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(content, calls, deltas) reassembled from the deltas as a client does."""
    s = ToolCallStream(plan)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, calls = "", {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # the first chunk of a call: id, type, name, empty arguments
                assert tc["function"]["arguments"] == "" and tc["index"] == len(calls)
                calls[tc["index"]] = {"id": tc["id"], "type": tc["type"], "function": {
                    "name": tc["function"]["name"], "arguments": ""}}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    assert s.called == len(calls)
    return content, [calls[i] for i in sorted(calls)], deltas


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, content, calls", [c for c in HERMES_CASES if c[2]] + [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None,
     [("add", {"a": 1, "b": 2})]),
])
def test_streamed_calls_reassemble_to_the_whole_parse(text, content, calls, size):
    got_content, got_calls, _ = _stream(AUTO, _pieces(text, size))
    assert _calls(got_calls) == calls
    whole_content, _ = parse_tool_calls(text, NAMES)
    assert (got_content.strip() or None) == whole_content


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_text_is_sent_and_tag_starts_held_back(size):
    text = "a < b, and <tool is not a tag; <tool_cal"
    s = ToolCallStream(AUTO)
    sent = ""
    for p in _pieces(text, size):
        sent += "".join(d.get("content", "") for d in s.feed(p))
        assert not sent.endswith(("<t", "<tool_cal")), sent  # a possible tag start waits
    rest = "".join(d["content"] for d in s.finish())
    assert sent + rest == text and sent.startswith("a < b, and <tool is not a tag; ")


def test_streamed_long_arguments_come_in_pieces_that_concatenate():
    args = {"city": "x" * 200}
    text = f'<tool_call>{json.dumps({"name": "get_weather", "arguments": args})}</tool_call>'
    _, calls, deltas = _stream(AUTO, _pieces(text, 5))
    assert json.loads(calls[0]["function"]["arguments"]) == args
    pieces = [d for d in deltas if "tool_calls" in d][1:]
    assert len(pieces) == -(-len(json.dumps(args)) // ARGUMENT_PIECE_CHARS) > 1


def test_streamed_forced_and_none():
    _, calls, _ = _stream(ToolPlan(TOOLS, "required"),
                          _pieces('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', 3))
    assert _calls(calls) == [("add", {"a": 1, "b": 2})]
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    content, calls, _ = _stream(ToolPlan(TOOLS, "none"), _pieces(text, 4))
    assert content == text and calls == []
    content, calls, _ = _stream(AUTO, _pieces('{"answer": 42}', 2))  # JSON, not a call
    assert content == '{"answer": 42}' and calls == []


@pytest.mark.parametrize("size", [3, 1000])
@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    '[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
])
def test_auto_without_parallel_calls_keeps_the_first_call(text, size):
    """``parallel_tool_calls=false`` under "auto": one call, the first, in a
    whole response and in a stream; with it (the default) both calls."""
    plan = plan_tools(TOOLS, "auto", False)
    both = [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert _calls(parse_output(text, AUTO)[1]) == both
    content, calls = parse_output(text, plan)
    assert content is None and _calls(calls) == both[:1]
    choice = apply_to_choice({"index": 0, "message": {"role": "assistant", "content": text},
                              "finish_reason": "stop"}, plan)
    assert _calls(choice["message"]["tool_calls"]) == both[:1]
    assert choice["finish_reason"] == "tool_calls"
    content, calls, _ = _stream(plan, _pieces(text, size))
    assert content.strip() == "" and _calls(calls) == both[:1]
    assert _calls(_stream(AUTO, _pieces(text, size))[1]) == both


# ---- the chat template -------------------------------------------------------------

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The tool parts of Qwen 2.5's template, abridged.
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


def _render(source, messages, tools):
    messages, tools = tool_messages(source, messages, tools)
    return render_chat_template(source, messages, tools=tools)


def test_template_with_tools_gets_them_and_the_calls():
    text = _render(QWEN_TOOLS, HISTORY, TOOLS)
    assert json.dumps(WEATHER, ensure_ascii=False) in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant")  # the abridged template trims the newline


def test_template_without_tools_gets_a_hermes_prompt_and_calls_as_text():
    text = _render(CHATML, [{"role": "system", "content": "Be brief."}] + HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(ADD, ensure_ascii=False) in text and "<tool_call></tool_call>" in text
    # the call is not dropped from the prompt: it is in the assistant turn
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text
    # no system message: one is added; no tools and no calls: unchanged
    assert _render(CHATML, HISTORY[:1], [ADD]).startswith("<|im_start|>system\n# Tools")
    plain = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]
    assert tool_messages(CHATML, plain, None) == (plain, None)


def test_forced_schema_keeps_pydantic_refs_resolvable():
    """Parameters from pydantic (instructor, LangChain) hold ``$defs`` and
    ``#/$defs/...`` refs, recursive ones too; under ``arguments`` they must
    still resolve: they are gathered at the root, per tool."""
    from typing import Literal

    from pydantic import BaseModel

    class Address(BaseModel):
        city: Literal["Paris", "Oslo"]

    class Person(BaseModel):
        name: str
        address: Address
        friends: list["Person"] = []

    person = {"type": "function", "function": {"name": "Person",
                                               "parameters": Person.model_json_schema()}}
    other = {"type": "function", "function": {"name": "Address",  # its own "Address"
                                              "parameters": Address.model_json_schema()}}
    good = {"name": "Person", "arguments": {"name": "a", "address": {"city": "Oslo"},
                                            "friends": [{"name": "b",
                                                         "address": {"city": "Paris"}}]}}
    bad = {"name": "Person", "arguments": {"name": "a", "address": {"city": "Rome"}}}
    bad_friend = {"name": "Person", "arguments": {"name": "a", "address": {"city": "Oslo"},
                                                  "friends": [{"name": "b"}]}}
    for plan, wrap in ((ToolPlan([person, other], "Person"), lambda x: x),
                       (ToolPlan([person, other], "required"), lambda x: [x])):
        schema = forced_tool_schema(plan)
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(wrap(good), schema)
        for b in (bad, bad_friend):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrap(b), schema)
    jsonschema.validate([{"name": "Address", "arguments": {"city": "Paris"}}],
                        forced_tool_schema(ToolPlan([person, other], "required")))
