"""Multi-host (multi-controller) serving: one scheduler, every process steps.

JAX on a pod slice or on several GPU hosts is multi-controller: every host
runs the same program, and a jitted function over the global mesh must be
launched by every process, in the same order, with the same inputs. jaxserve
keeps one scheduler, on process 0, which also owns the gRPC server and the
tokenizer. Before each step process 0 broadcasts the step's plan: the padded
host arrays the jitted step takes (token ids, positions, slot mapping,
``kv_lens``, page table, ``cu_q_lens``, logits rows, the sampling tensors)
and a few static ints (decode or mixed step, decode rows, query window, top-N
logprobs). Every other process runs ``ModelRunner.follow``: receive a plan,
run the identical step, repeat until process 0 sends STOP.

Broadcast: ``jax.experimental.multihost_utils.broadcast_one_to_all`` (a sum
over all devices, only process 0 contributing), twice per step: a fixed-size
header ``i32[HEADER_LEN]`` (opcode, step number, static ints, and each
leaf's shape and dtype), then the leaves. The leaves' shapes are the runner's
buckets, so the broadcast compiles as rarely as the step does. This is the
layout JetStream and MaxText use for multi-host engines: the plan is small
(kilobytes), the weights and KV cache never move.

Failure (all processes stop, none hangs):

* a collective whose peer process died fails at once on gloo (CPU) with
  "Connection closed by peer"; the runner turns any error after a plan was
  sent into ``MultihostError``, and the caller exits non-zero;
* a process that fails on its own (an exception in its step) records the
  reason in the coordination service's key-value store under
  ``jaxserve/failed/<process>`` and exits; the others see their collective
  fail and report that reason;
* a process killed while the others are idle is noticed by the coordination
  service's heartbeats, which terminate every process after
  ``heartbeat_timeout_s`` (JAX's own fatal error, "Terminating process
  because the JAX distributed service detected fatal errors"); when process
  0, which hosts the coordination service, dies, the others get that error
  at once, sometimes before their own collective reports the failure.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import jax
import numpy as np

log = logging.getLogger(__name__)

OP_STEP, OP_STOP = 1, 2
HEADER_LEN = 128
_MAX_STATICS = 8
_MAX_LEAVES = (HEADER_LEN - 3 - _MAX_STATICS) // 3
# Leaf dtypes on the wire (the plan's arrays are all of these).
_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32))


class MultihostError(RuntimeError):
    """The job can no longer run a step: a process failed, or the collectives
    broke. Fatal: every process must stop (the server exits non-zero)."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int = 100,
               initialization_timeout_s: int = 300) -> None:
    """Join the multi-process job (``jax.distributed.initialize``).

    With no arguments JAX detects the cluster (a TPU pod slice's metadata,
    SLURM, Open MPI); on one machine or plain GPU hosts give all three. CPU
    collectives use gloo, so processes on one machine (tests, CI) form a
    real job too. Call before anything touches a JAX device.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service
        (default: ``$JAX_COORDINATOR_ADDRESS`` or auto-detected).
      num_processes: processes in the job.
      process_id: this process, in ``[0, num_processes)``.
      heartbeat_timeout_s: seconds without a heartbeat before the
        coordination service declares a process dead and stops the job.
      initialization_timeout_s: seconds to wait for every process to join.

    Raises:
      ValueError: only one of ``num_processes`` and ``process_id`` is given,
        or ``process_id`` is outside ``[0, num_processes)``.
    """
    if (num_processes is None) != (process_id is None):
        raise ValueError(f"multihost: give both num_processes and process_id, or neither "
                         f"(auto-detect); got {num_processes=}, {process_id=}")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"multihost: process_id must be in [0, {num_processes}), "
                         f"got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=initialization_timeout_s)
    log.info("multihost: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())


def pod_environment() -> bool:
    """True on a multi-host TPU slice (``TPU_WORKER_HOSTNAMES`` lists more than
    one host), where every worker must join the job."""
    return len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def in_job() -> bool:
    """True once this process has joined a multi-process job (``initialize``)."""
    from jax._src import distributed
    return distributed.global_state.client is not None


def _kv_client():
    from jax._src import distributed
    return distributed.global_state.client


def record_failure(message: str) -> None:
    """Publish why this process is stopping, for the other processes' errors."""
    try:
        _kv_client().key_value_set(f"jaxserve/failed/{jax.process_index()}", message[:2000])
    except Exception:  # noqa: BLE001 - best effort: the coordinator may be gone
        pass


def failure_reasons() -> dict[int, str]:
    """``{process: message}`` recorded by failed processes (empty when the
    coordination service is unreachable, e.g. process 0 died)."""
    try:
        entries = _kv_client().key_value_dir_get("jaxserve/failed/")
    except Exception:  # noqa: BLE001
        return {}
    return {int(k.rsplit("/", 1)[-1]): v for k, v in entries}


def shutdown() -> None:
    """Leave the job cleanly (a barrier: every process calls it once, after
    process 0's STOP). Without it JAX's exit hook waits for processes that
    already left until the heartbeat timeout, then aborts."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def check_same_setup(setup: dict) -> None:
    """Check that every process of the job builds the same engine (a
    collective: every process calls it at the same point).

    Processes with different models, meshes, dtypes or cache shapes would
    compile different steps whose collectives never match: a hang, not an
    error. Each process publishes ``setup`` (JSON-able) in the coordination
    service and all compare SHA-256 digests.

    Raises:
      ValueError: some process's ``setup`` differs from process 0's; the
        message names the processes and the differing top-level fields.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    text = json.dumps(setup, sort_keys=True, default=str)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.int32)
    me = jax.process_index()
    try:
        _kv_client().key_value_set(f"jaxserve/setup/{me}", text)
    except Exception:  # noqa: BLE001 - only used to name the difference
        pass
    try:
        digests = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 8]
    except Exception as e:  # noqa: BLE001 - another process failed before this point
        reasons = failure_reasons()
        raise ValueError(f"multihost: process {me} could not compare engine setups with the "
                         f"other processes: "
                         + ("; ".join(m for _, m in sorted(reasons.items())) or
                            f"{type(e).__name__}: {str(e)[:300]}")) from None
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if not differ:
        return
    detail = ""
    try:
        other = 0 if me != 0 else differ[0]
        theirs = json.loads(_kv_client().blocking_key_value_get(f"jaxserve/setup/{other}",
                                                                10_000))
        fields = {f"{k}.{kk}" for k in setup for kk in set(setup[k]) | set(theirs.get(k, {}))
                  if json.dumps(setup[k].get(kk), sort_keys=True, default=str) !=
                  json.dumps(theirs.get(k, {}).get(kk), sort_keys=True, default=str)}
        detail = f"; process {me} and process {other} differ in {sorted(fields)}"
    except Exception:  # noqa: BLE001
        pass
    raise ValueError(f"multihost: process(es) {differ} were started with a different engine "
                     f"setup (model, mesh, dtype, cache or scheduler flags) than process 0; "
                     f"every process must run the same command{detail}")


