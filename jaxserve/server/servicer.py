"""The ``jaxserve.v1.Generation`` servicer (grpc.aio) over an ``AsyncEngine``.

Every request is checked here before it reaches the engine; a bad one ends
with INVALID_ARGUMENT and a message that names the field. The servicer
exists before the model has loaded (so health and reflection answer at
once); until ``set_engine`` its methods answer UNAVAILABLE.
"""

from __future__ import annotations

import itertools
import logging
import time

import grpc
import jinja2

from jaxserve.engine.request import MAX_LOGPROBS, RequestOutput, SamplingParams
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.async_engine import (AsyncEngine, EngineError, QueueFullError,
                                          ShuttingDownError, StreamAborted)

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "logprobs",
             "prompt_logprobs", "repetition_penalty")


class InvalidRequest(ValueError):
    """A request field is bad; the message starts with the field's name."""


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
    """

    def __init__(self, model_name: str, max_prompt_len: int | None = None):
        self.model_name = model_name
        self.max_prompt_len = max_prompt_len
        self.engine: AsyncEngine | None = None
        self._live_ids: set[str] = set()
        self._ids = itertools.count()

    def set_engine(self, engine: AsyncEngine) -> None:
        """Start serving (the model has loaded)."""
        if self.max_prompt_len is None:
            self.max_prompt_len = engine.engine.max_model_len - 1
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

    def _chat_ids(self, chat: pb.ChatMessages, field: str) -> list[int]:
        tok = self.engine.engine.tokenizer
        if tok is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer or chat template")
        messages = self._messages(chat, field)
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (ValueError, jinja2.TemplateError) as e:
            raise InvalidRequest(f"{field}: the chat template rejected it: {e}") from None

    def _check_ids(self, ids, field: str) -> list[int]:
        vocab = self.engine.engine.model_config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequest(f"{field}: token ids {bad[:5]} are outside the "
                                 f"vocabulary [0, {vocab})")
        return [int(i) for i in ids]

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set one of text, token_ids or chat")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("prompt.text: is empty")
            if self.engine.engine.tokenizer is None:
                raise InvalidRequest("prompt.text: this model has no tokenizer; send token_ids")
            ids = self.engine.engine.encode(request.text)
        elif kind == "token_ids":
            if not request.token_ids.ids:
                raise InvalidRequest("prompt.token_ids: is empty")
            ids = self._check_ids(request.token_ids.ids, "prompt.token_ids")
        else:
            ids = self._chat_ids(request.chat, "prompt.chat")
        if len(ids) > self.max_prompt_len:
            raise InvalidRequest(f"prompt: {len(ids)} tokens is more than max_prompt_len="
                                 f"{self.max_prompt_len}")
        return ids

    # ---- Generate -----------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context):
        arrival_time = time.monotonic()
        engine = await self._ready(context)
        engine.metrics.received.inc()
        try:
            if request.output_kind not in pb.OutputKind.values():
                raise InvalidRequest(f"output_kind: unknown value {request.output_kind}")
            params = sampling_params_from_proto(request.sampling)
            ids = self._prompt_ids(request)
            if params.stop_token_ids:
                self._check_ids(params.stop_token_ids, "sampling.stop_token_ids")
        except InvalidRequest as e:
            engine.metrics.rejected.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"req-{next(self._ids)}"
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
            except ShuttingDownError as e:
                engine.metrics.rejected.labels("UNAVAILABLE").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            kind = request.output_kind
            reported_finish: set[int] = set()
            first = True
            last = None
            try:
                # Initial metadata tells the client the request is in the engine.
                await context.send_initial_metadata((("x-request-id", rid),))
                async for out in outputs:
                    last = out
                    if kind == pb.OUTPUT_KIND_FINAL_ONLY and not out.finished:
                        continue
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

    def _response(self, rid: str, out: RequestOutput, kind: int, first: bool,
                  reported_finish: set[int]) -> pb.GenerateResponse:
        delta = kind == pb.OUTPUT_KIND_DELTA
        resp = pb.GenerateResponse(request_id=rid, finished=out.finished)
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
        if first and out.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(
                position_logprobs_proto(t, e) for t, e in
                zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
        if out.finished:
            m = out.metrics
            resp.usage.CopyFrom(pb.Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=sum(len(c.token_ids) for c in out.outputs),
                cached_tokens=m.num_cached_tokens))
            resp.timing.CopyFrom(pb.Timing(queue_ms=m.queue_ms or 0.0, ttft_ms=m.ttft_ms or 0.0,
                                           tpot_ms=m.tpot_ms or 0.0, e2e_ms=m.e2e_ms or 0.0))
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
            cached_tokens=m.num_cached_tokens if m else 0))
        resp.timing.CopyFrom(pb.Timing(
            queue_ms=(m.queue_ms or 0.0) if m else 0.0, ttft_ms=(m.ttft_ms or 0.0) if m else 0.0,
            e2e_ms=(time.monotonic() - arrival_time) * 1e3))
        return resp

    # ---- unary methods ------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        engine = await self._ready(context)
        tok = engine.engine.tokenizer
        try:
            if tok is None:
                raise InvalidRequest("input: this model has no tokenizer")
            kind = request.WhichOneof("input")
            if kind is None:
                raise InvalidRequest("input: set one of text or chat")
            if kind == "text":
                ids = tok.encode(request.text, add_special_tokens=request.add_special_tokens)
            else:
                ids = self._chat_ids(request.chat, "input.chat")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) or "" for i in ids])

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        engine = await self._ready(context)
        tok = engine.engine.tokenizer
        try:
            if tok is None:
                raise InvalidRequest("token_ids: this model has no tokenizer")
            ids = self._check_ids(request.token_ids, "token_ids")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.DetokenizeResponse(
            text=tok.decode(ids, skip_special_tokens=request.skip_special_tokens))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context):
        engine = await self._ready(context)
        e = engine.engine
        import jax  # already loaded by the engine
        cfg = e.config
        return pb.ModelInfoResponse(
            name=self.model_name, architecture=e.model_config.architecture,
            max_model_len=e.max_model_len, dtype=cfg.dtype,
            kv_cache_dtype=str(e.runner.k_cache[0].dtype), mesh=dict(e.mesh.shape),
            backend=jax.default_backend(), num_devices=e.mesh.size,
            vocab_size=e.model_config.vocab_size,
            page_size=e.allocator.page_size, num_pages=e.allocator.num_pages,
            attention_impl=e.attention_impl, max_prompt_len=self.max_prompt_len)


__all__ = ["GenerationServicer", "InvalidRequest", "MAX_LOGPROBS", "position_logprobs_proto",
           "sampling_params_from_proto"]
