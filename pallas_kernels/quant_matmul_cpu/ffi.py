"""Loads ``_quant_matmul_cpu*.so`` (built by setup.py next to this file),
registers its six matmul XLA:CPU FFI targets (and ``OTHER_TARGETS``: the
dequantizing targets, the decode and prefill attention handlers of
``ragged_paged_attention.kernel_cpu`` and the greedy sampler, built into the
same library) and wraps them as jittable functions.

``available()`` is False (and every caller takes the XLA path) when
``JAXSERVE_CPU_KERNELS=0``, when the library is missing (no compiler at
install time) or fails to load; the reason is logged once at INFO.

All functions take a weight as ``quant.py`` stores it and feature-major
activations ``x_DM`` f32 [D, M], and return f32 [F, M]. ``isa``: -1 the best
this CPU runs, 0 scalar, 1 AVX2, 2 AVX-512 (tests pin a level); ``threads``:
0 XLA's intra-op pool size, n at most n threads; ``panel`` (weight-only
targets): -1 the kernel's rule (the GEMM-style panel path from a measured
column count on), 0 the row tiles, 1 the panel path; ``layer``: None for a 2-D
weight, or an i32 scalar when the weight's parts are stacked over a scanned
run of layers (``[L, F, D]``, scales ``[L, F, G]``): the kernel reads that
layer's part in place (``quant.StackedRead``), with no copy of the slice.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

_log = logging.getLogger(__name__)
_TARGETS = {"int8": "JaxserveQmmInt8", "q8g": "JaxserveQmmQ8g", "q4g": "JaxserveQmmQ4g",
            "w8a8": "JaxserveQmmW8a8", "f32": "JaxserveQmmF32",
            "q4g_parts": "JaxserveQmmQ4gParts"}
# The same library's other handlers (the dequantizing targets below,
# ``ragged_paged_attention/kernel_cpu.cc``, ``sampling_cpu/kernel.cc``), registered
# here too so that a stored program calling them runs without being traced again;
# each only where the library has it (``has_target``).
OTHER_TARGETS = {"jaxserve_qmm_q4g_a8": "JaxserveQmmQ4gA8",
                 "jaxserve_qmm_q8g_a8": "JaxserveQmmQ8gA8",
                 "jaxserve_qmm_q4g_a16": "JaxserveQmmQ4gA16",
                 "jaxserve_qmm_q8g_a16": "JaxserveQmmQ8gA16",
                 "jaxserve_qmm_dequant_q4g": "JaxserveQmmDequantQ4g",
                 "jaxserve_qmm_dequant_q8g": "JaxserveQmmDequantQ8g",
                 "jaxserve_rpa_decode_f32": "JaxserveRpaDecodeF32",
                 "jaxserve_rpa_decode_int8": "JaxserveRpaDecodeInt8",
                 "jaxserve_rpa_prefill_f32": "JaxserveRpaPrefillF32",
                 "jaxserve_rpa_prefill_int8": "JaxserveRpaPrefillInt8",
                 "jaxserve_greedy_f32": "JaxserveGreedyF32"}


_REGISTERED: set[str] = set()  # the OTHER_TARGETS this process's library has


def has_target(name: str) -> bool:
    """``available()`` and the loaded library has FFI target ``name`` (one of
    ``OTHER_TARGETS``: a library built before a target was added lacks it)."""
    return available() and name in _REGISTERED


def library_path() -> str | None:
    """The built shared library next to this file, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_quant_matmul_cpu*.so")))
    return found[0] if found else None


