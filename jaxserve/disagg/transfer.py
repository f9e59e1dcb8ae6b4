"""KV page buffers between processes over ``jax.experimental.transfer``.

JAX's DCN transfer (the one vLLM's TPU backend uses for the same job): each
process starts a ``TransferServer``; the owner of some arrays offers them
under a 63-bit uuid (``await_pull``), and a peer that connected to its
address pulls them by uuid into arrays of given shapes, dtypes and shardings.

Traps this wrapper works around (jax 0.10.2, seen on CPU):
  - A pull's shardings must match what was offered: buffers are offered and
    pulled on one device each side (``ModelRunner.read_pages`` puts them on
    the mesh's first device), so meshes of any size and tp meet.
  - A uuid can be pulled once.
  - Pull timeouts do not fire reliably, and a pull from a dead peer or of an
    expired offer blocks until the connection drops: ``pull`` runs in its own
    daemon thread and the caller's deadline is an asyncio one; a pull that
    misses it is abandoned (its thread ends when the connection does).
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
import threading

import jax
from jax.experimental import transfer


class TransferTimeout(Exception):
    """A pull missed its deadline (the peer is dead, slow, or the offer expired)."""


class KVTransfer:
    """This process's transfer server, its connections and its offers.

    Args:
      device: where pulled buffers land (a decode worker's first mesh device);
        offered buffers may be on any device of this process.
      host: the address to listen on (loopback unless told otherwise); the
        port is picked free.

    Attributes:
      address: ``host:port`` peers connect to.
    """

    def __init__(self, device: jax.Device, host: str = "127.0.0.1"):
        self.device = device
        self.server = transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])
        self.address: str = self.server.address()
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, arrays: list[jax.Array], lease_s: float) -> int:
        """Offer ``arrays`` for one pull; returns the uuid. The transfer
        server drops them after ``lease_s`` seconds if nobody pulled."""
        uuid = secrets.randbits(63)
        self.server.await_pull(uuid, list(arrays), timeout=datetime.datetime.now()
                               + datetime.timedelta(seconds=lease_s))
        return uuid

    def _connection(self, address: str):
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self.server.connect(address)
            return conn

    def forget(self, address: str) -> None:
        """Drop the cached connection to ``address`` (its peer failed)."""
        with self._lock:
            self._conns.pop(address, None)

    def pull(self, address: str, uuid: int, specs: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        """Pull an offer into arrays on ``device`` (blocking until they are
        ready; may block for good: see the module docstring).

        Raises:
          jax.errors.JaxRuntimeError: the transfer failed.
        """
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        want = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
        out = self._connection(address).pull(uuid, want)
        return jax.block_until_ready(out)

    async def pull_async(self, address: str, uuid: int, specs: list[jax.ShapeDtypeStruct],
                         timeout_s: float) -> list[jax.Array]:
        """``pull`` in a daemon thread with an asyncio deadline.

        Raises:
          TransferTimeout: not done within ``timeout_s`` seconds (the thread
            is abandoned and the connection forgotten).
          jax.errors.JaxRuntimeError: the transfer failed.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run():
            try:
                result = self.pull(address, uuid, specs)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(lambda err=e: fut.done() or fut.set_exception(err))
            else:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
        threading.Thread(target=run, name="jaxserve-kv-pull", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            self.forget(address)
            raise TransferTimeout(f"KV pull {uuid} from {address} took over {timeout_s:g} s")
        except Exception:
            self.forget(address)
            raise
