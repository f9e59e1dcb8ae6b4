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

Multi-host (``--multihost``, process 0): the engine broadcasts every step to
the other processes (``jaxserve.engine.multihost``). At shutdown process 0
sends them STOP and leaves the job; when a step fails because a process died,
every open stream ends with INTERNAL, the server stops, and the process exits 1.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import os
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import ServerConfig
from jaxserve.engine import compile_cache
from jaxserve.metrics import ServingMetrics
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.checks import add_generation_servicer
from jaxserve.server.http import OpenAIServer
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


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot read: {e.strerror}") from None


def _tls_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """Read and check a PEM certificate chain and its private key.

    Returns:
      (key PEM, cert PEM) bytes, as ``grpc.ssl_server_credentials`` takes them.

    Raises:
      ValueError: naming ``--tls_cert`` or ``--tls_key``: unreadable, not PEM,
        an encrypted key, or a key that does not match the certificate.
    """
    cert, key = _read(cert_path, "--tls_cert"), _read(key_path, "--tls_key")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ValueError(f"--tls_cert {cert_path!r}: not a PEM certificate (no "
                         f"'-----BEGIN CERTIFICATE-----' line)")
    if b"PRIVATE KEY-----" not in key:
        raise ValueError(f"--tls_key {key_path!r}: not a PEM private key (no "
                         f"'-----BEGIN ... PRIVATE KEY-----' line)")
    if b"ENCRYPTED" in key:
        raise ValueError(f"--tls_key {key_path!r}: the key is encrypted; gRPC needs it "
                         f"unencrypted")

    def no_password():  # never prompt on the terminal
        raise ValueError(f"--tls_key {key_path!r}: the key is encrypted; gRPC needs it "
                         f"unencrypted")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path,
                                                                password=no_password)
    except ssl.SSLError as e:
        why = "the key does not match the certificate" if e.reason == "KEY_VALUES_MISMATCH" \
            else f"not a valid certificate and private key ({e.reason or e})"
        raise ValueError(f"--tls_cert {cert_path!r} / --tls_key {key_path!r}: {why}") from None
    except OSError as e:  # changed since the read above
        raise ValueError(f"--tls_cert {cert_path!r} / --tls_key {key_path!r}: cannot read: "
                         f"{e.strerror}") from None
    return key, cert


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
    """

    def __init__(self, config: ServerConfig, load_engine: Callable, model_name: str,
                 warmup: bool = True, background_warmup: bool = True):
        self.config = config
        self.load_engine = load_engine
        self.warmup = warmup
        # A disaggregated worker warms up whole: KV handed over from a prefill
        # worker joins the running set past the scheduler's admission caps.
        self.background_warmup = warmup and background_warmup and config.disagg.role == "both"
        self.startup: dict[str, float] = {}  # load_s, warmup_s, warmup_compilations
        self.startup_report: compile_cache.StartupReport | None = None  # set at SERVING
        self.metrics = ServingMetrics()
        self.servicer = GenerationServicer(model_name, config.max_prompt_len)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else \
            health.HealthServicer()
        self.server: grpc.aio.Server | None = None  # built by ``start``
        self.async_engine: AsyncEngine | None = None
        self.exit_code = 0  # 1 after a fatal multi-host error
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http = OpenAIServer(self.servicer, self.metrics, config) \
            if config.http_port is not None else None
        self._stopping: asyncio.Event | None = None
        self.prefill_service = None  # --role prefill: jaxserve.disagg.worker.PrefillService
        if config.disagg.role == "prefill":
            from jaxserve.disagg.worker import PrefillService
            self.prefill_service = PrefillService(lambda: self.async_engine,
                                                  config.disagg.kv_lease_s, config.host)

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
        if self.prefill_service is not None:
            self.prefill_service.add_to_server(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{cfg.host}:{cfg.port}"
        pair = _tls_pair(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
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
        if self.config.disagg.role != "both" and self.warmup:  # the handoff's gathers/scatters
            t1 = time.monotonic()
            n = await _in_daemon_thread(engine.runner.warmup_pages)
            print(f"jaxserve: compiled the KV handoff for {n} page counts in "
                  f"{time.monotonic() - t1:.1f} s", file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        kw = dict(metrics=self.metrics, max_waiting_requests=self.config.max_waiting_requests,
                  on_fatal=lambda e: loop.call_soon_threadsafe(self._on_fatal, e))
        dc = self.config.disagg
        if dc.role == "decode":
            from jaxserve.disagg.router import DecodeEngine
            self.async_engine = DecodeEngine(
                engine, prefill_workers=list(dc.prefill_workers),
                min_prefill_tokens=dc.min_prefill_tokens, max_cached_ratio=dc.max_cached_ratio,
                prefill_timeout_s=dc.prefill_timeout_s, transfer_timeout_s=dc.transfer_timeout_s,
                token=self.config.auth_token, transfer_host=self.config.host, **kw)
        else:
            self.async_engine = AsyncEngine(engine, **kw)
        self.async_engine.start()
        if self.prefill_service is not None:
            self.prefill_service.start()
        if dc.role != "both":
            transfer = (self.prefill_service or self.async_engine).transfer
            print(f"jaxserve: role {dc.role}; KV transfer server on {transfer.address}"
                  + (f"; prefill workers {', '.join(dc.prefill_workers)}"
                     if dc.role == "decode" else f"; lease {dc.kv_lease_s:g} s"),
                  file=sys.stderr, flush=True)
        self.metrics.observe_stats(engine.stats())
        self.servicer.set_engine(self.async_engine)
        if self.servicer.tokenizer_pool is not None:  # spawn the tokenizer workers now
            await asyncio.to_thread(self.servicer.tokenizer_pool.start)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.startup_report = report = compile_cache.StartupReport.now(warm)
        self.metrics.observe_startup(report.ready_s, report.programs.compiled,
                                     report.programs.loaded)
        print(f"jaxserve: serving {self.servicer.model_name}: {report.line()}", file=sys.stderr,
              flush=True)

    def _warmup_done(self, engine, num_buckets: int, t0: float, before) -> None:
        """Report the end of the warm-up: the ``compiled N step shapes`` line
        (its seconds since the warm-up began, split into tracing, lowering,
        compiling and loading) and ``startup`` / ``/metrics``."""
        warm = compile_cache.counts() - before
        self.startup["warmup_s"] = time.monotonic() - t0
        self.startup["warmup_compilations"] = engine.warmup_programs
        self.metrics.observe_warmup_done(self.startup["warmup_s"],
                                         engine.runner.num_compilations)
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
        if self.servicer.tokenizer_pool is not None:
            self.servicer.tokenizer_pool.close()
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
          warmup: bool = True, background_warmup: bool = True) -> None:
    """Blocking entry point of ``--mode serve`` (``warmup`` and
    ``background_warmup`` as in ``Server``).

    Raises:
      ValueError: bad TLS files, an unbindable host or port (gRPC or
        metrics), or a model that fails to load; the message names the flag.
    """
    server = Server(config, load_engine, model_name, warmup, background_warmup)
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
