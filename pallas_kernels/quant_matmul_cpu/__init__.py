"""XLA:CPU kernels for quantized weights, through ``jax.ffi``: weight [F, D] as
``jaxserve.models.quant`` stores it x f32 activations [D, M] (feature-major)
-> f32 [F, M]. ``quant.quantized_matmul`` calls them on the CPU backend
where ``use_kernel`` says they measured faster than its XLA form.

| function | operands | math |
|---|---|---|
| ``int8_matmul`` | q i8[F, D], scale f32[F, 1] | ``scale * sum q x``, f32 FMAs |
| ``q8g_matmul`` | q i8[F, D], scale f16[F, G] | ``s q`` in registers, f32 FMAs |
| ``q4g_matmul`` | p u8[F, D/2], scale, zero f16[F, G] | ``s q + z`` (a lookup), f32 FMAs |
| ``w8a8_matmul`` | q i8[F, D], scale f32[F, 1], xq i8[D, M], sx f32[1, M] | int32 sums |
| ``q4g_a8_matmul``, ``q8g_a8_matmul`` | as ``q4g`` / ``q8g`` (groups of 32) | x in int8 blocks of 32, int32 sums per block (``kernel_a8.cc``, gguf_a8) |
| ``q4g_a16_matmul``, ``q8g_a16_matmul`` | as ``q4g`` / ``q8g`` (groups of 32) | x in int16 blocks of 32, int32 sums per block (``kernel_a8.cc``, gguf_a16) |

Weight-only formats never round the activations: results equal the numpy
f64 reference (``reference.py``) within f32 summation rounding; w8a8's
integer sums are exact and its scaling is quant.py's ``float(acc) * sx * scale``.

Design (``kernel.cc``, ``kernel_body.inc``):

* The weights are read as stored, once per block of columns: x is first
  transposed to [M, D] (one column contiguous); each tile is 2 rows x C
  columns (C = 8 with AVX-512, 4 with AVX2), so one dequantized weight vector
  feeds C FMAs and one x load feeds two (4-bit groups at one column: 4 rows,
  eight FMA chains; 3-8% less time than pairs for 30 SmolLM2 layers' seven
  projections, alternated in one process on the Xeon below). int4 nibbles need no shuffles: the
  transposed x is permuted inside every 2W-block (evens, then odds) so the
  low nibbles of W bytes meet inputs 2j and the high ones 2j + 1.
* 4-bit groups with AVX-512: each group's 16 possible weights ``fma(i, s, z)``
  are computed once into one register and ``vpermps`` looks the nibbles up
  (it reads an index's low 4 bits: the zero-extended bytes, then the same
  shifted by 4), replacing an int-to-float conversion and a dequantizing FMA
  per 16 weights; the same values, so the same sums. The rows' f16 scales
  and zeros are converted 16 at a time into a small buffer the broadcasts
  read, and at few columns the low and high nibbles' products go to two
  accumulators (two FMA chains). Measured on the Xeon below, 30 SmolLM2
  layers' seven projections at M = 1, one thread, alternated in one process
  (box shared with two helpers' jobs): 8.97 -> 7.63 ms (1.18x) and 19.7 ->
  17.2 ms; the time per call of a 576 x 576 projection read from beyond L2,
  6.8 against 5.3 GB/s of weight bytes (1.28x).
* The panel path (``kernel_panel.inc``; weight-only targets from
  ``PANEL_COLUMNS`` columns on): GEMM-style, x read feature-major as it comes
  ([D, M]: a column block at one d is contiguous; copied once as blocks of the
  microkernel's 32 columns, each [D, 32] contiguous and zero-padded, so the
  microkernel reads one sequential stream: bit-equal to and 0-7% faster than
  contiguous 128-column spans at M = 64-512, quiet box). A panel of 12 weight rows
  (AVX-512; AVX2 6, scalar 4) x all of D is dequantized into a per-thread f32
  buffer (the same values as the tiles: q4g ``fma(q, s, z)``, q8g ``s q``,
  int8 ``q`` with the row scale applied to the sums), then a microkernel keeps
  12 rows x 2 vectors (32 columns; AVX2 6 x 2 x 8) of accumulators, one
  broadcast weight per row and d: no horizontal sums (12 rows against 8:
  30 SmolLM2 layers' seven projections at M = 16-128, alternated in one
  process on the Xeon below, f32 8-12% and Q4_1 / Q8_0 2-5% less time,
  bit-equal). Rows are split over threads as for the tiles, in chunks of
  48 rows (whole panels); a ragged F tail panel is zero-padded.
* Dequantization (``q4g_dequantize``, ``q8g_dequantize``): a stacked weight's
  layer to f32 [F, D] in its own order, the values ``quant.dequantize``
  gives, rows over the threads; ``quant`` uses it past the matmul widths,
  before XLA's f32 dot (XLA:CPU's own int4 unpack fusion wrote ~2 GB/s).
* w8a8 with AVX-512 VNNI: ``vpdpbusd`` multiplies unsigned by signed bytes,
  so x goes in as ``xq + 128`` and ``128 * sum q`` (a ``vpdpbusd`` of ones,
  once per row) is taken back off; a ragged D by masked, zeroing loads.
  Without VNNI, AVX2 ``vpmaddwd`` on sign-extended int16 (exact).
* One source, three builds: ``kernel_body.inc`` is compiled under
  ``#pragma GCC target`` regions for AVX-512 (F/BW/VL/VNNI + FMA/F16C), AVX2
  (+FMA/F16C) and plain C++ (any CPU; also every group size the vector
  widths do not divide: Q8_0 needs W | gs, 4-bit 2W | gs). The level is
  picked at run time by ``__builtin_cpu_supports``; never -march=native.
* Threads: rows are cut into chunks that the calling thread and tasks on
  XLA's intra-op pool (``ffi::ThreadPool``, jaxlib 0.10) take from one atomic
  counter, so a busy pool costs parallelism, never a deadlock; below 2^18
  multiply-adds one thread does it all. On 2 cores the pool helps the large
  shapes (LM head M >= 32: 1.3-2x) and is noise-level at the projections.
* Works under ``jit`` and ``lax.scan`` (a custom call per layer); not split
  over a mesh (``quant`` keeps the XLA form when the abstract mesh has
  several devices, and for stacked [E, F, D] expert weights).

Built by ``setup.py`` as an optional extension (-O3 -std=c++17 -fPIC); no
compiler, no jax headers or a failed build only warns, and then
``available()`` is False. ``JAXSERVE_CPU_KERNELS=0`` forces the XLA path.

Measured (Intel Xeon, AVX-512 incl. VNNI/BF16/FP16 and AMX, 2 cores, jax
0.10.2; the box loaded by two other jobs, load average 9-10, so ratios
within one process, A/B alternated, median of 5): ms per forward of 30
SmolLM2-135M layers (7 projections each: 576x576 x2, 192x576 x2,
1536x576 x2, 576x1536), all under one ``lax.scan``:

| format | form | M=1 | 2 | 8 | 32 | 128 |
|---|---|---|---|---|---|---|
| (f32) | ``W @ x`` | 155 | 165 | 188 | 270 | 529 |
| int4 (g32) | XLA: unpack + dequantize in the dot | 347 | 368 | 360 | 426 | 677 |
| int4 (g32) | kernel | **55** | **54** | **77** | **231** | 818 |
| (f32) | ``W @ x`` | 119 | 163 | 144 | 257 | 503 |
| Q8_0 | XLA: dequantize in the dot | 76 | 104 | 83 | 198 | 424 |
| Q8_0 | kernel | **41** | **54** | 89 | 208 | 732 |
| (f32) | ``W @ x`` | 103 | 112 | 138 | 248 | 487 |
| int8 | XLA: two int8 terms, one int8 dot | 33.6 | 33.0 | 37.5 | 57 | 99 |
| int8 | kernel | **31.9** | 37.6 | 61 | 222 | 662 |
| (f32) | ``W @ x`` | 157 | 158 | 179 | 282 | 512 |
| w8a8 | XLA: int8 dot, M padded to 2 | 42.8 | 44.5 | 51 | 56 | 72 |
| w8a8 | kernel | **35.5** | 43.5 | 64 | 157 | 489 |

(each group of three rows from one process run; a second run agreed
within the box's noise: int4 7.2x / 7.9x / 5.3x / 1.9x / 0.94x faster than
XLA, Q8_0 2.4x / 2.2x / 1.4x / 0.76x / 0.56x, int8 1.07x at M=1.) The LM
head's shape alone (49152x576, not quantized by ``--quantization``; ms per
call): int4 kernel 14.8 vs XLA 195 at M=1, Q8_0 18.9 vs 142, int8 2.0 vs 3.3.

Reading: at decode widths the kernel reads int4 at 2.8x the speed of f32
and 6x XLA's int4; the XLA forms that win at M >= 32 run the int8 dot on
oneDNN (AMX), which f32 FMAs cannot match, and for the grouped formats the
f32 GEMM's blocking beats this kernel's row tiles at M = 128.

With the panel path (same machine, 2026-12-05, load average 2-3 from other
jobs; one process run per M, XLA / tiles / panels alternated, median of 5;
M >= 512: 3 layers and 3 repeats, scaled to 30): ms per forward of the 30
layers as above.

| format | form | M=1 | 4 | 8 | 16 | 32 | 64 | 128 | 512 | 1024 |
|---|---|---|---|---|---|---|---|---|---|---|
| f32 | XLA | 48.5 | 100 | 139 | 142 | 112 | 164 | 358 | 865 | **1640** |
| f32 | kernel tiles | **24.6** | **65** | 133 | 157 | 166 | 295 | 544 | | |
| f32 | kernel panels | 46.1 | 86 | **129** | **131** | **101** | 167 | **247** | 847 | 1877 |
| int4 | XLA | 153 | 374 | 421 | 444 | 278 | 383 | 456 | 998 | **1827** |
| int4 | kernel tiles | **10.3** | **41** | **62** | 95 | 123 | 296 | 526 | | |
| int4 | kernel panels | 28.8 | 76 | 81 | **50** | **64** | **147** | **231** | **877** | 1947 |
| Q8_0 | XLA | 36.9 | 90 | 93 | 96 | 90 | 148 | 245 | **800** | **1652** |
| Q8_0 | kernel tiles | **15.1** | **54** | **72** | 106 | 123 | 253 | 423 | | |
| Q8_0 | kernel panels | 31.3 | 86 | 112 | **64** | **68** | **130** | **233** | 868 | 1866 |
| int8 | XLA | 14.0 | **43** | **31** | **35** | **31** | **40** | **83** | **241** | **649** |
| int8 | kernel tiles | **13.5** | 50 | 66 | 91 | 118 | 229 | 478 | | |
| int8 | kernel panels | 32.1 | 86 | 94 | 50 | 67 | 123 | 233 | 853 | 1921 |

(M = 128 again in a second run: f32 253 / 515 / 232, int4 429 / 485 / 217,
Q8_0 225 / 380 / 210, int8 54 / 436 / 216; M = 256, XLA / panels: f32 437 /
415, int4 609 / 403, Q8_0 413 / 414.) The LM head's shape (49152x576,
ms per call, XLA / tiles / panels): Q8_0 at M = 8: 61 / 10.8 / 12.2, 16: 66 /
19.0 / 12.0, 32: 73 / 34 / 15.5, 128: 100 / 115 / 52, 512: 378 / 434 / 242
(its f32 dot: 16 / 21 / 30 / 55 / 351); int4 alike; int8's XLA dot wins from
M = 8 (3.9 vs 8.0 tiles / 11.1 panels; 128: 41.5 vs 52.5 panels).

Reading: the panels run at the f32 GEMM's speed (oneDNN's; both ~40% of the
FMA peak here) without its dequantized copy, so the grouped formats gain
1.4-6x over XLA from M = 16 to 128; from M = 512 oneDNN's f32 GEMM blocking
(D and packing) catches up, and an int8 dot on AMX beats any f32 FMA path. A
panel pads M to the vector width (16), so below it the tiles win. Hence
``PANEL_COLUMNS`` (12) and ``BUILTIN_MAX_COLUMNS``: int4 to 512, f32 to 256,
Q8_0 to 128 (a tie at 256); int8 and w8a8 stay at M = 1. That table is the
Xeon's: ``jaxserve.engine.kernel_widths`` measures each machine's (once,
cached) and installs it (``set_max_columns``).
"""

