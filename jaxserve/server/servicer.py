"""The ``jaxserve.v1.Generation`` servicer (grpc.aio) over an ``AsyncEngine``.

Every request is checked before it reaches the engine, cheapest check
first: the wire checks of ``jaxserve.server.checks`` (which give the order),
then the front end both APIs share (``jaxserve.server.frontend``: the
engine's limits, tokenizing on worker processes for large texts, the prompt
length, a ``max_tokens`` that is set against the context, as HTTP checks
it). A bad request ends with INVALID_ARGUMENT and a message that names
the field (anything UTF-8 cannot encode written as a backslash escape). Register the servicer with ``checks.add_generation_servicer``,
whose deserializer turns undecodable bytes into INVALID_ARGUMENT. The
servicer exists before the model has loaded (so health and reflection
answer at once); until ``Frontend.set_engine`` its methods answer UNAVAILABLE.

LoRA adapters: ``GenerateRequest.lora_name`` picks one (empty or the served
model's name: the base; another name: NOT_FOUND, ``Frontend.resolve_model``);
``LoadLoRAAdapter`` / ``UnloadLoRAAdapter`` are vLLM's load and unload
routes (a folder is read on a worker thread); ``ModelInfo`` lists the
adapters.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from concurrent.futures.process import BrokenProcessPool

import grpc

from jaxserve.engine.adapters import UnknownAdapterError
from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, escape_text
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.request_stream import (EngineError, QueueFullError, ShuttingDownError,
                                            StreamAborted)
from jaxserve.server.checks import (
    CumulativeChoice,
    InvalidRequest,
    check_decoded,
    check_output_size,
    check_request_id,
    header_request_id,
    length_delimited,
)
from jaxserve.server.frontend import Frontend, chat_messages
from jaxserve.server.output_constraints import json_schema_value, structured_outputs_of

log = logging.getLogger(__name__)

# The start of a chat_messages error about an assistant's call: its OpenAI
# path "<field>.<i>.tool_calls.<j>.function.", which is "....tool_calls.<j>." in ToolCall.
_FLAT_CALL = re.compile(r"^(\S*?\.tool_calls\.\d+)\.function\.")
_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "logprobs",
             "prompt_logprobs", "repetition_penalty")


def constraint_from_proto(msg: pb.SamplingParams):
    """The ``constraint`` oneof as (``StructuredOutputsParams`` or None, the
    field that set it: ``sampling.json_schema`` ...), by the rule HTTP
    applies too (``output_constraints.structured_outputs_of``).

    Raises:
      InvalidRequest: naming ``sampling.<field>`` (a schema that is not
        JSON, an empty regex or choice).
    """
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None, None
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    key = {"json_schema": "json"}.get(kind, kind)
    if key == "json":
        value = json_schema_value(value, f"sampling.{kind}")
    return structured_outputs_of([(f"sampling.{kind}", {key: value})])


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """``SamplingParams`` from its message; unset optional fields take the
    defaults; empty ``logit_bias`` / ``allowed_token_ids`` / ``bad_words``
    are unset.

    Raises:
      InvalidRequest: naming the field (``sampling.<field>``) and the value.
    """
    kw = {f: getattr(msg, f) for f in _OPTIONAL if msg.HasField(f)}
    kw.update(min_p=msg.min_p, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
              ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens,
              presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
              structured_outputs=constraint_from_proto(msg)[0],
              logit_bias=dict(msg.logit_bias) or None,
              allowed_token_ids=list(msg.allowed_token_ids) or None,
              bad_words=list(msg.bad_words) or None)
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
    """Implements ``jaxserve.v1.Generation`` over ``frontend`` (its engine,
    model name, prompt limits and tokenizer pool serve both APIs)."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self._live_ids: set[str] = set()
        self._ids = itertools.count()

    async def _ready(self, context) -> AsyncEngine:
        engine = self.frontend.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        return engine

    @staticmethod
    def _messages(chat: pb.ChatMessages, field: str) -> list[dict]:
        """The chat template's message dicts of ``chat``: each ``ChatMessage``
        as the HTTP API's OpenAI message, ``tool_calls`` as ``{id, type,
        function: {name, arguments}}`` and ``tool_call_id`` when set, checked
        and converted by the one ``frontend.chat_messages``.

        Raises:
          InvalidRequest: as ``chat_messages``; a call's path is the proto's
            flat one (``<field>.messages.<i>.tool_calls.<j>.arguments``).
        """
        pairs = [(m.role, m.content, {
            "tool_call_id": m.tool_call_id if m.HasField("tool_call_id") else None,
            "tool_calls": [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]}) for m in chat.messages]
        try:
            return chat_messages(pairs, f"{field}.messages")
        except InvalidRequest as e:  # OpenAI's call.function.<x> is ToolCall.<x> here
            raise InvalidRequest(_FLAT_CALL.sub(r"\1.", str(e), count=1)) from None

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        fe = self.frontend
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set one of text, token_ids or chat")
        if kind == "text":
            return await fe.text_prompt(request.text, "prompt.text")
        if kind == "token_ids":
            return fe.ids_prompt(request.token_ids.ids, "prompt.token_ids")
        return await fe.chat_prompt(self._messages(request.chat, "prompt.chat"), "prompt.chat")

    # ---- Generate -----------------------------------------------------------

    async def _reject(self, context, code: grpc.StatusCode, error: Exception) -> None:
        if self.frontend.engine is not None:
            self.frontend.engine.metrics.rejected.labels(code.name).inc()
        await context.abort(code, escape_text(str(error)))

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
            try:
                lora = self.frontend.resolve_model(request.lora_name)
            except UnknownAdapterError as e:
                await self._reject(context, grpc.StatusCode.NOT_FOUND,
                                   UnknownAdapterError(f"lora_name: {e}"))
            params = sampling_params_from_proto(request.sampling)
            self.frontend.check_limits(params, "sampling.")
            check_output_size(params, request.output_kind)
            engine.check_queue(params)  # before tokenizing: a full queue costs nothing
            await self.frontend.compile_constraint(params,
                                                   constraint_from_proto(request.sampling)[1])
            ids = await self._prompt_ids(request)
            if request.sampling.HasField("max_tokens"):  # HTTP's rule: it must fit the context
                self.frontend.output_budget(params.max_tokens, len(ids), "sampling.max_tokens")
            if request.WhichOneof("prompt") == "chat":  # a transcript's turn end
                params = params.with_stop(engine.tokenizer.chat_stop)
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
                outputs = await engine.generate(ids, params, arrival_time, lora=lora)
                outputs.set_request_id(rid)
            except UnknownAdapterError as e:  # unloaded since resolve_model
                engine.metrics.rejected.labels("NOT_FOUND").inc()
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    escape_text(f"lora_name: {e}"))
            except ValueError as e:
                engine.metrics.rejected.labels("INVALID_ARGUMENT").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(str(e)))
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
                        sent = await self._write(
                            context, self._cumulative_response(rid, out, first, cumulative))
                    else:
                        sent = await self._write(
                            context, self._response(rid, out, kind, first, reported_finish))
                    if not sent:
                        log.info("request %s: the client went away during a write", rid)
                        return
                    first = False
            except StreamAborted:
                await self._write(context, self._aborted_response(
                    rid, len(ids), last, arrival_time, kind, reported_finish))
            except EngineError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            finally:
                await outputs.aclose()  # aborts the request if it is still running
        finally:
            self._live_ids.discard(rid)

    @staticmethod
    async def _write(context, response: pb.GenerateResponse) -> bool:
        """Send one response. ``Generate`` writes with ``context.write`` (not
        ``yield``) so that a send failing because the client went away while
        it waited on flow control (a cancel or a closed connection while the
        stream was unread) surfaces here, not as ``grpc.aio``'s logged
        traceback. Returns False then."""
        try:
            await context.write(response)
        except grpc.aio.InternalError:  # ExecuteBatchError: the call is gone
            return False
        return True

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
        """The final message of a stream cut by shutdown or backpressure
        (``StreamBackpressure``, a ``StreamAborted``): every unfinished
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
        fe = self.frontend
        try:
            check_decoded(request)
            kind = request.WhichOneof("input")
            if kind is None:
                raise InvalidRequest("input: set one of text or chat")
            if kind == "text":
                ids = await fe.text_ids(request.text, "input.text", request.add_special_tokens)
            else:
                ids = await fe.chat_ids(self._messages(request.chat, "input.chat"), "input.chat")
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(str(e)))
        except QueueFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BrokenProcessPool as e:  # as in Generate: the retry's pool died too
            log.error("tokenizer workers died twice in a row: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer workers died; retry")
        tok = engine.tokenizer
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) or "" for i in ids])

    async def Detokenize(self, request: pb.DetokenizeRequest, context):
        await self._ready(context)
        try:
            check_decoded(request)
            text = self.frontend.detokenize(request.token_ids, "token_ids",
                                            request.skip_special_tokens)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(str(e)))
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context):
        engine = await self._ready(context)
        try:
            check_decoded(request)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(str(err)))
        adapters = [pb.LoRAAdapter(name=n, path=p)
                    for n, p in sorted(engine.lora_adapters().items())]
        return pb.ModelInfoResponse(name=self.frontend.model_name,
                                    max_prompt_len=self.frontend.max_prompt_len,
                                    max_loras=engine.max_loras or 0, lora_adapters=adapters,
                                    **engine.model_info())

    # ---- LoRA adapters ----------------------------------------------------------

    async def _lora_engine(self, request, context) -> AsyncEngine:
        engine = await self._ready(context)
        try:
            check_decoded(request)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(str(err)))
        if engine.max_loras is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is not enabled: start the server with --enable_lora "
                                "(or --lora_modules)")
        if not request.lora_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name: must not be empty")
        return engine

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context):
        engine = await self._lora_engine(request, context)
        if request.lora_name == self.frontend.model_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(
                f"lora_name: {request.lora_name!r} is the served model's name"))
        if not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: must not be empty")
        try:
            await engine.add_lora(request.lora_name, request.lora_path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, escape_text(str(e)))
        return pb.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context):
        engine = await self._lora_engine(request, context)
        try:
            engine.remove_lora(request.lora_name)
        except UnknownAdapterError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, escape_text(str(e)))
        return pb.UnloadLoRAAdapterResponse()


__all__ = ["GenerationServicer", "InvalidRequest", "MAX_LOGPROBS", "constraint_from_proto",
           "position_logprobs_proto", "sampling_params_from_proto"]
