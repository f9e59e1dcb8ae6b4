"""``--quantization auto``: the weight format chosen by measurement, once per machine.

The CPU dev machines differ (AVX2 only, AVX-512, AVX-512 with AMX) and so
do XLA:CPU's and the CPU kernels' relative costs on them: which format
decodes fastest is a property of the machine, not of the model alone. So
``auto`` times the candidate formats on this machine at the model's own
projection shapes and serves the fastest; the answer is cached per
(machine, jax version, the kernel library's bytes, shapes) in
``$JAXSERVE_CACHE/format_choice.json`` (default ``~/.cache/jaxserve``), so
only a machine's first start pays for it (a few seconds).

Candidates are the formats that keep the checkpoint's own numerics:

| checkpoint | candidates | why |
|---|---|---|
| a GGUF file whose projections are all Q8_0 / Q4_0 / Q4_1 blocks | ``none``, ``gguf``, ``gguf_a16`` | ``none`` and ``gguf`` compute with the file's values exactly (``gguf`` keeps the blocks, ``none`` their f32 dequantization): PPL +0.00%. ``gguf_a16`` multiplies the same blocks by int16 blocks of the activations on the integer units: on SmolLM2-135M its PPL is -0.001% of f32's (mean KL < 1e-6 nats, the same top token at every scored position) and 23 of 24 chat answers (first 16 greedy tokens) are f32's, the 24th an equal rewording. ``gguf_a8`` (int8 blocks, llama.cpp's arithmetic) is timed too and reported as the opt-in, not chosen: its PPL is +0.35% on SmolLM2-135M, within the +0.5% a default may cost, but it answers the demo's first prompt as llama.cpp does ("L'Étoile, ..." for "What is the capital of France?", where f32, HF transformers, ``gguf`` and ``gguf_a16`` say Paris; a 0.08-logit margin), and the default path keeps HF transformers' numerics |
| anything else (HF folder, other GGUF types) | ``none`` | another format re-quantizes: its eval differs per model (SmolLM2's: ``benchmarks/quant``), so it stays an explicit choice |
| an Orbax folder | its own | the checkpoint was converted with one |
| GPU / TPU | ``none`` | bf16 with f32 accumulation is the accelerator default |
| under 32 MiB of f32 projection weights | ``none`` | a step is overhead-bound and the formats time alike within noise |
| a multi-host job | ``none`` | each process would measure, and all must build the same model |

A measurement times one program that runs every projection of every layer
(the weights of ``num_layers`` layers, so they stream from memory as a
model's do, plus the LM head) at M = 1 and M = 32 activation columns (a
decode step alone and a batch of 32) through ``quant.quantized_matmul``
(the kernel or XLA form it picks); a candidate's score is the geometric
mean of its two times over ``none``'s, and the lowest score wins, where
it takes at most 97% of the time of every candidate before it in the list
(so ties go to ``none``, then to ``gguf``). The figures are logged and kept in the cache entry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import executables
from jaxserve.models import quant_format

log = logging.getLogger(__name__)

CACHE_FILE = "format_choice.json"
COLUMNS = (1, 32)
TIE = 0.97  # a candidate must take <= 97% of none's time to win
# Below this many bytes of f32 projection weights a step is overhead-bound: the formats
# time alike within noise, so a measurement would pick at random; auto keeps f32.
MIN_WEIGHT_BYTES = 32 << 20
# Timed beside the candidates of a block GGUF file and reported, never chosen (module
# docstring): the same blocks with int8 activations.
# (gguf_a16, a candidate, is the same blocks with int16 activation blocks.)
OPT_IN = "gguf_a8"
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
              "avx512_bf16", "amx_int8", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class FormatChoice:
    """What ``choose`` decided.

    Attributes:
      quantization: the chosen method (``EngineConfig.quantization``).
      candidates: the methods considered.
      score: method -> geometric mean of its times over ``none``'s (1.0 for
        ``none``); empty when nothing was measured.
      ms: method -> {M: ms per pass over every projection} as measured.
      cached: the answer came from the cache file.
      reason: one line for the log and ``/v1/models``-style reports.
    """

    quantization: str
    candidates: tuple[str, ...]
    score: dict
    ms: dict
    cached: bool
    reason: str


def machine_key() -> str:
    """The CPU model name and the vector flags that change which form is fastest."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return f"{name} [{' '.join(f for f in _CPU_FLAGS if f in flags)}]"


