"""Start and stop real ``python -m jaxserve.main --mode serve`` processes for tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request


class ServerProcess:
    """A server subprocess on 127.0.0.1 with free ports.

    Args:
      args: extra ``jaxserve.main`` flags (``--model``, engine flags, ...).
      env: extra environment variables.
      timeout_s: how long start-up (weights and the "serving" line) may take.
      wait_serving: return only once the model has loaded (else as soon as
        the port is bound; call ``wait_serving`` later).
      warmup: let the server compile every step shape before serving
        (``--warmup``); off by default so tests start in seconds (their
        steps compile lazily).

    Attributes:
      port, target: the gRPC port and ``127.0.0.1:port``.
      metrics_port: the Prometheus port (None when off).
      http_port, http_url: the OpenAI HTTP API's port and
        ``http://127.0.0.1:port`` (None without ``--http_port``).

    Raises:
      RuntimeError: the process exited or did not report serving in time
        (the message holds its stderr).
    """

    def __init__(self, args: list[str], env: dict | None = None, timeout_s: float = 300.0,
                 wait_serving: bool = True, warmup: bool = False):
        cmd = [sys.executable, "-m", "jaxserve.main", "--mode", "serve", "--port", "0",
               "--metrics_port", "0", *([] if warmup else ["--nowarmup"]), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._serving = threading.Event()
        self._bound = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.timeout_s = timeout_s
        self.wait(self._bound)
        text = "".join(self.lines)
        self.port = int(re.search(r"gRPC on [\d.]+:(\d+)", text).group(1))
        m = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", text)
        self.metrics_port = int(m.group(1)) if m else None
        self.target = f"127.0.0.1:{self.port}"
        # With --http_port the OpenAI API's line comes before the gRPC one.
        m = re.search(r"HTTP on http://[\d.]+:(\d+)", text)
        self.http_port = int(m.group(1)) if m else None
        self.http_url = f"http://127.0.0.1:{self.http_port}" if m else None
        if wait_serving:
            self.wait_serving()

    def wait(self, event: threading.Event) -> None:
        t_end = time.monotonic() + self.timeout_s
        while not event.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > t_end:
                self.kill()
                raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))

    def wait_serving(self) -> None:
        """Block until the server logs that the model is loaded and serving."""
        self.wait(self._serving)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("jaxserve: gRPC on"):
                self._bound.set()
            if line.startswith("jaxserve: serving"):
                self._serving.set()

    def metrics(self) -> dict[str, float]:
        """The ``/metrics`` page as {sample name with labels: value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills after ``timeout_s``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
