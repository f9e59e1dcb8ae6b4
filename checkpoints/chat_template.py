"""Render a Jinja chat template exactly as transformers' ``apply_chat_template`` does.

Mirrors ``transformers.utils.chat_template_utils._cached_compile_jinja_template``
and ``render_jinja_template`` (v5): an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block that renders its body unchanged, the globals
``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that does not
HTML-escape. The special-token strings (``bos_token``, ``eos_token``, ...) are
passed as template variables, as HF passes its ``special_tokens_map``.

``render_transcript`` is the fallback for a model without a template.

Tools: ``render_chat_template`` passes ``tools`` (OpenAI's function tools) to
the template as transformers does, and messages keep their ``tool_calls``
(arguments as objects, as HF templates expect) and ``tool_call_id``.
``tool_messages`` prepares them for a template that knows no tools (or for
the transcript): the tool descriptions go into the system prompt in the
Hermes style (``hermes_tools_prompt``, Qwen 2.5's text), assistant calls
become ``<tool_call>`` blocks in the content and tool results
``<tool_response>`` blocks, so a call and its result are never dropped from
the prompt.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: HF uses it to mark assistant
    tokens; for rendering it is a no-op wrapper."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# A model with no chat template of its own (a pretrained base model: Gemma 3
# 270M's GGUF, a folder without one) was never trained on turn tokens; it
# continues a plain transcript sensibly. ``render_transcript`` writes
# the conversation as one, and the assistant's turn ends where the model
# starts the next user line (``TRANSCRIPT_STOP``, added to chat requests'
# stop strings by ``Tokenizer.chat_stop``). vLLM refuses to chat without a
# template; llama.cpp falls back to ChatML, which a base model does not follow.
TRANSCRIPT_STOP = ("\nUser:",)
_TRANSCRIPT_ROLES = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def render_transcript(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """``messages`` as a plain transcript: a system message as its own
    paragraph, then one ``User: ...`` / ``Assistant: ...`` line per message,
    ending with ``Assistant:`` when ``add_generation_prompt``. List content
    keeps its text parts, joined.

    Raises:
      TypeError: a message is not a dict.
      ValueError: a role other than system, user, assistant or tool.
    """
    lines = []
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        content = m.get("content") or ""
        if not isinstance(content, str):
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        role = m.get("role")
        if role == "system":
            lines.append(content.strip() + "\n")
        elif role in _TRANSCRIPT_ROLES:
            lines.append(f"{_TRANSCRIPT_ROLES[role]}: {content.strip()}")
        else:
            raise ValueError(f"unknown chat role {role!r}")
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a chat template.

    Raises:
      jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(source: str, messages: list[dict[str, Any]],
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``source`` over ``messages``.

    Args:
      source: Jinja template text (GGUF ``tokenizer.chat_template``).
      messages: ``[{"role": ..., "content": ...}, ...]``. Keys whose value is None
        are dropped first, as HF does.
      add_generation_prompt: ask the template to open an assistant turn.
      **variables: extra template variables (``bos_token``, ``eos_token``, ``tools``...).

    Returns:
      The rendered prompt text.

    Raises:
      jinja2.TemplateError: the template called ``raise_exception`` or failed.
      TypeError: a message is not a dict.
    """
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    return compile_template(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables)


@functools.lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (``tools``,
    ``messages``, ...); empty for a template that does not parse."""
    try:
        env = ImmutableSandboxedEnvironment(extensions=[_Generation, jinja2.ext.loopcontrols])
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return frozenset()


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The Hermes / Qwen 2.5 system-prompt text describing ``tools`` and the
    ``<tool_call>`` format to answer in."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    return ("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments":
                                           fn.get("arguments")}, ensure_ascii=False)
            + "\n</tool_call>")


def tool_messages(source: str | None, messages: list[dict], tools: list[dict] | None
                  ) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render with template ``source`` (None: the
    transcript). A template that reads ``tools`` gets both unchanged; one
    that does not gets the tools as a Hermes system prompt
    (``hermes_tools_prompt``, merged into a leading system message) and
    ``tools`` None. A template that never reads ``tool_calls`` gets each
    assistant call as a ``<tool_call>`` block in its content, and each
    ``tool`` message's content wrapped in ``<tool_response>``. A
    conversation with neither tools nor calls is returned as it is.
    """
    if not tools and not any(m.get("tool_calls") for m in messages):
        return messages, tools  # a conversation without tools renders as before
    names = template_variables(source) if source else frozenset()
    knows_calls = bool(source) and "tool_calls" in source
    out = []
    for m in messages:
        if not knows_calls and m.get("tool_calls"):
            text = "\n".join([m.get("content") or ""] + [_call_text(c) for c in m["tool_calls"]])
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text.strip()}
        elif not knows_calls and m.get("role") == "tool":
            m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if not tools or "tools" in names:
        return out, tools
    prompt = hermes_tools_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


__all__ = ["TRANSCRIPT_STOP", "compile_template", "hermes_tools_prompt", "render_chat_template",
           "render_transcript", "template_variables", "tool_messages"]
