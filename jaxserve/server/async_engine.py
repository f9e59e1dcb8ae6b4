"""The engine loop behind the gRPC server: one thread steps the engine,
asyncio coroutines submit requests and read their outputs.

Threads and queues (JetStream's orchestrator, reduced to one loop):

  asyncio thread (gRPC handlers)            engine thread (owns the Engine)
  ------------------------------            -------------------------------
  submit(): validate, put ("add", ...) ───▶ drains the command queue before
  on the command queue, await the add's       every step: add_request (its
  future (ValueError comes back here)         ValueError goes back through the
  abort(): put ("abort", id, step)  ──────▶   future) and abort
  stream: async-iterate an asyncio.Queue ◀── step(); each RequestOutput is
                                              handed to its request's asyncio
                                              queue with call_soon_threadsafe

No other thread touches the ``Engine``, except its LoRA registry
(``add_lora`` / ``remove_lora`` / ``list_loras``: thread-safe; a folder is
parsed on a worker thread, its slot written by the engine thread when a
request first needs it). An abort queued while a step runs is
applied before the next step starts, so a cancelled request stops within one
step (``jaxserve_abort_delay_steps`` records the gap). Engine request ids are
internal (``s<counter>``), so a client may reuse its own id at once.

If ``step()`` raises, every in-flight request is aborted and its stream ends
with ``EngineError``; the loop goes on serving new requests (the failure
counter records it). Requests arrive in the engine only through
``add_request``, whose checks raise ``ValueError`` for anything bad, so a
request cannot stop the loop.

Each stream's queue is bounded: a stream nobody reads is paused (its
request set aside in the engine until the client reads) and, if it stays
unread, aborted (``StreamBackpressure``; the rule is in
``jaxserve.server.backpressure``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import jax

from jaxserve.engine.engine import Engine
from jaxserve.engine.multihost import MultihostError
from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.metrics import ServingMetrics
from jaxserve.server.backpressure import StreamGuard, StreamLimits
from jaxserve.server.request_stream import (EngineError, QueueFullError, RequestStream,
                                            ShuttingDownError, StreamAborted, StreamBackpressure,
                                            StreamState)

log = logging.getLogger(__name__)


class AsyncEngine:
    """Serve an ``Engine`` to asyncio code.

    Args:
      engine: the engine; from ``start`` on, only the engine thread uses it.
      metrics: where to record; a fresh ``ServingMetrics`` by default.
      max_waiting_requests: bound on sequences that cannot start: those
        submitted or waiting in the engine beyond the running slots still
        free (``max_num_seqs`` less the sequences running after the last
        step). ``generate`` raises ``QueueFullError`` beyond it, so a burst
        into an idle engine is admitted up to its free slots plus this bound.
      on_fatal: called (from the engine thread) with the ``MultihostError``
        of a multi-host job that can no longer step; the engine thread has
        then ended every stream with ``EngineError`` and stopped, and
        ``fatal_error`` holds the error. (A failed step of a one-process
        engine is not fatal: its requests fail, the loop goes on.)
      stream_limits: each stream's output bound and stall timeout
        (``StreamLimits``; its defaults when None).
    """

    def __init__(self, engine: Engine, *, metrics: ServingMetrics | None = None,
                 max_waiting_requests: int = 256,
                 on_fatal: Callable[[Exception], None] | None = None,
                 stream_limits: StreamLimits | None = None):
        self.engine = engine
        self.stream_limits = stream_limits if stream_limits is not None else StreamLimits()
        self.on_fatal = on_fatal
        self.fatal_error: Exception | None = None
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, StreamState] = {}  # engine id -> stream (engine thread's view)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._accepting = True
        # Counters shared across threads; each has one writer.
        self._submitted = 0        # asyncio thread: sequences put on the command queue
        self._drained = 0          # engine thread: sequences taken off it
        self._engine_waiting = 0   # engine thread: Engine.num_waiting after the last step
        self._engine_running = 0   # engine thread: Engine.num_running after the last step
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self.num_steps = 0         # engine thread: steps run
        self.num_in_flight = 0     # asyncio thread: streams not yet finished
        self._open: set[StreamState] = set()  # asyncio thread: those streams
        self._adding: set[asyncio.Future] = set()  # asyncio thread: adds not yet applied
        self._watch: asyncio.Task | None = None
        self._guard = StreamGuard(self.stream_limits, self.metrics, self.abort,
                                  StreamBackpressure, self.pause, self.resume)

    # ---- asyncio side -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will submit."""
        self._loop = asyncio.get_running_loop()
        lora = self.engine.lora_stats()
        if lora is not None:  # the LoRA figures exist from the start
            self.metrics.observe_lora(lora, self.max_loras)
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        if self.stream_limits.watched:
            self._watch = asyncio.ensure_future(self._guard.watch(lambda: list(self._open)))

    @property
    def num_waiting(self) -> int:
        """Sequences that cannot start now: submitted or waiting in the engine,
        beyond the running slots still free."""
        pending = self._submitted - self._drained + self._engine_waiting
        return max(0, pending - (self.max_num_seqs - self._engine_running))

    @property
    def num_running(self) -> int:
        """Sequences running in the engine after its last step."""
        return self._engine_running

    @property
    def accepting(self) -> bool:
        """False once ``stop_accepting`` ran (shutdown)."""
        return self._accepting

    # Read-only facts of the engine, fixed once it is built, so the asyncio
    # thread may read them while the engine thread steps.

    @property
    def tokenizer(self):
        """The model's tokenizer, or None (prompts must be token ids)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest sequence, prompt and output, tokens."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds (pages x page size)."""
        return self.engine.num_pages * self.engine.page_size

    def model_info(self) -> dict:
        """The served model and engine as ``ModelInfoResponse`` fields
        (all but ``name`` and ``max_prompt_len``, which the server knows)."""
        e = self.engine
        return dict(architecture=e.model_config.architecture, max_model_len=e.max_model_len,
                    dtype=e.config.dtype, kv_cache_dtype=str(e.kv_dtype),
                    mesh=dict(e.mesh.shape), backend=jax.default_backend(),
                    num_devices=len(e.devices), vocab_size=e.model_config.vocab_size,
                    page_size=e.page_size, num_pages=e.num_pages,
                    attention_impl=e.attention_impl)

    def check_queue(self, params: SamplingParams) -> None:
        """Raises ``QueueFullError`` if, with ``params.n`` more sequences,
        more than ``max_waiting_requests`` could not start (beyond the free
        running slots); ``ShuttingDownError`` after ``stop_accepting``."""
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down")
        pending = self._submitted - self._drained + self._engine_waiting + params.n
        if pending - (self.max_num_seqs - self._engine_running) > self.max_waiting_requests:
            raise QueueFullError(f"{self.num_waiting} sequences cannot start yet "
                                 f"(max_waiting_requests={self.max_waiting_requests})")

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None,
                       hold_kv: bool = False, lora: str | None = None) -> "RequestStream":
        """Queue a request and return a ``RequestStream`` of its outputs; the
        last one has ``finished`` True. The caller must ``aclose()`` it
        (in a ``finally``): closing it before the end aborts the request.

        Args:
          prompt_ids: the prompt's token ids.
          params: sampling parameters.
          arrival_time: ``time.monotonic()`` when the request arrived (the
            gRPC handler's start), so queue time and TTFT include the wait for
            the engine thread; default now.
          hold_kv: keep the pages when it finishes (``Engine.add_request``;
            a prefill worker's requests). The engine id is the stream's
            ``engine_id``.
          lora: the LoRA adapter's name (``Engine.add_request``'s ``lora``);
            None: the base model. Counted in ``jaxserve_lora_requests_total``.

        A request with a token mask (structured outputs, allowed_token_ids,
        bad_words) has its constraints built on a worker thread first
        (``Engine.build_constraints``: grammar compiles are cached by spec),
        so the engine thread never waits on a grammar compile.

        Raises (before any output):
          ValueError: from ``Engine.add_request``'s checks or the grammar
            backend (a server checks requests before:
            ``jaxserve.server.frontend``).
          UnknownAdapterError: ``lora`` names no adapter (unloaded since the
            front end checked it).
          StreamAborted: ``abort_all`` ran before the engine thread took it.
          QueueFullError: too many sequences cannot start (``check_queue``).
          ShuttingDownError: after ``stop_accepting``.
        """
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        constraints = None
        if params.has_token_mask:  # a grammar compile never runs on the engine thread
            self.check_queue(params)
            constraints = await asyncio.to_thread(self.engine.build_constraints, params)
        stream = await self._submit(params, lambda engine, engine_id: engine.add_request(
            engine_id, prompt_ids, params, arrival_time=arrival, hold_kv=hold_kv,
            constraints=constraints, lora=lora))
        if lora is not None:
            self.metrics.lora_requests.labels(lora).inc()
        return stream

    # ---- LoRA adapters: the registry is thread-safe (``Engine.add_lora`` and the rest), so
    # these run on the asyncio thread or a worker thread, never the engine's.

    @property
    def max_loras(self) -> int | None:
        """Adapter slots on the device; None when LoRA is off."""
        lora = self.engine.config.lora
        return None if lora is None else lora.max_loras

    def lora_adapters(self) -> dict[str, str]:
        """Every registered adapter's name -> its PEFT folder ({} when off)."""
        return self.engine.lora_paths()

    async def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT folder ``path`` as adapter ``name``; the folder is
        read and checked on a worker thread (``Engine.add_lora``).

        Raises:
          ValueError: LoRA off, a taken or bad name, a folder the model cannot
            take (naming the file and field).
        """
        await asyncio.to_thread(self.engine.add_lora, name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister adapter ``name``; its running requests finish with it.

        Raises:
          UnknownAdapterError: no adapter of that name (or LoRA off).
        """
        self.engine.remove_lora(name)

    async def _submit(self, params: SamplingParams, add) -> "RequestStream":
        """Queue ``add(engine, engine_id)`` (an ``Engine`` method that starts
        the request; its ``ValueError`` comes back here) for the engine
        thread; returns the request's stream (see ``generate``)."""
        self.check_queue(params)
        engine_id = f"s{next(self._ids)}"
        stream = StreamState(engine_id, asyncio.Queue())
        added = self._loop.create_future()
        self._submitted += params.n
        self._commands.put(("add", engine_id, params.n, add, stream, added))
        self._adding.add(added)
        try:
            await added  # raises ValueError from add_request
        except (asyncio.CancelledError, StreamAborted):
            self.abort(stream)  # applied after the add: commands run in order
            raise
        finally:
            self._adding.discard(added)
        self.num_in_flight += 1
        self._open.add(stream)
        return RequestStream(self, stream, self._guard)

    async def call(self, fn: Callable[[Engine], object]):
        """``fn(engine)`` run on the engine thread between steps; returns its
        result or raises its exception. For short engine-state work (the KV
        handoff's page lookups, exports and releases)."""
        fut = self._loop.create_future()
        self._commands.put(("call", fn, fut))
        return await fut

    def abort(self, stream: StreamState) -> None:
        """Abort a stream's request in the engine before its next step
        (thread-safe; a finished request is left alone)."""
        stream.cancel_step = self.num_steps
        self._commands.put(("abort", stream))

    def pause(self, stream: StreamState) -> None:
        """Set a stream's request aside in the engine before its next step
        (``Engine.pause``; thread-safe)."""
        self._commands.put(("pause", stream))

    def resume(self, stream: StreamState) -> None:
        """Schedule a paused stream's request again (``Engine.resume``;
        thread-safe)."""
        self._commands.put(("resume", stream))

    def close_stream(self, stream: StreamState) -> None:
        """A stream its consumer closed (asyncio thread): no longer open."""
        self._open.discard(stream)

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown after the grace period).

        Each open stream ends at once with ``StreamAborted`` (even while the
        engine thread is inside a long step), and so does each ``generate``
        still waiting for the engine thread to take its request; the engine
        frees the requests before its next step. Call from the event loop's
        thread."""
        for added in list(self._adding):
            _set_exception(added, StreamAborted("aborted: the server is shutting down"))
        self._commands.put(("abort_all",))
        for stream in self._open:
            if not stream.done:
                stream.outputs.put_nowait(StreamAborted("aborted: the server is shutting down"))
                stream.dropped = True

    def stop_accepting(self) -> None:
        self._accepting = False

    async def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the engine thread after its current step; returns False if it
        is still running after ``timeout_s`` seconds."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._watch is not None:
            self._watch.cancel()
        if self._thread is None:
            return True
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        while self._thread.is_alive() and (t_end is None or time.monotonic() < t_end):
            await asyncio.sleep(0.02)
        return not self._thread.is_alive()

    # ---- engine thread ------------------------------------------------------

    def _post(self, stream: StreamState, item) -> None:
        self._loop.call_soon_threadsafe(self._guard.deliver, stream, item)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        kind = cmd[0]
        engine = self.engine
        if kind == "add":
            _, engine_id, n, add, stream, added = cmd
            if self.fatal_error is not None:  # the engine thread has stopped for good
                self._drained += n
                self._loop.call_soon_threadsafe(_set_exception, added, ShuttingDownError(
                    f"the engine stopped: {self.fatal_error}"))
                return
            try:
                add(engine, engine_id)
            except ValueError as e:
                self._drained += n
                self._loop.call_soon_threadsafe(_set_exception, added, e)
                return
            # Counted as waiting in the engine before it stops counting as
            # submitted, so ``num_waiting`` never misses it between steps.
            self._engine_waiting = engine.num_waiting
            self._engine_running = engine.num_running
            self._drained += n
            self._streams[engine_id] = stream
            self._loop.call_soon_threadsafe(_set_result, added, None)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                result = fn(engine)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                self._loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)
            self._engine_running = engine.num_running
            self.metrics.observe_stats(engine.stats(), self._submitted - self._drained)
        elif kind == "abort":
            stream = cmd[1]
            if stream.engine_id in self._streams:
                engine.abort(stream.engine_id)
                self.metrics.abort_delay.observe(max(0, self.num_steps - stream.cancel_step))
        elif kind in ("pause", "resume"):
            stream = cmd[1]
            if stream.engine_id in self._streams:
                getattr(engine, kind)(stream.engine_id)
                self._engine_waiting = engine.num_waiting
                self._engine_running = engine.num_running
                self.metrics.observe_stats(engine.stats(), self._submitted - self._drained)
        elif kind == "abort_all":
            engine.abort(list(self._streams))

    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        finally:
            self._drain(block=False)  # aborts queued at shutdown still free their pages

    def _loop_until_stopped(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain(block=not engine.has_unfinished_requests())
            if self._stop.is_set():
                break
            if not engine.has_unfinished_requests():
                continue
            try:
                outs = engine.step()
            except MultihostError as e:  # the processes cannot agree any more: stop serving
                log.error("multi-host step failed; failing %d requests and stopping: %s",
                          len(self._streams), e)
                self._accepting = False
                self.fatal_error = e
                streams, self._streams = list(self._streams.values()), {}
                for s in streams:
                    self.metrics.failed.inc()
                    self._post(s, EngineError(f"engine step failed: {e}"))
                if self.on_fatal is not None:
                    self.on_fatal(e)
                return
            except Exception as e:  # noqa: BLE001 - the loop must survive a failed step
                log.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(e)
                continue
            self.num_steps += 1
            now = time.monotonic()
            for out in outs:
                self._dispatch(out, now)
            self._engine_waiting = engine.num_waiting
            self._engine_running = engine.num_running
            self.metrics.observe_stats(engine.stats(), self._submitted - self._drained)
            lora = engine.lora_stats()
            if lora is not None:
                self.metrics.observe_lora(lora, self.max_loras)

    def _dispatch(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        m = self.metrics
        for c in out.outputs:
            if c.delta_token_ids:
                last = stream.last_token_time.get(c.index)
                if last is not None:
                    m.itl.observe(now - last)
                stream.last_token_time[c.index] = now
        if not stream.first_token_seen and out.metrics.ttft_ms is not None:
            stream.first_token_seen = True
            m.ttft.observe(out.metrics.ttft_ms / 1e3)
        if out.finished:
            del self._streams[out.request_id]
            m.observe_finished(out)
        self._post(stream, out)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = list(self._streams.values()), {}
        try:
            self.engine.abort([s.engine_id for s in streams])
            self.engine.step()  # collects the abort outputs; frees nothing more
        except Exception:  # noqa: BLE001
            log.exception("aborting after a failed step failed too")
        for s in streams:
            self.metrics.failed.inc()
            self._post(s, EngineError(f"engine step failed: {type(error).__name__}: {error}"))


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
