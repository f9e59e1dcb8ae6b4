"""The persistent XLA compilation cache: set up once, and count what it serves.

Two jobs, both process-wide because JAX's cache and its monitoring hooks are:

* ``enable(folder)`` points JAX's persistent compilation cache at ``folder``
  once per process. JAX keeps one cache per process (``jax.config``'s
  ``jax_compilation_cache_dir``, bound to a folder at the first compile after
  it is set; a later change is ignored until a private ``reset_cache``), so
  the first folder wins: a second engine asking for another folder keeps the
  first and is told so in a log line, and a folder the user set themselves
  (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config.update``) is used as it is,
  with their thresholds. When this module sets the folder it also lowers
  JAX's two write thresholds so that every program is written:
  ``jax_persistent_cache_min_compile_time_secs`` 0 (JAX's default 1 s and
  the 0.5 s used before skipped every program that compiles faster, which
  is every program of a small model, and once the layers are scanned most
  programs of a large one), and ``jax_persistent_cache_min_entry_size_bytes``
  -1 (no size floor, and none that a filesystem-specific JAX build may
  substitute for 0). Measured on the 2-core dev machine (Intel Xeon, AVX-512,
  AMX), SmolLM2 with the scanned layer body (64 sequences, 2,048-token
  budget, 8-token pages): all 81 programs of a start (66 of them the
  warm-up's) compile in 0.03-0.86 s, so JAX's 1 s would write none of them
  and 0.5 s only 39; with 0 all 81 are written, 1.8-80 KB each (3.5 MB in
  all), and a second start compiles none.

* ``counts()`` says how many XLA executables this process has built and how
  many of them came from that cache, from ``jax.monitoring`` events that
  ``install()`` listens to (JAX 0.10, ``jax/_src/compiler.py`` and
  ``interpreters/pxla.py``):

    ``/jax/core/compile/backend_compile_duration`` (duration, ``fun_name``):
        one per executable built, compiled or read from the persistent cache
        (the in-memory jit cache builds none): the program count.
    ``/jax/compilation_cache/cache_hits``: the executable was read from the
        persistent cache; recorded inside the same call, on the same thread,
        before the duration event, so a thread-local flag attributes it.
    ``/jax/compilation_cache/cache_misses``: a compiled executable was
        written to the cache (JAX records it at the write, after the size
        threshold).
    ``/jax/core/compile/jaxpr_trace_duration``,
    ``/jax/core/compile/jaxpr_to_mlir_module_duration``: tracing and
        lowering, which a warm start still pays for every program.

  (``/jax/compilation_cache/compile_requests_use_cache`` is not used: JAX
  records it whenever ``jax_enable_compilation_cache`` is on, folder or not.)

``StartupReport`` is what ``--mode serve`` and the CLI demo print once they are
ready (``ready in 12.3 s: 27 programs (25 loaded from cache, 2 compiled), RSS
1.02 GB``) and what ``/metrics`` exports (``jaxserve.metrics``); ``parse_line``
reads that line back (the start-up benchmark, tests).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import threading
import time

log = logging.getLogger(__name__)

AUTO = "auto"  # ``LLM(compilation_cache_dir=...)`` / the CLI flag: the default folder

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_WRITE = "/jax/compilation_cache/cache_misses"

_lock = threading.Lock()
_installed = False
_enabled_dir: str | None = None  # the folder ``enable`` set (None: not set by us)
_thread = threading.local()  # .hit: a cache hit seen since this thread's last program
_totals = collections.Counter()  # programs, loaded, written; *_s: seconds
_compiled_names = collections.Counter()  # fun_name -> executables compiled (not loaded)


def default_dir() -> str:
    """``$JAXSERVE_CACHE/xla`` (default ``~/.cache/jaxserve/xla``): the
    folder the CLI and ``LLM`` use unless told otherwise."""
    root = os.environ.get("JAXSERVE_CACHE") or os.path.expanduser("~/.cache/jaxserve")
    return os.path.join(root, "xla")


def resolve_dir(value: str | None) -> str | None:
    """The folder a ``compilation_cache_dir`` argument names: ``"auto"`` ->
    ``default_dir()``; None or ``""`` -> None (no persistent cache); a path
    -> itself, ``~`` expanded."""
    if value == AUTO:
        return default_dir()
    return os.path.expanduser(value) if value else None


def enable(folder: str) -> str:
    """Use ``folder`` as this process's persistent compilation cache, once;
    see the module docstring for why the first folder wins. Also installs
    the program counters (``install``). Returns the folder JAX uses.

    Raises:
      ValueError: ``folder`` cannot be created (names it and why).
    """
    global _enabled_dir
    import jax
    install()
    folder = os.path.abspath(os.path.expanduser(folder))
    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if current is None:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise ValueError(f"compilation_cache_dir {folder!r}: cannot create it: "
                                 f"{e.strerror}") from None
            jax.config.update("jax_compilation_cache_dir", folder)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
            _enabled_dir = folder
            return folder
    if os.path.abspath(current) != folder:
        whose = "an earlier engine" if current == _enabled_dir else "the user"
        log.warning("compilation cache: this process already uses %s (set by %s; JAX keeps "
                    "one cache folder per process), not %s", current, whose, folder)
    return current


def active_dir() -> str | None:
    """The persistent cache folder JAX writes to in this process (None: off)."""
    import jax
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir


@dataclasses.dataclass(frozen=True)
class ProgramCounts:
    """XLA executables built by this process since ``install`` (or, as a
    difference of two ``counts()``, in between).

    Attributes:
      programs: executables built: compiled, or read from the persistent cache.
      loaded: of them, read from the persistent cache.
      written: compiled executables written to the persistent cache.
      compile_s: seconds in XLA compiling the ones not loaded.
      load_s: seconds reading (and deserializing) the loaded ones.
      trace_s, lower_s: seconds tracing jaxprs and lowering them to MLIR (paid
        by a warm start too).
      compiled_names: ``(jit function name, executables compiled)`` pairs,
        sorted by name: what a warm start still had to compile.
    """

    programs: int = 0
    loaded: int = 0
    written: int = 0
    compile_s: float = 0.0
    load_s: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0
    compiled_names: tuple[tuple[str, int], ...] = ()

    @property
    def compiled(self) -> int:
        """Executables compiled by XLA (not found in the persistent cache)."""
        return self.programs - self.loaded

    def __sub__(self, other: "ProgramCounts") -> "ProgramCounts":
        names = collections.Counter(dict(self.compiled_names))
        names.subtract(dict(other.compiled_names))
        return ProgramCounts(
            self.programs - other.programs, self.loaded - other.loaded,
            self.written - other.written, self.compile_s - other.compile_s,
            self.load_s - other.load_s, self.trace_s - other.trace_s,
            self.lower_s - other.lower_s,
            tuple(sorted((k, v) for k, v in names.items() if v > 0)))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compiled"] = self.compiled
        d["compiled_names"] = dict(self.compiled_names)
        return d


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        _thread.hit = True
    elif event == _CACHE_WRITE:
        with _lock:
            _totals["written"] += 1


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        hit = getattr(_thread, "hit", False)
        _thread.hit = False
        if not hit:
            _thread.fresh = getattr(_thread, "fresh", 0) + 1
        with _lock:
            _totals["programs"] += 1
            if hit:
                _totals["loaded"] += 1
                _totals["load_s"] += seconds
            else:
                _totals["compile_s"] += seconds
                _compiled_names[str(kwargs.get("fun_name", "?"))] += 1
    elif event in (_TRACE, _LOWER):
        with _lock:
            _totals["trace_s" if event == _TRACE else "lower_s"] += seconds


def fresh_compiles_in_thread() -> int:
    """Executables XLA compiled in this thread (not read from the persistent
    cache) since ``install``."""
    return getattr(_thread, "fresh", 0)


def note_loaded(seconds: float) -> None:
    """Count one program loaded without JAX's cache (``executables``: a
    serialized executable deserialized in ``seconds``) as loaded from cache."""
    with _lock:
        _totals["programs"] += 1
        _totals["loaded"] += 1
        _totals["load_s"] += seconds


def install() -> None:
    """Start counting (``jax.monitoring`` listeners, registered once per
    process; later calls do nothing). Call it before the compiles to count:
    the CLI does at start, ``enable`` and so ``Engine`` do too."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import jax.monitoring
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def counts() -> ProgramCounts:
    """A snapshot of the counters (all zero before ``install``)."""
    with _lock:
        t = dict(_totals)
        names = tuple(sorted(_compiled_names.items()))
    return ProgramCounts(t.get("programs", 0), t.get("loaded", 0), t.get("written", 0),
                         t.get("compile_s", 0.0), t.get("load_s", 0.0), t.get("trace_s", 0.0),
                         t.get("lower_s", 0.0), names)