@functools.cache
def _load() -> bool:
    path = library_path()
    if path is None:
        _log.info("quant_matmul_cpu: no built library next to %s (no compiler at install "
                  "time?); quantized matmuls take the XLA path", __file__)
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        for name, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(f"jaxserve_qmm_{name}",
                                        jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        for name, symbol in OTHER_TARGETS.items():
            if hasattr(lib, symbol):  # a library built before them lacks them
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
                _REGISTERED.add(name)
    except (OSError, AttributeError, RuntimeError, ValueError) as e:
        _log.info("quant_matmul_cpu: %s failed to load (%s); quantized matmuls take the XLA "
                  "path", path, e)
        return False
    return True


def available() -> bool:
    """True when the kernels may run: ``JAXSERVE_CPU_KERNELS`` is not ``0`` and
    the library loaded and registered (checked once per process)."""
    if os.environ.get("JAXSERVE_CPU_KERNELS", "1") == "0":
        return False
    return _load()


def _call(name, F, M, *args, layer=None, isa=-1, threads=0, **attrs):
    if not _load():
        raise RuntimeError("quant_matmul_cpu: the kernel library is not available")
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    return jax.ffi.ffi_call(f"jaxserve_qmm_{name}", jax.ShapeDtypeStruct((F, M), jnp.float32))(
        *args, layer.reshape(()), isa=np.int32(isa), threads=np.int32(threads),
        **{k: np.int32(v) for k, v in attrs.items()})


def int8_matmul(q_FD, scale_F1, x_DM, layer=None, isa: int = -1, threads: int = 0,
                panel: int = -1):
    """Per-channel int8 weight-only: ``scale * (q @ x)``; q i8[F, D], scale f32[F, 1]."""
    return _call("int8", q_FD.shape[-2], x_DM.shape[1], q_FD, scale_F1.astype(jnp.float32),
                 x_DM.astype(jnp.float32), layer=layer, isa=isa, threads=threads, panel=panel)


def q8g_matmul(q_FD, scale_FG, x_DM, layer=None, isa: int = -1, threads: int = 0,
               panel: int = -1):
    """Grouped int8 (Q8_0): ``w = scale[f, d // gs] q``; q i8[F, D], scale f16[F, G]."""
    return _call("q8g", q_FD.shape[-2], x_DM.shape[1], q_FD, scale_FG.astype(jnp.float16),
                 x_DM.astype(jnp.float32), layer=layer, isa=isa, threads=threads, panel=panel)


def q4g_matmul(p_FD2, scale_FG, zero_FG, x_DM, layer=None, isa: int = -1, threads: int = 0,
               panel: int = -1):
    """Grouped uint4 (int4, Q4_0/1): ``w = scale q + zero``; p u8[F, D/2] packed
    (input 2j low nibble, 2j + 1 high), scale and zero f16[F, G]."""
    return _call("q4g", p_FD2.shape[-2], x_DM.shape[1], p_FD2, scale_FG.astype(jnp.float16),
                 zero_FG.astype(jnp.float16), x_DM.astype(jnp.float32), layer=layer, isa=isa,
                 threads=threads, panel=panel)


def q4g_matmul_parts(parts, x_DM, layer=None, isa: int = -1, threads: int = 0,
                     act_block: int = 0, act_bits: int = 8):
    """Several ``q4g_matmul``s of the same x in one call (row tiles; a layer's
    q/k/v or gate/up at decode widths): x is prepared once and the parts' rows
    are shared over the threads as one range. ``parts``: 1-4 (p, scale, zero)
    triples as ``q4g_matmul``'s, one G for all, each 2-D or stacked [L, ...]
    and read at ``layer``. Returns [f32[F_i, M]], the same sums as one
    ``q4g_matmul(..., panel=0)`` per part. ``act_block`` 32 (``gguf_a8``,
    ``gguf_a16``): x is first replaced by the values of its blocks of
    ``act_bits`` (8 or 16; ``quant_format.fake_quantize_act_blocks``, the
    same f32 values), once.

    Raises:
      RuntimeError: the kernel library is not available.
    """
    if not _load():
        raise RuntimeError("quant_matmul_cpu: the kernel library is not available")
    layer = jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)
    M = x_DM.shape[1]
    flat = [a for p, s, z in parts
            for a in (p, s.astype(jnp.float16), z.astype(jnp.float16))]
    outs = [jax.ShapeDtypeStruct((p.shape[-2], M), jnp.float32) for p, _, _ in parts]
    return jax.ffi.ffi_call("jaxserve_qmm_q4g_parts", outs)(
        x_DM.astype(jnp.float32), layer.reshape(()), *flat, isa=np.int32(isa),
        threads=np.int32(threads), act_block=np.int32(act_block), act_bits=np.int32(act_bits))


def w8a8_matmul(q_FD, scale_F1, xq_DM, sx_1M, layer=None, isa: int = -1, threads: int = 0):
    """int8 x int8 with int32 accumulation: ``float(q @ xq) * sx * scale``; q i8[F, D],
    scale f32[F, 1], xq i8[D, M], sx f32[1, M] (bit-equal to quant.py's XLA form)."""
    return _call("w8a8", q_FD.shape[-2], xq_DM.shape[1], q_FD, scale_F1.astype(jnp.float32),
                 xq_DM, sx_1M.astype(jnp.float32), layer=layer, isa=isa, threads=threads)


def f32_matmul(w_FD, x_DM, layer=None, isa: int = -1, threads: int = 0,
               panel: int = -1):
    """Dense f32 ``w @ x``; w f32[F, D] (or [L, F, D] with ``layer``). Its use is
    a scanned layer's f32 projections read in place at decode widths."""
    return _call("f32", w_FD.shape[-2], x_DM.shape[1], w_FD, x_DM.astype(jnp.float32),
                 layer=layer, isa=isa, threads=threads, panel=panel)


