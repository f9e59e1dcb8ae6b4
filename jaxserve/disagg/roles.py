"""How a disaggregated worker plugs into the server (``--role prefill|decode``).

``jaxserve.server`` knows nothing of disaggregation (this package builds on
it, never the reverse): the entry point asks ``server_role`` for the role of
``ServerConfig.disagg.role`` and hands it to ``jaxserve.server.serve.serve``,
which calls it at three points:

  ``add_to_server(grpc_server)``    before the port is bound: the prefill
                                    worker's control service beside ``Generation``
  ``async_engine(engine, **kw)``    once the engine is built: the decode
                                    worker's routing ``DecodeEngine``, else an
                                    ``AsyncEngine``
  ``start(async_engine) -> str``    once the engine thread runs: the prefill
                                    worker's transfer server and lease sweeper;
                                    returns the start-up line to print
"""

from __future__ import annotations

from jaxserve.server_config import ServerConfig
from jaxserve.disagg.router import DecodeEngine
from jaxserve.disagg.worker import PrefillService
from jaxserve.server.async_engine import AsyncEngine


class PrefillRole:
    """``--role prefill``: serve ``PrefillWorker`` and hold finished prompts'
    pages for a decode worker's pull (``worker.PrefillService``)."""

    def __init__(self, config: ServerConfig):
        self.lease_s = config.disagg.kv_lease_s
        self._async_engine: AsyncEngine | None = None  # None while the model loads
        self.service = PrefillService(lambda: self._async_engine, self.lease_s, config.host)

    def add_to_server(self, server) -> None:
        self.service.add_to_server(server)

    def async_engine(self, engine, **kw) -> AsyncEngine:
        self._async_engine = AsyncEngine(engine, **kw)
        return self._async_engine

    def start(self, async_engine: AsyncEngine) -> str:
        self.service.start()
        return (f"role prefill; KV transfer server on {self.service.transfer.address}; "
                f"lease {self.lease_s:g} s")


class DecodeRole:
    """``--role decode``: route long uncached prompts to the prefill workers
    (``router.DecodeEngine``)."""

    def __init__(self, config: ServerConfig):
        self.config = config

    def add_to_server(self, server) -> None:
        pass  # a decode worker serves Generation only

    def async_engine(self, engine, **kw) -> DecodeEngine:
        return DecodeEngine(engine, disagg=self.config.disagg, token=self.config.auth_token,
                            transfer_host=self.config.host, **kw)

    def start(self, async_engine: DecodeEngine) -> str:
        return (f"role decode; KV transfer server on {async_engine.transfer.address}; "
                f"prefill workers {', '.join(self.config.disagg.prefill_workers)}")


def server_role(config: ServerConfig) -> PrefillRole | DecodeRole | None:
    """The role ``serve`` takes for ``config.disagg.role`` (None: ``both``)."""
    if config.disagg.role == "prefill":
        return PrefillRole(config)
    if config.disagg.role == "decode":
        return DecodeRole(config)
    return None


__all__ = ["DecodeRole", "PrefillRole", "server_role"]
