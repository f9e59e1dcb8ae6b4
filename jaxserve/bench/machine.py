"""The machine a benchmark ran on, named with every figure, and its limits.

* ``describe()``: ``lscpu``'s model name and its vector and matrix flags
  (``avx*``, ``amx*``), CPU count, memory (total and available now), the load
  average, Python, JAX and its devices, ``XLA_FLAGS``. Every benchmark's
  JSON carries it as ``machine``; no measuring.
* ``environment(extra)``: package versions (None when absent), devices and
  the load average, for the serving, start-up and device benchmarks' JSON.
* ``measure_limits(...)``: what the first device reaches, measured in the
  same run: matmul FLOP/s (an ``n^3`` f32 matmul, ``2 n^3`` FLOPs) and the
  in-place copy's bytes/s (``roofline.measure_ceilings``), and matvec
  bytes/s (``W @ x``, W f32[n, n], bytes = the matrix's), each the median of a
  few timed runs after one warm-up.
* ``busy_note(machine)``: a warning when the 1-minute load average at the
  start was above ``BUSY_LOAD`` (other processes skew every figure).
* ``git_commit()``: ``git describe --always --dirty`` of this checkout.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import time

import jax
import jax.numpy as jnp

from jaxserve.bench import roofline
from pallas_kernels.bench import median_time

BUSY_LOAD = 0.5  # 1-minute load average at the start above which a report warns
VERSIONS = ("jax", "jaxlib", "flax", "numpy", "transformers", "torch", "llama_cpp_python",
            "matplotlib")


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _meminfo(key: str) -> int | None:
    """``key`` of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``), bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def mem_available() -> int | None:
    """MemAvailable of ``/proc/meminfo``, bytes (None where there is none)."""
    return _meminfo("MemAvailable")


def describe(devices: bool = True) -> dict:
    """The machine (see the module docstring): ``cpu_model``, ``avx_flags``
    and ``amx_flags`` (sorted), ``cpu_count``, ``mem_total_bytes``,
    ``mem_available_bytes``, ``load_average_start``, ``platform``,
    ``python``, ``jax``, ``xla_flags`` and, with ``devices``, ``jax_backend``
    and ``devices``. ``devices=False`` leaves JAX's backends alone: a driver
    that spawns servers (start-up, soak) must not take the accelerator's
    memory first."""
    model, flags = platform.processor() or "?", []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
        if m := re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE):
            model = m[1].strip()
        if m := re.search(r"^Flags:\s*(.+)$", out, re.MULTILINE):
            flags = sorted(m[1].split())
    except (OSError, subprocess.SubprocessError):
        pass
    out = {"cpu_model": model, "avx_flags": [f for f in flags if f.startswith("avx")],
           "amx_flags": [f for f in flags if f.startswith("amx")], "cpu_count": os.cpu_count(),
           "mem_total_bytes": _meminfo("MemTotal"), "mem_available_bytes": mem_available(),
           "load_average_start": load_average(), "platform": platform.platform(),
           "python": platform.python_version(), "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if devices:
        out["jax_backend"] = jax.default_backend()
        out["devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
    return out


def environment(extra: dict | None = None) -> dict:
    """Python, OS, CPU count and load average, package versions (None when
    absent), JAX devices and ``XLA_FLAGS``, merged with ``extra``."""
    versions = {}
    for pkg in VERSIONS:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "versions": versions,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           # Other processes competing for the CPUs skew every figure: say how busy it was.
           "load_average_1_5_15_min": load_average()}
    try:
        env["jax_backend"] = jax.default_backend()
        env["devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
    except Exception as e:  # a broken accelerator install must not lose the results
        env["devices"] = [f"unavailable: {e}"]
    env.update(extra or {})
    return env


def measure_limits(matmul_n: int = 2048, matvec_n: int = 8192, copy_mib: int = 256,
                   iters: int = 5) -> dict:
    """Matmul FLOP/s, matvec bytes/s and copy bytes/s of the first device (f32)."""
    t = time.monotonic()
    ceil = roofline.measure_ceilings("float32", matmul_n=matmul_n, copy_mib=copy_mib,
                                     iters=iters)
    n = matvec_n
    w = jnp.ones((n, n), jnp.float32)
    x = jnp.ones((n,), jnp.float32)
    matvec_s = median_time(jax.jit(lambda a, b: a @ b), w, x, iters=iters, warmup=1)
    nbytes = w.nbytes
    del w, x
    return {"matmul_flops_per_s": ceil.flops_per_s, "matmul": f"{matmul_n}^3 f32",
            "matvec_bytes_per_s": nbytes / matvec_s, "matvec": f"f32[{n}, {n}] @ f32[{n}]",
            "matvec_bytes": nbytes, "matvec_ms": 1e3 * matvec_s,
            "copy_bytes_per_s": ceil.bytes_per_s, "copy": ceil.source, "iters": iters,
            "seconds": time.monotonic() - t}


def busy_note(m: dict) -> str | None:
    """A report line when the machine was busy at the start, else None."""
    load = (m.get("load_average_start") or [0.0])[0]
    if load <= BUSY_LOAD:
        return None
    return (f"**the machine was busy**: 1-minute load average {load:.2f} at the start on "
            f"{m['cpu_count']} cores; other processes skew every figure (llama.cpp's and "
            "torch's thread pools most): run it again on a quiet machine")


def git_commit() -> str | None:
    """``git describe --always --dirty`` of the checkout this module runs from."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=False,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
