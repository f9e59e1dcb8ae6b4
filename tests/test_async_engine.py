"""``AsyncEngine`` (the server's engine loop) in-process on the tiny model:
a failing step ends the in-flight streams with ``EngineError`` and the loop
keeps serving; bad requests come back as ``ValueError`` without reaching a
step; the waiting queue is bounded."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve import SamplingParams
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.request_stream import EngineError, QueueFullError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def _collect(ae: AsyncEngine, ids, params=GREEDY):
    stream = await ae.generate(ids, params)
    try:
        return [out async for out in stream]
    finally:
        await stream.aclose()


def test_failed_step_fails_in_flight_requests_and_loop_survives(make_tiny_llm):
    llm = make_tiny_llm()
    engine = llm.engine
    want = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step of the run below
            raise RuntimeError("injected device fault")
        return real_launch(*a, **kw)

    async def run():
        ae = AsyncEngine(engine)
        ae.start()
        engine.runner.launch = flaky
        try:
            with pytest.raises(EngineError, match="injected device fault"):
                await _collect(ae, [5, 6, 7])
            assert ae.metrics.failed._value.get() == 1
            # The loop is alive and the engine healthy: the next request runs.
            outs = await _collect(ae, [5, 6, 7])
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await ae.generate([5, 10**6], GREEDY)
            return outs
        finally:
            await ae.stop()

    outs = asyncio.run(asyncio.wait_for(run(), 120))  # fail, not hang
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
    assert engine.num_free_pages == engine.num_pages
    assert not engine.has_unfinished_requests()


def test_waiting_queue_is_bounded(make_tiny_llm):
    llm = make_tiny_llm(max_num_seqs=1)

    async def run():
        ae = AsyncEngine(llm.engine, max_waiting_requests=2)
        ae.start()
        try:
            # Nothing has been drained yet when these are submitted together.
            results = await asyncio.gather(
                *(_collect(ae, [5 + i, 6], GREEDY) for i in range(5)), return_exceptions=True)
        finally:
            await ae.stop()
        return results

    results = asyncio.run(asyncio.wait_for(run(), 120))
    full = [r for r in results if isinstance(r, QueueFullError)]
    done = [r for r in results if isinstance(r, list)]
    assert len(full) + len(done) == 5 and full and len(done) >= 2
    for outs in done:
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    assert llm.engine.num_free_pages == llm.engine.num_pages


def test_abort_all_ends_streams_while_a_step_is_stuck(make_tiny_llm):
    """Shutdown's abort reaches clients at once even when the engine thread
    is inside a long step; the engine frees the requests afterwards."""
    import time

    from jaxserve.server.request_stream import StreamAborted
    llm = make_tiny_llm()
    engine = llm.engine
    real_finish = engine.runner.finish
    slow = {"on": False}

    def finish(*a, **kw):
        if slow["on"]:
            time.sleep(3.0)  # a long compile or step
        return real_finish(*a, **kw)

    async def run():
        ae = AsyncEngine(engine)
        ae.start()
        engine.runner.finish = finish
        try:
            stream = await ae.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
            await stream.__anext__()
            slow["on"] = True
            await asyncio.sleep(0.2)  # the engine thread is now inside a slow step
            t0 = time.monotonic()
            ae.abort_all()
            with pytest.raises(StreamAborted):
                async for _ in stream:
                    pass
            waited = time.monotonic() - t0
            await stream.aclose()
            slow["on"] = False
            assert await ae.stop(timeout_s=30)
            return waited
        finally:
            engine.runner.finish = real_finish

    waited = asyncio.run(asyncio.wait_for(run(), 120))
    assert waited < 1.0, waited
    # The engine applied the abort after its slow step; nothing leaked.
    engine.step()
    assert engine.num_free_pages == engine.num_pages
    assert not engine.has_unfinished_requests()
