"""Backpressure for streams nobody reads.

Each request's outputs travel from the engine thread to its consumer (the
HTTP SSE generator or the gRPC handler) through an asyncio queue
(``jaxserve.server.async_engine``). A client that stops reading stops its
consumer: Starlette's ``StreamingResponse`` awaits uvicorn's ``send``, which
waits for the socket to drain once the kernel's send buffer is full; a
``grpc.aio`` handler's ``yield`` waits once the HTTP/2 flow-control window is
spent. The engine goes on stepping the request, so without a bound the queue
grows by one ``RequestOutput`` per step (with ``n`` choices and their
``logprobs``) and the request holds its slots and pages until ``max_tokens``.

The rule (``StreamLimits``):

- **Stalled**: output has waited in the queue and the consumer has taken
  nothing for ``stall_timeout_s`` seconds: the request is aborted.
- **Buffer full**: more than ``buffer_outputs`` outputs wait unread: the
  request is aborted at once (a consumer that keeps up holds at most a few;
  one step adds one output per engine request).

An aborted stream's queued outputs are dropped at once, and so is everything
the engine sends it afterwards; the engine frees its pages before its next
step, as for a client cancel, and on the stall watch's next tick glibc's
``malloc_trim`` hands the freed heap back to the OS (freed small objects
otherwise keep RSS up). The consumer, when it runs again, sees
``StreamBackpressure`` (a ``StreamAborted``): the SSE stream ends with
``finish_reason`` "abort" and ``[DONE]``, the gRPC stream with its aborted
response. One log line names the request, the reason, how long it went unread
and how many outputs were buffered; ``jaxserve_stream_backpressure_total``
counts it by ``action`` ("aborted") and ``reason`` ("stalled",
"buffer_full").

Why abort, not pause: pausing (preempting the sequences and resuming them
when the client reads) keeps the request alive at the price of a recompute,
but it also keeps a client that went away for good admitted for ever, and
the engine has no held state for it. vLLM and SGLang have no bound at all:
vLLM v1 merges a slow consumer's outputs into one growing output per request
(``RequestOutputCollector``) and relies on the disconnect to abort; SGLang
queues every chunk. Both leave a silent client's request running to its end.
A client that reads slower than generation but does read keeps its stream:
each read resets the stall clock, and with ``buffer_outputs`` at its default
a reader may fall 256 steps behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from typing import Callable, Iterable

from jaxserve.server_config import StreamLimits

log = logging.getLogger(__name__)


class StreamGuard:
    """Applies ``StreamLimits`` to an ``AsyncEngine``'s streams; asyncio
    thread only. A stream is the engine's ``_Stream``: ``outputs`` (its
    ``asyncio.Queue``), ``unread_since`` (monotonic s; None when nothing
    waits), ``dropped``, ``done``, ``label`` and ``engine_id``.

    Args:
      limits: the bounds.
      metrics: a ``ServingMetrics`` (``stream_backpressure`` is counted).
      abort: aborts a stream's request in the engine (``AsyncEngine.abort``).
      error: the exception class the consumer gets (``StreamBackpressure``).
    """

    def __init__(self, limits: StreamLimits, metrics, abort: Callable, error: type):
        self.limits = limits
        self.metrics = metrics
        self._abort = abort
        self._error = error
        self._trim = False  # a cut freed outputs: hand the heap back on the next tick

    def deliver(self, stream, item) -> None:
        """Queue an output from the engine thread; abort the request when more
        than ``buffer_outputs`` wait. A dropped stream's outputs are discarded."""
        if stream.dropped:
            return
        stream.outputs.put_nowait(item)
        if stream.unread_since is None:
            stream.unread_since = time.monotonic()
        if stream.outputs.qsize() > self.limits.buffer_outputs:
            self.cut(stream, "buffer_full", time.monotonic())

    @staticmethod
    def read(stream) -> None:
        """The consumer took an output: the stall clock restarts if more wait."""
        stream.unread_since = None if stream.outputs.empty() else time.monotonic()

    @staticmethod
    def drop(stream) -> None:
        """The consumer closed the stream: free what waits, discard what comes."""
        stream.dropped = True
        stream.unread_since = None
        drop_pending(stream.outputs)

    def cut(self, stream, reason: str, now: float) -> None:
        """Abort a stream nobody reads: drop its queued outputs, hand the
        consumer the error, log one line, count it."""
        if stream.dropped or stream.done:
            return
        unread_s = now - (stream.unread_since or now)
        buffered = drop_pending(stream.outputs)
        stream.dropped = True
        stream.unread_since = None
        self._abort(stream)
        stream.outputs.put_nowait(self._error(
            f"aborted: the client read nothing for {unread_s:.1f} s ({reason})"))
        self._trim = True
        self.metrics.stream_backpressure.labels("aborted", reason).inc()
        log.warning("stream backpressure: request %s (engine %s) aborted: %s, unread %.1f s, "
                    "%d outputs buffered", stream.label or "?", stream.engine_id, reason,
                    unread_s, buffered)

    async def watch(self, open_streams: Callable[[], Iterable]) -> None:
        """Cut every stream of ``open_streams()`` whose output waited unread
        past ``stall_timeout_s``; runs until cancelled."""
        timeout = self.limits.stall_timeout_s
        while True:
            await asyncio.sleep(self.limits.check_interval_s)
            if self._trim:  # the last tick's cuts freed their outputs by now
                self._trim = False
                malloc_trim()
            now = time.monotonic()
            for s in open_streams():
                if s.unread_since is not None and now - s.unread_since > timeout:
                    self.cut(s, "stalled", now)


_LIBC = ctypes.util.find_library("c")


def malloc_trim() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``), so
    a cut stream's dropped outputs leave RSS; a no-op without glibc."""
    try:
        ctypes.CDLL(_LIBC).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def drop_pending(q) -> int:
    """Empty an ``asyncio.Queue`` without waiting; returns how many items it held."""
    n = 0
    while not q.empty():
        q.get_nowait()
        n += 1
    return n


__all__ = ["StreamGuard", "StreamLimits", "drop_pending"]
