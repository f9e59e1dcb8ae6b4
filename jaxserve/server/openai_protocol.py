"""OpenAI's request and response shapes for the HTTP API (``jaxserve.server.http``).

Requests are pydantic models of OpenAI's fields (``/v1/completions``,
``/v1/chat/completions``) plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``prompt_logprobs``),
with vLLM's defaults, and the fields that constrain the output
(``response_format``, ``structured_outputs``, ``guided_*``, ``logit_bias``,
``allowed_token_ids``, ``bad_words``; chat: ``tools``, ``tool_choice``,
``parallel_tool_calls``, messages' ``tool_calls`` / ``tool_call_id``),
translated by ``output_constraints`` and ``chat_tools``. Unknown fields are
kept aside (``unknown_fields``) so
the server can log and ignore them, as vLLM does; a known field with a bad
type or value is an ``APIError`` 400 whose ``param`` names it.

Responses are plain dicts in OpenAI's shapes, built by pure functions from
the engine's ``RequestOutput``s (``completion_response``, ``chat_response``,
and for streams one server-sent event per choice that changed:
``completion_chunks``, ``chat_chunks``): logprobs as the legacy completions
object (``tokens``,
``token_logprobs``, ``top_logprobs`` as {token text: logprob}, ``text_offset``)
or the chat object (``content``: [{token, logprob, bytes, top_logprobs}]).
Token texts are ``Logprob.decoded_token`` (the token decoded alone, special
tokens included); ``top_logprobs`` holds the ``k`` best candidates by rank,
the sampled token's own logprob sits beside them.

Reference: https://platform.openai.com/docs/api-reference (completions,
chat, errors) and vLLM's ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Iterator, Sequence

import pydantic
from pydantic import BaseModel, ConfigDict

from jaxserve.engine.request import Logprob, RequestOutput
from jaxserve.engine.sampling_params import SamplingParams, StructuredOutputsParams, escape_text

# OpenAI's error "type" for each status jaxserve answers.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable_error"}


class APIError(Exception):
    """An HTTP error in OpenAI's shape ``{"error": {message, type, param, code}}``;
    ``code`` is the HTTP status (as vLLM sends it)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        # A client's value echoed in the message (a model name, a dict key in
        # ``param``) may hold a lone surrogate, which UTF-8 cannot encode:
        # written as a backslash escape, so every error renders.
        message = escape_text(message)
        param = None if param is None else escape_text(param)
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# vLLM's extras that change what is generated and that jaxserve does not
# implement: refused with 400 rather than ignored with a warning.
REFUSED_FIELDS = ("chat_template", "chat_template_kwargs",
                  "continue_final_message", "echo", "logits_processors", "truncate_prompt_tokens")


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def refused_fields(self) -> list[str]:
        """vLLM fields jaxserve does not implement that would change the
        result if honoured (so ignoring them is wrong): set, not default."""
        extra = self.model_extra or {}
        out = [f for f in REFUSED_FIELDS if extra.get(f) not in (None, False, {}, [])]
        if extra.get("add_generation_prompt", True) is not True:
            out.append("add_generation_prompt")
        return out


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """The fields both APIs share (OpenAI's, then vLLM's extras; vLLM's
    ``guided_whitespace_pattern`` is an unknown field, logged and ignored)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Output constraints: OpenAI's ``response_format``, vLLM's
    # ``structured_outputs`` and ``guided_*`` (``output_constraints``).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None  # accepted and ignored (one backend)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text, a list of texts, a list
    of token ids or a list of such lists; ``max_tokens`` absent means 16,
    null means up to the context length."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to this call


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` (or the older
    ``max_tokens``) absent or null means up to the context length."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def parse(cls: type[_Request], body: Any) -> _Request:
    """``cls`` from a decoded JSON body.

    Raises:
      APIError: 400 naming the first bad field (``param`` is its dotted path).
    """
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        req = cls.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[",
                                                                   "str", "int"))]
        param = ".".join(loc) or None
        got = err.get("input")
        shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        raise bad_request(f"{param or 'body'}: {err['msg']} (got {shown})", param) from None
    refused = req.refused_fields()
    if refused:
        raise bad_request(f"{refused[0]}: is not supported by jaxserve", refused[0])
    if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    return req


_FIELD = re.compile(r"SamplingParams\.(\w+)")


def sampling_params(req: _Sampling, max_tokens: int, logprobs: int | None,
                    names: dict[str, str],
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``req``.

    Args:
      max_tokens: output tokens for this prompt (the caller resolved null).
      logprobs: the engine's ``logprobs`` (top candidates per position) or None.
      names: engine field -> the API field a user set it by (``logprobs`` is
        ``top_logprobs`` in chat, ``max_tokens`` may be ``max_completion_tokens``).
      structured: the output constraint (``output_constraints``) or None.

    Raises:
      APIError: 400 naming the API field whose value the engine refuses.
    """
    kw = dict(structured_outputs=structured, logit_bias=req.logit_bias or None,
              allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
              max_tokens=max_tokens, n=req.n, stop=req.stop, seed=req.seed,
              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
              min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
              skip_special_tokens=req.skip_special_tokens,
              include_stop_str_in_output=req.include_stop_str_in_output)
    defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0)
    for f, default in defaults.items():
        v = getattr(req, f)
        kw[f] = default if v is None else v
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        m = _FIELD.search(str(e))
        field = names.get(m.group(1), m.group(1)) if m else None
        msg = str(e).replace(f"SamplingParams.{m.group(1)}", field) if m else str(e)
        raise bad_request(msg, field) from None


