"""What the soak benchmark measures on the server besides its answers: the
process's memory (``process_memory``), the XLA executables it builds
(``CompileCounter``, from ``JAX_LOG_COMPILES`` lines on its stderr), one
sample of memory and ``/metrics`` counters (``sample``), glibc's heap before
and after ``malloc_trim`` (``SITECUSTOMIZE`` loaded into the server by
``--malloc_probe``, read with ``malloc_probe``). The machine is named by
``machine.describe``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

from jaxserve.bench.serving import scrape

# glibc probe loaded into the server by --malloc_probe (PYTHONPATH sitecustomize):
# SIGUSR1 -> append {"before": mallinfo2, "after": mallinfo2 after malloc_trim(0)}
# as one JSON line to $SOAK_MALLOC_FILE; $SOAK_MALLOC_TRIM_S > 0 also trims
# every that many seconds from a daemon thread (what a periodic trim would buy).
SITECUSTOMIZE = r'''
import ctypes, json, os, signal, threading, time
try:
    _libc = ctypes.CDLL("libc.so.6")
    class _MI2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    _libc.mallinfo2.restype = _MI2
    def _info():
        m = _libc.mallinfo2()
        return {f: getattr(m, f) for f, _ in _MI2._fields_}
    def _rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    def _probe(*_):
        rec = {"t": time.monotonic(), "rss_before": _rss(), "before": _info()}
        t = time.perf_counter()
        _libc.malloc_trim(0)
        rec.update(trim_s=time.perf_counter() - t, rss_after=_rss(), after=_info())
        with open(os.environ["SOAK_MALLOC_FILE"], "a") as f:
            f.write(json.dumps(rec) + "\n")
    signal.signal(signal.SIGUSR1, _probe)
    _every = float(os.environ.get("SOAK_MALLOC_TRIM_S", "0") or 0)
    if _every > 0:
        def _loop():
            while True:
                time.sleep(_every)
                _libc.malloc_trim(0)
        threading.Thread(target=_loop, daemon=True, name="soak-malloc-trim").start()
except (OSError, AttributeError):
    pass
'''


def process_memory(pid: int) -> dict:
    """Memory of process ``pid``, MB: ``rss`` (psutil if installed, else
    /proc VmRSS), and from /proc/PID/status where it exists ``rss_anon``,
    ``rss_file``, ``hwm`` (peak RSS so far) and ``threads`` (a count); {} when
    the process is gone."""
    out = {}
    try:
        import psutil  # optional: /proc's VmRSS below serves without it
        out["rss"] = psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 (psutil.NoSuchProcess, AccessDenied, ...)
        return {}
    keys = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "VmHWM": "hwm",
            "Threads": "threads"}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys and (keys[k] != "rss" or "rss" not in out):
                    n = int(v.split()[0])
                    out[keys[k]] = n if k == "Threads" else n / 1024
    except OSError:
        pass
    return out


class CompileCounter:
    """Stands in for ``sys.stderr`` while a spawned server runs:
    ``spawn_server`` echoes the server's stderr through it; lines of
    ``JAX_LOG_COMPILES`` are counted (``Finished XLA compilation of NAME``:
    one executable built or loaded from the persistent cache) and hidden,
    the rest pass through. ``tracebacks`` counts the server's
    ``Traceback (most recent call last):`` lines (none allowed)."""

    _FINISHED = re.compile(r"Finished XLA compilation of (\S+)")
    _CACHE_HIT = re.compile(r"Persistent compilation cache hit")
    _HIDE = re.compile(r"Finished XLA compilation|Finished tracing|Finished jaxpr to MLIR|"
                       r"Compiling \S+ with global shapes|Persistent compilation cache|"
                       r"compilation cache (hit|miss)|Not writing persistent cache")

    def __init__(self, stream):
        self.stream = stream
        self.events: list[tuple[float, str]] = []  # (monotonic s, jit name)
        self.cache_hits = 0
        self.tracebacks = 0
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        if m := self._FINISHED.search(s):
            with self._lock:
                self.events.append((time.monotonic(), m[1]))
        if "Traceback (most recent call last)" in s:
            self.tracebacks += 1
        if self._CACHE_HIT.search(s):
            self.cache_hits += 1
        if self._HIDE.search(s):
            return len(s)
        return self.stream.write(s)

    def count(self, until: float = float("inf")) -> int:
        """Executables built (or loaded) by monotonic time ``until``."""
        with self._lock:
            return sum(1 for t, _ in self.events if t <= until)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def sample(t0: float, pid: int | None, url: str | None, counter: CompileCounter | None) -> dict:
    """One sample: times, the server's memory (``process_memory``), KV pages,
    running/waiting/paused, backpressure and token counters from ``/metrics``,
    executables so far."""
    now = time.monotonic()
    s = {"t": now, "t_rel": now - t0, "wall": time.time()}
    if pid is not None:
        s.update(process_memory(pid))
    m = scrape(url, labelled=True)
    for key, name in (("pages_total", "jaxserve_kv_cache_pages_total"),
                      ("pages_free", "jaxserve_kv_cache_pages_free"),
                      ("pages_used", "jaxserve_kv_cache_pages_used"),
                      ("running", "jaxserve_num_requests_running"),
                      ("waiting", "jaxserve_num_requests_waiting"),
                      ("paused", "jaxserve_num_requests_paused"),
                      ("streams_paused", 'jaxserve_stream_backpressure_total{action="paused",'
                                         'reason="unread"}'),
                      ("streams_resumed", 'jaxserve_stream_backpressure_total{action="resumed",'
                                          'reason="read"}'),
                      ("streams_stalled", 'jaxserve_stream_backpressure_total{action="aborted",'
                                          'reason="stalled"}'),
                      ("streams_buffer_full", 'jaxserve_stream_backpressure_total{action='
                                              '"aborted",reason="buffer_full"}'),
                      ("steps", "jaxserve_engine_steps_total"),
                      ("received", "jaxserve_request_received_total"),
                      ("generation_tokens", "jaxserve_generation_tokens_total"),
                      ("prompt_tokens", "jaxserve_prompt_tokens_total"),
                      ("cached_tokens", "jaxserve_cached_prompt_tokens_total")):
        if name in m:
            s[key] = int(m[name])
    if counter is not None:
        s["compilations"] = counter.count(now)
    return s


def malloc_probe(proc, path: str) -> dict | None:
    """SIGUSR1 the server (its sitecustomize appends a JSON line to ``path``);
    the figures in MB, or None when nothing came back within 10 s."""
    def lines():
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return f.read().splitlines()
    n0 = len(lines())
    proc.send_signal(signal.SIGUSR1)
    for _ in range(100):
        time.sleep(0.1)
        if len(got := lines()) > n0:
            r = json.loads(got[-1])
            mb = lambda x: x / 2**20  # noqa: E731
            return {"rss_before_mb": mb(r["rss_before"]), "rss_after_mb": mb(r["rss_after"]),
                    "trim_s": r.get("trim_s"), "in_use_mb": mb(r["before"]["uordblks"]),
                    "free_mb": mb(r["before"]["fordblks"]),
                    "arena_mb": mb(r["before"]["arena"]), "mmap_mb": mb(r["before"]["hblkhd"]),
                    "raw": r}
    return None


__all__ = ["SITECUSTOMIZE", "CompileCounter", "malloc_probe", "process_memory",
           "sample"]
