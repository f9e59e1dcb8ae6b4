"""Render a Jinja chat template exactly as transformers' ``apply_chat_template`` does.

Mirrors ``transformers.utils.chat_template_utils._cached_compile_jinja_template``
and ``render_jinja_template`` (v5): an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block that renders its body unchanged, the globals
``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that does not
HTML-escape. The special-token strings (``bos_token``, ``eos_token``, ...) are
passed as template variables, as HF passes its ``special_tokens_map``.

``render_transcript`` is the fallback for a model without a template.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
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


__all__ = ["TRANSCRIPT_STOP", "compile_template", "render_chat_template", "render_transcript"]
