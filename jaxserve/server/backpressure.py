"""Backpressure for streams nobody reads.

Each request's outputs travel from the engine thread to its consumer (the
HTTP SSE generator or the gRPC handler) through an asyncio queue
(``jaxserve.server.async_engine``). A client that stops reading stops its
consumer: Starlette's ``StreamingResponse`` awaits uvicorn's ``send``, which
waits for the socket to drain once the kernel's send buffer is full; a
``grpc.aio`` handler's ``yield`` waits once the HTTP/2 flow-control window is
spent. Without a rule the engine goes on stepping the request, the queue
grows by one ``RequestOutput`` per step (with ``n`` choices and their
``logprobs``), and the request holds its slots and pages until
``max_tokens``, so a few silent clients can hold every slot while others wait.

The rule (``StreamLimits``), checked by a watch every ``check_interval_s``:

- **Paused**: output has waited unread for ``pause_after_s`` (1 s by
  default), or more than a quarter of ``buffer_outputs`` outputs wait (a
  consumer that reads, but slower than the engine writes): the request's
  sequences are set aside (``Engine.pause``: running
  ones preempted, their pages freed, their tokens kept), so its slots and
  pages serve clients that read. When the consumer has taken everything
  queued, the request is resumed (``Engine.resume``): first in the queue,
  prefilled again from its prompt and outputs so far (prefix-cache pages it
  still finds are reused), and its tokens are those it would have had
  (greedy is unchanged; a seeded sample too, its key being per position).
  This is TCP's flow control carried into the scheduler: a slow reader is
  served at the speed it reads.
- **Stalled**: output has waited while the consumer took nothing for
  ``stall_timeout_s`` seconds (30 by default): the request is aborted, paused
  or not; a client that went away for good is not kept for ever.
- **Buffer full**: more than ``buffer_outputs`` outputs wait unread: the
  request is aborted at once (a paused request adds at most the output of
  the step in flight when it paused, so this bounds a request that pausing
  is off for).

An aborted stream's queued outputs are dropped at once, and so is everything
the engine sends it afterwards; the engine frees its pages before its next
step, as for a client cancel, and on the watch's next tick glibc's
``malloc_trim`` hands the freed heap back to the OS (freed small objects
otherwise keep RSS up). The consumer, when it runs again, sees
``StreamBackpressure`` (a ``StreamAborted``): the SSE stream ends with
``finish_reason`` "abort" and ``[DONE]``, the gRPC stream with its aborted
response. A cut logs one warning naming the request, the reason, how long it
went unread and how many outputs were buffered; a pause and a resume log at
info. ``jaxserve_stream_backpressure_total`` counts each by ``action`` and
``reason`` (paused/unread, resumed/read, aborted/stalled,
aborted/buffer_full); ``jaxserve_num_requests_paused`` is the sequences
paused now.

Elsewhere: vLLM and SGLang have no bound. vLLM v1 merges a slow consumer's
outputs into one growing output per request (``RequestOutputCollector``) and
relies on the disconnect to abort; SGLang queues every chunk. Both leave a
silent client's request running to its end, holding its batch slot.
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
    thread only. A stream is a ``request_stream.StreamState``: ``outputs`` (its
    ``asyncio.Queue``), ``unread_since`` (monotonic s; None when nothing
    waits), ``paused``, ``dropped``, ``done``, ``label`` and ``engine_id``.

    Args:
      limits: the bounds.
      metrics: a ``ServingMetrics`` (``stream_backpressure`` is counted).
      abort: aborts a stream's request in the engine (``AsyncEngine.abort``).
      error: the exception class the consumer gets (``StreamBackpressure``).
      pause, resume: set a stream's request aside in the engine and schedule
        it again (``AsyncEngine.pause`` / ``resume``); None: pausing is off.
    """

    def __init__(self, limits: StreamLimits, metrics, abort: Callable, error: type,
                 pause: Callable | None = None, resume: Callable | None = None):
        self.limits = limits
        self.metrics = metrics
        self._abort = abort
        self._error = error
        self._pause = pause if limits.pause_after_s is not None else None
        self._resume = resume
        self._trim = False  # a cut freed outputs: hand the heap back on the next tick

    def deliver(self, stream, item) -> None:
        """Queue an output from the engine thread; pause the request when more
        than a quarter of ``buffer_outputs`` wait, abort it when more than
        ``buffer_outputs`` do. A dropped stream's outputs are discarded."""
        if stream.dropped:
            return
        stream.outputs.put_nowait(item)
        if stream.unread_since is None:
            stream.unread_since = time.monotonic()
        waiting = stream.outputs.qsize()
        if waiting > self.limits.buffer_outputs:
            self.cut(stream, "buffer_full", time.monotonic())
        elif waiting > self.limits.buffer_outputs // 4 and not stream.paused:
            self.pause(stream, time.monotonic())

    def read(self, stream) -> None:
        """The consumer took an output: the stall clock restarts if more wait;
        a paused stream whose queue is now empty is resumed."""
        if not stream.outputs.empty():
            stream.unread_since = time.monotonic()
            return
        stream.unread_since = None
        if stream.paused and not (stream.dropped or stream.done):
            stream.paused = False
            self._resume(stream)
            self.metrics.stream_backpressure.labels("resumed", "read").inc()
            log.info("stream backpressure: request %s (engine %s) resumed: its client read",
                     stream.label or "?", stream.engine_id)

    @staticmethod
    def drop(stream) -> None:
        """The consumer closed the stream: free what waits, discard what comes."""
        stream.dropped = True
        stream.unread_since = None
        drop_pending(stream.outputs)

    def pause(self, stream, now: float) -> None:
        """Set a stream's request aside until its client has read everything
        queued (``read``)."""
        if stream.paused or stream.dropped or stream.done or self._pause is None:
            return
        stream.paused = True
        self._pause(stream)
        self.metrics.stream_backpressure.labels("paused", "unread").inc()
        log.info("stream backpressure: request %s (engine %s) paused: unread %.1f s, "
                 "%d outputs buffered", stream.label or "?", stream.engine_id,
                 now - (stream.unread_since or now), stream.outputs.qsize())

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
                    "%d outputs buffered%s", stream.label or "?", stream.engine_id, reason,
                    unread_s, buffered, " (paused)" if stream.paused else "")

    async def watch(self, open_streams: Callable[[], Iterable]) -> None:
        """Every ``check_interval_s``: cut each stream of ``open_streams()``
        whose output waited unread past ``stall_timeout_s``, pause each past
        ``pause_after_s``; runs until cancelled."""
        stall, pause_after = self.limits.stall_timeout_s, self.limits.pause_after_s
        while True:
            await asyncio.sleep(self.limits.check_interval_s)
            if self._trim:  # the last tick's cuts freed their outputs by now
                self._trim = False
                # On a worker thread (ctypes drops the GIL): in a process of a
                # few GB, malloc_trim walks the heap for up to a second or
                # more, and on the loop that stall made healthy readers look
                # unread (their outputs waited the whole trim) and got them cut.
                await asyncio.to_thread(malloc_trim)
            now = time.monotonic()
            for s in open_streams():
                if s.unread_since is None:
                    continue
                unread = now - s.unread_since
                if stall is not None and unread > stall:
                    self.cut(s, "stalled", now)
                elif pause_after is not None and unread > pause_after:
                    self.pause(s, now)


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