def gguf_block_format(path: pathlib.Path):
    """The ``quant.TensorFormat`` of a GGUF file's projections when every one
    of them is a Q8_0 / Q4_0 / Q4_1 block tensor (the most common one if
    mixed), else None."""
    from checkpoints.gguf_loader import KEPT_TYPES, tensor_types
    from jaxserve.models import quant
    proj = [t for n, t in tensor_types(path).items() if quant.is_projection(n)]
    if not proj or any(t not in KEPT_TYPES for t in proj):
        return None
    names = [t.name for t in proj]
    return quant.Q8_0 if max(set(names), key=names.count) == "Q8_0" else quant.Q4


def _candidates(config: EngineConfig):
    """(candidates, the gguf TensorFormat or None, the reason when fixed)."""
    from checkpoints.fetch import resolve_model
    from checkpoints.loader import is_orbax_checkpoint
    if jax.default_backend() != "cpu":
        return ("none",), None, f"{jax.default_backend()}: bf16 weights are the default"
    if jax.process_count() > 1:
        return ("none",), None, "a multi-host job: every process must build the same model"
    if is_orbax_checkpoint(config.model):
        return ("none",), None, "an Orbax checkpoint brings its own quantization"
    path = pathlib.Path(config.model).expanduser()
    if not path.exists():
        path = resolve_model(config.model)
    if path.suffix != ".gguf":
        return ("none",), None, "not a GGUF file: only f32 keeps its numerics"
    fmt = gguf_block_format(path)
    if fmt is None:
        return ("none",), None, "the GGUF file's projections are not all Q8_0/Q4_0/Q4_1 blocks"
    return ("none", "gguf", "gguf_a16"), fmt, ""


def projection_pass(fmt, shapes, layers: int, head: tuple[int, int] | None, M: int):
    """A function that runs one pass over ``layers`` copies of every
    projection in ``shapes`` (a ``lax.scan`` over stacked copies, as the model
    runs its layers) plus the LM head ``head`` [V, D] (None: none) at M
    activation columns, and returns its ms; ``fmt`` None is dense f32. Random
    weights (seed 0). The program is traced, compiled and run once before
    this returns, so it keeps the forms (``quant_matmul_cpu.max_columns``)
    in force now."""
    from jaxserve.models import quant
    rng = np.random.default_rng(0)

    def stored(shape, copies):
        w = rng.standard_normal(shape, dtype=np.float32) * 0.02
        parts = (w,) if fmt is None else (lambda t: (t.q, t.scale, t.zero))(
            quant.quantize_np(w, fmt))
        return tuple(None if a is None else jnp.asarray(np.stack([a] * copies) if copies
                                                         else a) for a in parts)

    stack = [stored(s, layers) for s in shapes]
    head_w = None if head is None else stored(head, 0)
    xs = {d: jnp.asarray(rng.standard_normal((d, M), dtype=np.float32))
          for d in {s[-1] for s in shapes + ([head] if head else [])}}

    def linear(w, x_DT):
        return quant.matmul_parts(fmt, w, x_DT)

    @jax.jit
    def run(stack, head_w, xs):
        # As stack.run_layers runs a model: the stacked projections read at the
        # layer's offset (quant.StackedRead), every output summed into the carry.
        def layer(acc, i):
            ws = [tuple(None if a is None else quant.StackedRead(a, i) for a in w) for w in stack]
            return acc + sum(linear(w, xs[s[-1]]).sum() for w, s in zip(ws, shapes)), None
        acc, _ = jax.lax.scan(layer, jnp.zeros((), jnp.float32), jnp.arange(layers))
        return acc if head_w is None else acc + linear(head_w, xs[head[1]]).sum()

    run(stack, head_w, xs).block_until_ready()

    def one_pass() -> float:
        t = time.perf_counter()
        run(stack, head_w, xs).block_until_ready()
        return 1e3 * (time.perf_counter() - t)
    return one_pass


def time_projections(fmt, shapes, layers: int, head: tuple[int, int] | None, reps: int = 3,
                     columns: tuple[int, ...] = COLUMNS) -> dict:
    """{M: ms} per pass (``projection_pass``) at each of ``columns``: the
    median of ``reps`` timed passes after an untimed one."""
    out = {}
    for M in columns:
        one_pass = projection_pass(fmt, shapes, layers, head, M)
        out[M] = statistics.median(one_pass() for _ in range(reps))
    return out


