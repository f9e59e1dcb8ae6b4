"""Run the gRPC server: ``python -m jaxserve.main --mode serve``.

Start-up order: the grpc.aio server starts at once with the standard
``grpc.health.v1`` service (NOT_SERVING) and reflection, so probes answer
while the weights load in a worker thread; then the engine thread starts and
health turns SERVING. ``Generate`` before that answers UNAVAILABLE.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING and new calls are
refused (UNAVAILABLE); running requests get ``grace_period_s`` minus 1.5 s
to finish, then every one still running is aborted: its stream ends at once
with a final message (``finish_reason`` "abort", usage and timing so far)
and status OK, even while the engine thread is inside a long step. The
server stops and the process exits 0 (``os._exit``, skipping the slow
interpreter teardown) within the grace period.

Multi-host (``--multihost``, process 0): the engine broadcasts every step to
the other processes (``jaxserve.engine.multihost``). At shutdown process 0
sends them STOP and leaves the job; when a step fails because a process died,
every open stream ends with INTERNAL, the server stops, and the process exits 1.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import logging
import signal
import sys
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import ServerConfig
from jaxserve.metrics import ServingMetrics
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.servicer import GenerationServicer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # jaxserve.v1.Generation
# Abort what still runs this long before the grace period ends, so the
# abort outputs reach the clients and the process exits in time.
_ABORT_MARGIN_S = 1.0
# Time kept for the process exit itself (flush, os._exit) after the shutdown.
_EXIT_MARGIN_S = 0.5


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without ``authorization: Bearer <token>`` metadata
    with UNAUTHENTICATED (constant-time comparison)."""

    def __init__(self, token: str, metrics: ServingMetrics | None = None):
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

    async def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return await continuation(details)
        if self._metrics is not None:
            self._metrics.rejected.labels("UNAUTHENTICATED").inc()
        handler = await continuation(details)
        if handler is None:
            return None
        return _denying_handler(handler)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    msg = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror}") from None