def completion_prompts(req: CompletionRequest) -> list:
    """The prompts of a completions request, each a text or a list of ids.

    Raises:
      APIError: 400 for no prompt or an option jaxserve does not implement.
    """
    if req.suffix:
        raise bad_request("suffix: is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of: only best_of == n is supported", "best_of")
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise bad_request("prompt: is empty", "prompt")
    return prompts


def check_chat(req: ChatCompletionRequest) -> None:
    """Raises ``APIError`` 400 for a chat option jaxserve does not implement."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")


# ---- responses ----------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The ``k`` best candidates of a position, by rank."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                  key=lambda lp: lp.rank)[:k]


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def completion_logprobs(token_ids: list[int], entries: list, k: int, offset: int,
                        token_text=None) -> dict:
    """The legacy completions ``logprobs`` object of ``token_ids`` (one
    ``{token_id: Logprob}`` entry each, None for a position without one: the
    first prompt token under ``echo``, whose text is ``token_text(id)``, the
    token decoded alone, and whose logprobs are null, as vLLM and OpenAI
    send it); ``offset`` is the character offset of the first token in the
    choice's text, each next one's is the previous plus its token's length."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(token_ids, entries):
        out["text_offset"].append(offset)
        if entry is None:
            text = token_text(tok) if token_text is not None else ""
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            offset += len(text)
            continue
        chosen = entry[tok]
        out["tokens"].append(_text(chosen))
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({_text(lp): lp.logprob for lp in _top(entry, k)})
        offset += len(_text(chosen))
    return out


def _chat_token(lp: Logprob) -> dict:
    t = _text(lp)
    return {"token": t, "logprob": lp.logprob, "bytes": list(t.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list, k: int) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}] (the k best)}]}``."""
    return {"content": [{**_chat_token(entry[tok]),
                         "top_logprobs": [_chat_token(lp) for lp in _top(entry, k)]}
                        for tok, entry in zip(token_ids, entries)]}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
    ``{token_id: {logprob, rank, decoded_token}}``."""
    if entries is None:
        return None
    return [None if e is None else {str(i): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for i, lp in e.items()} for e in entries]


# ---- response bodies and stream events ---------------------------------------------

DONE = "data: [DONE]\n\n"  # a stream's last event


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def head(request_id: str, obj: str, model: str) -> dict:
    """The fields every response and chunk starts with."""
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model}


def usage_of(prompt_ids: Sequence[Sequence[int]], last: Sequence[RequestOutput | None]) -> dict:
    """The usage of prompts ``prompt_ids`` whose last outputs are ``last``."""
    return usage(sum(len(i) for i in prompt_ids),
                 sum(len(c.token_ids) for o in last if o for c in o.outputs),
                 sum(o.metrics.num_cached_tokens for o in last if o))


def model_card(name: str, created: int, max_model_len: int, root: str | None = None,
               parent: str | None = None) -> dict:
    """A ``/v1/models`` entry (vLLM's ``ModelCard``): a LoRA adapter's
    ``root`` is its folder and ``parent`` the base model; the base model's
    ``root`` is its own name, its ``parent`` null."""
    return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
            "root": root or name, "parent": parent, "max_model_len": max_model_len}


def _echo_logprobs(prompt_ids: Sequence[int], out: RequestOutput):
    """(token ids, entries) the echoed prompt contributes to logprobs."""
    return list(prompt_ids), list(out.prompt_logprobs or [None] * len(prompt_ids))


