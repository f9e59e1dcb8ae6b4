"""The decode worker (``--role decode``): routes each request to a prefill
worker or runs it here, and takes handed-off requests into its engine.

Routing (every decision counted in ``jaxserve_disagg_routed_total{route}``):
  - ``unsupported``: ``n > 1``, logprobs or prompt logprobs (a handoff
    carries one token's id), or a token mask or logit_bias (the prefill
    worker samples the first token without them) run here;
  - ``cached``: at least ``max_cached_ratio`` of the prompt is in this
    worker's prefix cache;
  - ``short``: fewer than ``min_prefill_tokens`` prompt tokens are uncached
    (the handoff's round trips would cost more than the prefill);
  - ``no_worker``: no prefill worker answered its last health poll;
  - ``handoff``: otherwise, to the least-loaded healthy prefill worker.

A handoff that fails (the worker dies, times out, refuses, the pull fails or
the pages no longer fit) is recomputed here: the client sees a longer TTFT
and nothing else; ``jaxserve_disagg_fallbacks_total{reason}`` counts it and
the request's ``metrics.disagg_route`` is ``fallback:<reason>``. A client
that goes away mid-handoff cancels the prefill call (the prefill worker
aborts it) or releases the held pages; pages nobody releases are freed by
the prefill worker's lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import jax
import numpy as np

from jaxserve.server_config import DisaggConfig
from jaxserve.disagg.transfer import KVTransfer, TransferTimeout
from jaxserve.disagg.worker import PrefillClient, params_to_dict
from jaxserve.engine.kv_handoff import KVHandoffError
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.request_stream import RequestStream

log = logging.getLogger(__name__)


class DecodeEngine(AsyncEngine):
    """An ``AsyncEngine`` whose ``generate`` may hand a prompt's prefill to a
    prefill worker (see the module docstring).

    Args:
      engine, metrics, max_waiting_requests, on_fatal: as ``AsyncEngine``.
      disagg: the decode role's settings (``DisaggConfig``, checked there):
        prefill workers, the routing thresholds, the call deadlines.
      poll_s: how often each prefill worker's health and load are polled.
      token: bearer token for the prefill workers' gRPC ports.
      transfer_host: the address this worker's transfer server listens on.
    """

    def __init__(self, engine, *, disagg: DisaggConfig, poll_s: float = 1.0,
                 token: str | None = None, transfer_host: str = "127.0.0.1", **kw):
        super().__init__(engine, **kw)
        self.worker_addresses = list(disagg.prefill_workers)
        self.token = token
        self.min_prefill_tokens = disagg.min_prefill_tokens
        self.max_cached_ratio = disagg.max_cached_ratio
        self.prefill_timeout_s = disagg.prefill_timeout_s
        self.transfer_timeout_s = disagg.transfer_timeout_s
        self.poll_s = poll_s
        self.transfer = KVTransfer(engine.devices[0], transfer_host)
        self.workers: list[PrefillClient] = []
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        super().start()
        fingerprint = self.engine.kv_fingerprint()
        self.workers = [PrefillClient(a, self.token, fingerprint) for a in self.worker_addresses]
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(w.poll() for w in self.workers))
            await asyncio.sleep(self.poll_s)

    async def stop(self, timeout_s: float | None = None) -> bool:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(w.close() for w in self.workers), return_exceptions=True)
        return await super().stop(timeout_s)

    # ---- routing ------------------------------------------------------------

    async def route(self, prompt_ids: list[int], params: SamplingParams
                    ) -> tuple[str, PrefillClient | None, int]:
        """(route, worker, cached pages): ``handoff`` with the worker to use,
        or the reason to run here (see the module docstring); the prompt's
        full pages in this worker's prefix cache (0 when not looked up: a
        prompt shorter than ``min_prefill_tokens`` is short without asking
        the engine thread)."""
        if params.n != 1 or params.logprobs is not None or params.prompt_logprobs is not None \
                or params.has_token_mask or params.logit_bias:
            # (a prefill worker samples the first token: it would do so unmasked)
            return "unsupported", None, 0
        if len(prompt_ids) < self.min_prefill_tokens:
            return "short", None, 0
        pages = await self.call(lambda e: e.cached_prefix_pages(prompt_ids))
        cached = pages * self.engine.page_size
        if cached >= self.max_cached_ratio * len(prompt_ids):
            return "cached", None, pages
        if len(prompt_ids) - cached < self.min_prefill_tokens:
            return "short", None, pages
        healthy = [w for w in self.workers if w.healthy]
        if not healthy:
            return "no_worker", None, pages
        return "handoff", min(healthy, key=lambda w: w.load), pages

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None,
                       hold_kv: bool = False, lora: str | None = None) -> RequestStream:
        """``AsyncEngine.generate``, routed: the prompt is prefilled by a
        prefill worker when ``route`` says so, here otherwise (or when the
        handoff fails). A LoRA adapter's request (``lora``) always runs here
        (prefill workers hold no adapters). Raises as ``AsyncEngine.generate``."""
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self.check_queue(params)
        if lora is not None:
            self.metrics.disagg_routed.labels(route="unsupported").inc()
            return await self._local(prompt_ids, params, arrival, "unsupported", lora)
        route, worker, skip = await self.route(prompt_ids, params)
        self.metrics.disagg_routed.labels(route=route).inc()
        if worker is not None:
            try:
                return await self._handoff(worker, prompt_ids, params, arrival, skip)
            except _HandoffFailed as e:
                log.warning("handoff to %s failed (%s); prefilling here: %s",
                            worker.target, e.reason, str(e)[:300])
                self.metrics.disagg_fallbacks.labels(reason=e.reason).inc()
                route = f"fallback:{e.reason}"
        return await self._local(prompt_ids, params, arrival, route)

    async def _local(self, prompt_ids, params, arrival, route, lora=None) -> RequestStream:
        constraints = None
        if params.has_token_mask:  # a grammar compile never runs on the engine thread
            constraints = await asyncio.to_thread(self.engine.build_constraints, params)

        def add(engine, engine_id):
            engine.add_request(engine_id, prompt_ids, params, arrival_time=arrival,
                               constraints=constraints, lora=lora)
            engine.get_sequences(engine_id)[0].metrics.disagg_route = route
        stream = await self._submit(params, add)
        if lora is not None:
            self.metrics.lora_requests.labels(lora).inc()
        return stream

    async def _handoff(self, worker: PrefillClient, prompt_ids, params, arrival, skip: int
                       ) -> RequestStream:
        """Prefill on ``worker``, pull the KV of the pages after this
        worker's ``skip`` cached ones, start decoding here (if those pages
        are evicted meanwhile, ``add_prefilled`` refuses: ``evicted``).

        Raises:
          _HandoffFailed: any failure but a cancellation (the caller then
            prefills here).
        """
        if params.seed is None:  # both sides must sample the first token alike
            params = _with_seed(params, int(np.random.default_rng().integers(2**32)))
        key = None
        worker.in_flight += 1
        started = time.monotonic()  # the request's prefill phase starts here
        try:
            try:
                r = await worker.call("Prefill", dict(prompt_token_ids=list(map(int, prompt_ids)),
                                                      params=params_to_dict(params)),
                                      self.prefill_timeout_s)
                key = r["kv_key"]
                t0 = time.monotonic()
                p = await worker.call("Pull", dict(kv_key=key, skip_pages=skip),
                                      self.transfer_timeout_s)
                key = None  # the prefill worker freed its pages when it exported them
                spec_tree = self.engine.kv_page_spec(int(r["num_pages"]) - skip)
                spec = jax.tree.leaves(spec_tree)
                if [list(s.shape) for s in spec] != p["shapes"] or \
                        [str(s.dtype) for s in spec] != p["dtypes"]:
                    raise _HandoffFailed("bad_kv", f"the prefill worker sent {p['shapes']} "
                                         f"{p['dtypes']}; this cache needs "
                                         f"{[list(s.shape) for s in spec]}")
                t1 = time.monotonic()
                leaves = await self.transfer.pull_async(
                    _reachable(p["address"], worker.target), int(p["uuid"]), spec,
                    max(0.1, self.transfer_timeout_s - (time.monotonic() - t0)))
                ms = (time.monotonic() - t0) * 1e3
                log.debug("handoff to %s: prefill %.1f ms, Pull call %.1f ms, pull %.1f ms "
                          "(%d bytes)", worker.target, r["prefill_ms"], (t1 - t0) * 1e3,
                          (time.monotonic() - t1) * 1e3, p["bytes"])
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNAUTHENTICATED):
                    worker.mark(f"{e.code().name}: {e.details()}")  # until the next poll
                raise _HandoffFailed(_rpc_reason(e), f"{e.code().name}: {e.details()}") from None
            except TransferTimeout as e:
                raise _HandoffFailed("transfer_timeout", str(e)) from None
            except jax.errors.JaxRuntimeError as e:
                raise _HandoffFailed("transfer_failed", str(e)) from None
        except BaseException:
            if key is not None:  # prefilled, not exported: free its pages there now
                asyncio.get_running_loop().create_task(_release(worker, key))
            raise
        finally:
            worker.in_flight -= 1
        nbytes = int(sum(a.nbytes for a in leaves))
        self.metrics.kv_transfer_seconds.observe(ms / 1e3)
        self.metrics.kv_transfer_bytes.inc(nbytes)
        kv = jax.tree.unflatten(jax.tree.structure(spec_tree), leaves)

        def add(engine, engine_id):
            engine.add_prefilled(engine_id, prompt_ids, params, int(r["first_token"]), kv, skip,
                                 arrival_time=arrival, first_logprob=float(r["first_logprob"]),
                                 transfer_ms=ms, transfer_bytes=nbytes, scheduled_time=started)
        try:
            return await self._submit(params, add)
        except KVHandoffError as e:
            raise _HandoffFailed(e.reason, str(e)) from None


class _HandoffFailed(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _rpc_reason(e: grpc.aio.AioRpcError) -> str:
    return {grpc.StatusCode.UNAVAILABLE: "worker_unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "worker_timeout",
            grpc.StatusCode.NOT_FOUND: "kv_expired"}.get(e.code(), "worker_error")


def _reachable(address: str, target: str) -> str:
    """A transfer server's ``host:port`` as this worker can reach it: an
    unspecified host (the prefill worker bound ``--host 0.0.0.0``) is
    replaced by the host its gRPC ``target`` was reached at."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        return f"{target.rpartition(':')[0]}:{port}"
    return address


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


async def _release(worker: PrefillClient, key: str) -> None:
    try:
        await worker.call("Release", dict(kv_key=key), 5.0)
    except grpc.aio.AioRpcError:
        pass  # the lease frees them
