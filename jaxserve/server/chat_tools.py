"""Chat requests with tools and output constraints: what they ask, what they answer.

``prepare_chat`` turns a parsed ``/v1/chat/completions`` request into what
the engine and the chat template take: the messages (with their
``tool_calls`` and ``tool_call_id``), the ``ToolPlan`` of its ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` (``tool_parsers``), and its one
output constraint (``output_constraints``: ``response_format``,
``structured_outputs``, ``guided_*``, or the schema a forced
``tool_choice`` builds; two at once is a 400 naming both). Completions
requests take the constraint through ``request_constraint`` alone.

Responses: ``chat_tool_response`` parses each choice's text for calls
(``message.tool_calls``, ``finish_reason`` "tool_calls"); for streams,
``chat_tool_chunks`` feeds each choice's new text through a
``ToolCallStream`` and sends ``delta.content`` / ``delta.tool_calls``
chunks, the held-back tail when the choice finishes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator

from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import StructuredOutputsParams
from jaxserve.server import openai_protocol as oai
from jaxserve.server import output_constraints as oc
from jaxserve.server.frontend import chat_messages
from jaxserve.server.tool_parsers import (ToolCallStream, ToolPlan, apply_to_choice,
                                          forced_tool_schema, plan_tools)

log = logging.getLogger(__name__)


def request_constraint(req, plan: ToolPlan | None = None
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it (see
    ``output_constraints.structured_outputs_of``); a forced ``plan`` adds
    its tool-call schema as ``tool_choice``.

    Raises:
      InvalidRequest: a malformed field, or two constraints at once.
    """
    fields = {f: getattr(req, f, None) for f in (*oc.GUIDED_FIELDS, "guided_decoding_backend")}
    fields["guided_whitespace_pattern"] = (req.model_extra or {}).get("guided_whitespace_pattern")
    ignored = oc.ignored_backend_fields(fields)
    if ignored:
        log.info("ignoring %s: jaxserve runs one grammar backend", ", ".join(ignored))
    specs = [oc.response_format_spec(getattr(req, "response_format", None)),
             oc.structured_object_spec(getattr(req, "structured_outputs", None)),
             *oc.guided_specs(fields)]
    if plan is not None and plan.forced:
        specs.append(("tool_choice", {"json": forced_tool_schema(plan)}))
    return oc.structured_outputs_of(specs)


def chat_pairs(req: oai.ChatCompletionRequest) -> list[tuple[str, str | None, dict]]:
    """(role, content, extras) of each message, text parts joined by
    newlines (as vLLM does); extras are its ``tool_calls``, ``tool_call_id``
    and ``name``. Roles, text and calls are checked by ``frontend.chat_messages``.

    Raises:
      APIError: 400 naming a part that is not text.
    """
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise oai.bad_request(
                        f"messages.{i}.content.{j}: only text parts are supported, got "
                        f"type {part.type!r}", f"messages.{i}.content.{j}")
                texts.append(part.text)
            content = "\n".join(texts)
        out.append((m.role, content, {"tool_calls": m.tool_calls,
                                      "tool_call_id": m.tool_call_id, "name": m.name}))
    return out


@dataclasses.dataclass
class ChatSetup:
    """What a chat request asks, checked.

    Attributes:
      messages: the template's message dicts (``frontend.chat_messages``).
      plan: its tools (None: no tools offered).
      structured: its output constraint (None: unconstrained).
      constraint_field: the API field that set ``structured``.
    """

    messages: list[dict]
    plan: ToolPlan | None
    structured: StructuredOutputsParams | None
    constraint_field: str | None

    @property
    def tools(self) -> list[dict] | None:
        return self.plan.tools if self.plan else None


def prepare_chat(req: oai.ChatCompletionRequest) -> ChatSetup:
    """A chat request's messages, tools and constraint.

    Raises:
      InvalidRequest / APIError: naming the field at fault.
    """
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    structured, field = request_constraint(req, plan)
    return ChatSetup(chat_messages(chat_pairs(req), "messages"), plan, structured, field)


def chat_tool_response(body: dict, plan: ToolPlan | None) -> dict:
    """A whole chat response with each choice's tool calls parsed out."""
    if plan is not None and plan.parses:
        body["choices"] = [apply_to_choice(c, plan) for c in body["choices"]]
    return body


def chat_tool_chunks(head: dict, out: RequestOutput, k: int | None, finished: set[int],
                     streams: dict[int, ToolCallStream], plan: ToolPlan) -> Iterator[str]:
    """``oai.chat_chunks`` for a request with tools: each choice's new text
    goes through its ``ToolCallStream`` (``streams``, by choice index,
    updated here); a finishing choice sends what was held back, then its
    finish reason ("tool_calls" when it called and stopped)."""
    for c in out.outputs:
        stream = streams.setdefault(c.index, ToolCallStream(plan))
        new_finish = c.finish_reason is not None and c.index not in finished
        ids = list(c.delta_token_ids)
        deltas = stream.feed(c.delta_text) if c.delta_text else []
        if new_finish:
            deltas += stream.finish()
            finished.add(c.index)
        lp = None
        if k is not None and ids:
            entries = c.logprobs[len(c.logprobs) - len(ids):]
            lp = oai.chat_logprobs(ids, list(entries), k)
            if not deltas:
                deltas = [{}]
        for j, delta in enumerate(deltas):
            yield oai.chat_chunk(head, c.index, delta, lp if j == 0 else None, None)
        if new_finish:
            reason = "tool_calls" if stream.called and c.finish_reason == "stop" else \
                c.finish_reason
            yield oai.chat_chunk(head, c.index, {}, None, reason, c.stop_reason)


__all__ = ["ChatSetup", "chat_pairs", "chat_tool_chunks", "chat_tool_response",
           "prepare_chat", "request_constraint"]