def completion_response(head: dict, req: CompletionRequest, prompt_ids: list[list[int]],
                        prompt_texts: list[str | None], n: int,
                        last: list[RequestOutput | None], aborted: bool,
                        k: int | None, token_text=None) -> dict:
    """A whole ``/v1/completions`` response: ``n`` choices per prompt (in
    ``index`` order), from each prompt's last output (None: aborted at
    shutdown before its first); ``k``: top logprobs per position or None;
    ``token_text``: id -> text, for the echoed first prompt token."""
    choices = []
    for i, out in enumerate(last):
        if out is None:
            choices += [{"index": i * n + j, "text": prompt_texts[i] or "" if req.echo else "",
                         "logprobs": None, "finish_reason": "abort", "stop_reason": None}
                        for j in range(n)]
        for c in (out.outputs if out else []):
            text, lp = c.text, None
            ids, entries = list(c.token_ids), list(c.logprobs or [])
            if req.echo:
                text = prompt_texts[i] + text
                if k is not None:
                    pids, pentries = _echo_logprobs(prompt_ids[i], out)
                    ids, entries = pids + ids, pentries + entries
            if k is not None:
                lp = completion_logprobs(ids, entries, k, 0, token_text)
            choice = {"index": i * n + c.index, "text": text, "logprobs": lp,
                      "finish_reason": c.finish_reason or ("abort" if aborted else None),
                      "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None and c.index == 0:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {**head, "choices": choices, "usage": usage_of(prompt_ids, last)}


def completion_chunk(head: dict, index: int, text: str, lp, finish, stop_reason=None) -> str:
    """One ``text_completion`` stream event for choice ``index``."""
    return sse({**head, "choices": [{"index": index, "text": text, "logprobs": lp,
                                     "finish_reason": finish, "stop_reason": stop_reason}]})


def completion_chunks(head: dict, req: CompletionRequest, i: int, out: RequestOutput, n: int,
                      prompt_ids: list[int], prompt_text: str | None, k: int | None,
                      offsets: dict[int, int], finished: set[int],
                      token_text=None) -> Iterator[str]:
    """The events of prompt ``i``'s output ``out``: one per choice that
    gained text (or tokens with logprobs) or finished. ``offsets`` (choice
    index -> characters sent) and ``finished`` (choice indices reported
    finished) are the stream's state, updated here."""
    for c in out.outputs:
        idx = i * n + c.index
        new_finish = c.finish_reason is not None and idx not in finished
        text, ids = c.delta_text, list(c.delta_token_ids)
        entries = list(c.logprobs[len(c.logprobs) - len(ids):]) if ids and \
            c.logprobs is not None else []
        if req.echo and idx not in offsets:
            text = prompt_text + text
            if k is not None:
                pids, pentries = _echo_logprobs(prompt_ids, out)
                ids, entries = pids + ids, pentries + entries
        if not (text or new_finish or (k is not None and ids)):
            continue
        lp = completion_logprobs(ids, entries, k, offsets.get(idx, 0), token_text) \
            if k is not None else None
        offsets[idx] = offsets.get(idx, 0) + len(text)
        if new_finish:
            finished.add(idx)
        yield completion_chunk(head, idx, text, lp, c.finish_reason, c.stop_reason)


def chat_response(head: dict, prompt_ids: list[int], n: int, out: RequestOutput | None,
                  aborted: bool, k: int | None) -> dict:
    """A whole ``/v1/chat/completions`` response from the last output (None:
    aborted at shutdown before its first)."""
    choices = [] if out is not None else [
        {"index": j, "message": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": "abort", "stop_reason": None} for j in range(n)]
    for c in (out.outputs if out else []):
        lp = chat_logprobs(list(c.token_ids), list(c.logprobs or []), k) if k is not None \
            else None
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason or ("abort" if aborted else None),
                        "stop_reason": c.stop_reason})
    return {**head, "choices": choices, "usage": usage_of([prompt_ids], [out])}


def chat_chunk(head: dict, index: int, delta: dict, lp, finish, stop_reason=None) -> str:
    """One ``chat.completion.chunk`` stream event for choice ``index``."""
    return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                     "finish_reason": finish, "stop_reason": stop_reason}]})


def chat_role_chunks(head: dict, n: int) -> tuple[str, ...]:
    """The events that open each of ``n`` choices with the assistant role."""
    return tuple(chat_chunk(head, idx, {"role": "assistant", "content": ""}, None, None)
                 for idx in range(n))


def chat_chunks(head: dict, out: RequestOutput, k: int | None,
                finished: set[int]) -> Iterator[str]:
    """The events of output ``out``: one per choice that gained text (or
    tokens with logprobs) or finished; ``finished`` as in ``completion_chunks``."""
    for c in out.outputs:
        new_finish = c.finish_reason is not None and c.index not in finished
        ids = list(c.delta_token_ids)
        if not (c.delta_text or new_finish or (k is not None and ids)):
            continue
        lp = None
        if k is not None:
            entries = c.logprobs[len(c.logprobs) - len(ids):] if ids else []
            lp = chat_logprobs(ids, list(entries), k)
        if new_finish:
            finished.add(c.index)
        delta = {"content": c.delta_text} if c.delta_text else {}
        yield chat_chunk(head, c.index, delta, lp, c.finish_reason, c.stop_reason)


__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "DONE", "ERROR_TYPES",
           "bad_request", "chat_chunk", "chat_chunks", "chat_logprobs",
           "chat_response", "chat_role_chunks", "check_chat", "completion_chunk",
           "completion_chunks", "completion_logprobs", "completion_prompts",
           "completion_response", "head", "model_card", "parse", "prompt_logprobs_json",
           "sampling_params", "sse", "usage", "usage_of"]