def exit_on_fatal(error: BaseException) -> None:
    """Print a ``MultihostError`` and leave at once with status 1.

    ``os._exit`` skips JAX's shutdown barrier, which would otherwise wait for
    the dead process until the heartbeat timeout and then abort."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


class StepChannel:
    """Process 0 sends each step's plan; the other processes receive it.

    A plan on the wire is ``(op, statics, leaves)``: ``statics`` up to 8 ints,
    ``leaves`` up to 39 numpy arrays of rank <= 2 and dtype i32, f32 or u32.
    Sends and receives must pair up in order on every process (they are
    collectives). After a failure the channel is broken and every call
    raises ``MultihostError`` without touching the devices.

    Raises:
      MultihostError: a collective failed (a process died), or a process got
        a step out of sequence.
      ValueError: a plan that does not fit the header (a programming error).
    """

    def __init__(self):
        self.process_index = jax.process_index()
        self.is_source = self.process_index == 0
        self.num_sent = 0  # plans sent (process 0) or received (others)
        self.broken: MultihostError | None = None
        self.stopped = False

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def fail(self, error: BaseException) -> MultihostError:
        """Mark the channel broken because of ``error``; returns the
        ``MultihostError`` to raise, naming the process that failed first."""
        if isinstance(error, MultihostError):
            self.broken = error
            return error
        # Say it before touching the coordination service: when process 0 died,
        # JAX's error polling may terminate this process any moment now.
        print(f"jaxserve: process {self.process_index}: multi-host step {self.num_sent} failed: "
              f"{type(error).__name__}: {str(error)[:500]}", file=sys.stderr, flush=True)
        record_failure(f"process {self.process_index}: {type(error).__name__}: {error}")
        reasons = {p: m for p, m in failure_reasons().items() if p != self.process_index}
        cause = "; ".join(m for _, m in sorted(reasons.items())) or \
            f"{type(error).__name__}: {str(error)[:500]}"
        self.broken = MultihostError(
            f"multihost job failed at step {self.num_sent} on process {self.process_index} "
            f"of {jax.process_count()}: {cause}")
        return self.broken

    @staticmethod
    def _header(op: int, step: int, statics, leaves) -> np.ndarray:
        if len(statics) > _MAX_STATICS or len(leaves) > _MAX_LEAVES:
            raise ValueError(f"plan too large for the header: {len(statics)} statics "
                             f"(max {_MAX_STATICS}), {len(leaves)} leaves (max {_MAX_LEAVES})")
        h = np.zeros(HEADER_LEN, np.int32)
        h[0], h[1], h[2] = op, step % (1 << 31), len(leaves)
        h[3:3 + len(statics)] = statics
        for i, a in enumerate(leaves):
            if a.ndim > 2 or a.dtype not in _DTYPES:
                raise ValueError(f"plan leaf {i}: shape {a.shape} dtype {a.dtype} "
                                 f"(rank <= 2 of {[str(d) for d in _DTYPES]} only)")
            j = 3 + _MAX_STATICS + 3 * i
            h[j:j + 2] = a.shape + (-1,) * (2 - a.ndim)
            h[j + 2] = _DTYPES.index(a.dtype)
        return h

    def _broadcast(self, tree):
        from jax.experimental import multihost_utils
        return multihost_utils.broadcast_one_to_all(tree, is_source=self.is_source)

    def send(self, op: int, statics=(), leaves=()) -> None:
        """Process 0: broadcast one plan (``OP_STEP``) or ``OP_STOP``."""
        self._check()
        leaves = [np.asarray(a) for a in leaves]
        header = self._header(op, self.num_sent, [int(s) for s in statics], leaves)
        try:
            self._broadcast(header)
            if leaves:
                self._broadcast(leaves)
        except Exception as e:  # noqa: BLE001 - any failure here is fatal for the job
            raise self.fail(e) from e
        self.num_sent += 1
        if op == OP_STOP:
            self.stopped = True

    def recv(self) -> tuple[int, list[int], list[np.ndarray]]:
        """Other processes: block until process 0 sends; returns
        ``(op, statics, leaves)``."""
        self._check()
        try:
            h = self._broadcast(np.zeros(HEADER_LEN, np.int32))
            op, step, n = int(h[0]), int(h[1]), int(h[2])
            if op not in (OP_STEP, OP_STOP) or step != self.num_sent % (1 << 31):
                raise MultihostError(f"process {self.process_index} expected step "
                                     f"{self.num_sent}, got op {op} step {step}: the processes "
                                     f"diverged")
            templates = []
            for i in range(n):
                j = 3 + _MAX_STATICS + 3 * i
                shape = tuple(int(d) for d in h[j:j + 2] if d >= 0)
                templates.append(np.zeros(shape, _DTYPES[int(h[j + 2])]))
            leaves = [np.asarray(a) for a in self._broadcast(templates)] if n else []
        except Exception as e:  # noqa: BLE001
            raise self.fail(e) from e
        self.num_sent += 1
        return op, [int(s) for s in h[3:3 + _MAX_STATICS]], leaves
