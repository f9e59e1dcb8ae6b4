"""The OpenAI-compatible HTTP API: FastAPI on uvicorn, beside the gRPC server.

``--mode serve --http_port 8080`` serves it from the same process, the same
asyncio loop and the same engine thread (``AsyncEngine``) as gRPC, so both
front ends share the queue, the prefix cache and the metrics:

  ``POST /v1/completions``        text, list of texts, token ids or lists of them
  ``POST /v1/chat/completions``   messages rendered with the model's chat template
  ``GET  /v1/models``             the served model and its LoRA adapters (vLLM's cards:
                                  an adapter's ``root`` is its folder, ``parent`` the model)
  ``POST /v1/load_lora_adapter``  vLLM's ``{lora_name, lora_path}``: register a PEFT folder
  ``POST /v1/unload_lora_adapter``  vLLM's ``{lora_name}``
  ``GET  /health``                200 serving; 503 while loading or draining
  ``GET  /version``               ``{"version"}`` (vLLM's), the installed jaxserve
  ``GET  /metrics``               the Prometheus registry of the metrics port
  ``POST /tokenize``, ``/detokenize``   vLLM's shapes

This module holds the routes only (``/v1/models`` and ``/tokenize`` in
``model_routes``, the adapters' in ``lora_routes``): requests and responses follow OpenAI's
API with vLLM's extras, parsed and built by ``jaxserve.server.openai_protocol``
(pydantic models, pure response builders); output constraints and tools by
``output_constraints``, ``chat_tools`` and ``tool_parsers`` (README
"Structured outputs and tool calling"); every request is checked and
tokenized by the front end the gRPC servicer uses too
(``jaxserve.server.frontend``: one set of checks, one tokenizer pool, so
large prompts never hold the event loop). Errors are OpenAI's
``{"error": {message, type, param, code}}``: 400 for bad input (``param``
names the field: a bad value, a malformed JSON body or one nested deeper
than ``json_body.MAX_JSON_DEPTH``, a content type other than
``application/json``, a request no idle server could hold), 413 for a body
over ``max_http_body_bytes``, 401 without the bearer token when one is
configured (every route but ``/health`` and ``/metrics``; the rule gRPC
applies too, ``auth.bearer_refusal``), 404 for another model name or route,
or an adapter that is not loaded (the ``model`` field names a LoRA adapter,
vLLM's convention: ``Frontend.resolve_model``),
429 when the waiting queue is full now (retry later), 503 while loading or
draining, 500 when the engine fails a running request. Messages write what
UTF-8 cannot encode (a lone surrogate in a model name) as backslash escapes
(``APIError``), so every error renders. An error after a stream started arrives as
a last ``data: {"error": ...}`` event before ``data: [DONE]``.

Streams are server-sent events (``data: {...}``, then ``data: [DONE]``): one
chunk per engine step per choice that gained text, ``n`` choices interleaved
by ``index``; deltas never split a UTF-8 character nor show a stop string
(the engine's detokenizer holds such tails back). With
``stream_options.include_usage`` the last chunk has empty ``choices`` and
the usage. A client that disconnects (a closed stream, or a dropped
non-streamed request) has its request aborted in the engine before the next
step, freeing its pages, as a gRPC cancel does; at shutdown, streams still
running when the grace period ends get ``finish_reason`` "abort". A client
that stops reading blocks the generator in uvicorn's ``send`` (it waits for
the socket to drain); its request is aborted by the stream stall rule
(``jaxserve.server.backpressure``) and, if it reads again, ends the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import socket
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.server_config import ServerConfig
from jaxserve.engine.adapters import UnknownAdapterError
from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import escape_text
from jaxserve.metrics import ServingMetrics
from jaxserve.server import json_body
from jaxserve.server import openai_protocol as oai
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.request_stream import (EngineError, QueueFullError, ShuttingDownError,
                                            StreamAborted)
from jaxserve.server.auth import bearer_refusal
from jaxserve.server.chat_tools import (chat_tool_chunks, chat_tool_response,
                                        prepare_chat, request_constraint)
from jaxserve.server.checks import MAX_REQUEST_ID_CHARS, InvalidRequest
from jaxserve.server.frontend import Frontend, Job, start_job
from jaxserve.server.lora_routes import LoRARoutes
from jaxserve.server.model_routes import ModelRoutes
from jaxserve.server.sse_events import sse_events

log = logging.getLogger(__name__)

# The gRPC status names ``jaxserve_requests_rejected_total`` is labelled with.
_REJECT_LABEL = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND",
                 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


def _version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _Uvicorn(uvicorn.Server):
    """uvicorn that leaves SIGTERM/SIGINT to the gRPC server's handlers."""

    def capture_signals(self):
        return contextlib.nullcontext()