def layer_shapes(model_config: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of one layer's seven dense projections: q, k, v, o, gate, up,
    down (an MoE model's experts left out: the kernels do not serve them)."""
    from checkpoints.loader import projection_shapes
    shapes = projection_shapes(model_config)[:5]  # q, k(=v), o, gate(=up), down
    return shapes[:2] + shapes[1:4] + shapes[3:]  # v and up counted again


def cache_path() -> pathlib.Path:
    """``$JAXSERVE_CACHE/format_choice.json`` (default ``~/.cache/jaxserve``)."""
    root = os.environ.get("JAXSERVE_CACHE") or os.path.expanduser("~/.cache/jaxserve")
    return pathlib.Path(root) / CACHE_FILE


def read_cache(path: pathlib.Path) -> dict:
    """A per-machine JSON cache file's entries; {} when absent or unreadable."""
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def write_cache(path: pathlib.Path, cache: dict) -> None:
    """Write ``cache`` to ``path`` atomically (a temporary name, then
    ``os.replace``: processes sharing the folder see whole files); a failure
    is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not write %s: %s", path, e)


def choose(config: EngineConfig, model_config: ModelConfig, *, use_cache: bool = True,
           layers: int | None = None) -> FormatChoice:
    """The method ``--quantization auto`` serves ``config.model`` with here.

    Args:
      config: the engine config (``model`` names the checkpoint).
      model_config: the checkpoint's model config (shapes, layer count).
      use_cache: read and write ``$JAXSERVE_CACHE/format_choice.json``.
      layers: layers of weights in the timed program (default the model's).

    Raises:
      ValueError, RuntimeError: as ``checkpoints.fetch.resolve_model`` for a
        model that cannot be found or fetched.
    """
    cands, gguf_fmt, why = _candidates(config)
    shapes = layer_shapes(model_config)
    head = (model_config.vocab_size, model_config.hidden_size)
    layers = layers or model_config.num_layers
    f32_bytes = 4 * layers * sum(math.prod(s) for s in shapes)
    if len(cands) > 1 and f32_bytes < MIN_WEIGHT_BYTES:
        why = (f"{f32_bytes / 2**20:.1f} MiB of f32 projections: overhead-bound, formats time "
               f"alike; f32 kept")
        cands = ("none",)
    if len(cands) == 1:
        return FormatChoice(cands[0], cands, {}, {}, False, why)
    key = (f"{machine_key()} | jax {jax.__version__} | {executables.library_digest()} | "
           f"{gguf_fmt} | {shapes} x {layers} + {head}")
    path = cache_path()
    cache = read_cache(path) if use_cache else {}
    if key in cache and cache[key].get("quantization") in cands:  # else: chosen by other rules
        e = cache[key]
        return FormatChoice(e["quantization"], cands, e["score"], e["ms"], True, e["reason"])
    fmts = {"none": None, "gguf": gguf_fmt,
            **{m: quant_format.adopted_format(gguf_fmt, quant_format.method_format(m))
               for m in ("gguf_a16", "gguf_a8")}}
    ms = {m: time_projections(fmts[m], shapes, layers, head) for m in (*cands, OPT_IN)}
    score = {m: math.exp(statistics.fmean(math.log(ms[m][c] / ms["none"][c]) for c in COLUMNS))
             for m in ms}
    best = pick(score, cands)
    reason = (f"measured on {machine_key()}: " + ", ".join(
        f"{m} {score[m]:.2f}x f32's time (M=1: {ms[m][1]:.1f} ms, M=32: {ms[m][32]:.1f} ms)"
        for m in cands[1:]) + f" (f32: {ms['none'][1]:.1f}, {ms['none'][32]:.1f} ms); "
        f"opt-in {OPT_IN} (int8 activations, llama.cpp's arithmetic) {score[OPT_IN]:.2f}x")
    if use_cache:
        cache[key] = {"quantization": best, "score": score,
                      "ms": {m: {str(c): v for c, v in t.items()} for m, t in ms.items()},
                      "reason": reason}
        write_cache(path, cache)
    return FormatChoice(best, cands, score, ms, False, reason)


def pick(score: dict, cands: tuple[str, ...]) -> str:
    """The candidate with the lowest score that takes at most ``TIE`` of the
    time of every candidate before it in ``cands`` (the order of preference:
    exact numerics first, then ``gguf_a16``); ``cands[0]`` when none does."""
    best = cands[0]
    for i, m in enumerate(cands[1:], 1):
        if score[m] < score[best] and all(score[m] <= TIE * score[c] for c in cands[:i]):
            best = m
    return best


def resolve(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """``config`` with ``quantization="auto"`` replaced by ``choose``'s
    answer (logged); any other config unchanged."""
    if config.quantization != "auto":
        return config
    c = choose(config, model_config)
    # Logged at INFO only when a measurement decided (now or cached): a fixed
    # answer (tiny model, HF folder, GPU) is no news on a CLI's stderr.
    (log.info if c.score else log.debug)("--quantization auto -> %s (%s%s)", c.quantization,
                                         c.reason, ", cached" if c.cached else "")
    return dataclasses.replace(config, quantization=c.quantization)
