"""Decode and prefill attention on XLA:CPU as C++ FFI kernels that read the
paged KV cache in place (``kernel_cpu.cc`` with ``kernel_cpu_body.inc``
(decode) and ``kernel_cpu_prefill.inc`` (prefill), built into
``quant_matmul_cpu``'s library by setup.py). Decode first; prefill below.

``kernel_xla``'s decode rows gather each page block (a copy) and then run two
small batched dots: ~3 GB/s of K/V read per CPU second on XLA:CPU (its module
docstring). This handler does the decode rows (rows ``0 .. num_decode - 1``,
one query token each, query token = row) directly from the pages:

* One work unit is (row[, split]): one pass over the row's visible
  positions ``[max(0, kv_len - window), kv_len)``, page by page, reading
  the page's K and V slots where they lie (one contiguous run each; the
  next page of the table is prefetched: pages lie in random order and the
  hardware prefetchers do not cross into it). Per page and kv head: the G
  query heads' scores (q pre-scaled by ``sm_scale``; ``soft_cap`` as
  ``c * tanh(s / c)``), then an online softmax (Milakov & Gimelshein 2018):
  running max and sum, the accumulator ``[G, H]`` rescaled once per page,
  then ``acc += p_j v_j``. Vectorised over H (AVX-512 when H % 16 == 0,
  with a polynomial exp of the page's 16 scores; AVX2 + FMA when H % 8 ==
  0; else scalar; picked at run time by ``__builtin_cpu_supports``,
  ``#pragma GCC target`` regions, as ``quant_matmul_cpu``).
* Threads: units go to the caller and tasks on XLA's intra-op pool from one
  atomic counter. With fewer rows than 4 per thread, the positions are
  split too (page-aligned, at least 16 pages a split: flash-
  decoding, Dao et al. 2023), each split's (max, sum, acc) merged at the end.
* Page ids are taken as given (the model passes the flat ``[layers * P, L,
  K, H]`` cache with ids shifted to the layer), clamped to ``[0, P)`` as
  XLA's gather clamps them; positions past ``pages_per_seq * L`` are not
  read. Rows past ``num_decode`` come out 0 (the prefill path fills them);
  a row with no visible position gives 0.
* f32 pages, and int8 pages with f32 [P, L, K] scales (``quant``): int8
  converted in registers, the K scale applied to the score and the V scale
  to the probability; fp8 and bf16 pages keep ``kernel_xla``'s decode path.

``available()`` is ``quant_matmul_cpu.ffi.available()`` (``JAXSERVE_CPU_KERNELS=0``
turns it off) and the library exporting this target (an older build may not).

Measured (``python -m pallas_kernels.bench --decode-cpu``, 15 alternated
pairs per case, medians, one process): an Intel Xeon (AVX-512 F/BW/VL/VNNI/
BF16/FP16, AMX), 2 cores, jax 0.10.2, shared with other jobs (load average
1.2-1.4 during this run), where the large f32 matvec read 27.5-27.8 GB/s of
wall time and 15.2-15.3 per CPU second. SmolLM2's heads (N 9, K 3, H 64,
page 16), pages in random order, one layer's decode rows
(``kernel_xla.ragged_paged_attention(decode_only=True)``: the engine's
``decode_step`` call), XLA decode path / this kernel; GB/s of K/V bytes read
(int8 counts its f32 scales) per wall second and per process CPU second;
ratio: XLA wall time / kernel wall time:

  ====  ====  ====  ================  ===========  ===========  =====
  KV    rows  ctx   ms XLA / kernel   GB/s wall    GB/s CPU     ratio
  ====  ====  ====  ================  ===========  ===========  =====
  f32   1     256   0.210 / 0.084     1.9 / 4.7    1.8 / 4.7    2.5
  f32   1     1024  0.456 / 0.126     3.4 / 12.5   3.6 / 4.8    3.6
  f32   1     4096  1.449 / 0.457     4.3 / 13.8   3.0 / 10.7   3.2
  f32   8     256   1.130 / 0.319     2.8 / 9.9    2.2 / 9.2    3.5
  f32   8     1024  2.877 / 0.750     4.4 / 16.8   3.4 / 10.9   3.8
  f32   8     4096  9.962 / 3.074     5.1 / 16.4   3.8 / 11.0   3.2
  f32   32    256   3.146 / 0.685     4.0 / 18.4   3.1 / 10.6   4.6
  f32   32    1024  9.042 / 2.722     5.6 / 18.5   4.0 / 11.0   3.3
  f32   32    4096  38.2 / 13.9       5.3 / 14.5   3.3 / 7.5    2.7
  int8  1     256   0.089 / 0.028     1.2 / 3.7    1.2 / 3.7    3.2
  int8  1     1024  0.280 / 0.109     1.5 / 3.8    1.5 / 3.8    2.6
  int8  1     4096  1.338 / 0.233     1.2 / 7.2    1.2 / 3.5    5.7
  int8  8     256   1.204 / 0.258     0.7 / 3.2    0.7 / 3.0    4.7
  int8  8     1024  2.464 / 0.541     1.4 / 6.2    1.3 / 3.6    4.6
  int8  8     4096  9.669 / 1.794     1.4 / 7.5    1.2 / 4.1    5.4
  int8  32    256   3.203 / 0.667     1.0 / 5.0    0.9 / 3.4    4.8
  int8  32    1024  10.9 / 2.128      1.2 / 6.3    1.1 / 3.8    5.1
  int8  32    4096  40.5 / 9.390      1.3 / 5.7    1.1 / 3.2    4.3
  ====  ====  ====  ================  ===========  ===========  =====

The kernel takes 2.5-4.6x less wall time with f32 pages and 2.6-5.7x less
with int8; at SmolLM2's decode (1 row, 1,024 positions, f32) 0.46 -> 0.13
ms a layer. Per CPU second it reads 5-11 GB/s of f32 against the XLA path's
2-4 (and the matvec's ~15): below the bandwidth, it is compute-bound per
thread (int8, 4x fewer bytes, takes only 1.3-2x less time). An earlier run on a
more loaded box (load 3.4-3.9, the second core mostly busy, before G was a
compile-time constant) still gave 1.8-2.8x (f32) and 1.6-3.4x (int8) with
wall time equal to CPU time. Steps of this kernel, single-thread at 8 rows
x 4,096 (wall ms, separate runs on the shared box, so +-15%): per-(row,
kv head) units reading 256 of every 768 bytes of a slot 12.8; the next
page prefetched 6.6; a vector exp 5.9; one unit per row (whole pages read
as one run) 5.4; G a compile-time constant 4.2; 16 positions' scores
reduced at once (AVX-512) 4.1 (32 rows x 1,024: 4.5 -> 3.7; 1 x 4,096:
0.61 -> 0.50).

Prefill (``prefill_attention``, targets ``jaxserve_rpa_prefill_f32`` /
``_int8``): rows ``num_decode .. num_seqs - 1``, packed by ``cu_q_lens``,
causal, possibly chunked (a row's q_len queries are the last q_len of its
kv_len positions), tiled as FlashAttention-2 (Dao 2023):

* One work unit is (sequence, kv head, block of tokens): ``max(1, 192 //
  G)`` tokens, so X = tokens * G query vectors (64 tokens at G = 3), queries
  pre-scaled by ``sm_scale``. It reads the positions its queries can see,
  ``[max(0, first position - window + 1), min(last position + 1, kv_len))``
  (clipped to ``pages_per_seq * L``; tiles outside are never touched), in
  tiles of whole pages (128 positions at L = 16; against 64, 30 layers of a
  940-token SmolLM2 prompt took 10-12% less time, 256 was slower, A/B in one
  process on the Xeon of the README). Per tile: the tile's keys of head k
  transposed into a [H, C] buffer and its value rows copied into a [C, H]
  one (the next tile's K and V rows are prefetched meanwhile: pages lie in
  random order), scores [X, C] =
  queries [X, H] x keys [H, C], online softmax in f32 (each query's visible
  keys in a tile are one interval [ja, jb): causal and window give one, so
  only the diagonal and window-edge tiles mask anything, as a range, not per
  element; ``soft_cap`` as ``c * tanh(s / c)``), the accumulator rescaled
  once per tile and query (no exp while its running max holds), then acc
  [X, H] += p [X, C] x V [C, H] in one pass over the tile.
* Both products are one register-blocked micro-kernel, C[XB, NB W] +=
  A[XB, kd] B[kd, NB W]: 6 x 4 zmm accumulators (AVX-512; 3 x 4 with AVX2),
  per step NB vector loads of B and XB broadcasts of A's elements, 24 FMAs
  per 10 loads (scores: A the queries, B the transposed keys; values: A the
  probabilities, B the value rows). exp is the decode body's vector one.
* int8 pages: the tile's keys and values are dequantized into the tile
  buffers (``q * scale``, the reference's order); fp8 and bf16 keep the XLA
  path. Page ids clamped to ``[0, P)``; every position a tile reads is
  below the row's kv_len, so NaN in pages a row does not own cannot leak;
  rows of no prefill sequence (decode rows too) come out 0: ``kernel_xla``
  adds this output to the decode kernel's.
* Threads: units, largest first, from one atomic counter over the caller
  and XLA's intra-op pool (as decode); no split of the positions (a prefill
  has many units).

Measured (``python -m pallas_kernels.bench --prefill-cpu``, 9 alternated
pairs per case, medians, one process; the Intel Xeon above (AVX-512 F/BW/
VL/VNNI/BF16/FP16, AMX, 2 cores, 1 thread a core), jax 0.10.2, shared with
a C++ build and other jobs: load average 2.8-4 on its 2 cores): SmolLM2's
heads, one layer, one sequence of n tokens (the whole prompt), pages in
random order, ``kernel_xla.ragged_paged_attention``'s prefill rows by the
XLA path (``_prefill_seqs``, Q 256, 16 pages a block) / this kernel;
GFLOP/s = 4 N H (visible pairs) per second:

  ====  ======  ================  ===============  ===============  =====  =====
  KV    tokens  ms XLA / kernel   GFLOP/s wall     GFLOP/s CPU      wall   CPU
  ====  ======  ================  ===============  ===============  =====  =====
  f32   128     1.41 / 0.61       13.5 / 31.3      13.5 / 31.3      2.3    2.3
  f32   512     7.46 / 2.68       40.5 / 113.0     33.1 / 65.1      2.8    2.0
  f32   940     17.41 / 7.23      58.5 / 141.0     36.6 / 72.5      2.4    2.0
  f32   2048    64.00 / 31.82     75.5 / 151.9     47.4 / 78.9      2.0    1.7
  int8  128     1.13 / 0.59       16.8 / 32.0      15.0 / 27.1      1.9    1.8
  int8  512     7.36 / 4.04       41.1 / 75.0      41.1 / 74.9      1.8    1.8
  int8  940     23.58 / 12.68     43.2 / 80.4      43.2 / 80.8      1.9    1.9
  int8  2048    82.40 / 52.55     58.7 / 92.0      58.7 / 92.3      1.6    1.6
  ====  ======  ================  ===============  ===============  =====  =====

Ratios: XLA time / kernel time. The f32 rows ran with the second core mostly
free (kernel wall half its CPU time: both threads busy), the int8 rows with
it taken (wall = CPU): 2.3-2.8x less wall time and 1.7-2.3x less CPU time
with f32 pages, 1.6-1.9x with int8; at SmolLM2's 940 tokens 17.4 -> 7.2 ms
a layer (x 30 layers). The kernel reaches 73-92 GFLOP/s per CPU second at
512+ tokens, XLA's tiles 33-59.

Whole engine, SmolLM2-135M (f32 weights and KV), one 940-token prompt
(``Engine.shaped_step(1, 940, 940)``, 5 timed runs a process, processes
alternated, ``JAXSERVE_CPU_KERNELS=0`` / ``1``): CPU-time medians 3,033 and
2,829 ms / 2,510 and 2,376 ms (-16%); wall 5,000 and 3,471 / 2,533 and
2,448 ms on the loaded box.
Steps (f32, CPU ms of the kernel at 940 / 2,048 tokens, one process each,
the XLA path alternated beside it): 8 x 1 zmm blocks (8 FMAs per 9 loads),
a scalar max, units of 64 query vectors 25.9 / 122 (no faster than XLA);
6 x 4 blocks and a vector max 13.4 / 74; the next tile prefetched and units
of 192 vectors 13.1 / 57. 128-position tiles changed nothing (61.4-63.4 ms
against 61.5-62.9, 2,048 tokens, one thread, alternated processes). The
micro-kernel runs ~64% of the kernel's time (perf, 2,048 tokens, one
thread; ~140 GFLOP/s while it runs), the rest is the key transpose (its
loads from random pages), softmax and exp: where more would come from.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_matmul_cpu import ffi as qmm_ffi

_log = logging.getLogger(__name__)
NO_WINDOW = 1 << 30


@functools.cache
def _load() -> bool:
    """The library loaded and exports this module's targets (``quant_matmul_cpu.ffi``
    registers them with its own, so a stored program calling them runs untraced)."""
    if not qmm_ffi._load():  # the library itself (not JAXSERVE_CPU_KERNELS: read per call)
        return False
    lib = ctypes.cdll.LoadLibrary(qmm_ffi.library_path())
    missing = [s for s in qmm_ffi.OTHER_TARGETS.values() if not hasattr(lib, s)]
    if missing:
        _log.info("ragged_paged_attention.kernel_cpu: %s lacks %s (built before them?); "
                  "decode attention takes the XLA path", qmm_ffi.library_path(), missing)
        return False
    return True


def available() -> bool:
    """True when the decode kernel may run: ``JAXSERVE_CPU_KERNELS`` is not
    ``0`` and the library loaded with this target (checked once per process)."""
    return qmm_ffi.available() and _load()


def _operands(name, k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK, sliding_window):
    """The page kind ("f32" / "int8"), the scales as the targets take them (empty for
    f32 pages) and the window as an i32 scalar, for ``name``'s target.

    Raises:
      RuntimeError: the kernel library is not available.
      ValueError: pages neither f32 nor int8 with scales.
    """
    if not _load():
        raise RuntimeError("ragged_paged_attention.kernel_cpu: the kernel is not available")
    kind = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.int8): "int8"}.get(
        jnp.dtype(k_pages_PLKH.dtype))
    if (kind is None or v_pages_PLKH.dtype != k_pages_PLKH.dtype
            or (kind == "int8") != (k_scales_PLK is not None and v_scales_PLK is not None)):
        raise ValueError(f"{name}: f32 pages, or int8 pages with scales; got "
                         f"{k_pages_PLKH.dtype} (scales given: {k_scales_PLK is not None})")
    if kind == "f32":
        k_scales_PLK = v_scales_PLK = jnp.zeros((0,), jnp.float32)
    window = jnp.asarray(NO_WINDOW if sliding_window is None else sliding_window, jnp.int32)
    return kind, k_scales_PLK, v_scales_PLK, jnp.minimum(window.reshape(()), NO_WINDOW)


def decode_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, num_decode,
                     *, sm_scale: float, sliding_window=None, soft_cap: float | None = None,
                     k_scales_PLK=None, v_scales_PLK=None, isa: int = -1, threads: int = 0):
    """Attention of decode rows ``0 .. num_decode - 1`` (query token = row).

    Args:
      q_TNH: [T, N, H] queries (cast to f32), N = K * G.
      k_pages_PLKH, v_pages_PLKH: f32 or int8 [P, L, K, H] (L <= 256, G <= 16).
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8 pages (``quant``:
        k = pages * scales), None for f32 pages.
      kv_lens_S: i32[S]; page_indices_SP: i32[S, pages_per_seq].
      num_decode: i32 scalar (or [1], or a Python int).
      sm_scale: softmax scale; soft_cap: None or > 0.
      sliding_window: None, an int >= 1, or an i32 scalar (a scanned layer's;
        ``NO_WINDOW`` or more means none).
      isa: -1 the best this CPU runs, 0 scalar, 1 AVX2, 2 AVX-512 (tests pin
        one); threads: 0 XLA's intra-op pool size, n at most n.

    Returns:
      f32[T, N, H]: decode rows' outputs, 0 in every other row.

    Raises:
      RuntimeError: the kernel library is not available.
      ValueError: pages neither f32 nor int8 with scales.
    """
    kind, k_scales_PLK, v_scales_PLK, window = _operands(
        "decode_attention", k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK, sliding_window)
    nd = jnp.asarray(num_decode, jnp.int32).reshape(())
    return jax.ffi.ffi_call(f"jaxserve_rpa_decode_{kind}",
                            jax.ShapeDtypeStruct(q_TNH.shape, jnp.float32))(
        q_TNH.astype(jnp.float32), k_pages_PLKH, v_pages_PLKH,
        k_scales_PLK.astype(jnp.float32), v_scales_PLK.astype(jnp.float32),
        jnp.asarray(kv_lens_S, jnp.int32), jnp.asarray(page_indices_SP, jnp.int32), nd, window,
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
        isa=np.int32(isa), threads=np.int32(threads))


def prefill_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP, cu_q_lens_S1,
                      num_seqs, num_decode, *, sm_scale: float, sliding_window=None,
                      soft_cap: float | None = None, k_scales_PLK=None, v_scales_PLK=None,
                      isa: int = -1, threads: int = 0):
    """Attention of prefill rows ``num_decode .. num_seqs - 1`` (causal; a
    sequence's ``q_len = cu_q_lens[i + 1] - cu_q_lens[i]`` queries are the last
    ``q_len`` of its ``kv_lens[i]`` positions).

    Args:
      q_TNH: [T, N, H] queries (cast to f32), N = K * G, packed by cu_q_lens.
      k_pages_PLKH, v_pages_PLKH: f32 or int8 [P, L, K, H].
      k_scales_PLK, v_scales_PLK: f32[P, L, K] scales of int8 pages, None for f32.
      kv_lens_S: i32[S]; page_indices_SP: i32[S, pages_per_seq];
      cu_q_lens_S1: i32[S + 1] prefix sums of query lengths.
      num_seqs, num_decode: i32 scalars (or [1], or Python ints).
      sm_scale, soft_cap, sliding_window, isa, threads: as ``decode_attention``.

    Returns:
      f32[T, N, H]: prefill rows' outputs, 0 in every other row (decode rows too).

    Raises:
      RuntimeError: the kernel library is not available.
      ValueError: pages neither f32 nor int8 with scales.
    """
    kind, k_scales_PLK, v_scales_PLK, window = _operands(
        "prefill_attention", k_pages_PLKH, v_pages_PLKH, k_scales_PLK, v_scales_PLK, sliding_window)
    scalars = [jnp.asarray(x, jnp.int32).reshape(()) for x in (num_seqs, num_decode)]
    return jax.ffi.ffi_call(f"jaxserve_rpa_prefill_{kind}",
                            jax.ShapeDtypeStruct(q_TNH.shape, jnp.float32))(
        q_TNH.astype(jnp.float32), k_pages_PLKH, v_pages_PLKH,
        k_scales_PLK.astype(jnp.float32), v_scales_PLK.astype(jnp.float32),
        jnp.asarray(kv_lens_S, jnp.int32), jnp.asarray(page_indices_SP, jnp.int32),
        jnp.asarray(cu_q_lens_S1, jnp.int32), *scalars, window,
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
        isa=np.int32(isa), threads=np.int32(threads))