class OpenAIServer(LoRARoutes, ModelRoutes):
    """The HTTP API over the front end the gRPC servicer shares.

    Args:
      frontend: its engine (None while loading), model name, prompt limits,
        checks and tokenizer pool serve both APIs.
      metrics: the Prometheus registry served at ``/metrics``.
      config: host, ``http_port``, TLS files, bearer token, body limit.
    """

    def __init__(self, frontend: Frontend, metrics: ServingMetrics, config: ServerConfig):
        self.frontend = frontend
        self.metrics = metrics
        self.config = config
        self.draining = False
        self.created = int(time.time())
        self.port: int | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # ---- lifecycle --------------------------------------------------------------

    async def start(self) -> int:
        """Bind ``config.host:config.http_port`` and serve; returns the port.

        Raises:
          OSError: the bind failed (the caller names the flag).
        """
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.create_server((cfg.host, cfg.http_port), family=family, backlog=2048)
        self.port = sock.getsockname()[1]
        uv_config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
            ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key, timeout_graceful_shutdown=1,
            timeout_keep_alive=30)
        self._server = _Uvicorn(uv_config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {cfg.host}:{self.port} stopped at start-up")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, timeout_s: float) -> None:
        """Close the listener and the connections left (after the drain)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), max(0.1, timeout_s))
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()

    # ---- the app ----------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(oai.APIError)
        async def api_error(request: Request, e: oai.APIError):
            label = _REJECT_LABEL.get(e.status)
            if label is not None and self.frontend.engine is not None:
                self.metrics.rejected.labels(label).inc()
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            what = "route" if e.status_code == 404 else "method"
            return JSONResponse(oai.APIError(e.status_code, f"{request.method} {request.url.path}: "
                                             f"no such {what} ({e.detail})").body(),
                                status_code=e.status_code)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, e: Exception):
            log.exception("HTTP %s %s failed", request.method, request.url.path)
            return JSONResponse(oai.APIError(500, f"internal error: {type(e).__name__}: {e}")
                                .body(), status_code=500)

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        app.post("/v1/load_lora_adapter")(self.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)
        app.api_route("/health", methods=["GET", "HEAD"])(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/version")(lambda: {"version": _version()})
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        return app

    # ---- checks -----------------------------------------------------------------

    def _auth(self, request: Request) -> None:
        """The bearer-token rule gRPC applies too (``auth.bearer_refusal``)."""
        why = bearer_refusal(request.headers.getlist("authorization"), self.config.auth_token)
        if why is not None:
            raise oai.APIError(401, why)

    def _ready(self) -> AsyncEngine:
        if self.draining:
            raise oai.APIError(503, "the server is shutting down")
        engine = self.frontend.engine
        if engine is None:
            raise oai.APIError(503, "the model is loading")
        return engine

    async def _body(self, request: Request):
        """The request's JSON body. Raises ``APIError``: 400 for another
        content type or malformed JSON, 413 beyond ``max_http_body_bytes``."""
        ctype = request.headers.get("content-type")
        if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
            raise oai.bad_request(f"Content-Type must be application/json, got {ctype!r}")
        limit = self.config.max_http_body_bytes
        too_big = oai.APIError(413, f"the request body is larger than the {limit:,} bytes "
                                    f"allowed (--max_message_mib)")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > 4 * limit:
            raise too_big  # not worth reading
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > 4 * limit:
                break
        if size > limit:
            raise too_big
        return json_body.loads(b"".join(chunks))

    async def _parse(self, request: Request, cls):
        """The request body as ``cls`` and the LoRA adapter its ``model``
        names (None: the base model); 404 for another model."""
        self._auth(request)
        body = await self._body(request)
        req = oai.parse(cls, body)
        unknown = req.unknown_fields()
        if unknown:
            log.warning("%s: ignoring unknown fields %s", request.url.path,
                        escape_text(", ".join(unknown)))
        with self._errors():
            lora = self.frontend.resolve_model(getattr(req, "model", None))
        return req, lora

    @staticmethod
    def _request_id(request: Request, prefix: str) -> str:
        rid = request.headers.get("x-request-id")
        if rid and len(rid) <= MAX_REQUEST_ID_CHARS:
            return f"{prefix}-{rid}"
        return f"{prefix}-{uuid.uuid4().hex}"

    @contextlib.contextmanager
    def _errors(self):
        """The engine's and checks' exceptions as ``APIError``s."""
        try:
            yield
        except UnknownAdapterError as e:  # the model field names no model or adapter
            raise oai.APIError(404, str(e), "model") from None
        except InvalidRequest as e:  # "<field>: <why>"
            field = str(e).split(":", 1)[0]
            raise oai.bad_request(str(e), field if field.replace(".", "").isidentifier()
                                  else None) from None
        except ValueError as e:
            raise oai.bad_request(str(e)) from None
        except QueueFullError as e:
            raise oai.APIError(429, str(e)) from None
        except (ShuttingDownError, StreamAborted) as e:
            raise oai.APIError(503, str(e)) from None
        except BrokenProcessPool:
            log.error("tokenizer workers died twice in a row")
            raise oai.APIError(503, "the tokenizer workers died; retry") from None

    async def _start(self, engine: AsyncEngine, rid: str, prompt_ids, prompt_texts, base,
                     asked: int | None, max_name: str, arrival: float,
                     lora: str | None) -> Job:
        """Put every prompt in the engine, each with its output budget."""
        with self._errors():
            params = [dataclasses.replace(base, max_tokens=self.frontend.output_budget(
                asked, len(ids), max_name)) for ids in prompt_ids]
            return await start_job(engine, rid, prompt_ids, prompt_texts, params, arrival,
                                   lora)

    # ---- generation -------------------------------------------------------------

    async def completions(self, request: Request):
        arrival = time.monotonic()
        engine = self._ready()
        engine.metrics.received.inc()
        req, lora = await self._parse(request, oai.CompletionRequest)
        prompts = oai.completion_prompts(req)
        asked = None if "max_tokens" in req.model_fields_set and req.max_tokens is None else \
            req.max_tokens
        k = req.logprobs
        plp = req.prompt_logprobs
        if req.echo and k is not None:
            plp = max(plp or 0, k)
        with self._errors():
            structured, field = request_constraint(req)
        base = oai.sampling_params(req.model_copy(update={"prompt_logprobs": plp}),
                                   engine.max_model_len if asked is None else asked, k,
                                   {"max_tokens": "max_tokens"}, structured)
        fe = self.frontend
        with self._errors():
            fe.check_limits(base, num_prompts=len(prompts))
            engine.check_queue(dataclasses.replace(base, n=base.n * len(prompts)))
            await fe.compile_constraint(base, field)
            ids, texts = [], []
            for i, p in enumerate(prompts):
                field = "prompt" if len(prompts) == 1 else f"prompt.{i}"
                if isinstance(p, str):
                    ids.append(await fe.text_prompt(p, field))
                    texts.append(p)
                else:
                    ids.append(fe.ids_prompt(p, field))
                    texts.append(None)
        if req.echo:
            tok = engine.tokenizer
            texts = [t if t is not None else (tok.decode(i, skip_special_tokens=
                                                         req.skip_special_tokens) if tok else "")
                     for t, i in zip(texts, ids)]
        job = await self._start(engine, self._request_id(request, "cmpl"), ids, texts, base,
                                asked, "max_tokens", arrival, lora)
        if req.stream:
            return self._sse_response(self._completion_chunks(job, req, k))
        return await self._until_done(request, self._completion_body(job, req, k))

    async def chat_completions(self, request: Request):
        arrival = time.monotonic()
        engine = self._ready()
        engine.metrics.received.inc()
        req, lora = await self._parse(request, oai.ChatCompletionRequest)
        oai.check_chat(req)
        with self._errors():
            chat = prepare_chat(req)
        if req.max_completion_tokens is not None:
            asked, max_name = req.max_completion_tokens, "max_completion_tokens"
        else:
            asked, max_name = req.max_tokens, "max_tokens"
        k = (req.top_logprobs or 0) if req.logprobs else None
        base = oai.sampling_params(req, engine.max_model_len if asked is None else asked, k,
                                   {"max_tokens": max_name, "logprobs": "top_logprobs"},
                                   chat.structured)
        with self._errors():
            self.frontend.check_limits(base)
            engine.check_queue(base)
            await self.frontend.compile_constraint(base, chat.constraint_field)
            ids = await self.frontend.chat_prompt(chat.messages, "messages", chat.tools)
        base = base.with_stop(engine.tokenizer.chat_stop)  # a transcript's turn end
        job = await self._start(engine, self._request_id(request, "chatcmpl"), [ids], [None],
                                base, asked, max_name, arrival, lora)
        if req.stream:
            return self._sse_response(self._chat_chunks(job, req, k, chat.plan))
        return await self._until_done(request, self._chat_body(job, req, k, chat.plan))

    async def _until_done(self, request: Request, work) -> Response:
        """Await a non-streamed response; a client that disconnects first
        cancels it (which aborts its requests in the engine)."""
        task = asyncio.ensure_future(work)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if task.done():
            return JSONResponse(task.result())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody reads it

    @staticmethod
    def _sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @staticmethod
    async def _collect(job: Job) -> tuple[list[RequestOutput | None], bool]:
        try:
            return await job.collect()
        except EngineError as e:
            raise oai.APIError(500, str(e)) from None

    def _token_text(self):
        """id -> the token decoded alone, special tokens included (the echoed
        first prompt token's text in completions logprobs); None without a
        tokenizer."""
        tok = self.frontend.engine.tokenizer
        return None if tok is None else (lambda i: tok.decode([i], skip_special_tokens=False))

    def _head(self, job: Job, obj: str) -> dict:
        return oai.head(job.request_id, obj, job.lora or self.frontend.model_name)

    # ---- completions and chat ---------------------------------------------------

    async def _completion_body(self, job: Job, req: oai.CompletionRequest, k) -> dict:
        last, aborted = await self._collect(job)
        return oai.completion_response(self._head(job, "text_completion"), req, job.prompt_ids,
                                       job.prompt_texts, job.n, last, aborted, k,
                                       self._token_text())

    def _completion_chunks(self, job: Job, req: oai.CompletionRequest, k):
        head = self._head(job, "text_completion")
        offsets: dict[int, int] = {}  # choice index -> characters sent
        token_text = self._token_text()

        def on_output(i: int, out: RequestOutput, finished: set[int]):
            return oai.completion_chunks(head, req, i, out, job.n, job.prompt_ids[i],
                                         job.prompt_texts[i], k, offsets, finished, token_text)
        return sse_events(job, req, head, on_output,
                            lambda idx: oai.completion_chunk(head, idx, "", None, "abort"))

    async def _chat_body(self, job: Job, req: oai.ChatCompletionRequest, k, plan) -> dict:
        (out,), aborted = await self._collect(job)
        return chat_tool_response(oai.chat_response(
            self._head(job, "chat.completion"), job.prompt_ids[0], job.n, out, aborted, k), plan)

    def _chat_chunks(self, job: Job, req: oai.ChatCompletionRequest, k, plan):
        head = self._head(job, "chat.completion.chunk")
        streams: dict = {}  # choice index -> its ToolCallStream

        def on_output(i, out, finished):
            if plan is not None and plan.parses:
                return chat_tool_chunks(head, out, k, finished, streams, plan)
            return oai.chat_chunks(head, out, k, finished)
        return sse_events(job, req, head, on_output,
                            lambda idx: oai.chat_chunk(head, idx, {}, None, "abort"),
                            oai.chat_role_chunks(head, job.n))

    # ---- health and metrics (the model's routes: ``model_routes``) ------------------

    async def health(self, request: Request):
        self._ready()
        return {"status": "serving"}

    async def prometheus(self, request: Request):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


__all__ = ["OpenAIServer"]
