"""The server front end both APIs share: tokenize and check each request once.

The gRPC servicer (``servicer.py``) and the OpenAI HTTP API (``http.py``)
turn their wire messages into a prompt and a ``SamplingParams`` (each field
checked by ``SamplingParams`` itself), then hand both to one ``Frontend``,
which owns everything else a request is checked against before it reaches
the engine, cheapest first:

  1. ``check_limits``: the sampling parameters against this server's
     engine (``n`` <= ``max_num_seqs``, all the request's sequences <=
     ``max_num_seqs + max_waiting_requests``, ``stop_token_ids`` inside the
     vocabulary), before any tokenizing;
  2. a text's size in UTF-8 bytes against ``max_text_bytes`` (a text that
     long cannot fit ``max_prompt_len`` tokens whatever it says);
  3. tokenizing and chat templating, on a bounded pool of worker processes
     when the text is large (``tokenize_pool``), so a big prompt never holds
     the event loop that serves other requests and health checks;
  4. the prompt's token count against ``max_prompt_len`` (``*_prompt``),
     and the output budget against the context (``output_budget``, both
     APIs); then the engine.

Every failure is an ``InvalidRequest`` whose message starts with the
request field at fault in the caller's naming (``prompt.text``,
``messages.0.role``, ``sampling.n``): gRPC answers INVALID_ARGUMENT with it,
HTTP a 400 whose ``param`` is that field. A full tokenizer pool raises
``QueueFullError`` (RESOURCE_EXHAUSTED / 429).

The frontend exists before the model has loaded; ``engine`` is None until
``set_engine`` (both APIs answer UNAVAILABLE / 503 meanwhile). It reads only
the ``AsyncEngine``'s fixed facts (tokenizer, context, vocabulary, KV size),
never the engine thread's state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import AsyncIterator, Iterable, Sequence

import jinja2

from jaxserve.engine.adapters import UnknownAdapterError
from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import SamplingParams, check_text
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.request_stream import EngineError, QueueFullError, RequestStream, StreamAborted
from jaxserve.server.checks import InvalidRequest
from jaxserve.server.tokenize_pool import TokenizerPool

CHAT_ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
# Texts below this many characters are tokenized on the event loop (a few
# hundred microseconds at most); longer ones go to the worker pool.
INLINE_TOKENIZE_CHARS = 16_384


def max_text_bytes(tokenizer, max_prompt_len: int) -> int:
    """Longest text, UTF-8 bytes, that could encode to at most ``max_prompt_len``
    tokens: ``max_prompt_len`` times the longest vocabulary entry (its UTF-8
    length, which for a byte-level BPE spelling is at least the bytes it
    stands for), plus room for special tokens. Text beyond it is refused
    before tokenizing.
    """
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=16)
    return max_prompt_len * max(longest, 4) + 1024


def chat_messages(messages: Iterable[tuple], field: str) -> list[dict]:
    """The message dicts the chat template takes, from (role, content) or
    (role, content, extras) tuples: ``developer`` is ``system``, content
    must be valid Unicode; extras are an assistant's ``tool_calls`` (each
    ``{id, type, function: {name, arguments}}``, arguments given as JSON
    text become an object, as chat templates expect: vLLM does the same),
    a tool message's ``tool_call_id`` and a ``name``.

    Raises:
      InvalidRequest: no message, an unknown role, bad text or a malformed
        tool call, naming ``<field>.<i>.role`` / ``<field>.<i>.content`` /
        ``<field>.<i>.tool_calls.<j>``.
    """
    out = []
    for i, (role, content, *rest) in enumerate(messages):
        role = _ROLE_ALIASES.get(role, role)
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{field}.{i}.role: unknown role {role!r}; expected one of "
                                 f"{', '.join((*_ROLE_ALIASES, *CHAT_ROLES))}")
        m = {"role": role, "content": _text(content or "", f"{field}.{i}.content")}
        extras = rest[0] if rest else {}
        for key in ("tool_call_id", "name"):
            if extras.get(key) is not None:
                m[key] = _text(str(extras[key]), f"{field}.{i}.{key}")
        if extras.get("tool_calls"):
            m["tool_calls"] = [_tool_call(c, f"{field}.{i}.tool_calls.{j}")
                               for j, c in enumerate(extras["tool_calls"])]
        out.append(m)
    if not out:
        raise InvalidRequest(f"{field}: at least one message is needed")
    return out


def _tool_call(call, field: str) -> dict:
    """An assistant message's tool call as templates take it (arguments an object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"{field}: must be {{id, type: 'function', function: {{name, "
                             f"arguments}}}}")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(_text(args, f"{field}.function.arguments"))
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{field}.function.arguments: is not valid JSON: {e}") from None
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": _text(fn["name"], f"{field}.function.name"),
                         "arguments": args}}


