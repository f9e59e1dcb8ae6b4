"""Run the gRPC server: ``python -m jaxserve.main --mode serve``.

Start-up order: the grpc.aio server starts at once with the standard
``grpc.health.v1`` service (NOT_SERVING) and reflection, so probes answer
while the weights load in a worker thread and every step shape the engine
can reach is compiled (``Engine.warmup``, unless ``--nowarmup``; the
persistent compilation cache makes a second start load them from disk);
then the engine thread starts and health turns SERVING. ``Generate`` before
that answers UNAVAILABLE. The start-up line then says how long the process
took to get there, how many XLA programs it loaded from the persistent cache
and how many it compiled, and its RSS (``compile_cache.StartupReport``:
``jaxserve: serving M: ready in 12.3 s: 27 programs (25 loaded from cache, 2
compiled), RSS 1.02 GB``); ``/metrics`` has the same figures
(``jaxserve_startup_*``, ``jaxserve_process_resident_memory_bytes``).

Start-up failures are ``ValueError``s naming the flag and its value (the
caller prints ``error: ...`` and exits 2): TLS files missing, unreadable or
not a PEM certificate/key pair (checked with ``ssl`` before gRPC sees them,
since gRPC reports only "failed to bind"); a gRPC or metrics port in use or
refused; a ``--host`` that does not resolve or is not an address of this
machine (gRPC gives no reason, so a plain socket bind of the same address
finds it); a model that fails to load. The gRPC server is stopped before the
error leaves ``run``, so nothing else reaches stderr.

Shutdown (SIGTERM or SIGINT) drains with the port open: health answers
NOT_SERVING and new ``Generate`` calls get UNAVAILABLE ("the server is
shutting down"; other calls still answer), while running requests get
``grace_period_s`` minus 1.5 s to finish. Then every one still running is
aborted: its stream ends at once with a final message (``finish_reason``
"abort", usage and timing so far) and status OK, even while the engine
thread is inside a long step. Only then does the gRPC server stop (refusing
connections), and the process exits 0 (``os._exit``, skipping the slow
interpreter teardown) within the grace period.

With ``--http_port`` the OpenAI-compatible HTTP API (``jaxserve.server.http``)
is served from the same loop and engine: bound with the gRPC port (its line
``jaxserve: HTTP on http://host:port`` comes first), ``/health`` 503 until
the model is served and again while draining, its streams drained, aborted
and closed with the gRPC ones.

Disaggregated roles (``--role prefill|decode``) come in as a ``role`` built
by ``jaxserve.disagg.roles.server_role`` (this package never imports
``jaxserve.disagg``, which builds on it): it registers its gRPC service,
makes the ``AsyncEngine`` and starts its parts once the engine is up; the
server then warms the KV handoff's programs too and compiles every step
shape before SERVING.

Multi-host (``--multihost``, process 0): the engine broadcasts every step to
the other processes (``jaxserve.engine.multihost``). At shutdown process 0
sends them STOP and leaves the job; when a step fails because a process died,
every open stream ends with INTERNAL, the server stops, and the process exits 1.
"""

from __future__ import annotations

import asyncio
import errno
import os
import logging
import signal
import socket
import sys
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.server_config import ServerConfig
from jaxserve.engine import compile_cache, multihost
from jaxserve.metrics import ServingMetrics
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.auth import BearerTokenInterceptor, tls_pair
from jaxserve.server.checks import add_generation_servicer
from jaxserve.server.frontend import Frontend
from jaxserve.server.http import OpenAIServer
from jaxserve.server.servicer import GenerationServicer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # jaxserve.v1.Generation
# Abort what still runs this long before the grace period ends, so the
# abort outputs reach the clients and the process exits in time.
_ABORT_MARGIN_S = 1.0
# Time kept for the process exit itself (flush, os._exit) after the shutdown.
_EXIT_MARGIN_S = 0.5