class Server:
    """The gRPC server, its health service and metrics endpoint, around an
    engine that ``load_engine`` builds.

    Args:
      config: ``ServerConfig``.
      load_engine: builds the ``Engine`` (slow: weights and compilation); run
        in a worker thread after the server starts.
      model_name: reported by ``ModelInfo``.
    """

    def __init__(self, config: ServerConfig, load_engine: Callable, model_name: str):
        self.config = config
        self.load_engine = load_engine
        self.metrics = ServingMetrics()
        self.servicer = GenerationServicer(model_name, config.max_prompt_len)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else \
            health.HealthServicer()
        self.async_engine: AsyncEngine | None = None
        self.exit_code = 0  # 1 after a fatal multi-host error
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._stopping: asyncio.Event | None = None

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            r = self.health.set(name, status)
            if asyncio.iscoroutine(r):
                await r

    async def start(self) -> None:
        """Bind and start serving health (NOT_SERVING) and reflection.

        Raises:
          ValueError: unreadable TLS files, or the port cannot be bound.
        """
        cfg = self.config
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        interceptors = [BearerTokenInterceptor(cfg.auth_token, self.metrics)] \
            if cfg.auth_token else []
        self.server = grpc.aio.server(options=opts, interceptors=interceptors)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials([(_read(cfg.tls_key), _read(cfg.tls_cert))])
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise ValueError(f"cannot bind {address}")
        await self.server.start()
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.start_http_server(cfg.metrics_port, cfg.host)
        print(f"jaxserve: gRPC on {cfg.host}:{self.port} ({'TLS' if cfg.tls_cert else 'plaintext'}"
              f"{', bearer token' if cfg.auth_token else ''}); metrics on "
              f"{f'http://{cfg.host}:{self.metrics_port}/metrics' if self.metrics_port else 'off'}"
              f"; loading the model", file=sys.stderr, flush=True)

    async def load(self) -> None:
        """Load the engine in a worker thread, then serve (health SERVING)."""
        t0 = time.monotonic()
        engine = await _in_daemon_thread(self.load_engine)
        loop = asyncio.get_running_loop()
        self.async_engine = AsyncEngine(
            engine, metrics=self.metrics, max_waiting_requests=self.config.max_waiting_requests,
            on_fatal=lambda e: loop.call_soon_threadsafe(self._on_fatal, e))
        self.async_engine.start()
        self.metrics.observe_stats(engine.stats())
        self.servicer.set_engine(self.async_engine)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        print(f"jaxserve: serving {self.servicer.model_name} "
              f"(loaded in {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

    def _on_fatal(self, error: Exception) -> None:
        """The multi-host job failed: stop serving, exit non-zero."""
        print(f"jaxserve: error: {error}; stopping", file=sys.stderr, flush=True)
        self.exit_code = 1
        self.request_stop()

    def request_stop(self) -> None:
        """Begin a graceful shutdown (signal handlers call this)."""
        if self._stopping is not None:
            self._stopping.set()

    async def shutdown(self) -> bool:
        """Refuse new calls, let running requests finish until the grace
        period (less a margin) ends, abort the rest, stop. Returns False when
        the engine thread was still busy (e.g. compiling) at the deadline:
        the caller then exits without waiting for it."""
        t0 = time.monotonic()
        # Leave time for the process to exit inside the grace period.
        deadline = t0 + max(0.5, self.config.grace_period_s - _EXIT_MARGIN_S)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        ae = self.async_engine
        if ae is not None:
            ae.stop_accepting()
        # Refuses new RPCs at once; cancels any still open just before the deadline.
        stop = asyncio.create_task(self.server.stop(max(0.0, deadline - 0.3 - time.monotonic())))
        clean = True
        if ae is not None:
            while ae.num_in_flight and time.monotonic() < deadline - _ABORT_MARGIN_S:
                await asyncio.sleep(0.05)
            if ae.num_in_flight:
                print(f"jaxserve: grace period over; aborting {ae.num_in_flight} requests",
                      file=sys.stderr, flush=True)
                ae.abort_all()
        await stop
        if ae is not None:
            clean = await ae.stop(timeout_s=max(0.0, deadline - 0.1 - time.monotonic()))
        print(f"jaxserve: stopped in {time.monotonic() - t0:.1f} s"
              f"{'' if clean else ' (engine thread still busy; exiting without it)'}",
              file=sys.stderr, flush=True)
        return clean

    async def run(self) -> bool:
        """Start, load, serve until SIGTERM/SIGINT, shut down gracefully;
        returns ``shutdown``'s result."""
        self._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        load = asyncio.create_task(self.load())
        stopping = asyncio.create_task(self._stopping.wait())
        done, _ = await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if load in done:
            load.result()  # raises a load error
            await stopping
        else:
            load.cancel()
        return await self.shutdown()


async def _in_daemon_thread(fn: Callable):
    """``await fn()`` run in a daemon thread (unlike ``asyncio.to_thread``, a
    shutdown during a slow model load does not wait for the load to end)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run():
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda err=e: fut.done() or fut.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
    threading.Thread(target=run, name="jaxserve-load", daemon=True).start()
    return await fut


def serve(config: ServerConfig, load_engine: Callable, model_name: str) -> None:
    """Blocking entry point of ``--mode serve``.

    Raises:
      ValueError: bad TLS files, an unbindable port, or a bad model.
    """
    server = Server(config, load_engine, model_name)
    clean = asyncio.run(server.run())
    ae = server.async_engine
    if ae is not None and clean and server.exit_code == 0 and ae.engine.runner.channel is not None:
        from jaxserve.engine import multihost
        try:  # release the other processes of a multi-host job, then leave it
            ae.engine.stop_followers()
            multihost.shutdown()
        except multihost.MultihostError as e:
            print(f"jaxserve: error: {e}", file=sys.stderr, flush=True)
            server.exit_code = 1
    # Exit at once: interpreter teardown (JAX, XLA, threads) takes about a
    # second, and the engine thread may still be inside a step. Everything a
    # client needs has been sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)
