"""The prefill worker's control service (``--role prefill``) and its client.

A small gRPC service, ``jaxserve.disagg.v1.PrefillWorker``, on the prefill
worker's gRPC port beside ``Generation``; messages are JSON objects (the
handoff is a few ids and numbers; the KV itself goes by
``jax.experimental.transfer``):

  Prefill {request_id, prompt_token_ids, params}      -> {kv_key, first_token,
          first_logprob, finish_reason, num_pages, prefill_ms}
      Runs the prompt with ``max_tokens=1`` and ``hold_kv``; its pages stay
      held under ``kv_key`` for ``lease_s`` (then freed). Cancelling the
      call aborts the prefill and frees its pages.
  Pull {kv_key, skip_pages}                           -> {uuid, address,
          shapes, dtypes, bytes}
      Copies pages ``skip_pages..`` into one buffer per K/V, frees the pages,
      offers the buffers for one pull by ``uuid`` at ``address``.
  Release {kv_key}                                    -> {released}
      Frees held pages at once (the decode side gave up).
  Load {}                                             -> {running, waiting, held,
          fingerprint}
      Health and load; ``fingerprint`` is ``Engine.kv_fingerprint`` (a decode
      worker only hands off to prefill workers whose fingerprint is its own).

Errors are gRPC statuses: UNAVAILABLE while loading or draining,
INVALID_ARGUMENT for a bad message, NOT_FOUND for an unknown or expired
``kv_key``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import grpc
import jax

from jaxserve.disagg.transfer import KVTransfer
from jaxserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SERVICE = "jaxserve.disagg.v1.PrefillWorker"
METHODS = ("Prefill", "Pull", "Release", "Load")


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()


def _loads(data: bytes):
    return json.loads(data.decode())


def params_to_dict(params: SamplingParams) -> dict:
    """``SamplingParams`` as a JSON-able dict (``params_from_dict`` inverts it)."""
    return dataclasses.asdict(params)


def params_from_dict(d: dict) -> SamplingParams:
    """``SamplingParams`` of ``params_to_dict``'s dict.

    Raises:
      ValueError: unknown fields or bad values (from ``SamplingParams``).
    """
    if not isinstance(d, dict):
        raise ValueError(f"params must be an object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"params: unknown fields {unknown}")
    return SamplingParams(**d)


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill worker runs for ``params``: one token, sampled exactly
    as the decode side would sample its first (same seed, filters and
    penalties; EOS banned if ``min_tokens`` asks)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                               n=1, logprobs=None, prompt_logprobs=None)


class PrefillService:
    """The prefill worker's handlers (one per method; see the module docstring).

    Args:
      get_engine: returns the worker's ``AsyncEngine``, or None while it loads.
      lease_s: how long finished prompts' pages, and offered buffers, are
        held for a pull before they are freed.
      host: the address the transfer server listens on.
    """

    def __init__(self, get_engine, lease_s: float = 30.0, host: str = "127.0.0.1"):
        self.get_engine = get_engine
        self.lease_s = lease_s
        self.host = host
        self.transfer: KVTransfer | None = None  # started with the engine
        self.leases: dict[str, float] = {}  # kv_key -> monotonic deadline
        self.num_expired = 0
        self.fingerprint: str | None = None  # Engine.kv_fingerprint, set by start
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        """Start the transfer server and the lease sweeper (the engine is up;
        call from the event loop)."""
        ae = self.get_engine()
        self.fingerprint = ae.engine.kv_fingerprint()
        self.transfer = KVTransfer(ae.engine.devices[0], self.host)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.lease_s / 4))
            now = time.monotonic()
            for key in [k for k, t in self.leases.items() if t <= now]:
                self.leases.pop(key, None)
                self.num_expired += 1
                ae = self.get_engine()
                if ae is not None:
                    ae.metrics.kv_lease_expired.inc()
                try:
                    await self._release(key)
                except Exception:  # noqa: BLE001 - the sweeper must go on
                    log.exception("releasing the expired KV of %s failed", key)

    async def _release(self, key: str) -> bool:
        ae = self.get_engine()
        return bool(await ae.call(lambda e: e.release_kv(key))) if ae is not None else False

    def _engine(self, context):
        ae = self.get_engine()
        if ae is None or self.transfer is None or not ae.accepting:
            return None
        return ae

    async def prefill(self, req: dict, context) -> dict:
        ae = self._engine(context)
        if ae is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is not serving")
        try:
            ids = [int(i) for i in req["prompt_token_ids"]]
            params = prefill_params(params_from_dict(req.get("params") or {}))
        except (KeyError, TypeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Prefill: {e}")
        t0 = time.monotonic()
        try:
            stream = await ae.generate(ids, params, hold_kv=True)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - queue full, shutting down
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}")
        key, final = stream.engine_id, None
        try:
            async for out in stream:
                final = out
        except asyncio.CancelledError:
            await stream.aclose()  # aborts it if still running (its pages are freed)
            asyncio.get_running_loop().create_task(self._release(key))  # if it had finished
            raise
        except Exception as e:  # noqa: BLE001 - the engine failed
            await stream.aclose()
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
        await stream.aclose()
        c = final.outputs[0]
        if c.finish_reason == "abort" or not c.token_ids:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill was aborted")
        self.leases[key] = time.monotonic() + self.lease_s
        page_size = ae.engine.page_size
        return dict(kv_key=key, first_token=int(c.token_ids[0]),
                    first_logprob=float(c.cumulative_logprob), finish_reason=c.finish_reason,
                    num_pages=-(-len(ids) // page_size), page_size=page_size,
                    prefill_ms=(time.monotonic() - t0) * 1e3)

    async def pull(self, req: dict, context) -> dict:
        ae = self._engine(context)
        if ae is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is not serving")
        try:
            key, skip = str(req["kv_key"]), int(req.get("skip_pages", 0))
        except (KeyError, TypeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad Pull: {e}")
        if self.leases.pop(key, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV held under {key!r} "
                                f"(pulled, released or expired)")
        try:
            kv = await ae.call(lambda e: e.export_kv(key, skip))
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await ae.call(lambda e: e.release_kv(key))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        leaves = jax.tree.leaves(kv)
        uuid = self.transfer.offer(leaves, self.lease_s)
        return dict(uuid=uuid, address=self.transfer.address,
                    shapes=[list(a.shape) for a in leaves],
                    dtypes=[str(a.dtype) for a in leaves],
                    bytes=int(sum(a.nbytes for a in leaves)))

    async def release(self, req: dict, context) -> dict:
        key = str(req.get("kv_key", ""))
        self.leases.pop(key, None)
        return dict(released=await self._release(key))

    async def load(self, req: dict, context) -> dict:
        ae = self.get_engine()
        if ae is None or not ae.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is not serving")
        return dict(running=ae.num_running, waiting=ae.num_waiting, held=len(self.leases),
                    in_flight=ae.num_in_flight, fingerprint=self.fingerprint)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the service (JSON in, JSON out) on a ``grpc.aio`` server."""
        def wrap(fn):
            async def handler(data: bytes, context):
                try:
                    req = _loads(data)
                except ValueError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not JSON: {e}")
                if not isinstance(req, dict):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a JSON object")
                return _dumps(await fn(req, context))
            return grpc.unary_unary_rpc_method_handler(handler)
        handlers = {m: wrap(getattr(self, m.lower())) for m in METHODS}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class PrefillClient:
    """The decode worker's handle on one prefill worker.

    Args:
      target: the prefill worker's gRPC ``host:port``.
      token: bearer token, if the prefill worker wants one.

    Attributes:
      healthy: the last call or load poll succeeded.
      load: the prefill worker's last reported running + waiting + held, plus
        the handoffs this client has in flight to it.
    """

    def __init__(self, target: str, token: str | None = None, fingerprint: str | None = None):
        self.target = target
        self.fingerprint = fingerprint
        self.problem: str | None = "not polled yet"  # why it is not healthy (logged on change)
        self.channel = grpc.aio.insecure_channel(target)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._calls = {m: self.channel.unary_unary(f"/{SERVICE}/{m}", request_serializer=_dumps,
                                                   response_deserializer=_loads)
                       for m in METHODS}
        self.healthy = False
        self.reported_load = 0
        self.in_flight = 0

    @property
    def load(self) -> int:
        return self.reported_load + self.in_flight

    async def call(self, method: str, req: dict, timeout_s: float) -> dict:
        """One control call.

        Raises:
          grpc.aio.AioRpcError: the call failed (its ``code()`` says why).
        """
        return await self._calls[method](req, timeout=timeout_s, metadata=self.metadata)

    async def poll(self, timeout_s: float = 2.0) -> None:
        """Refresh ``healthy`` and ``reported_load`` from ``Load``; a worker
        whose ``fingerprint`` differs from ours (another model, page size or
        KV dtype) is never healthy. Changes of health are logged."""
        problem = None
        try:
            r = await self.call("Load", {}, timeout_s)
        except grpc.aio.AioRpcError as e:
            problem = f"{e.code().name}: {e.details()}"
        else:
            if self.fingerprint is not None and r.get("fingerprint") != self.fingerprint:
                problem = ("it serves another model, page size or KV cache dtype than this "
                           "decode worker (Engine.kv_fingerprint differs); start both with "
                           "the same --model, --page_size, --dtype and --kv_cache_dtype")
            else:
                self.reported_load = int(r["running"]) + int(r["waiting"])
        self.mark(problem)

    def mark(self, problem: str | None) -> None:
        """Set health from a problem (None: healthy), logging a change."""
        if problem != self.problem:
            if problem is None:
                log.info("prefill worker %s is healthy", self.target)
            else:
                log.warning("prefill worker %s is not usable: %s", self.target, problem)
        self.problem = problem
        self.healthy = problem is None

    async def close(self) -> None:
        await self.channel.close()
