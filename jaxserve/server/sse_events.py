"""A streamed API request's server-sent events, from its engine outputs.

``sse_events`` is the one loop both streamed routes of ``jaxserve.server.http``
run (completions and chat, with or without tools): what each output adds
comes from the route's ``on_output``; shutdown, engine failures, the usage
chunk and ``[DONE]`` are handled here the same way for all.
"""

from __future__ import annotations

from jaxserve.engine.request import RequestOutput
from jaxserve.server import openai_protocol as oai
from jaxserve.server.request_stream import EngineError, StreamAborted
from jaxserve.server.frontend import Job


async def sse_events(job: Job, req, head: dict, on_output, aborted_chunk,
                     first: tuple[str, ...] = ()):
    """A stream's SSE events: ``first``, then ``on_output(prompt index,
    output, finished choice indices)``'s chunks for each output; at
    shutdown ``aborted_chunk(index)`` for every unfinished choice, on an
    engine failure an error event; the usage chunk if asked; ``[DONE]``."""
    last: list[RequestOutput | None] = [None] * len(job.streams)
    finished: set[int] = set()
    outputs = job.outputs()
    for event in first:
        yield event
    try:
        async for i, out in outputs:
            last[i] = out
            for event in on_output(i, out, finished):
                yield event
    except StreamAborted:
        for idx in range(len(job.streams) * job.n):
            if idx not in finished:
                yield aborted_chunk(idx)
    except EngineError as e:
        yield oai.sse(oai.APIError(500, str(e)).body())
        yield oai.DONE
        return
    finally:
        await outputs.aclose()
    if req.include_usage:
        yield oai.sse({**head, "choices": [], "usage": oai.usage_of(job.prompt_ids, last)})
    yield oai.DONE


__all__ = ["sse_events"]