from pallas_kernels.quant_matmul_cpu.ffi import (available, f32_matmul, has_target, int8_matmul,
                                                 library_path, q4g_a8_matmul, q4g_a16_matmul,
                                                 q4g_dequantize, q4g_matmul, q4g_matmul_parts,
                                                 q8g_a8_matmul, q8g_a16_matmul, q8g_dequantize,
                                                 q8g_matmul, w8a8_matmul)

# From this many columns M the weight-only targets run the panel path, below it the
# row tiles (kernel.cc's kPanel* constants, its rule for ``panel=-1``; a test checks
# that the two agree). Measured: 8 columns faster on the tiles, 16 on the panels (f32
# level at 8).
PANEL_COLUMNS = {"int8": 12, "q8g": 12, "q4g": 12, "f32": 8}

# The largest column count M at which the kernel (tiles, then panels) measured
# faster than the XLA form, per kind: the built-in table, measured on the Xeon above.
# Other machines differ (AMD EPYC, AVX-512 without AMX: int8 wins to M = 256 there, as
# XLA's int8 dot has no AMX to run on), so ``jaxserve.engine.kernel_widths`` measures
# this machine's once, caches it and installs it with ``set_max_columns``.
BUILTIN_MAX_COLUMNS = {"int8": 1, "w8a8": 1, "q8g": 128, "q4g": 512, "f32": 256,
                       "q4g_a8": 2048, "q8g_a8": 2048, "q4g_a16": 2048, "q8g_a16": 2048}
