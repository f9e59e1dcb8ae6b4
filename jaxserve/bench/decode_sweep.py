"""Decode steps over batch rows and context lengths, beside the bandwidth
roofline: ``python -m jaxserve.bench sweep`` (and ``throughput --sweep``).

Every row count of ``--rows`` at every context of ``--contexts``: each row
has exactly ``ctx`` tokens in its cache (``ctx - 1`` cached, one computed in
the step; ``steps.time_step``) and the step is
``Engine.shaped_step``: step ms = the median of ``--iters``
timed calls after one untimed call (which compiles the row bucket; the K/V
read are zeros, timing does not depend on them), output tokens/s = rows /
step s. Beside each point the bandwidth roofline at the matvec bytes/s
(``machine.measure_limits``): weights = param bytes (every array of the
model's state) / bytes/s, attention = rows x ctx x 2 (K, V) x layers x kv
heads x head dim x the KV dtype's bytes / bytes/s, and their sum. A row count
whose step is more than ``SMOOTH_LIMIT`` (1.25x) the straight line between
its two neighbours in the sweep (same context) is flagged. The KV cache is
sized for max(rows) x max(contexts) tokens, capped (and the report says so,
and which points were skipped) by the memory available at the start minus
``MEMORY_RESERVE`` (4 GiB). ``sweep.png``: step ms against rows, one panel
per context, measured and roofline lines.
"""

from __future__ import annotations

import gc
import sys
import time

import jax
import numpy as np

from jaxserve import LLM
from jaxserve.bench.machine import mem_available
from jaxserve.bench.report import fmt
from jaxserve.bench.steps import time_step
from jaxserve.engine.page_table import cdiv

DEFAULT_ROWS = "1,2,4,8,16,18,24,32,64"
DEFAULT_CONTEXTS = "128,1024,4096"
SMOOTH_LIMIT = 1.25  # step / straight line between the neighbours
MEMORY_RESERVE = 4 << 30  # bytes left to params, XLA programs and the peers
PAGE_SIZE = 16


def log(t0: float, msg: str) -> None:
    print(f"bench [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def param_bytes(engine) -> int:
    """Bytes of every array of the engine's model state (the weights streamed
    once per decode step)."""
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(engine.weights)))


