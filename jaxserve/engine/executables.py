"""Serialized warm-up executables: a warm start that skips tracing and lowering.

JAX's persistent compilation cache (``compile_cache``) is keyed by the
lowered program, so a warm start still traces and lowers every program to
find it: on the dev machine (2-core AVX-512/AMX Xeon) 2.7 s of tracing and
3.1 s of lowering for SmolLM2's 66 warm-up programs, more than loading them
(1.7 s). This store keeps each warm-up program's compiled executable
(``jax.experimental.serialize_executable``: the PJRT executable and the
argument/result pytree structures) under a key computed without tracing:

* a **fingerprint** of everything that shapes the programs: the source of
  ``jaxserve``, ``pallas_kernels`` and ``sharding``; whether the CPU kernel
  library is in use, its bytes and the widths it serves (``kernel_digest``:
  its programs call it, and ``JAXSERVE_CPU_KERNELS=0`` or other column
  limits build others); XLA's int8 form past the kernel
  (``quant_cpu.int8_wide_form``); jax and jaxlib versions,
  ``XLA_FLAGS`` and the x64 / matmul-precision settings; the backend, its
  devices and the mesh; and what the caller adds (the runner's model
  graph, parameter and cache shapes, dtypes and shardings, limits);
* the program's **name** (which jit, which bucket, which variant).

A start with the same fingerprint deserializes each program (~30 ms for a
SmolLM2 step) and calls it as a ``jax.stages.Compiled``; anything else
misses, traces and lowers, and compiles or finds the program in JAX's
cache, then saves it: a compiled program as it serializes, one JAX's cache
served with that cache entry's own bytes (``capture_cache_reads``: on CPU
a cache-served executable re-serializes without its kernels). Files are written atomically (a
temporary name, then ``os.replace``), so concurrent processes sharing a
folder see whole files or none; a file that fails to load is ignored (and
recompiled). Only a folder the user trusts may be used: loading an
executable runs its code (JAX's own warning).

Counts go to ``compile_cache`` as programs loaded from the cache, so the
start-up line and ``/metrics`` include them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time

log = logging.getLogger(__name__)

_PACKAGES = ("jaxserve", "pallas_kernels", "sharding")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over every ``.py`` file of the packages whose code builds the
    programs (path and bytes, in sorted order)."""
    import importlib.util
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = list(spec.submodule_search_locations)[0]
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=2)
def _file_digest(path: str, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def library_digest() -> str:
    """``"xla"`` when the CPU kernel library is not in use (not built, not
    loadable, or ``JAXSERVE_CPU_KERNELS=0``), else a digest of its bytes (so
    a rebuilt library is a new one to the per-machine caches that key on it)."""
    from pallas_kernels import quant_matmul_cpu
    path = quant_matmul_cpu.library_path()
    if path is None or not quant_matmul_cpu.available():
        return "xla"
    return _file_digest(path, os.stat(path).st_mtime_ns)


def kernel_digest() -> str:
    """``library_digest()`` and, where the library is in use, the process's
    column limits (``quant_matmul_cpu.max_columns``: which widths call it,
    ``kernel_widths``)."""
    from pallas_kernels import quant_matmul_cpu
    digest = library_digest()
    if digest == "xla":
        return digest
    return f"{digest} {sorted(quant_matmul_cpu.max_columns().items())}"


def fingerprint(*parts) -> str:
    """A hex digest of ``parts`` (their ``repr``) and of the process's
    program-shaping state (``source_digest``, versions, flags, devices)."""
    import jax
    import jaxlib

    from jaxserve.models import quant_cpu
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    env = (source_digest(), kernel_digest(), quant_cpu.int8_wide_form(), jax.__version__,
           jaxlib.__version__,
           os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64,
           str(jax.config.jax_default_matmul_precision), jax.default_backend(), devices)
    return hashlib.sha256(repr((env, parts)).encode()).hexdigest()[:32]


_capture = threading.local()  # .on: inside capture_cache_reads; .serialized: last bytes read
_capture_lock = threading.Lock()


def _install_cache_read_hook() -> bool:
    """Wrap ``jax._src.compilation_cache.extract_executable_and_time`` (once
    per process) so that, on a thread inside ``capture_cache_reads``, the
    serialized executable JAX's persistent cache returned is kept; True when
    the wrapper is in place. ``get_executable_and_time`` calls it by module
    lookup for every cache hit (jax 0.10.2); a JAX without it gets no
    wrapper (False), and programs its cache serves are then not saved."""
    try:
        from jax._src import compilation_cache as cc
    except ImportError:
        return False
    with _capture_lock:
        current = getattr(cc, "extract_executable_and_time", None)
        if current is None:
            return False
        if getattr(current, "_keeps_bytes", False):
            return True

        def extract_executable_and_time(entry, _jax_extract=current):
            serialized, compile_time = _jax_extract(entry)
            if getattr(_capture, "on", False):
                _capture.serialized = serialized
            return serialized, compile_time

        extract_executable_and_time._keeps_bytes = True
        cc.extract_executable_and_time = extract_executable_and_time
        return True


class CacheRead:
    """What ``capture_cache_reads`` saw: ``serialized``, the bytes of the
    last executable JAX's persistent cache returned in the context (None:
    none, or the hook could not be installed)."""

    serialized: bytes | None = None


@contextlib.contextmanager
def capture_cache_reads():
    """A context (this thread only) yielding a ``CacheRead`` that holds the
    serialized executable of a program JAX's persistent cache served inside
    it. Why: an executable JAX's cache returned on CPU serializes again
    without its kernels ("Function ... not found" when the copy runs; jax
    0.10.2), so the store saves the cache entry's own bytes for it instead
    (``ExecutableStore.save(..., serialized=...)``). Compiling such a program
    afresh would also do, but costs a compile per program wherever the store
    misses and JAX's cache would have served (every engine of a test suite
    after a source change)."""
    _install_cache_read_hook()
    read = CacheRead()
    before_on, before = getattr(_capture, "on", False), getattr(_capture, "serialized", None)
    _capture.on, _capture.serialized = True, None
    try:
        yield read
        read.serialized = _capture.serialized
    finally:
        _capture.on, _capture.serialized = before_on, before


def _serialize(compiled, serialized: bytes | None):
    """``jax.experimental.serialize_executable.serialize`` (jax 0.10.2: the
    unloaded executable, the flat argument info and ``_no_kwargs``, pickled
    with PJRT objects as persistent ids), with the XLA executable written as
    ``serialized`` when given: the bytes JAX's cache held for it."""
    import io

    import jax
    from jax.experimental import serialize_executable as se
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc
    if serialized is None:
        return se.serialize(compiled)

    class Pickler(se._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, (xc.LoadedExecutable, _jax.Executable)):
                return ("exec", serialized)
            return super().persistent_id(obj)

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None:
        raise ValueError("compilation does not support serialization")
    if compiled._params.const_args:
        raise ValueError("an executable with constant arguments")
    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as f:
        Pickler(f).dump((unloaded, args_info_flat, compiled._no_kwargs))
        return f.getvalue(), in_tree, compiled.out_tree


class ExecutableStore:
    """Compiled programs of one fingerprint in ``folder/<fingerprint>/``.

    Args:
      folder: the store's root (``compile_cache.active_dir()/executables``).
      key: ``fingerprint(...)`` of the programs' owner.
      devices: the devices the programs run on (the mesh's, in its order).
    """

    def __init__(self, folder: str, key: str, devices):
        self.folder = os.path.join(folder, key)
        self.devices = list(devices)
        self.num_loaded = 0
        self.num_saved = 0

    def _path(self, name: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return os.path.join(self.folder, safe + ".exe")

    def load(self, name: str):
        """The ``jax.stages.Compiled`` saved as ``name``, or None (missing, or
        unreadable: logged once and recompiled by the caller)."""
        path = self._path(name)
        if not os.path.exists(path):
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        from jaxserve.engine import compile_cache
        t0 = time.monotonic()
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = deserialize_and_load(payload, in_tree, out_tree,
                                            execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 - a stale or torn file: compile instead
            log.warning("executable store: cannot load %s (%s: %s); compiling it", path,
                        type(e).__name__, e)
            return None
        self.num_loaded += 1
        compile_cache.note_loaded(time.monotonic() - t0)
        return compiled

    def save(self, name: str, compiled, serialized: bytes | None = None) -> None:
        """Write ``compiled`` as ``name`` (atomically), its XLA executable as
        ``serialized`` when given (``capture_cache_reads``: a program JAX's
        persistent cache served); a program that cannot be serialized, or a
        folder that cannot be written, is skipped with a log line."""
        try:
            payload, in_tree, out_tree = _serialize(compiled, serialized)
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((payload, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self._path(name))
            self.num_saved += 1
        except Exception as e:  # noqa: BLE001 - the store is an optimisation only
            log.warning("executable store: cannot save %s (%s: %s)", name, type(e).__name__, e)


__all__ = ["CacheRead", "ExecutableStore", "capture_cache_reads", "fingerprint", "source_digest"]
