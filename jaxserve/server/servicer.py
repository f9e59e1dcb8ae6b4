"""The ``jaxserve.v1.Generation`` servicer (grpc.aio) over an ``AsyncEngine``.

Every request is checked here before it reaches the engine, cheapest check
first (``jaxserve.server.checks`` gives the order): a bad one ends with
INVALID_ARGUMENT and a message that names the field, before any tokenizing.
Large texts and chats are tokenized in worker processes
(``tokenize_pool``), so the event loop keeps serving other requests and
health checks meanwhile. Register it with ``checks.add_generation_servicer``, whose
deserializer turns undecodable bytes into INVALID_ARGUMENT. The servicer
exists before the model has loaded (so health and reflection answer at
once); until ``set_engine`` its methods answer UNAVAILABLE.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures.process import BrokenProcessPool

import grpc
import jinja2

from jaxserve.engine.request import MAX_LOGPROBS, RequestOutput, SamplingParams
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.async_engine import (
    AsyncEngine,
    EngineError,
    QueueFullError,
    ShuttingDownError,
    StreamAborted,
)
from jaxserve.server.checks import (
    INLINE_TOKENIZE_CHARS,
    CumulativeChoice,
    InvalidRequest,
    check_decoded,
    check_output_size,
    check_request_id,
    header_request_id,
    length_delimited,
    max_text_bytes,
)
from jaxserve.server.tokenize_pool import TokenizerPool

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "logprobs",
             "prompt_logprobs", "repetition_penalty")


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """``SamplingParams`` from its message; unset optional fields take the defaults.

    Raises:
      InvalidRequest: naming the field (``sampling.<field>``) and the value.
    """
    kw = {f: getattr(msg, f) for f in _OPTIONAL if msg.HasField(f)}
    kw.update(min_p=msg.min_p, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
              ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens,
              presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise InvalidRequest(f"sampling: {e}") from None


def _logprob_proto(token_id: int, lp) -> pb.TopLogprob:
    return pb.TopLogprob(token_id=token_id, logprob=lp.logprob, rank=lp.rank,
                         token=lp.decoded_token or "")


def position_logprobs_proto(chosen: int, entry: dict) -> pb.PositionLogprobs:
    """One position's ``{token_id: Logprob}`` dict as a message (top sorted by rank)."""
    top = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return pb.PositionLogprobs(chosen=_logprob_proto(chosen, entry[chosen]),
                               top=[_logprob_proto(i, lp) for i, lp in top])