def kv_bytes_per_token(cfg, itemsize: int = 4) -> int:
    """K and V of one token over all layers, bytes (no scales)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def sweep_pages(cfg, rows, contexts, page_size: int) -> tuple[int, int, str | None]:
    """(pages wanted, pages to allocate, why capped or None): enough for
    max(rows) sequences of max(contexts) tokens, within the memory available
    now minus ``MEMORY_RESERVE``."""
    want = max(rows) * cdiv(max(contexts), page_size)
    per_page = kv_bytes_per_token(cfg) * page_size
    avail = mem_available()
    if avail is None or want * per_page <= avail - MEMORY_RESERVE:
        return want, want, None
    got = max(1, (avail - MEMORY_RESERVE) // per_page)
    return want, got, (f"the KV cache was capped at {got} pages ({got * per_page / 2**30:.1f} "
                       f"GiB) of the {want} ({want * per_page / 2**30:.1f} GiB) that "
                       f"{max(rows)} x {max(contexts)} tokens need: {avail / 2**30:.1f} GiB "
                       f"available at the start, {MEMORY_RESERVE >> 30} GiB kept back")


def flag_smoothness(points: list[dict]) -> None:
    """Set ``smooth_ratio`` (step / the straight line between the measured
    neighbours at this row count, same context) and ``smooth_flag`` (ratio >
    ``SMOOTH_LIMIT``) on each measured point; the ends get None / False."""
    for ctx in sorted({p["ctx"] for p in points}):
        pts = sorted((p for p in points if p["ctx"] == ctx and "step_ms" in p),
                     key=lambda p: p["rows"])
        for p in pts:
            p["smooth_ratio"], p["smooth_flag"] = None, False
        for a, p, b in zip(pts, pts[1:], pts[2:]):
            line = a["step_ms"] + (b["step_ms"] - a["step_ms"]) * (p["rows"] - a["rows"]) / (
                b["rows"] - a["rows"])
            p["smooth_ratio"] = p["step_ms"] / line
            p["smooth_flag"] = p["smooth_ratio"] > SMOOTH_LIMIT


def run_points(engine, rows, contexts, iters: int, limits: dict, t0: float) -> list[dict]:
    """Every (ctx, rows) decode point; see the module docstring."""
    cfg = engine.model_config
    bps = limits["matvec_bytes_per_s"]
    pbytes = param_bytes(engine)
    per_tok = kv_bytes_per_token(cfg, engine.kv_dtype.itemsize)
    rng = np.random.default_rng(0)
    points = []
    for ctx in contexts:
        for n in rows:
            p = {"rows": n, "ctx": ctx, "weights_ms": 1e3 * pbytes / bps,
                 "attention_ms": 1e3 * n * ctx * per_tok / bps}
            p["roofline_ms"] = p["weights_ms"] + p["attention_ms"]
            points.append(p)
            need = n * cdiv(ctx, engine.page_size)
            if need > engine.num_free_pages:
                p["skipped"] = f"needs {need} KV pages, the cache has {engine.num_free_pages}"
                log(t0, f"sweep rows {n} ctx {ctx}: skipped ({p['skipped']})")
                continue
            st = time_step(engine, n, 1, ctx, iters, rng)
            s = st["median_s"]
            p.update(step_ms=1e3 * s, tokens_per_s=n / s, first_call_s=st["first_call_s"],
                     iters=iters, min_ms=1e3 * st["min_s"], max_ms=1e3 * st["max_s"],
                     compilations_timed=st["compilations"],
                     vs_roofline=1e3 * s / p["roofline_ms"])
            log(t0, f"sweep rows {n:>3} ctx {ctx:>5}: {p['step_ms']:8.2f} ms/step, "
                    f"{p['tokens_per_s']:7.1f} tok/s, roofline {p['roofline_ms']:.2f} ms "
                    f"(first call {st['first_call_s']:.1f} s)")
    flag_smoothness(points)
    return points


def run(name: str, parts: dict, quantization: str, rows, contexts, iters: int, limits: dict,
        xla_dir: str, t0: float) -> tuple[dict, int]:
    """Build the sweep's engine (f32, ``quantization`` weights, prefix
    caching off, a KV cache for the sweep: ``sweep_pages``), run every point,
    free the engine; returns (the ``sweep`` entry of the JSON, param bytes)."""
    cfg = parts["model_config"]
    want, got, cap = sweep_pages(cfg, rows, contexts, PAGE_SIZE)
    if cap:
        log(t0, cap)
    llm = LLM(name, **parts, dtype="float32", page_size=PAGE_SIZE, quantization=quantization,
              kv_cache_memory_bytes=got * kv_bytes_per_token(cfg) * PAGE_SIZE,
              max_num_seqs=max(rows), max_model_len=max(contexts) + 1,
              enable_prefix_caching=False, compilation_cache_dir=xla_dir)
    engine = llm.engine
    pbytes = param_bytes(engine)
    log(t0, f"sweep engine: {engine.num_pages} KV pages ({engine.num_pages * PAGE_SIZE} tokens)")
    sweep = {"iters": iters, "rows": rows, "contexts": contexts, "kv_pages": engine.num_pages,
             "kv_pages_wanted": want, "page_size": PAGE_SIZE,
             "max_model_len": engine.max_model_len, "cap_note": cap,
             "quantization": quantization,
             "points": run_points(engine, rows, contexts, iters, limits, t0)}
    del llm, engine
    gc.collect()
    jax.clear_caches()
    return sweep, pbytes


def markdown(sw: dict) -> list[str]:
    """The report's ``## Decode sweep`` section (lines)."""
    lines = ["## Decode sweep", "",
             f"Median of {sw['iters']} timed `Engine.shaped_step` steps after one untimed "
             "call; every row has `ctx` tokens in its cache. Roofline = weights + attention "
             "bytes at the matvec bytes/s. `smooth`: step / the straight line between its "
             f"neighbours; **flagged** above {SMOOTH_LIMIT}x. Weights "
             f"{sw.get('quantization', 'none')} (none = f32), KV f32.", ""]
    if sw.get("cap_note"):
        lines += [f"**{sw['cap_note']}.**", ""]
    lines += ["| ctx | rows | step ms | out tok/s | weights ms | attention ms | roofline ms "
              "| step / roofline | smooth | compiles (timed) |", "|" + "---:|" * 10]
    for p in sw["points"]:
        if "step_ms" not in p:
            lines.append(f"| {p['ctx']} | {p['rows']} | skipped: {p['skipped']} | | | | | | | |")
            continue
        sm = fmt(p.get("smooth_ratio"), "{:.2f}x")
        if p.get("smooth_flag"):
            sm = f"**{sm} flagged**"
        lines.append(f"| {p['ctx']} | {p['rows']} | {p['step_ms']:.2f} | "
                     f"{p['tokens_per_s']:.1f} | {p['weights_ms']:.2f} | "
                     f"{p['attention_ms']:.2f} | {p['roofline_ms']:.2f} | "
                     f"{p['vs_roofline']:.2f}x | {sm} | {p['compilations_timed']} |")
    return lines + [""]


def plot(result: dict, path: str, plt) -> None:
    """``sweep.png``: step ms against rows, one panel per context."""
    pts = result["sweep"]["points"]
    ctxs = sorted({p["ctx"] for p in pts})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        ps = sorted((p for p in pts if p["ctx"] == ctx), key=lambda p: p["rows"])
        rows = [p["rows"] for p in ps]
        ax.plot(rows, [p["roofline_ms"] for p in ps], "k--", label="roofline (weights + KV)")
        ax.plot(rows, [p["weights_ms"] for p in ps], "k:", label="weights alone")
        got = [p for p in ps if "step_ms" in p]
        ax.plot([p["rows"] for p in got], [p["step_ms"] for p in got], "o-", label="measured")
        bad = [p for p in got if p.get("smooth_flag")]
        if bad:
            ax.plot([p["rows"] for p in bad], [p["step_ms"] for p in bad], "rs", ms=10,
                    mfc="none", label=f"> {SMOOTH_LIMIT}x neighbours' line")
        ax.set(title=f"ctx {ctx}", xlabel="rows (sequences decoding)", ylabel="step ms",
               ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"jaxserve decode steps, {result['model']} f32, on "
                 f"{result['machine']['cpu_model']} ({result['machine']['cpu_count']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