def _bind_error(host: str, port: int, port_flag: str) -> str | None:
    """Why ``host:port`` cannot be bound, found with a plain socket bind
    (gRPC and the metrics server give no reason, and gRPC logs its own
    failure on stderr, so this runs first); names the flag at fault. None
    when the bind works."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host!r}: cannot resolve it ({e.strerror})"
    error = None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
                sock.bind(addr)
                return None
        except OSError as e:
            error = e
    if error is None:
        return f"--host {host!r}: resolves to no address"
    if error.errno == errno.EADDRINUSE:
        return f"{port_flag} {port}: {host}:{port} is in use by another process"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host!r}: not an address of this machine ({error.strerror})"
    if error.errno == errno.EACCES:
        return f"{port_flag} {port}: cannot bind {host}:{port}: {error.strerror} (ports below " \
               f"1024 need privileges)"
    return f"--host {host!r} {port_flag} {port}: cannot bind: {error.strerror}"


class Server:
    """The gRPC server, its health service and metrics endpoint, around an
    engine that ``load_engine`` builds.

    Args:
      config: ``ServerConfig``.
      load_engine: builds the ``Engine`` (slow: weights and compilation); run
        in a worker thread after the server starts.
      model_name: reported by ``ModelInfo``.
      warmup: compile every step shape the engine can reach
        (``Engine.warmup``), so no request waits on XLA.
      background_warmup: with ``warmup``, health turns SERVING once the
        smallest decode and prefill steps are compiled; the rest compile in
        the background, steps staying within the ready ones meanwhile
        (``Engine.warmup(background=True)``; a multi-host, speculative or
        disaggregated engine compiles all first). A line and ``/metrics`` say when all
        are ready. False: all before SERVING.
      role: a disaggregated worker's role (``jaxserve.disagg.roles.server_role``),
        or None. It has ``add_to_server(grpc_server)``,
        ``async_engine(engine, **kw) -> AsyncEngine`` and
        ``start(async_engine) -> str`` (starts its parts, returns the line
        to print).
    """

    def __init__(self, config: ServerConfig, load_engine: Callable, model_name: str,
                 warmup: bool = True, background_warmup: bool = True, role=None):
        self.config = config
        self.load_engine = load_engine
        self.warmup = warmup
        self.role = role
        # A disaggregated worker warms up whole: KV handed over from a prefill
        # worker joins the running set past the scheduler's admission caps.
        self.background_warmup = warmup and background_warmup and role is None
        self.startup: dict[str, float] = {}  # load_s, warmup_s, warmup_compilations
        self.startup_report: compile_cache.StartupReport | None = None  # set at SERVING
        self.metrics = ServingMetrics()
        self.metrics.export_vllm_names(model_name)  # vllm:* beside jaxserve_*
        self.frontend = Frontend(model_name, config.max_prompt_len)
        self.servicer = GenerationServicer(self.frontend)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else \
            health.HealthServicer()
        self.server: grpc.aio.Server | None = None  # built by ``start``
        self.async_engine: AsyncEngine | None = None
        self.exit_code = 0  # 1 after a fatal multi-host error
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http = OpenAIServer(self.frontend, self.metrics, config) \
            if config.http_port is not None else None
        self._stopping: asyncio.Event | None = None

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            r = self.health.set(name, status)
            if asyncio.iscoroutine(r):
                await r

    async def start(self) -> None:
        """Bind and start serving health (NOT_SERVING) and reflection.

        Raises:
          ValueError: bad TLS files, or the gRPC or metrics port cannot be
            bound (the message names the flag at fault).
        """
        cfg = self.config
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        interceptors = [BearerTokenInterceptor(cfg.auth_token, self.metrics)] \
            if cfg.auth_token else []
        self.server = grpc.aio.server(options=opts, interceptors=interceptors)
        add_generation_servicer(self.servicer, self.server)
        if self.role is not None:
            self.role.add_to_server(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        pair = tls_pair(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
        for port, flag in ((cfg.port, "--port"), (cfg.metrics_port, "--metrics_port"),
                           (cfg.http_port, "--http_port")):
            error = _bind_error(cfg.host, port, flag) if port is not None else None
            if error:
                raise ValueError(error)
        try:
            if pair is not None:
                self.port = self.server.add_secure_port(
                    address, grpc.ssl_server_credentials([pair]))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpc: "Failed to bind to address ..." (taken meanwhile)
            self.port = 0
        if not self.port:
            raise ValueError(_bind_error(cfg.host, cfg.port, "--port") or
                             f"--port {cfg.port}: cannot bind {address}")
        await self.server.start()
        if self.http is not None:
            try:
                port = await self.http.start()
            except OSError as e:
                raise ValueError(_bind_error(cfg.host, cfg.http_port, "--http_port") or
                                 f"--http_port {cfg.http_port}: cannot serve HTTP on "
                                 f"{cfg.host}: {e.strerror or e}") from None
            scheme = "https" if cfg.tls_cert else "http"
            print(f"jaxserve: HTTP on {scheme}://{cfg.host}:{port} (OpenAI API: /v1/completions, "
                  f"/v1/chat/completions, /v1/models, /health, /metrics)", file=sys.stderr,
                  flush=True)
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_http_server(cfg.metrics_port, cfg.host)
            except OSError as e:
                raise ValueError(_bind_error(cfg.host, cfg.metrics_port, "--metrics_port") or
                                 f"--metrics_port {cfg.metrics_port}: cannot serve metrics "
                                 f"on {cfg.host}: {e.strerror or e}") from None
        print(f"jaxserve: gRPC on {cfg.host}:{self.port} ({'TLS' if cfg.tls_cert else 'plaintext'}"
              f"{', bearer token' if cfg.auth_token else ''}); metrics "
              f"{f'on http://{cfg.host}:{self.metrics_port}/metrics' if self.metrics_port else 'off'}"
              f"; loading the model", file=sys.stderr, flush=True)

    async def load(self) -> None:
        """Load the engine in a worker thread, then serve (health SERVING)."""
        t0 = time.monotonic()
        engine = await _in_daemon_thread(self.load_engine)
        self.startup["load_s"] = time.monotonic() - t0
        warm = None  # the warm-up's programs (compile_cache.ProgramCounts)
        if self.warmup:
            buckets = engine.step_buckets()  # (decode, T): decode_step and prefill_step
            rows = [T for d, T in buckets if d]
            tokens = [T for d, T in buckets if not d]
            print(f"jaxserve: compiling {len(buckets)} step shapes (decode_step: rows "
                  f"{rows[0]}..{rows[-1]}; prefill_step: tokens {tokens[0]}..{tokens[-1]}) "
                  + ("the smallest before serving, the rest in the background"
                     if self.background_warmup else "before serving"),
                  file=sys.stderr, flush=True)
            t1, before = time.monotonic(), compile_cache.counts()
            await _in_daemon_thread(lambda: engine.warmup(background=self.background_warmup))
            warm = compile_cache.counts() - before
            if engine.warmup_done.is_set():
                self._warmup_done(engine, len(buckets), t1, before)
            else:  # the line comes when the background thread is done
                def report_when_done(n=len(buckets)):
                    engine.warmup_done.wait()
                    self._warmup_done(engine, n, t1, before)
                threading.Thread(target=report_when_done, name="jaxserve-warmup-report",
                                 daemon=True).start()
        if self.role is not None and self.warmup:  # the handoff's gathers/scatters
            t1 = time.monotonic()
            n = await _in_daemon_thread(engine.warmup_kv_handoff)
            print(f"jaxserve: compiled the KV handoff for {n} page counts in "
                  f"{time.monotonic() - t1:.1f} s", file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        kw = dict(metrics=self.metrics, max_waiting_requests=self.config.max_waiting_requests,
                  stream_limits=self.config.stream_limits(),
                  on_fatal=lambda e: loop.call_soon_threadsafe(self._on_fatal, e))
        self.async_engine = AsyncEngine(engine, **kw) if self.role is None else \
            self.role.async_engine(engine, **kw)
        self.async_engine.start()
        if self.role is not None:
            print(f"jaxserve: {self.role.start(self.async_engine)}", file=sys.stderr, flush=True)
        self.metrics.observe_stats(engine.stats())
        self.frontend.set_engine(self.async_engine)
        await self.frontend.start_tokenizer_pool()  # spawn the tokenizer workers now
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.startup_report = report = compile_cache.StartupReport.now(warm)
        self.metrics.observe_startup(report.ready_s, report.programs.compiled,
                                     report.programs.loaded)
        print(f"jaxserve: serving {self.frontend.model_name}: {report.line()}", file=sys.stderr,
              flush=True)

    def _warmup_done(self, engine, num_buckets: int, t0: float, before) -> None:
        """Report the end of the warm-up: the ``compiled N step shapes`` line
        (its seconds since the warm-up began, split into tracing, lowering,
        compiling and loading) and ``startup`` / ``/metrics``."""
        warm = compile_cache.counts() - before
        self.startup["warmup_s"] = time.monotonic() - t0
        self.startup["warmup_compilations"] = engine.warmup_programs
        self.metrics.observe_warmup_done(self.startup["warmup_s"],
                                         engine.num_compilations)
        error = f"; stopped early: {engine.warmup_error}" if engine.warmup_error else ""
        print(f"jaxserve: compiled {num_buckets} step shapes in {self.startup['warmup_s']:.1f} s "
              f"({engine.warmup_programs} XLA programs traced: {warm.loaded} loaded from cache, "
              f"{warm.compiled} compiled; seconds tracing {warm.trace_s:.1f}, lowering "
              f"{warm.lower_s:.1f}, compiling {warm.compile_s:.1f}, loading {warm.load_s:.1f}; "
              f"persistent cache: {compile_cache.active_dir() or 'off'}){error}",
              file=sys.stderr, flush=True)

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
        """Drain: health NOT_SERVING and new ``Generate`` calls UNAVAILABLE
        with the port still open; let running requests finish until the
        grace period (less a margin) ends, abort the rest, then stop the gRPC
        server. Returns False when the engine thread was still busy (e.g.
        compiling) at the deadline: the caller then exits without waiting
        for it."""
        t0 = time.monotonic()
        # Leave time for the process to exit inside the grace period.
        deadline = t0 + max(0.5, self.config.grace_period_s - _EXIT_MARGIN_S)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.http is not None:
            self.http.draining = True  # /health and new requests: 503
        ae = self.async_engine
        clean = True
        if ae is not None:
            ae.stop_accepting()  # Generate raises ShuttingDownError -> UNAVAILABLE
            while ae.num_in_flight and time.monotonic() < deadline - _ABORT_MARGIN_S:
                await asyncio.sleep(0.05)
            if ae.num_in_flight:
                print(f"jaxserve: grace period over; aborting {ae.num_in_flight} requests",
                      file=sys.stderr, flush=True)
                ae.abort_all()
        # Refuses new RPCs from here; lets the last messages out, cancels any
        # call still open just before the deadline.
        stops = [self.server.stop(max(0.0, deadline - 0.3 - time.monotonic()))]
        if self.http is not None:
            stops.append(self.http.stop(max(0.0, deadline - 0.3 - time.monotonic())))
        await asyncio.gather(*stops)
        if ae is not None:
            clean = await ae.stop(timeout_s=max(0.0, deadline - 0.1 - time.monotonic()))
        self.frontend.close()
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
        try:
            await self.start()
            load = asyncio.create_task(self.load())
            stopping = asyncio.create_task(self._stopping.wait())
            done, _ = await asyncio.wait({load, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if load in done:
                load.result()  # raises a load error (ValueError: a bad model)
                await stopping
            else:
                load.cancel()
        except BaseException:
            # Stop the gRPC server inside the loop: left to the garbage
            # collector it prints "Event loop is closed" tracebacks.
            if self.server is not None:
                await self.server.stop(None)
            if self.http is not None:
                await self.http.stop(1.0)
            raise
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


def serve(config: ServerConfig, load_engine: Callable, model_name: str,
          warmup: bool = True, background_warmup: bool = True, role=None) -> None:
    """Blocking entry point of ``--mode serve`` (``warmup``,
    ``background_warmup`` and ``role`` as in ``Server``).

    Raises:
      ValueError: bad TLS files, an unbindable host or port (gRPC or
        metrics), or a model that fails to load; the message names the flag.
    """
    server = Server(config, load_engine, model_name, warmup, background_warmup, role)
    clean = asyncio.run(server.run())
    ae = server.async_engine
    if ae is not None and clean and server.exit_code == 0 and multihost.in_job():
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
