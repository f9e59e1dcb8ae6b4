"""One request's stream as the server sees it: the asyncio side of a request
(``StreamState``), the async iterator a handler reads (``RequestStream``), and
the errors a stream or a submit ends with. ``jaxserve.server.async_engine``
makes them; the handlers read them.
"""

from __future__ import annotations

import asyncio
import dataclasses

from jaxserve.engine.request import RequestOutput


class QueueFullError(Exception):
    """The waiting queue holds ``max_waiting_requests`` already."""


class EngineError(Exception):
    """The engine failed while running this request."""


class ShuttingDownError(Exception):
    """The server stopped accepting requests."""


class StreamAborted(Exception):
    """``abort_all`` ended this stream (shutdown); the engine frees the
    request before its next step."""


class StreamBackpressure(StreamAborted):
    """The stream's consumer stopped reading (``jaxserve.server.backpressure``):
    its request was aborted and its queued outputs dropped."""


@dataclasses.dataclass(eq=False)
class StreamState:
    """The asyncio side of one request."""

    engine_id: str
    outputs: asyncio.Queue
    cancel_step: int | None = None
    done: bool = False
    first_token_seen: bool = False
    last_token_time: dict = dataclasses.field(default_factory=dict)  # choice -> monotonic s
    label: str = ""  # the API's request id, for the log
    unread_since: float | None = None  # monotonic s: output waits since (last read or put)
    dropped: bool = False  # closed or aborted: outputs from the engine are discarded
    paused: bool = False  # set aside in the engine until the consumer reads


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s (from
    ``AsyncEngine.generate``). ``aclose()`` ends it and aborts the request
    if it has not finished; it is idempotent.

    Raises (from iteration):
      EngineError: the engine failed while running the request.
      StreamAborted: ``abort_all`` ended it (shutdown).
    """

    def __init__(self, engine, stream: StreamState, guard):
        self._engine = engine  # the AsyncEngine: num_in_flight, close_stream, abort
        self._stream = stream
        self._guard = guard  # its StreamGuard (jaxserve.server.backpressure)
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    @property
    def engine_id(self) -> str:
        """The request's id inside the engine (``Engine`` methods take it)."""
        return self._stream.engine_id

    def set_request_id(self, request_id: str) -> None:
        """The API's request id, for the backpressure log line."""
        self._stream.label = request_id

    async def __anext__(self) -> RequestOutput:
        if self._stream.done or self._closed:
            raise StopAsyncIteration
        item = await self._stream.outputs.get()
        self._guard.read(self._stream)
        if isinstance(item, BaseException):
            self._stream.done = True  # the engine dropped it (or abort_all will)
            raise item
        if item.finished:
            self._stream.done = True
        return item

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.num_in_flight -= 1
        self._engine.close_stream(self._stream)
        self._guard.drop(self._stream)  # what is queued or still comes is garbage
        if not self._stream.done:
            self._engine.abort(self._stream)