_MAX_COLUMNS = dict(BUILTIN_MAX_COLUMNS)


def use_kernel(kind: str, F: int, D: int, M: int) -> bool:
    """Whether ``quantized_matmul`` should call the kernel for a weight [F, D] of
    ``kind`` (``"int8"``, ``"w8a8"``, ``"q8g"``, ``"q4g"``, ``"f32"``, ``"q4g_a8"``,
    ``"q8g_a8"``, ``"q4g_a16"``, ``"q8g_a16"``) and M columns: M <= the kind's
    limit in this process's table (``max_columns``)."""
    return M <= _MAX_COLUMNS[kind]


def max_columns() -> dict[str, int]:
    """This process's table: kind -> the largest M the kernel serves (a copy)."""
    return dict(_MAX_COLUMNS)


def set_max_columns(limits: dict[str, int]) -> dict[str, int]:
    """Install ``limits`` (kind -> largest M served; 0: never the kernel) over
    this process's table for the kinds it names; returns the previous table.
    Programs traced afterwards read the new limits (compiled ones keep theirs).

    Raises:
      ValueError: a kind not in ``BUILTIN_MAX_COLUMNS``, or a limit that is not
        an int >= 0.
    """
    for kind, m in limits.items():
        if kind not in BUILTIN_MAX_COLUMNS:
            raise ValueError(f"unknown kernel kind {kind!r}; known: {sorted(BUILTIN_MAX_COLUMNS)}")
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"column limit for {kind!r} must be an int >= 0, got {m!r}")
    previous = dict(_MAX_COLUMNS)
    _MAX_COLUMNS.update(limits)
    return previous


__all__ = ["BUILTIN_MAX_COLUMNS", "PANEL_COLUMNS", "available", "f32_matmul",
           "has_target", "int8_matmul", "library_path", "max_columns", "q4g_a8_matmul",
           "q4g_a16_matmul", "q4g_dequantize", "q4g_matmul", "q4g_matmul_parts",
           "q8g_a8_matmul", "q8g_a16_matmul",
           "q8g_dequantize", "q8g_matmul", "set_max_columns", "use_kernel", "w8a8_matmul"]