def _text(text: str, field: str) -> str:
    try:
        return check_text(text, field)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


class Frontend:
    """Tokenizing and request checks over one ``AsyncEngine``.

    Args:
      model_name: the served model's name (both APIs report it).
      max_prompt_len: longest prompt accepted, tokens (None: the engine's
        max_model_len - 1).
      tokenize_workers: processes that tokenize large prompts (0: tokenize
        everything on the event loop).
      max_pending_tokenize: large prompts tokenizing or queued for it at
        once; beyond it a request gets ``QueueFullError``.
    """

    def __init__(self, model_name: str, max_prompt_len: int | None = None, *,
                 tokenize_workers: int = 2, max_pending_tokenize: int = 64):
        self.model_name = model_name
        self.max_prompt_len = max_prompt_len
        self.max_text_bytes: int | None = None
        self.engine: AsyncEngine | None = None
        self.tokenize_workers = tokenize_workers
        self.tokenizer_pool: TokenizerPool | None = None
        self._max_pending = max_pending_tokenize
        self._pending = 0

    def set_engine(self, engine: AsyncEngine) -> None:
        """Start serving (the model has loaded)."""
        if self.max_prompt_len is None:
            self.max_prompt_len = engine.max_model_len - 1
        tok = engine.tokenizer
        if tok is not None:
            self.max_text_bytes = max_text_bytes(tok, self.max_prompt_len)
            if self.tokenize_workers and self.tokenizer_pool is None:
                self.tokenizer_pool = TokenizerPool(tok, self.tokenize_workers)
        self.engine = engine

    async def start_tokenizer_pool(self) -> None:
        """Spawn the tokenizer workers (after ``set_engine``; a no-op without)."""
        if self.tokenizer_pool is not None:
            await asyncio.to_thread(self.tokenizer_pool.start)

    def close(self) -> None:
        """Stop the tokenizer workers."""
        if self.tokenizer_pool is not None:
            self.tokenizer_pool.close()

    # ---- the model a request names ----------------------------------------------

    def resolve_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model name picks (vLLM's rule): None
        for the base model (its name, or no name), the name itself for a
        registered adapter.

        Raises:
          UnknownAdapterError: any other name (HTTP 404 naming ``model``,
            gRPC NOT_FOUND naming the request's field).
        """
        if not model or model == self.model_name:
            return None
        adapters = self.engine.lora_adapters() if self.engine is not None else {}
        if model in adapters:
            return model
        loaded = f" and the LoRA adapters {sorted(adapters)}" if adapters else ""
        raise UnknownAdapterError(f"The model `{model}` does not exist; this server "
                                  f"serves `{self.model_name}`{loaded}")

    # ---- sampling limits ------------------------------------------------------

    def check_limits(self, params: SamplingParams, prefix: str = "", num_prompts: int = 1,
                     prompt_field: str = "prompt") -> None:
        """The one server-side check of ``params`` (after ``SamplingParams``'
        own): what this engine can run, before any tokenizing. ``prefix``
        goes before the field names (gRPC: ``"sampling."``); ``num_prompts``
        requests of ``params.n`` sequences each make up the API request
        (a completions ``prompt`` list, named ``prompt_field``).

        Raises:
          InvalidRequest: what retrying can never fix: ``n`` above
            ``max_num_seqs`` (its choices could never all run at once), more
            sequences in all than ``max_num_seqs + max_waiting_requests``
            (an idle server could not take them: without this the queue
            check would answer a retryable 429), or stop token ids outside
            the vocabulary; ``logit_bias`` keys or ``allowed_token_ids``
            outside the vocabulary.
        """
        limit = self.engine.max_num_seqs
        if params.n > limit:
            raise InvalidRequest(f"{prefix}n: {params.n} is more than max_num_seqs={limit}, the "
                                 f"most sequences that run at once")
        total = params.n * num_prompts
        most = limit + self.engine.max_waiting_requests
        if total > most:
            field = f"{prefix}n" if num_prompts == 1 else prompt_field
            raise InvalidRequest(
                f"{field}: {num_prompts} prompt(s) x n={params.n} is {total} sequences, more "
                f"than this server can ever hold: max_num_seqs={limit} running + "
                f"max_waiting_requests={self.engine.max_waiting_requests} waiting = {most}")
        if params.stop_token_ids:
            self.check_ids(params.stop_token_ids, f"{prefix}stop_token_ids")
        if params.logit_bias:
            self.check_ids(params.logit_bias, f"{prefix}logit_bias")
        if params.allowed_token_ids:
            self.check_ids(params.allowed_token_ids, f"{prefix}allowed_token_ids")

    async def compile_constraint(self, params: SamplingParams, field: str) -> None:
        """Compile ``params.structured_outputs`` with the engine's grammar
        backend on a worker thread (never on the event loop: a large schema
        takes tens of milliseconds to seconds), so an invalid schema, regex
        or grammar is refused here and the engine's own compile of the same
        spec is a cache hit. ``field`` is the API field that set it.

        The compiler is ``Engine.compile_structured(spec)`` (the engine
        behind the ``AsyncEngine``; it must be safe to call from any
        thread while the engine thread steps: blocking, cached by spec,
        ValueError for what it cannot compile); an engine without one skips
        this check (its ``add_request`` still refuses the spec, as a 400
        without the API field's name).

        Raises:
          InvalidRequest: the backend refused the spec (``<field>: <why>``).
        """
        spec = params.structured_outputs
        compile_fn = getattr(getattr(self.engine, "engine", None), "compile_structured", None)
        if spec is None or compile_fn is None:
            return
        try:
            await asyncio.to_thread(compile_fn, spec)
        except ValueError as e:  # "structured_outputs.json: <why>" -> "<field>: <why>"
            why = re.sub(r"^(SamplingParams\.)?structured_outputs(\.\w+)?:?\s*", "", str(e))
            raise InvalidRequest(f"{field}: {why}") from None

    def output_budget(self, asked: int | None, prompt_len: int, field: str) -> int:
        """Output tokens for a prompt of ``prompt_len`` tokens: ``asked``, or
        (None) all the room left in the context and the KV cache.

        Raises:
          InvalidRequest: ``asked`` does not fit the context (names ``field``).
        """
        context = self.engine.max_model_len
        if asked is None:
            return max(1, min(context, self.engine.kv_capacity_tokens) - prompt_len)
        if prompt_len + asked > context:
            raise InvalidRequest(
                f"{field}: this model's maximum context length is {context} tokens; the prompt "
                f"has {prompt_len} and {field} asks {asked} more ({prompt_len + asked} in all)")
        return asked

    # ---- prompts --------------------------------------------------------------

    async def text_prompt(self, text: str, field: str) -> list[int]:
        """A text prompt's token ids, checked (see the module docstring)."""
        if not text:
            raise InvalidRequest(f"{field}: is empty")
        if self.engine.tokenizer is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer; send token ids")
        return self._fits(await self.text_ids(text, field), field)

    def ids_prompt(self, ids: Sequence[int], field: str) -> list[int]:
        """A token-id prompt as ints, checked."""
        if not len(ids):
            raise InvalidRequest(f"{field}: is empty")
        return self._fits(self.check_ids(ids, field), field)

    async def chat_prompt(self, messages: list[dict], field: str,
                          tools: list[dict] | None = None) -> list[int]:
        """A conversation's token ids (``chat_messages``' dicts; ``tools``
        for the template), checked."""
        return self._fits(await self.chat_ids(messages, field, tools), field)

    def _fits(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise InvalidRequest(f"{field}: is empty")
        if len(ids) > self.max_prompt_len:
            raise InvalidRequest(f"{field}: {len(ids)} tokens is more than max_prompt_len="
                                 f"{self.max_prompt_len}")
        return ids

    def check_ids(self, ids: Iterable[int], field: str) -> list[int]:
        """``ids`` as ints. Raises ``InvalidRequest`` (naming ``field``) for
        ids outside the vocabulary."""
        vocab = self.engine.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequest(f"{field}: token ids {bad[:5]} are outside the "
                                 f"vocabulary [0, {vocab})")
        return [int(i) for i in ids]

    # ---- tokenizing -----------------------------------------------------------

    async def text_ids(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (large ones on the tokenizer pool); no
        prompt-length check (``/tokenize`` uses it as is).

        Raises:
          InvalidRequest: no tokenizer, text that is not valid Unicode, or
            too much text for ``max_prompt_len`` (names ``field``).
          QueueFullError: too many large prompts are being tokenized.
        """
        tok = self._tokenizer(field)
        self._check_text_size(len(text), lambda: len(text.encode("utf-8", "surrogatepass")),
                              field)
        _text(text, field)
        return await self._off_loop(
            lambda: tok.encode(text, add_special_tokens=add_special_tokens),
            lambda: self.tokenizer_pool.encode(text, add_special_tokens), len(text))

    async def chat_ids(self, messages: list[dict], field: str,
                       tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (``chat_messages``' dicts) rendered
        with the chat template and the generation prompt; large ones on the
        tokenizer pool. ``tools`` (OpenAI function tools) are the template's
        ``tools`` variable, or a Hermes system prompt for a template without
        (``checkpoints.chat_template.tool_messages``).

        Raises:
          InvalidRequest: no tokenizer, too much text for ``max_prompt_len``,
            or the template rejected it (the message starts with ``field``).
          QueueFullError: too many large prompts are being tokenized.
        """
        tok = self._tokenizer(field, " or chat template")
        chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self._check_text_size(chars, lambda: sum(len(m["content"].encode()) for m in messages),
                              field)
        try:
            return await self._off_loop(
                lambda: tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, tools=tools),
                lambda: self.tokenizer_pool.chat_ids(messages, tools), chars)
        except (ValueError, jinja2.TemplateError) as e:
            raise InvalidRequest(f"{field}: the chat template rejected it: {e}") from None

    def detokenize(self, ids: Sequence[int], field: str, skip_special_tokens: bool) -> str:
        """The text of ``ids``.

        Raises:
          InvalidRequest: no tokenizer, more ids than ``max_model_len``, or
            ids outside the vocabulary (names ``field``).
        """
        tok = self._tokenizer(field)
        if len(ids) > self.engine.max_model_len:
            raise InvalidRequest(f"{field}: {len(ids)} ids is more than max_model_len="
                                 f"{self.engine.max_model_len}")
        return tok.decode(self.check_ids(ids, field), skip_special_tokens=skip_special_tokens)

    def _tokenizer(self, field: str, what: str = ""):
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer{what}")
        return tok

    def _check_text_size(self, size_chars: int, text_bytes, field: str) -> None:
        """Refuse text that cannot fit ``max_prompt_len`` tokens, before
        tokenizing it; ``text_bytes()`` gives its UTF-8 length when needed."""
        bound = self.max_text_bytes
        if bound is None or 4 * size_chars <= bound:
            return
        size = size_chars if size_chars > bound else text_bytes()
        if size > bound:
            raise InvalidRequest(
                f"{field}: {size:,} bytes of text cannot fit max_prompt_len="
                f"{self.max_prompt_len} tokens (the limit is {bound:,} bytes)")

    async def _off_loop(self, inline, pooled, size_chars: int):
        """``inline()`` for small inputs (or without a pool), else ``await pooled()``."""
        inline_below = min(INLINE_TOKENIZE_CHARS, max(256, (self.max_text_bytes or 0) // 8))
        if size_chars < inline_below or self.tokenizer_pool is None:
            return inline()
        if self._pending >= self._max_pending:
            raise QueueFullError(f"{self._pending} large prompts are being tokenized "
                                 f"(at most {self._max_pending})")
        self._pending += 1
        try:
            return await pooled()
        finally:
            self._pending -= 1


# ---- one API request's engine requests ---------------------------------------------

@dataclasses.dataclass
class Job:
    """One API request's engine work: one engine request (``n`` choices) per
    prompt, e.g. a ``/v1/completions`` call with a list of prompts."""

    request_id: str
    prompt_ids: list[list[int]]
    prompt_texts: list[str | None]
    params: list[SamplingParams]
    streams: list[RequestStream]
    lora: str | None = None  # the LoRA adapter every prompt runs with (None: the base)

    @property
    def n(self) -> int:
        return self.params[0].n

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every prompt's request, as they come.
        Raises ``StreamAborted`` / ``EngineError`` from any of them; closing
        it aborts whatever still runs. Each pump hands on one output at a time
        (a bounded queue), so outputs a slow consumer has not taken wait in
        their request's stream, where backpressure sees them."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(self.streams))

        async def pump(i: int, stream: RequestStream):
            try:
                async for out in stream:
                    await queue.put((i, out))
            except (StreamAborted, EngineError) as e:
                await queue.put((i, e))
            await queue.put((i, None))
        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        left = len(tasks)
        try:
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in self.streams:
                await s.aclose()  # aborts a request still running

    async def collect(self) -> tuple[list[RequestOutput | None], bool]:
        """Every prompt's last output (None before its first); True when
        shutdown aborted them. Raises ``EngineError`` from any of them."""
        last: list[RequestOutput | None] = [None] * len(self.streams)
        outputs = self.outputs()
        try:
            async for i, out in outputs:
                last[i] = out
        except StreamAborted:
            return last, True
        finally:
            await outputs.aclose()
        return last, False


async def start_job(engine: AsyncEngine, request_id: str, prompt_ids: list[list[int]],
                    prompt_texts: list[str | None], params: list[SamplingParams],
                    arrival: float, lora: str | None = None) -> Job:
    """Put every prompt in the engine (with the LoRA adapter ``lora``, or
    the base model), or none: a failure closes the ones already in. Raises
    as ``AsyncEngine.generate``."""
    job = Job(request_id, prompt_ids, prompt_texts, params, [], lora)
    try:
        for ids, p in zip(prompt_ids, params):
            job.streams.append(await engine.generate(ids, p, arrival, lora=lora))
            job.streams[-1].set_request_id(request_id)
    except BaseException:
        for s in job.streams:
            await s.aclose()
        raise
    return job


__all__ = ["CHAT_ROLES", "Frontend", "INLINE_TOKENIZE_CHARS", "InvalidRequest", "Job",
           "chat_messages", "max_text_bytes", "start_job"]