class GenerationServicer(pb_grpc.GenerationServicer):
    """Implements ``jaxserve.v1.Generation``.

    Args:
      model_name: what ``ModelInfo`` reports as the name.
      max_prompt_len: longest prompt accepted, tokens (None: the engine's
        max_model_len - 1).
      tokenize_workers: processes that tokenize large prompts (0: tokenize
        everything on the event loop).
      max_pending_tokenize: large prompts tokenizing or queued for it at
        once; beyond it a request gets RESOURCE_EXHAUSTED.
    """

    def __init__(self, model_name: str, max_prompt_len: int | None = None, *,
                 tokenize_workers: int = 2, max_pending_tokenize: int = 64):
        self.model_name = model_name
        self.max_prompt_len = max_prompt_len
        self.max_text_bytes: int | None = None
        self.engine: AsyncEngine | None = None
        self._live_ids: set[str] = set()
        self._ids = itertools.count()
        self.tokenize_workers = tokenize_workers
        self.tokenizer_pool: TokenizerPool | None = None
        self._max_pending = max_pending_tokenize
        self._pending = 0

    def set_engine(self, engine: AsyncEngine) -> None:
        """Start serving (the model has loaded)."""
        if self.max_prompt_len is None:
            self.max_prompt_len = engine.engine.max_model_len - 1
        tok = engine.engine.tokenizer
        if tok is not None:
            self.max_text_bytes = max_text_bytes(tok, self.max_prompt_len)
            if self.tokenize_workers and self.tokenizer_pool is None:
                self.tokenizer_pool = TokenizerPool(tok, self.tokenize_workers)
        self.engine = engine

    async def _ready(self, context) -> AsyncEngine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        return self.engine

    # ---- request checks -----------------------------------------------------

    def _messages(self, chat: pb.ChatMessages, field: str) -> list[dict]:
        if not chat.messages:
            raise InvalidRequest(f"{field}.messages: at least one message is needed")
        out = []
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"{field}.messages[{i}].role: unknown role {m.role!r}; "
                                     f"expected one of {', '.join(CHAT_ROLES)}")
            out.append({"role": m.role, "content": m.content})
        return out

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

    async def _chat_ids(self, chat: pb.ChatMessages, field: str) -> list[int]:
        return await self.chat_ids(self._messages(chat, field), field)

    async def chat_ids(self, messages: list[dict], field: str) -> list[int]:
        """Token ids of a conversation (role/content dicts, checked) rendered
        with the chat template and the generation prompt; large ones on the
        tokenizer pool.

        Raises:
          InvalidRequest: no tokenizer, too much text for ``max_prompt_len``,
            or the template rejected it (the message starts with ``field``).
          QueueFullError: too many large prompts are being tokenized.
        """
        tok = self.engine.engine.tokenizer
        if tok is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer or chat template")
        chars = sum(len(m["content"]) for m in messages)
        self._check_text_size(chars, lambda: sum(len(m["content"].encode()) for m in messages),
                              field)

        try:
            return await self._off_loop(
                lambda: tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True),
                lambda: self.tokenizer_pool.chat_ids(messages), chars)
        except (ValueError, jinja2.TemplateError) as e:
            raise InvalidRequest(f"{field}: the chat template rejected it: {e}") from None

    async def text_ids(self, text: str, field: str, add_special_tokens: bool = True):
        """Token ids of ``text`` (large ones on the tokenizer pool).

        Raises:
          InvalidRequest: too much text for ``max_prompt_len`` (names ``field``).
          QueueFullError: too many large prompts are being tokenized.
        """
        tok = self.engine.engine.tokenizer
        self._check_text_size(len(text), lambda: len(text.encode()), field)
        return await self._off_loop(
            lambda: tok.encode(text, add_special_tokens=add_special_tokens),
            lambda: self.tokenizer_pool.encode(text, add_special_tokens), len(text))

    def check_ids(self, ids, field: str) -> list[int]:
        """``ids`` as ints. Raises ``InvalidRequest`` (naming ``field``) for
        ids outside the vocabulary."""
        vocab = self.engine.engine.model_config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequest(f"{field}: token ids {bad[:5]} are outside the "
                                 f"vocabulary [0, {vocab})")
        return [int(i) for i in ids]

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set one of text, token_ids or chat")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("prompt.text: is empty")
            if self.engine.engine.tokenizer is None:
                raise InvalidRequest("prompt.text: this model has no tokenizer; send token_ids")
            ids = await self.text_ids(request.text, "prompt.text")
        elif kind == "token_ids":
            if not request.token_ids.ids:
                raise InvalidRequest("prompt.token_ids: is empty")
            ids = self.check_ids(request.token_ids.ids, "prompt.token_ids")
        else:
            ids = await self._chat_ids(request.chat, "prompt.chat")
        if len(ids) > self.max_prompt_len:
            raise InvalidRequest(f"prompt: {len(ids)} tokens is more than max_prompt_len="
                                 f"{self.max_prompt_len}")
        return ids

    # ---- Generate -----------------------------------------------------------

    async def _reject(self, context, code: grpc.StatusCode, error: Exception) -> None:
        if self.engine is not None:
            self.engine.metrics.rejected.labels(code.name).inc()
        await context.abort(code, str(error))

    async def Generate(self, request: pb.GenerateRequest, context):
        arrival_time = time.monotonic()
        engine = await self._ready(context)
        engine.metrics.received.inc()
        try:
            check_decoded(request)
            rid = check_request_id(request.request_id) if request.request_id else \
                f"req-{next(self._ids)}"
            if request.output_kind not in pb.OutputKind.values():
                raise InvalidRequest(f"output_kind: unknown value {request.output_kind}")
            params = sampling_params_from_proto(request.sampling)
            engine.check_limits(params)
            check_output_size(params, request.output_kind)
            if params.stop_token_ids:
                self.check_ids(params.stop_token_ids, "sampling.stop_token_ids")
            engine.check_queue(params)  # before tokenizing: a full queue costs nothing
            ids = await self._prompt_ids(request)
            if request.WhichOneof("prompt") == "chat":  # a transcript's turn end
                params = params.with_stop(engine.engine.tokenizer.chat_stop)
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, e)
        except QueueFullError as e:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, e)
        except ShuttingDownError as e:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, e)
        except BrokenProcessPool as e:
            log.error("tokenizer workers died twice in a row: %s", e)
            await self._reject(context, grpc.StatusCode.UNAVAILABLE,
                               RuntimeError("the tokenizer workers died; retry"))
        if rid in self._live_ids:
            engine.metrics.rejected.labels("ALREADY_EXISTS").inc()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {rid!r} is in use by a running request")
        self._live_ids.add(rid)
        try:
            try:
                outputs = await engine.generate(ids, params, arrival_time)
            except ValueError as e:
                engine.metrics.rejected.labels("INVALID_ARGUMENT").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except QueueFullError as e:
                engine.metrics.rejected.labels("RESOURCE_EXHAUSTED").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except (ShuttingDownError, StreamAborted) as e:
                engine.metrics.rejected.labels("UNAVAILABLE").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            kind = request.output_kind
            reported_finish: set[int] = set()
            cumulative: dict[int, CumulativeChoice] = {}
            first = True
            last = None
            try:
                # Initial metadata tells the client the request is in the engine.
                await context.send_initial_metadata((("x-request-id", header_request_id(rid)),))
                async for out in outputs:
                    last = out
                    if kind == pb.OUTPUT_KIND_FINAL_ONLY and not out.finished:
                        continue
                    if kind == pb.OUTPUT_KIND_CUMULATIVE:
                        yield self._cumulative_response(rid, out, first, cumulative)
                    else:
                        yield self._response(rid, out, kind, first, reported_finish)
                    first = False
            except StreamAborted:
                yield self._aborted_response(rid, len(ids), last, arrival_time, kind,
                                             reported_finish)
            except EngineError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                await outputs.aclose()  # aborts the request if it is still running
        finally:
            self._live_ids.discard(rid)

    def _response_head(self, rid: str, out: RequestOutput, first: bool) -> pb.GenerateResponse:
        """A response without completions: prompt logprobs on the first,
        usage and timing on the last."""
        resp = pb.GenerateResponse(request_id=rid, finished=out.finished)
        if first and out.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(
                position_logprobs_proto(t, e) for t, e in
                zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
        if out.finished:
            m = out.metrics
            resp.usage.CopyFrom(pb.Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=sum(len(c.token_ids) for c in out.outputs),
                cached_tokens=m.num_cached_tokens, num_draft_tokens=m.num_draft_tokens,
                num_accepted_tokens=m.num_accepted_tokens))
            resp.timing.CopyFrom(pb.Timing(queue_ms=m.queue_ms or 0.0, ttft_ms=m.ttft_ms or 0.0,
                                           tpot_ms=m.tpot_ms or 0.0, e2e_ms=m.e2e_ms or 0.0))
            if m.disagg_route is not None:
                resp.disagg.CopyFrom(pb.Disagg(route=m.disagg_route,
                                               kv_transfer_ms=m.kv_transfer_ms or 0.0,
                                               kv_transfer_bytes=m.kv_transfer_bytes))
        return resp

    def _cumulative_response(self, rid: str, out: RequestOutput, first: bool,
                             choices: dict[int, CumulativeChoice]) -> bytes:
        """An OUTPUT_KIND_CUMULATIVE response, serialized: each choice's token
        ids and logprobs so far are kept as bytes (``CumulativeChoice``), so
        the Python work is for this step's new tokens only."""
        parts = [self._response_head(rid, out, first).SerializeToString()]
        for c in out.outputs:
            choice = choices.get(c.index)
            if choice is None or len(c.token_ids) < choice.num_tokens:
                choice = choices[c.index] = CumulativeChoice()
            new = c.token_ids[choice.num_tokens:]
            lps = None
            if c.logprobs is not None and new:
                entries = c.logprobs[len(c.logprobs) - len(new):]
                lps = [position_logprobs_proto(t, e) for t, e in zip(new, entries)]
            choice.extend(new, lps)
            head = pb.Completion(index=c.index, text=c.text, finish_reason=c.finish_reason or "",
                                 stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                                 cumulative_logprob=c.cumulative_logprob)
            parts.append(length_delimited(2, choice.completion_bytes(head)))
        return b"".join(parts)

    def _response(self, rid: str, out: RequestOutput, kind: int, first: bool,
                  reported_finish: set[int]) -> pb.GenerateResponse:
        delta = kind == pb.OUTPUT_KIND_DELTA
        resp = self._response_head(rid, out, first)
        for c in out.outputs:
            new_finish = c.finish_reason is not None and c.index not in reported_finish
            if delta and not (c.delta_token_ids or c.delta_text or new_finish):
                continue
            if new_finish:
                reported_finish.add(c.index)
            ids = c.delta_token_ids if delta else c.token_ids
            comp = pb.Completion(index=c.index, text=c.delta_text if delta else c.text,
                                 token_ids=ids, finish_reason=c.finish_reason or "",
                                 stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                                 cumulative_logprob=c.cumulative_logprob)
            if c.logprobs is not None and ids:
                lps = c.logprobs[len(c.logprobs) - len(ids):]
                comp.logprobs.extend(position_logprobs_proto(t, e) for t, e in zip(ids, lps))
            resp.completions.append(comp)
        return resp

    def _aborted_response(self, rid: str, prompt_len: int, last: RequestOutput | None,
                          arrival_time: float, kind: int,
                          reported_finish: set[int]) -> pb.GenerateResponse:
        """The final message of a stream cut by shutdown: every unfinished
        choice gets finish_reason "abort"; usage and timing from what ran."""
        resp = pb.GenerateResponse(request_id=rid, finished=True)
        outs = last.outputs if last is not None else []
        for c in outs:
            if c.index in reported_finish:
                continue
            comp = pb.Completion(index=c.index, finish_reason="abort",
                                 cumulative_logprob=c.cumulative_logprob)
            if kind != pb.OUTPUT_KIND_DELTA:
                comp.text, comp.token_ids[:] = c.text, c.token_ids
            resp.completions.append(comp)
        if not outs:
            resp.completions.append(pb.Completion(index=0, finish_reason="abort"))
        m = last.metrics if last is not None else None
        resp.usage.CopyFrom(pb.Usage(
            prompt_tokens=prompt_len, completion_tokens=sum(len(c.token_ids) for c in outs),
            cached_tokens=m.num_cached_tokens if m else 0,
            num_draft_tokens=m.num_draft_tokens if m else 0,
            num_accepted_tokens=m.num_accepted_tokens if m else 0))
        resp.timing.CopyFrom(pb.Timing(
            queue_ms=(m.queue_ms or 0.0) if m else 0.0, ttft_ms=(m.ttft_ms or 0.0) if m else 0.0,
            e2e_ms=(time.monotonic() - arrival_time) * 1e3))
        return resp

    # ---- unary methods ------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        engine = await self._ready(context)
        tok = engine.engine.tokenizer
        try:
            check_decoded(request)
            if tok is None:
                raise InvalidRequest("input: this model has no tokenizer")
            kind = request.WhichOneof("input")
            if kind is None:
                raise InvalidRequest("input: set one of text or chat")
            if kind == "text":
                ids = await self.text_ids(request.text, "input.text",
                                           request.add_special_tokens)
            else:
                ids = await self._chat_ids(request.chat, "input.chat")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BrokenProcessPool as e:  # as in Generate: the retry's pool died too
            log.error("tokenizer workers died twice in a row: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer workers died; retry")
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) or "" for i in ids])

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        engine = await self._ready(context)
        tok = engine.engine.tokenizer
        try:
            check_decoded(request)
            if tok is None:
                raise InvalidRequest("token_ids: this model has no tokenizer")
            if len(request.token_ids) > engine.engine.max_model_len:
                raise InvalidRequest(f"token_ids: {len(request.token_ids)} ids is more than "
                                     f"max_model_len={engine.engine.max_model_len}")
            ids = self.check_ids(request.token_ids, "token_ids")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.DetokenizeResponse(
            text=tok.decode(ids, skip_special_tokens=request.skip_special_tokens))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context):
        engine = await self._ready(context)
        try:
            check_decoded(request)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        e = engine.engine
        import jax  # already loaded by the engine
        cfg = e.config
        return pb.ModelInfoResponse(
            name=self.model_name, architecture=e.model_config.architecture,
            max_model_len=e.max_model_len, dtype=cfg.dtype,
            kv_cache_dtype=str(e.runner.kv_dtype), mesh=dict(e.mesh.shape),
            backend=jax.default_backend(), num_devices=e.mesh.size,
            vocab_size=e.model_config.vocab_size,
            page_size=e.allocator.page_size, num_pages=e.allocator.num_pages,
            attention_impl=e.attention_impl, max_prompt_len=self.max_prompt_len)


__all__ = ["GenerationServicer", "InvalidRequest", "MAX_LOGPROBS", "position_logprobs_proto",
           "sampling_params_from_proto"]