# ---- the start-up report -----------------------------------------------------

def process_rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size of a process (``VmRSS`` of ``/proc/<pid>/status``),
    bytes; None where there is no such file (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def trim_host_heap() -> bool:
    """Hand the C heap's free memory back to the OS (glibc ``malloc_trim(0)``).

    Loading a checkpoint frees gigabytes of host buffers (dequantized
    weights, their copies on the way to the device, stacking the layers);
    glibc keeps most of that in its heap, where it counts in RSS though
    nothing uses it (SmolLM2-135M f32: 1.7 GB resident after the load,
    0.8 GB after a trim). Returns False where there is no glibc.
    """
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


_IMPORTED_AT = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat``'s start time
    against ``/proc/uptime``, 10 ms ticks); where there is no ``/proc``, since
    this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the name in
            # field 2 may hold spaces, so count from its closing parenthesis.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """How a start went, taken when the engine is ready to serve.

    Attributes:
      ready_s: process start to ready (health SERVING; the demo: warm-up
        done), seconds.
      programs: executables built since the process started counting (model
        load and warm-up; ``ProgramCounts``).
      warmup: those built by ``Engine.warmup`` alone (None: no warm-up).
      rss_bytes: the process's resident set size at ready, bytes (None: unknown).
      cache_dir: the persistent cache folder in use (None: off).
    """

    ready_s: float
    programs: ProgramCounts
    warmup: ProgramCounts | None
    rss_bytes: int | None
    cache_dir: str | None

    @classmethod
    def now(cls, warmup: ProgramCounts | None = None) -> "StartupReport":
        """The report of this process at this moment."""
        return cls(process_age_s(), counts(), warmup, process_rss_bytes(), active_dir())

    def line(self) -> str:
        """``ready in 12.3 s: 27 programs (25 loaded from cache, 2 compiled), RSS 1.02 GB``
        (``parse_line`` reads it back)."""
        p = self.programs
        rss = "?" if self.rss_bytes is None else f"{self.rss_bytes / 1e9:.2f} GB"
        cache = "" if self.cache_dir else "; persistent cache off"
        return (f"ready in {self.ready_s:.1f} s: {p.programs} programs ({p.loaded} loaded from "
                f"cache, {p.compiled} compiled), RSS {rss}{cache}")

    def as_dict(self) -> dict:
        return {"ready_s": self.ready_s, "programs": self.programs.as_dict(),
                "warmup": None if self.warmup is None else self.warmup.as_dict(),
                "rss_bytes": self.rss_bytes, "cache_dir": self.cache_dir}


_LINE_RE = re.compile(r"ready in ([\d.]+) s: (\d+) programs \((\d+) loaded from cache, "
                      r"(\d+) compiled\), RSS ([\d.]+|\?)")


def parse_line(text: str) -> dict | None:
    """``{"ready_s", "programs", "loaded", "compiled", "rss_bytes"}`` of the
    first ``StartupReport.line`` in ``text`` (rss_bytes None when it said ?,
    and good to 10 MB); None when there is none."""
    m = _LINE_RE.search(text)
    if m is None:
        return None
    return {"ready_s": float(m[1]), "programs": int(m[2]), "loaded": int(m[3]),
            "compiled": int(m[4]), "rss_bytes": None if m[5] == "?" else int(float(m[5]) * 1e9)}


__all__ = ["AUTO", "ProgramCounts", "StartupReport", "active_dir", "counts", "default_dir",
           "enable", "fresh_compiles_in_thread", "install", "note_loaded", "parse_line",
           "process_age_s", "process_rss_bytes", "resolve_dir", "trim_host_heap"]
