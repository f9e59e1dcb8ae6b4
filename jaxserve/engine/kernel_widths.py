"""The CPU kernel's column limits, measured once per machine.

``quant.matmul_parts`` runs a projection on the CPU kernel library
(``pallas_kernels.quant_matmul_cpu``) or on XLA's form of its format
(``quant.quantized_matmul``), by the number of activation columns M:
``quant_matmul_cpu.use_kernel`` serves M up to a limit per kernel kind
(``int8``, ``w8a8``, ``q8g`` = Q8_0-style groups, ``q4g`` = 4-bit groups,
``f32`` = a scanned layer's dense weight). Both forms compute the format's
values (w8a8: the same integer sums; the others: the same dequantized
weights with f32 sums, in another order; ``int8``'s XLA form writes the
activations as two int8 terms, ~16 bits, where the kernel takes them as
they are), so the limit is a matter of speed only, and speed depends on the
machine: the built-in table was measured on an AVX-512 + AMX Xeon, where
XLA's int8 dot runs on AMX and beats the kernel from M = 2; on an AMD EPYC
(AVX-512, no AMX) the kernel's int8 panels take 0.6-0.85x XLA's time at
every M from 1 to 256 (30 SmolLM2 layers' projections, one process).

So an engine on CPU whose model is large enough to be weight-bound (the
same 32 MiB floor as ``format_choice``) measures, for each kernel kind its
weights use, both forms at ``COLUMNS`` on its own layer shapes (a
``lax.scan`` over all its layers' stacked copies, as the model runs: with
fewer layers the weights sit in the caches and XLA's forms gain, so int8's
limit on the EPYC fell from 128 to 32) and installs the largest M up to
which the kernel was faster at every measured width
(``quant_matmul_cpu.set_max_columns``). Measuring stops at the first width
the kernel loses. For ``int8`` it first times XLA's two forms at
``WIDE_COLUMNS``: x as two int8 terms through XLA's int8 dot, or the weight
dequantized to f32 first (``quant_cpu.set_int8_wide_form``; on the EPYC
the second takes 0.65-0.7x the first's time, on the AMX Xeon the int8 dot
wins; the Xeon table in ``quant_matmul_cpu``: 241 against f32's 865 ms at
M = 512), and the kernel is then timed against the faster. Answers are
cached per (machine, jax version, the kernel library's bytes, kind, shapes) in
``$JAXSERVE_CACHE/kernel_widths.json``, so a machine's first start of a kind
pays for it and later starts nothing (SmolLM2-135M on the 2-core EPYC:
3-19 s a kind).

The table is the process's (a machine property): a kind is resolved once
per process, by the first engine that uses it; later engines, tiny ones
included, read it. ``JAXSERVE_KERNEL_WIDTHS=builtin`` keeps the built-in
table (no measurement); a multi-host job always does (every process must
trace the same programs). Measuring sets the table's entry for the kind it
times: a program another engine in the process traces meanwhile (a
background warm-up) may take the temporary limit, which changes its speed,
never its values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import threading

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.engine import executables, format_choice

log = logging.getLogger(__name__)

CACHE_FILE = "kernel_widths.json"
# Activation columns measured, in order; the limit is one of them (or 0).
COLUMNS = (1, 8, 32, 128, 256, 512)
# The block-activation kinds' (gguf_a8, gguf_a16) widths: their VNNI panels run from
# 12 columns on (kernel_a8.cc's kA8Panel; below, the same row tiles as the XLA form's), and
# measured faster than XLA's f32 dot up to a prefill chunk's (0.45x its time at 512
# columns on the EPYC), so up to the default token budget.
A8_COLUMNS = (32, 128, 512, 2048)
WIDE_COLUMNS = 512  # int8's two XLA forms past the kernel: a prefill's width
STREAM_COLUMNS = 32  # up to this many columns a pass runs over every layer (``layers_at``)
REPS = 3  # timed passes of each form, alternated; the median
ENV = "JAXSERVE_KERNEL_WIDTHS"  # "measure" (default) or "builtin"

_lock = threading.Lock()
_resolved: dict[str, "KindWidth"] = {}  # kind -> what set this process's limit


@dataclasses.dataclass(frozen=True)
class KindWidth:
    """One kernel kind's limit in this process.

    Attributes:
      kind: the kernel kind (``quant_matmul_cpu.BUILTIN_MAX_COLUMNS``' keys).
      max_columns: the largest M the kernel serves (0: never).
      ms: {M: (XLA form ms, kernel ms)} per pass as measured; empty when not.
      source: ``"measured"``, ``"cached"`` or ``"builtin"``.
      reason: one line for the log.
      wide_form: ``int8`` only, ``quant_cpu.int8_wide_form``'s value past the
        kernel; None for the other kinds.
      wide_ms: {form: ms} per pass at ``WIDE_COLUMNS`` as measured, or {}.
    """

    kind: str
    max_columns: int
    ms: dict
    source: str
    reason: str
    wide_form: str | None = None
    wide_ms: dict = dataclasses.field(default_factory=dict)


def limit_from(ms: dict) -> int:
    """The largest measured M up to which the kernel was faster at every
    measured width (``ms``: {M: (xla_ms, kernel_ms)}); 0 if it lost at the
    smallest."""
    limit = 0
    for M in sorted(ms):
        xla, kernel = ms[M]
        if kernel >= xla:
            break
        limit = M
    return limit


def kinds_of(model, quantization: str, dtype) -> list[str]:
    """The kernel kinds ``model``'s weights use: each quantized weight's format
    (``quant_cpu.kernel_kind``; the LM head included), plus ``"f32"`` for a
    dense f32 model (``quantization="none"``)."""
    from flax import nnx

    from jaxserve.models import quant, quant_cpu
    fmts = {node.fmt for _, node in nnx.iter_graph(model)
            if isinstance(node, quant.QuantizedWeight) and node.fmt.bits != 0}
    # gguf_a8's / a16's block-activation kinds, and the weight-only ones their narrow
    # widths take
    kinds = {quant_cpu.kernel_kind(f) for f in fmts | {f.weight_only() for f in fmts}}
    if quantization == "none" and jnp.dtype(dtype) == jnp.float32:
        kinds.add("f32")
    return sorted(k for k in kinds if k is not None)


def _format_of(kind: str):
    from jaxserve.models import quant
    if "_a" in kind:  # q4g_a8, q8g_a16, ...
        base, bits = kind.split("_a")
        return dataclasses.replace(_format_of(base), act_block=quant.ACT_BLOCK, act_bits=int(bits))
    return {"int8": quant.INT8, "w8a8": quant.W8A8, "q8g": quant.Q8_0, "q4g": quant.Q4,
            "f32": None}[kind]


def _alternated(passes: dict, reps: int) -> dict:
    """{name: median ms} of ``passes`` ({name: ``format_choice.projection_pass``}),
    timed in turn ``reps`` times, so drift on a shared machine hits each alike."""
    times = {name: [] for name in passes}
    for _ in range(reps):
        for name, one_pass in passes.items():
            times[name].append(one_pass())
    return {name: statistics.median(t) for name, t in times.items()}


def layers_at(M: int, layers: int) -> int:
    """Layers a pass at M columns runs over: all of them up to
    ``STREAM_COLUMNS``, where a step streams its weights from memory, and
    from there a share with about the same work (ceil(layers *
    STREAM_COLUMNS / M), at least 1): a wide step is compute-bound, so the
    ratio of the two forms holds on fewer layers, and a first start does not
    spend its measurement on 2,048-column passes over every layer (SmolLM2's
    two int16-activation kinds: 47 -> 7 s on the EPYC, its four kinds 71 -> 15 s)."""
    return layers if M <= STREAM_COLUMNS else max(1, -(-layers * STREAM_COLUMNS // M))


def measure(kind: str, shapes, layers: int, reps: int = REPS,
            columns: tuple[int, ...] = COLUMNS) -> dict:
    """{M: (XLA form ms, kernel ms)} per pass over ``layers_at(M, layers)``
    layers of ``shapes`` in ``kind``'s format
    (``format_choice.projection_pass``, the two forms alternated ``reps``
    times), from the smallest M until the kernel loses. Sets this process's
    limit for ``kind`` while each program traces, and restores it."""
    from pallas_kernels import quant_matmul_cpu
    fmt, out = _format_of(kind), {}
    previous = quant_matmul_cpu.max_columns()
    try:
        for M in columns:
            passes = {}
            for name, limit in (("xla", 0), ("kernel", M)):
                quant_matmul_cpu.set_max_columns({kind: limit})
                passes[name] = format_choice.projection_pass(fmt, shapes, layers_at(M, layers),
                                                             None, M)
            ms = _alternated(passes, reps)
            out[M] = (ms["xla"], ms["kernel"])
            if ms["kernel"] >= ms["xla"]:
                break
    finally:
        quant_matmul_cpu.set_max_columns(previous)
    return out


def measure_int8_wide(shapes, layers: int, reps: int = REPS, M: int = WIDE_COLUMNS) -> dict:
    """{form: ms} per pass over ``layers_at(M, layers)`` layers of ``shapes``
    in int8 at M columns with the kernel off, for each of ``quant_cpu.INT8_WIDE_FORMS``
    (alternated). Restores this process's int8 limit and wide form."""
    from jaxserve.models import quant, quant_cpu
    from pallas_kernels import quant_matmul_cpu
    limits, form = quant_matmul_cpu.max_columns(), quant_cpu.int8_wide_form()
    passes = {}
    try:
        quant_matmul_cpu.set_max_columns({"int8": 0})
        for f in quant_cpu.INT8_WIDE_FORMS:
            quant_cpu.set_int8_wide_form(f)
            passes[f] = format_choice.projection_pass(quant.INT8, shapes, layers_at(M, layers),
                                                      None, M)
    finally:
        quant_matmul_cpu.set_max_columns(limits)
        quant_cpu.set_int8_wide_form(form)
    return _alternated(passes, reps)


def _key(kind: str, shapes, layers: int) -> str:
    return (f"{format_choice.machine_key()} | jax {jax.__version__} | "
            f"{executables.library_digest()} | {kind} | {shapes} x {layers}")


def choose(kind: str, model_config: ModelConfig, *, use_cache: bool = True,
           layers: int | None = None) -> KindWidth:
    """``kind``'s limit on this machine for ``model_config``'s layer shapes:
    the cached answer, else measured (``measure``; int8 also
    ``measure_int8_wide``) and cached; the built-in limit (and int8's
    ``"int8_dot"``) where the library is not built, ``JAXSERVE_KERNEL_WIDTHS``
    is ``builtin``, the job has several processes, or the model's f32
    projections are under ``format_choice.MIN_WEIGHT_BYTES``.

    Raises:
      ValueError: ``JAXSERVE_KERNEL_WIDTHS`` is neither ``measure`` nor
        ``builtin``.
    """
    from jaxserve.models import quant_cpu
    from pallas_kernels import quant_matmul_cpu
    builtin = quant_matmul_cpu.BUILTIN_MAX_COLUMNS[kind]
    builtin_wide = quant_cpu.INT8_WIDE_FORMS[0] if kind == "int8" else None
    mode = os.environ.get(ENV, "measure")
    if mode not in ("measure", "builtin"):
        raise ValueError(f"{ENV} must be 'measure' or 'builtin', got {mode!r}")
    shapes = format_choice.layer_shapes(model_config)
    layers = layers or model_config.num_layers
    f32_bytes = 4 * layers * sum(math.prod(s) for s in shapes)
    why = ("the kernel library is not built" if not quant_matmul_cpu.available()
           else f"{ENV}=builtin" if mode == "builtin"
           else "a multi-host job" if jax.process_count() > 1
           else f"{f32_bytes / 2**20:.1f} MiB of f32 projections: overhead-bound"
           if f32_bytes < format_choice.MIN_WEIGHT_BYTES else "")
    if why:
        return KindWidth(kind, builtin, {}, "builtin", f"built-in table ({why})", builtin_wide)
    key = _key(kind, shapes, layers)
    path = format_choice.cache_path().with_name(CACHE_FILE)
    cache = format_choice.read_cache(path) if use_cache else {}
    if key in cache:
        e = cache[key]
        ms = {int(M): tuple(t) for M, t in e["ms"].items()}
        return KindWidth(kind, e["max_columns"], ms, "cached", e["reason"], e.get("wide_form"),
                         e.get("wide_ms", {}))
    wide_ms, wide, reason = {}, builtin_wide, f"measured on {format_choice.machine_key()}: "
    if kind == "int8":  # XLA's faster int8 form first: the kernel must beat that one
        wide_ms = measure_int8_wide(shapes, layers)
        wide = min(wide_ms, key=wide_ms.get)
        reason += (f"int8 XLA forms at M={WIDE_COLUMNS} "
                   + ", ".join(f"{f} {t:.1f} ms" for f, t in wide_ms.items()) + f" -> {wide}; ")
    form = quant_cpu.set_int8_wide_form(wide) if wide else None
    try:
        ms = measure(kind, shapes, layers,
                     columns=A8_COLUMNS if "_a" in kind else COLUMNS)
    finally:
        if form:
            quant_cpu.set_int8_wide_form(form)
    limit = limit_from(ms)
    reason += (f"{kind} kernel / XLA form " + ", ".join(f"M={M} {k / x:.2f}"
                                                       for M, (x, k) in ms.items())
               + f" -> kernel up to M={limit} (built-in {builtin})")
    if use_cache:
        cache = format_choice.read_cache(path)  # another process may have written meanwhile
        cache[key] = {"max_columns": limit, "reason": reason, "wide_form": wide,
                      "wide_ms": wide_ms, "ms": {str(M): list(t) for M, t in ms.items()}}
        format_choice.write_cache(path, cache)
    return KindWidth(kind, limit, ms, "measured", reason, wide, wide_ms)


def resolve(model, model_config: ModelConfig, quantization: str, dtype) -> dict[str, KindWidth]:
    """Install this machine's limits (``choose``; int8's wide form too) for the
    kinds ``model`` uses that this process has not resolved yet (CPU backend
    only); returns
    {kind: KindWidth} for every kind the model uses. Logged at INFO when a
    measurement decided (now or cached)."""
    if jax.default_backend() != "cpu":
        return {}
    from jaxserve.models import quant_cpu
    from pallas_kernels import quant_matmul_cpu
    out = {}
    with _lock:
        for kind in kinds_of(model, quantization, dtype):
            if kind not in _resolved:
                w = choose(kind, model_config)
                quant_matmul_cpu.set_max_columns({kind: w.max_columns})
                if w.wide_form is not None:
                    quant_cpu.set_int8_wide_form(w.wide_form)
                _resolved[kind] = w
                (log.info if w.ms else log.debug)(
                    "CPU kernel widths: %s up to M=%d (%s%s)", kind, w.max_columns, w.reason,
                    ", cached" if w.source == "cached" else "")
            out[kind] = _resolved[kind]
    return out


def resolved() -> dict[str, KindWidth]:
    """The kinds this process has resolved, and how (a copy)."""
    with _lock:
        return dict(_resolved)
