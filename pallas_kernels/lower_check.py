"""Lower both ragged paged attention kernels for TPU (Mosaic) and CUDA
(Triton) on a CPU machine, for every model shape the project claims.

    python -m pallas_kernels.lower_check                    # every claimed shape (= --all)
    python -m pallas_kernels.lower_check --platforms tpu,cuda --q_heads 8 --kv_heads 4 \\
        --head_dim 256 --kv_dtype int8 --page_size 16 --sliding_window 1024

Lowering is tracing plus the platform's Pallas lowering (Mosaic MLIR for
"tpu", Triton IR for "cuda"): ``jax.jit(partial(kernel, ...)).trace(
*ShapeDtypeStructs).lower(lowering_platforms=(platform,))``. It needs no
device and allocates no arrays; for "tpu" the default device ("cpu") is
registered as a TPU chip (``--tpu_chip``, default v6e) because Pallas reads
the chip's tiling from the device kind. It catches what the Pallas
lowerings reject at trace and lowering time (block shapes that do not tile,
shape errors, unsupported primitives or dtypes); it does not run the backend
compilers (Mosaic's layout passes, Triton's and ptxas), so vector layouts,
VMEM / SMEM budgets and register pressure are not checked: with jax 0.10.2
every claimed lowering passes before and after the kernels' layout fixes: none
of those layout findings shows here. The engine's start-up self-check
(``jaxserve.engine.attention_check``) covers the compile on the device.

One line per lowering::

    tpu  gemma3-4b    N8/K4/H256 L16 window=1024 cap=- int8      decode T64/S64  ok  (0.62 s)
    cuda qwen2.5-7b   N28/K4/H128 L16 window=- cap=- bfloat16  prefill T512/S8  FAILED: ...

and exit status 0 when every lowering passes, 1 when any fails (the last line
names the first failure), 2 on bad flags (one ``error:`` line).

Shapes (``MODELS``, from each model's HF ``config.json``: num_attention_heads,
num_key_value_heads, head_dim, sliding_window where layers slide,
attn_logit_softcapping): models sharing a head shape, window and cap are
lowered once and listed together. Gemma 3 has sliding layers (window 512 for
270M/1B, 1024 for 4B-27B) and global layers, so both are lowered; no claimed
model has an attention soft cap (Gemma 3's ``attn_logit_softcapping`` is
null), so one Gemma-2-2B-shaped probe (window 4096, cap 50) keeps the kernels'
soft-cap path lowered. Each shape is lowered for bfloat16, int8 and
float8_e4m3fn pages (q in bfloat16; f32[P, L, K] scales with the quantized
pages) and for a decode-sized batch (T 64 tokens, 64 rows) and a
prefill-sized one (T 512 tokens, 8 rows), pages of 16 tokens, 8k context.
``--all`` is 180 lowerings: 76 s on the 2-core dev CPU (38 s of CPU time),
jax 0.10.2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model's attention shape: query heads N, kv heads K, head dim H, and
    the sliding windows (None: a global layer) and soft cap of its layers."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    windows: tuple = (None,)
    soft_cap: float | None = None


MODELS = (
    ModelShape("smollm2", 9, 3, 64),
    ModelShape("gemma3-270m", 4, 1, 256, (512, None)),
    ModelShape("gemma3-1b", 4, 1, 256, (512, None)),
    ModelShape("gemma3-4b", 8, 4, 256, (1024, None)),
    ModelShape("gemma3-12b", 16, 8, 256, (1024, None)),
    ModelShape("gemma3-27b", 32, 16, 128, (1024, None)),
    ModelShape("llama3-8b", 32, 8, 128),
    ModelShape("llama3-70b", 64, 8, 128),
    ModelShape("qwen2.5-7b", 28, 4, 128),
    ModelShape("qwen2.5-14b", 40, 8, 128),
    ModelShape("qwen2.5-32b", 40, 8, 128),
    ModelShape("qwen3-8b", 32, 8, 128),
    ModelShape("qwen3-32b", 64, 8, 128),
    ModelShape("mixtral-8x7b", 32, 8, 128),
    ModelShape("mha", 32, 32, 128),  # G = 1
    ModelShape("softcap-probe", 8, 4, 256, (4096,), 50.0),  # Gemma 2 2B's attention
)

KV_DTYPES = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn,
             "float8_e4m3fn": jnp.float8_e4m3fn}
PLATFORMS = ("tpu", "cuda")
# (name, T packed query tokens, S rows); every row's context up to MAX_CONTEXT.
BATCHES = (("decode", 64, 64), ("prefill", 512, 8))
MAX_CONTEXT = 8192
NUM_PAGES = 4096
MAX_ERROR_CHARS = 400  # of an error's first line (Mosaic's quote a whole index map)
TPU_CHIP = "v6e"  # Trillium: the TPU generation lowered for (``target_tpu_chip``)


@dataclasses.dataclass(frozen=True)
class Case:
    """One lowering: a platform, a head shape, a window, a cap, a KV dtype, a batch."""

    platform: str
    models: str  # the models sharing this shape, "/"-joined
    q_heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    soft_cap: float | None
    kv_dtype: str
    page_size: int
    batch: str
    num_tokens: int
    max_seqs: int

    def label(self) -> str:
        cap = "-" if self.soft_cap is None else f"{self.soft_cap:g}"
        win = "-" if self.sliding_window is None else self.sliding_window
        return (f"{self.platform:<4} {self.models:<36} N{self.q_heads}/K{self.kv_heads}/"
                f"H{self.head_dim} L{self.page_size} window={win} cap={cap} "
                f"{self.kv_dtype:<13} {self.batch} T{self.num_tokens}/S{self.max_seqs}")


def kernel_for(platform: str):
    """The kernel function lowered for ``platform`` ("tpu" or "cuda")."""
    if platform == "tpu":
        from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu
    from pallas_kernels.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
    return ragged_paged_attention_gpu


def target_tpu_chip(chip: str = TPU_CHIP) -> None:
    """Make Mosaic lower for TPU ``chip`` ("v5e", "v6e", ... as in
    ``pltpu.ChipVersion``) on a machine without one: Pallas asks the default
    device for its kind ("cpu" here) to pick the chip's tiling, so "cpu" is
    registered as that chip (JAX's ``tpu_info.registry``, per process).

    Raises:
      ValueError: an unknown chip name.
    """
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu
    versions = {v.value: v for v in pltpu.ChipVersion}
    if chip not in versions:
        raise ValueError(f"unknown TPU chip {chip!r}; one of {sorted(versions)}")
    tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(versions[chip], 1)
    tpu_info.get_tpu_info.cache_clear()


def lower(case: Case) -> None:
    """Lower ``case``'s kernel for its platform from ShapeDtypeStructs (for
    ``TPU_CHIP`` unless ``target_tpu_chip`` chose another).

    Raises:
      Exception: whatever the kernel's validation or the Pallas lowering raises.
    """
    if case.platform == "tpu":
        from jax._src.pallas.mosaic import tpu_info
        if "cpu" not in tpu_info.registry and jax.default_backend() == "cpu":
            target_tpu_chip()
    T, S, N, K, H, L = (case.num_tokens, case.max_seqs, case.q_heads, case.kv_heads,
                        case.head_dim, case.page_size)
    kv_dtype = jnp.dtype(KV_DTYPES[case.kv_dtype])
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pages_per_seq = -(-MAX_CONTEXT // L)
    args = [sds((T, N, H), jnp.bfloat16), sds((NUM_PAGES, L, K, H), kv_dtype),
            sds((NUM_PAGES, L, K, H), kv_dtype), sds((S,), i32), sds((S, pages_per_seq), i32),
            sds((S + 1,), i32), sds((1,), i32)]
    kw = {}
    if kv_dtype != jnp.dtype(jnp.bfloat16):
        kw = dict(k_scales_PLK=sds((NUM_PAGES, L, K), jnp.float32),
                  v_scales_PLK=sds((NUM_PAGES, L, K), jnp.float32))
    fn = functools.partial(kernel_for(case.platform), sm_scale=H ** -0.5,
                           sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    names = ("k_scales_PLK", "v_scales_PLK")

    def call(*a):
        return fn(*a[:7], **dict(zip(names, a[7:])))

    jax.jit(call).trace(*args, *(kw[n] for n in names if n in kw)).lower(
        lowering_platforms=(case.platform,))


def claimed_cases(platforms=PLATFORMS, page_size: int = 16) -> list[Case]:
    """Every lowering ``--all`` runs: each distinct (head shape, window, cap)
    of ``MODELS`` x KV dtypes x ``BATCHES`` x ``platforms``."""
    shapes: dict[tuple, list[str]] = {}
    for m in MODELS:
        for w in m.windows:
            shapes.setdefault((m.q_heads, m.kv_heads, m.head_dim, w, m.soft_cap), []).append(m.name)
    return [Case(p, "/".join(names), N, K, H, w, cap, dt, page_size, b, T, S)
            for p in platforms
            for (N, K, H, w, cap), names in shapes.items()
            for dt in ("bfloat16", "int8", "float8_e4m3fn")
            for b, T, S in BATCHES]


def run(cases, out=sys.stdout) -> list[tuple[Case, str]]:
    """Lower every case, printing one line each; returns the failures as
    (case, first line of the error)."""
    failures = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            lower(case)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - every lowering error is a result here
            lines = f"{type(e).__name__}: {e}".strip().splitlines()
            first = (lines[0] if lines else type(e).__name__)[:MAX_ERROR_CHARS]
            failures.append((case, first))
            status = f"FAILED: {first}"
        print(f"{case.label()}  {status}  ({time.perf_counter() - t0:.2f} s)", file=out,
              flush=True)
    return failures


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one ``error:`` line instead of usage + error
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m pallas_kernels.lower_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--platforms", default="tpu,cuda", help="comma-separated: tpu, cuda")
    p.add_argument("--all", action="store_true", help="every claimed model shape (the default "
                   "when no shape flag is given)")
    p.add_argument("--q_heads", type=int)
    p.add_argument("--kv_heads", type=int)
    p.add_argument("--head_dim", type=int)
    p.add_argument("--kv_dtype", default=None, help="bfloat16, int8 or fp8_e4m3 (one shape: "
                   "default bfloat16)")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--sliding_window", type=int, default=None)
    p.add_argument("--soft_cap", type=float, default=None)
    p.add_argument("--tpu_chip", default=TPU_CHIP, help="TPU generation to lower for "
                   "(v5e, v5p, v6e, 7x, ...)")
    return p


def _cases(a) -> list[Case]:
    platforms = tuple(x.strip() for x in a.platforms.split(",") if x.strip())
    bad = [x for x in platforms if x not in PLATFORMS]
    if not platforms or bad:
        raise _ArgError(f"--platforms must be a comma-separated subset of tpu,cuda, "
                        f"got {a.platforms!r}")
    if a.page_size < 1:
        raise _ArgError(f"--page_size must be >= 1, got {a.page_size}")
    if a.kv_dtype is not None and a.kv_dtype not in KV_DTYPES:
        raise _ArgError(f"--kv_dtype must be bfloat16, int8 or fp8_e4m3, got {a.kv_dtype!r}")
    shape = (a.q_heads, a.kv_heads, a.head_dim)
    if a.all or shape == (None, None, None):
        if a.all and shape != (None, None, None):
            raise _ArgError("--all takes no --q_heads/--kv_heads/--head_dim")
        cases = claimed_cases(platforms, a.page_size)
        return [c for c in cases if a.kv_dtype is None
                or KV_DTYPES[c.kv_dtype] == KV_DTYPES[a.kv_dtype]]
    if None in shape:
        raise _ArgError("give all of --q_heads, --kv_heads and --head_dim (or none, for "
                        "every claimed shape)")
    N, K, H = shape
    if min(shape) < 1 or N % K:
        raise _ArgError(f"--q_heads ({N}) must be a positive multiple of --kv_heads ({K}), "
                        f"--head_dim ({H}) positive")
    if a.sliding_window is not None and a.sliding_window < 1:
        raise _ArgError(f"--sliding_window must be >= 1, got {a.sliding_window}")
    if a.soft_cap is not None and not a.soft_cap > 0:
        raise _ArgError(f"--soft_cap must be > 0, got {a.soft_cap}")
    dt = "float8_e4m3fn" if a.kv_dtype in ("fp8_e4m3", "float8_e4m3fn") else (
        a.kv_dtype or "bfloat16")
    return [Case(p, "custom", N, K, H, a.sliding_window, a.soft_cap, dt, a.page_size, b, T, S)
            for p in platforms for b, T, S in BATCHES]


def main(argv=None, out=sys.stdout) -> int:
    """The CLI; returns the exit status (0 all lowered, 1 a failure, 2 bad flags)."""
    parser = _parser()
    try:
        a = parser.parse_args(argv)
        cases = _cases(a)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _ArgError as e:
        print(f"error: {e}", file=out)
        return 2
    if "tpu" in {c.platform for c in cases}:
        try:
            target_tpu_chip(a.tpu_chip)
        except ValueError as e:
            print(f"error: {e}", file=out)
            return 2
    t0 = time.perf_counter()
    failures = run(cases, out)
    took = time.perf_counter() - t0
    if failures:
        case, first = failures[0]
        print(f"{len(failures)} of {len(cases)} lowerings FAILED in {took:.1f} s; first: "
              f"{case.label()}: {first}", file=out)
        return 1
    print(f"all {len(cases)} lowerings ok in {took:.1f} s", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
