"""Tool calling for ``/v1/chat/completions``: the request's tools, the calls in the output.

What a request asks (``ToolPlan``, from ``tools``, ``tool_choice`` and
``parallel_tool_calls``):

  ``"none"``      the tools are rendered into the prompt (vLLM's default) but
                  the output is not parsed: it is plain content.
  ``"auto"``      (the default with tools) the model chooses; the output is
                  parsed for calls in the formats the supported families
                  emit (``parse_tool_calls``).
  ``"required"``, ``{"type": "function", "function": {"name": ...}}``
                  the output is constrained by a JSON schema
                  (``forced_tool_schema``: one call object
                  ``{"name", "arguments"}`` per offered tool in an ``anyOf``,
                  arguments = that tool's ``parameters``; an array of them,
                  at least one, when ``parallel_tool_calls``), sent as
                  ``structured_outputs.json``, so even a small model returns
                  a valid call; the output is then parsed as that JSON.

Formats parsed under ``"auto"`` (first that matches):
  1. Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
     any number of them; text outside the tags is the content.
  2. Llama 3.x JSON: the whole output (after an optional ``<|python_tag|>``)
     is ``{"name": ..., "parameters": {...}}``, several joined by ``;``.
  3. JSON fallback: the whole output (optionally in a ```json fence) is a
     call object ``{"name", "arguments"|"parameters"}`` or a list of them.
For 2 and 3 the name must be one of the offered tools, so a JSON answer
that happens to have a ``name`` key stays content. A call whose JSON does
not parse is no call: the text is kept as content.

``parallel_tool_calls=false`` holds under every choice: a forced choice's
schema asks for one call object (not an array), and under ``"auto"``, where
nothing constrains the model, a response carries at most one call, the
first parsed; the calls after it are dropped (not returned as content), in
whole responses and in streams alike (vLLM does the same).

Results are OpenAI's ``message.tool_calls``: ``[{"id": "call_<24 hex>",
"type": "function", "function": {"name", "arguments": <JSON text>}}]``;
``finish_reason`` becomes ``"tool_calls"`` when the output held calls.
Streaming (``ToolCallStream``) holds back text that may be the start of a
``<tool_call>`` tag or a JSON call, and sends each call as
``delta.tool_calls`` chunks: ``{index, id, type, function: {name,
arguments: ""}}`` then ``{index, function: {arguments}}`` pieces that
concatenate to the call's JSON arguments.

Reference: vLLM ``vllm/entrypoints/openai/tool_parsers/`` (hermes, llama3_json)
and ``serving_chat.py`` (``_get_json_schema_from_tool``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.server.checks import InvalidRequest

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
# Arguments are streamed in pieces of at most this many characters.
ARGUMENT_PIECE_CHARS = 64


def call_id() -> str:
    """A fresh tool-call id, ``call_`` and 24 hex digits (OpenAI's shape)."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: Any) -> dict:
    """One ``message.tool_calls`` entry; ``arguments`` (an object, or its
    JSON text) is sent as JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


# ---- the request ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask.

    Attributes:
      tools: the function tools, OpenAI's ``{"type": "function", "function":
        {name, description, parameters}}``, checked; passed to the template.
      choice: "none", "auto", "required" or the named function's name.
      parallel: ``parallel_tool_calls`` (more than one call allowed). When
        False a forced choice's schema is one call object and any output's
        calls are cut to the first (``parse_output``, ``ToolCallStream``).
    """

    tools: list[dict]
    choice: str
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """The output must be a call (constrained by ``forced_tool_schema``)."""
        return self.choice not in ("none", "auto")

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def _check_tool(i: int, tool: Any) -> dict:
    field = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequest(f"{field}.type: only function tools are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{field}.function: must be an object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[^\s\ud800-\udfff]{1,256}", name):
        raise InvalidRequest(f"{field}.function.name: must be 1-256 characters of valid "
                             f"Unicode, no whitespace (OpenAI's: letters, digits, '_', '-')")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(f"{field}.function.parameters: must be a JSON Schema object")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The ``ToolPlan`` of a request, or None when it offers no tools (and
    ``tool_choice`` is absent or "none").

    Raises:
      InvalidRequest: a malformed tool (``tools.<i>...``), ``tool_choice``
        of another shape, naming an unknown function, or set without tools
        (naming ``tool_choice``).
    """
    tools = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: two tools have the same name")
    if tool_choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest(f"tool_choice: must be 'none', 'auto', 'required' or "
                                 f"{{'type': 'function', 'function': {{'name': ...}}}}, "
                                 f"got {tool_choice!r:.40}")
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise InvalidRequest(f"tool_choice: names function {choice!r:.64}, which is not "
                                 f"in tools ({', '.join(names) or 'none given'})")
    else:
        raise InvalidRequest("tool_choice: must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
    if choice != "none" and not tools:
        raise InvalidRequest(f"tool_choice: {choice!r} needs tools")
    if not tools:
        return None
    return ToolPlan(tools, choice, True if parallel_tool_calls is None else
                    bool(parallel_tool_calls))


_DEFS = ("$defs", "definitions")


def _rebase_refs(node: Any, prefix: str) -> Any:
    """``node`` with local ``$ref``s (``#/$defs/X``, ``#/definitions/X``,
    ``#``) pointing at ``#/$defs/<prefix>X`` (``<prefix>`` for ``#``)."""
    if isinstance(node, list):
        return [_rebase_refs(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            if v == "#":
                v = f"#/$defs/{prefix}"
            for d in _DEFS:
                if v.startswith(f"#/{d}/"):
                    v = f"#/$defs/{prefix}{v[len(d) + 3:]}"
        out[k] = _rebase_refs(v, prefix)
    return out


def _call_schema(tool: dict, i: int, defs: dict) -> dict:
    """Tool ``i``'s call object schema. Its parameters' ``$defs`` move to
    the root (``defs``, names prefixed ``tool<i>_``) and their refs with
    them: a schema from pydantic (``#/$defs/Model``) only resolves from the
    root, and the parameters sit under ``properties.arguments``."""
    fn = tool["function"]
    params = dict(fn.get("parameters") or {"type": "object"})
    prefix = f"tool{i}_"
    own = {}
    for d in _DEFS:
        own.update(params.pop(d, None) or {})
    params = _rebase_refs(params, prefix)
    defs.update({prefix + k: _rebase_refs(v, prefix) for k, v in own.items()})
    defs[prefix] = params  # the target of a recursive "#" ref
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_tool_schema(plan: ToolPlan) -> dict:
    """The JSON schema the output of a forced ``tool_choice`` must satisfy:
    a call object for the named tool; for "required" one call to any tool
    (``anyOf``, each arguments schema tied to its name), as an array of at
    least one when ``plan.parallel``. Tools' ``$defs`` are gathered at the
    root (``_call_schema``)."""
    defs: dict = {}
    if plan.choice not in ("required",):
        i, tool = next((i, t) for i, t in enumerate(plan.tools)
                       if t["function"]["name"] == plan.choice)
        schema = _call_schema(tool, i, defs)
    else:
        calls = [_call_schema(t, i, defs) for i, t in enumerate(plan.tools)]
        one = {"anyOf": calls} if len(calls) > 1 else calls[0]
        schema = {"type": "array", "items": one, "minItems": 1} if plan.parallel else one
    used = json.dumps(schema)
    defs = {k: v for k, v in defs.items() if f'"#/$defs/{k}"' in used or k in _referenced(defs)}
    return {**schema, "$defs": defs} if defs else schema


def _referenced(defs: dict) -> set[str]:
    """Names of ``defs`` that some def refers to."""
    text = json.dumps(defs)
    return {k for k in defs if f'"#/$defs/{k}"' in text}


# ---- the output ------------------------------------------------------------------

def _as_call(obj: Any, names: list[str] | None) -> dict | None:
    """A tool call from a decoded call object ``{"name", "arguments" |
    "parameters"}``; None if it is not one (or names a tool not in ``names``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return tool_call(obj["name"], args)


def _json_calls(text: str, names: list[str] | None) -> list[dict] | None:
    """Calls when ``text`` as a whole is a call object, a list of them or
    (Llama 3) call objects joined by ``;``; else None."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].strip()
    m = _FENCE.match(text)
    if m:
        text = m.group(1)
    if not text.startswith(("{", "[")):
        return None
    try:
        objs = json.loads(text)
    except json.JSONDecodeError:
        try:  # Llama 3.x: several calls joined by ";"
            objs = [json.loads(part) for part in text.split(";") if part.strip()]
        except json.JSONDecodeError:
            return None
    objs = objs if isinstance(objs, list) else [objs]
    calls = [_as_call(o, names) for o in objs]
    return calls if calls and all(calls) else None


def parse_tool_calls(text: str, names: list[str] | None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output under ``tool_choice`` "auto".

    Args:
      text: the whole output text.
      names: the offered tool names (a JSON call must name one of them).

    Returns:
      The text outside the calls (None when only whitespace is left) and the
      calls in order; (``text``, []) when it holds no call that parses.
    """
    if TOOL_CALL_OPEN in text:
        calls, kept, pos = [], [], 0
        for m in _HERMES.finditer(text):
            try:
                call = _as_call(json.loads(m.group(1)), None)
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue
            calls.append(call)
            kept.append(text[pos:m.start()])
            pos = m.end()
        if calls:
            content = "".join(kept + [text[pos:]]).strip()
            return content or None, calls
        return text, []
    calls = _json_calls(text, names)
    return (None, calls) if calls else (text, [])


def parse_forced(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, calls) of an output constrained by ``forced_tool_schema``:
    the JSON parsed directly; an output that is not such JSON (cut by
    ``max_tokens``) is parsed as under "auto", and failing that kept as
    content."""
    calls = _json_calls(text, plan.names)
    if calls:
        return None, calls
    return parse_tool_calls(text, plan.names)


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished output as ``plan`` asks: at most one
    call (the first parsed) when not ``plan.parallel``, whatever the choice;
    the text of the calls dropped is not kept as content."""
    if not plan.parses:
        return text, []
    content, calls = (parse_forced(text, plan) if plan.forced
                      else parse_tool_calls(text, plan.names))
    return content, calls if plan.parallel else calls[:1]


def apply_to_choice(choice: dict, plan: ToolPlan) -> dict:
    """A chat response choice with its message's tool calls parsed out of
    the content; ``finish_reason`` "stop" becomes "tool_calls" when any."""
    msg = choice["message"]
    content, calls = parse_output(msg.get("content") or "", plan)
    if calls:
        choice["message"] = {**msg, "content": content, "tool_calls": calls}
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"
    return choice


# ---- streaming -------------------------------------------------------------------

def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """One streamed choice's content and tool-call deltas.

    ``feed(delta_text)`` returns the deltas to send now: content that cannot
    belong to a call, never the start of a ``<tool_call>`` tag (held back
    until it is known); ``finish()`` parses what was held back and returns
    the last deltas. ``called`` tells whether any call was sent (then
    ``finish_reason`` "stop" is reported as "tool_calls"). Without
    ``plan.parallel`` only the first call is sent; later ones are dropped.
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""  # text not yet sent
        self.json_mode = plan.forced  # all output held: it may be one JSON call
        self.started = False  # the output's kind (JSON or text) is known
        self.called = 0

    def _call_deltas(self, calls: list[dict]) -> list[dict]:
        if not self.plan.parallel:
            calls = calls[:max(0, 1 - self.called)]
        out = []
        for call in calls:
            i, fn = self.called, call["function"]
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]})
            args = fn["arguments"]
            for s in range(0, len(args), ARGUMENT_PIECE_CHARS):
                out.append({"tool_calls": [{"index": i, "function": {
                    "arguments": args[s:s + ARGUMENT_PIECE_CHARS]}}]})
            self.called += 1
        return out

    def feed(self, delta: str) -> list[dict]:
        """Deltas (``{"content": ...}`` / ``{"tool_calls": [...]}``) for new text."""
        if not self.plan.parses:
            return [{"content": delta}] if delta else []
        self.held += delta
        if not self.started:
            first = self.held.lstrip()
            if not first or any(tag.startswith(first) and len(first) < len(tag)
                                for tag in (PYTHON_TAG, "```")):
                return []  # cannot tell yet whether the output is JSON
            self.started = True
            # Llama / fallback JSON: held whole and parsed at the end.
            self.json_mode = self.plan.forced or first.startswith(("{", "[", "```", PYTHON_TAG))
        if self.json_mode or not self.started:
            return []
        out = []
        while True:
            start = self.held.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_prefix(self.held, TOOL_CALL_OPEN)
                text, self.held = self.held[:len(self.held) - keep], self.held[
                    len(self.held) - keep:]
                if text:
                    out.append({"content": text})
                return out
            end = self.held.find(TOOL_CALL_CLOSE, start)
            if start:
                out.append({"content": self.held[:start]})
                self.held = self.held[start:]
                continue
            if end < 0:
                return out  # inside a call: wait for its end
            block, self.held = self.held[:end + len(TOOL_CALL_CLOSE)], self.held[
                end + len(TOOL_CALL_CLOSE):]
            _, calls = parse_tool_calls(block, None)
            out += self._call_deltas(calls) if calls else [{"content": block}]

    def finish(self) -> list[dict]:
        """The deltas for what was held back, at the end of the output."""
        held, self.held = self.held, ""
        if not held:
            return []
        if self.json_mode:
            content, calls = parse_output(held, self.plan)
        else:
            content, calls = parse_tool_calls(held, None)
        out = [{"content": content}] if content else []
        return out + self._call_deltas(calls)


__all__ = ["ARGUMENT_PIECE_CHARS", "PYTHON_TAG", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN",
           "ToolCallStream", "ToolPlan", "apply_to_choice", "call_id", "forced_tool_schema",
           "parse_forced", "parse_output", "parse_tool_calls", "plan_tools", "tool_call"]