def q4g_a8_matmul(p_FD2, scale_FG, zero_FG, x_DM, layer=None, isa: int = -1,
                  threads: int = 0):
    """Grouped uint4 weights (as ``q4g_matmul``) x activations quantized to
    int8 in blocks of the weight's group (``gguf_a8``; quant_format's
    ``quantize_act_blocks`` inside the kernel, the same values): per group,
    ``s sx sum(q xq) + z sx sum(xq)`` with exact int32 sums (AVX-512 VNNI
    ``vpdpbusd``; without VNNI the activations' block values through the
    weight-only panels). f32 [F, M].

    Raises:
      RuntimeError: the library or its target is not available.
    """
    return _q4g_act("q4g_a8", p_FD2, scale_FG, zero_FG, x_DM, layer, isa, threads)


def q4g_a16_matmul(p_FD2, scale_FG, zero_FG, x_DM, layer=None, isa: int = -1,
                   threads: int = 0):
    """``q4g_a8_matmul`` with the activations in int16 blocks (``gguf_a16``;
    ``quantize_act_blocks(..., bits=16)``): exact int32 sums by AVX-512 VNNI
    ``vpdpwssd``. f32 [F, M].

    Raises:
      RuntimeError: the library or its target is not available.
    """
    return _q4g_act("q4g_a16", p_FD2, scale_FG, zero_FG, x_DM, layer, isa, threads)


def q8g_a8_matmul(q_FD, scale_FG, x_DM, layer=None, isa: int = -1, threads: int = 0):
    """Grouped int8 weights (Q8_0, as ``q8g_matmul``) x activations quantized to
    int8 in blocks of the weight's group (``gguf_a8``): per group ``s sx
    sum(q xq)``, exact int32 sums. f32 [F, M].

    Raises:
      RuntimeError: the library or its target is not available.
    """
    return _q8g_act("q8g_a8", q_FD, scale_FG, x_DM, layer, isa, threads)


def q8g_a16_matmul(q_FD, scale_FG, x_DM, layer=None, isa: int = -1, threads: int = 0):
    """``q8g_a8_matmul`` with the activations in int16 blocks (``gguf_a16``).
    f32 [F, M].

    Raises:
      RuntimeError: the library or its target is not available.
    """
    return _q8g_act("q8g_a16", q_FD, scale_FG, x_DM, layer, isa, threads)


def _q4g_act(kind, p_FD2, scale_FG, zero_FG, x_DM, layer, isa, threads):
    if not has_target(f"jaxserve_qmm_{kind}"):
        raise RuntimeError(f"quant_matmul_cpu: no {kind} target in the kernel library")
    return _call(kind, p_FD2.shape[-2], x_DM.shape[1], p_FD2, scale_FG.astype(jnp.float16),
                 zero_FG.astype(jnp.float16), x_DM.astype(jnp.float32), layer=layer, isa=isa,
                 threads=threads)


def _q8g_act(kind, q_FD, scale_FG, x_DM, layer, isa, threads):
    if not has_target(f"jaxserve_qmm_{kind}"):
        raise RuntimeError(f"quant_matmul_cpu: no {kind} target in the kernel library")
    return _call(kind, q_FD.shape[-2], x_DM.shape[1], q_FD, scale_FG.astype(jnp.float16),
                 x_DM.astype(jnp.float32), layer=layer, isa=isa, threads=threads)


def _dequant(name, F, D, *args, layer, isa, threads):
    if not has_target(f"jaxserve_qmm_{name}"):
        raise RuntimeError(f"quant_matmul_cpu: no {name} target in the kernel library")
    return _call(name, F, D, *args, layer=layer, isa=isa, threads=threads)  # f32 [F, D]


def q4g_dequantize(p_FD2, scale_FG, zero_FG, layer=None, isa: int = -1, threads: int = 0):
    """f32 [F, D] of a ``q4g_matmul`` weight (2-D, or stacked [L, ...] and read
    at ``layer``): ``scale q + zero`` in the input order, the same values as
    ``quant.dequantize`` (``s q`` is exact in f32), by the threads, for an XLA
    dot of wide activations (XLA:CPU's own unpack fusion ran at ~2 GB/s).

    Raises:
      RuntimeError: the library or its target is not available.
    """
    return _dequant("dequant_q4g", p_FD2.shape[-2], 2 * p_FD2.shape[-1], p_FD2,
                    scale_FG.astype(jnp.float16), zero_FG.astype(jnp.float16), layer=layer,
                    isa=isa, threads=threads)


def q8g_dequantize(q_FD, scale_FG, layer=None, isa: int = -1, threads: int = 0):
    """f32 [F, D] of a ``q8g_matmul`` weight (2-D or stacked, as
    ``q4g_dequantize``): ``scale q``, the same values as ``quant.dequantize``.

    Raises:
      RuntimeError: the library or its target is not available.
    """
    return _dequant("dequant_q8g", q_FD.shape[-2], q_FD.shape[-1], q_FD,
                    scale_FG.astype(jnp.float16), layer=layer, isa=isa, threads=threads)
