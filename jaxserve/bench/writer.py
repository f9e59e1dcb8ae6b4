"""The issue-16 benchmark: ``python -m jaxserve.bench.writer --output DIR``.

One run, on the machine at hand, on the same prompts for every engine:

1. **Machine**: ``lscpu``'s model name and AVX flags (avx, avx2, avx512*),
   cores, memory available, load average, jax version; and its limits,
   measured in the same run: matmul FLOP/s (a 2048^3 f32 matmul, ``2 n^3``
   FLOPs, ``roofline.measure_ceilings``, which also gives the in-place copy's
   bytes/s) and matvec bytes/s (``W @ x``, W f32[8192, 8192], bytes = the
   matrix's 256 MiB), each the median of a few timed runs after one warm-up.
2. **Decode sweep** (jaxserve, f32): every row count of ``--rows`` at every
   context of ``--contexts``; each row has exactly ``ctx`` tokens in its
   cache (``ctx - 1`` cached, one computed in the step; pages allocated by
   hand, ``device._step_batch``) and the step is ``engine.runner.execute`` of
   that batch: step ms = the median of ``--iters`` timed calls after one
   untimed call (which compiles the row bucket; the K/V read are zeros,
   timing does not depend on them), output tokens/s = rows / step s. Beside
   each point the bandwidth roofline at the matvec bytes/s: weights = param
   bytes (every array of the model's state) / bytes/s, attention = rows x
   ctx x 2 (K, V) x layers x kv heads x head dim x 4 bytes / bytes/s, and their
   sum. A row count whose step is more than 1.25x the straight line between
   its two neighbours in the sweep (same context) is flagged (the issue's
   smoothness target). The KV cache is sized for max(rows) x max(contexts)
   tokens, capped (and the report says so, and which points were skipped) by
   the memory available at the start minus 4 GiB. ``sweep.png``: step ms
   against rows, one panel per context, measured and roofline lines.
3. **W1 and W2** (jaxserve, HF transformers, llama.cpp): W1 = 32 requests of
   ~118 prompt tokens (``chat``-shaped, +-10%) x 128 output tokens, all sent
   at once; output tok/s = all output tokens / (first send to last token).
   W2 = one 940-token prompt (``rag``-shaped: documents, then a question)
   then 128 output tokens: TTFT ms (send to first token) and TPOT ms (mean gap
   between tokens after the first). Greedy, EOS ignored: every engine writes
   exactly 128 tokens per request. jaxserve runs in-process on a second
   engine with ``LLM``'s default serving settings (``engine.warmup()`` first;
   each workload once untimed, then timed; XLA compilations are counted
   around every timed pass and must be 0). HF transformers loads the same
   GGUF (``gguf_file=``, dequantized to f32) and runs W1 as one static batch
   of 32 (``peers.run_hf``); llama.cpp (``llama-cpp-python``, the GGUF's own
   quantization, e.g. Q4_1 -- not f32) runs W1 one request at a time
   (``peers.run_llama_cpp``: its Python API runs one sequence). Each peer gets
   a 2-token untimed warm-up. The first 16 greedy tokens are compared with
   jaxserve's (token agreement).
4. **Weight formats and KV dtypes** (issue 17, ``--formats none,int8,w8a8,
   int4,gguf --kv_cache_dtypes auto,int8``): jaxserve's W1 and W2 again for
   every other (format, KV dtype) pair, one engine at a time at the same
   ``--kv_cache_mib`` budget, with weight bytes, KV pages, ratios to f32 /
   HF / llama.cpp, MBU and the issue-17 targets (``quant_bench``). The sweep
   stays f32 unless ``--sweep_format`` names another.
5. ``result.json`` (every figure), ``report.md`` (the tables: the figures with
   the machine named, the ratios jaxserve/HF and jaxserve/llama.cpp, the
   issue's targets evaluated) and ``sweep.png`` in ``--output``; the report
   is also printed. Targets: W2 TPOT <= 0.45x HF's and <= 1.6x the f32
   weight-streaming time; W2 TTFT <= 0.7x HF's; W1 output tok/s >= 2.5x HF's;
   a smooth sweep; zero compilations in timed passes.

``--smoke`` runs a tiny random config at tiny shapes with no peers (under a
minute; its figures mean nothing), for the test. Times are
``time.perf_counter`` / ``time.monotonic`` seconds, shown in ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

from jaxserve.bench import peers as peers_mod
from jaxserve.bench import quant_bench

DEFAULT_ROWS = "1,2,4,8,16,18,24,32,64"
DEFAULT_CONTEXTS = "128,1024,4096"
SMOOTH_LIMIT = 1.25  # step / straight line between the neighbours
MEMORY_RESERVE = 4 << 30  # bytes left to params, XLA programs and the peers
AGREEMENT_TOKENS = 16
BUSY_LOAD = 0.5  # 1-minute load average at the start above which the report warns


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The workloads' sizes: W1 ``w1_requests`` x ~``w1_prompt`` -> ``output``
    tokens, W2 one ``w2_prompt`` -> ``output``; and the limits' sizes."""

    w1_requests: int = 32
    w1_prompt: int = 118
    w2_prompt: int = 940
    output: int = 128
    matmul_n: int = 2048
    matvec_n: int = 8192
    copy_mib: int = 256


SMOKE_SHAPES = Shapes(w1_requests=4, w1_prompt=12, w2_prompt=40, output=8, matmul_n=128,
                      matvec_n=512, copy_mib=4)
HOW = {"jaxserve": "in-process `LLM`/`Engine`, continuous batching, f32",
       "hf": "transformers `generate`, f32 (GGUF dequantized), W1 as one static batch of all "
             "requests",
       "llama_cpp": "llama-cpp-python, the GGUF's own quantization, W1 **sequential** (one "
                    "request at a time)"}
LABEL = {"jaxserve": "jaxserve", "hf": "HF transformers", "llama_cpp": "llama.cpp"}


def _log(t0: float, msg: str) -> None:
    print(f"writer [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def _int_list(spec: str, name: str) -> list[int]:
    try:
        xs = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"{name} wants a comma list of integers >= 1, "
                                         f"got {spec!r}")
    return xs


def _mem_available() -> int | None:
    """MemAvailable of ``/proc/meminfo``, bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


# ---- 1. machine ---------------------------------------------------------------------

def machine() -> dict:
    """CPU model, AVX flags, cores, memory, load, versions (no measuring)."""
    import jax
    model, flags = platform.processor() or "?", []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
        if m := re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE):
            model = m[1].strip()
        if m := re.search(r"^Flags:\s*(.+)$", out, re.MULTILINE):
            flags = sorted(f for f in m[1].split() if f.startswith("avx"))
    except (OSError, subprocess.SubprocessError):
        pass
    versions = {name: peers_mod.version(name) if peers_mod.available(name) is None else None
                for name in peers_mod.PEERS}
    return {"cpu_model": model, "avx_flags": flags, "cpu_count": os.cpu_count(),
            "mem_available_bytes": _mem_available(), "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "peer_versions": versions,
            "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def measure_limits(shapes: Shapes, iters: int = 5) -> dict:
    """Matmul FLOP/s, matvec bytes/s and copy bytes/s of the first device (f32)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.bench import roofline
    from pallas_kernels.bench import median_time
    t = time.monotonic()
    ceil = roofline.measure_ceilings("float32", matmul_n=shapes.matmul_n,
                                     copy_mib=shapes.copy_mib, iters=iters)
    n = shapes.matvec_n
    w = jnp.ones((n, n), jnp.float32)
    x = jnp.ones((n,), jnp.float32)
    matvec_s = median_time(jax.jit(lambda a, b: a @ b), w, x, iters=iters, warmup=1)
    nbytes = w.nbytes
    del w, x
    return {"matmul_flops_per_s": ceil.flops_per_s, "matmul": f"{shapes.matmul_n}^3 f32",
            "matvec_bytes_per_s": nbytes / matvec_s, "matvec": f"f32[{n}, {n}] @ f32[{n}]",
            "matvec_bytes": nbytes, "matvec_ms": 1e3 * matvec_s,
            "copy_bytes_per_s": ceil.bytes_per_s, "copy": ceil.source, "iters": iters,
            "seconds": time.monotonic() - t}


# ---- 2. decode sweep ----------------------------------------------------------------

def param_bytes(engine) -> int:
    """Bytes of every array of the engine's model state (the weights streamed
    once per decode step)."""
    import jax
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(engine.runner.state)))


def kv_bytes_per_token(cfg, itemsize: int = 4) -> int:
    """K and V of one token over all layers, bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def sweep_pages(cfg, rows, contexts, page_size: int) -> tuple[int, int, str | None]:
    """(pages wanted, pages to allocate, why capped or None): enough for
    max(rows) sequences of max(contexts) tokens, within the memory available
    now minus ``MEMORY_RESERVE``."""
    from jaxserve.engine.page_table import cdiv
    want = max(rows) * cdiv(max(contexts), page_size)
    per_page = kv_bytes_per_token(cfg) * page_size
    avail = _mem_available()
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


def run_sweep(engine, rows, contexts, iters: int, limits: dict, t0: float) -> list[dict]:
    """Every (ctx, rows) decode point; see the module docstring."""
    import numpy as np

    from jaxserve.bench.device import _step_batch
    from jaxserve.engine.page_table import cdiv
    cfg, runner = engine.model_config, engine.runner
    bps = limits["matvec_bytes_per_s"]
    pbytes = param_bytes(engine)
    per_tok = kv_bytes_per_token(cfg, runner.kv_dtype.itemsize)
    rng = np.random.default_rng(0)
    points = []
    for ctx in contexts:
        for n in rows:
            p = {"rows": n, "ctx": ctx, "weights_ms": 1e3 * pbytes / bps,
                 "attention_ms": 1e3 * n * ctx * per_tok / bps}
            p["roofline_ms"] = p["weights_ms"] + p["attention_ms"]
            points.append(p)
            need = n * cdiv(ctx, engine.allocator.page_size)
            if need > engine.allocator.num_free_pages:
                p["skipped"] = (f"needs {need} KV pages, the cache has "
                                f"{engine.allocator.num_free_pages}")
                _log(t0, f"sweep rows {n} ctx {ctx}: skipped ({p['skipped']})")
                continue
            batch, reqs = _step_batch(engine, n, 1, ctx, rng)
            try:
                t = time.perf_counter()
                runner.execute(batch)  # compiles the row bucket on its first use
                first = time.perf_counter() - t
                comp = runner.num_compilations
                times = []
                for _ in range(iters):
                    t = time.perf_counter()
                    runner.execute(batch)  # returns host arrays: synchronised
                    times.append(time.perf_counter() - t)
                comp = runner.num_compilations - comp
            finally:
                for r in reqs:
                    engine.allocator.free(r.page_ids)
            s = statistics.median(times)
            p.update(step_ms=1e3 * s, tokens_per_s=n / s, first_call_s=first, iters=iters,
                     min_ms=1e3 * min(times), max_ms=1e3 * max(times),
                     compilations_timed=comp, vs_roofline=1e3 * s / p["roofline_ms"])
            _log(t0, f"sweep rows {n:>3} ctx {ctx:>5}: {p['step_ms']:8.2f} ms/step, "
                     f"{p['tokens_per_s']:7.1f} tok/s, roofline {p['roofline_ms']:.2f} ms "
                     f"(first call {first:.1f} s)")
    flag_smoothness(points)
    return points


# ---- 3. W1 and W2 -------------------------------------------------------------------

def make_prompts(tokenizer, vocab_size: int, shapes: Shapes, seed: int = 0):
    """(W1 requests, W2 request): see the module docstring. Without a
    tokenizer the ids are random (seeded)."""
    import numpy as np

    from jaxserve.bench import workloads
    from jaxserve.bench.workloads import BenchRequest, make_requests
    w1 = [dataclasses.replace(r, output_len=shapes.output) for r in make_requests(
        tokenizer, vocab_size, "chat", shapes.w1_requests, seed=seed,
        scale=shapes.w1_prompt / workloads.SHAPES["chat"].input_len)]
    rng = np.random.default_rng(seed + 1)
    text = workloads._Text(tokenizer, vocab_size, rng)
    n = shapes.w2_prompt
    head = text.encode("Use the documents below to answer the question.\n\nDocument 1: ")
    q = workloads.QUESTIONS[int(rng.integers(len(workloads.QUESTIONS)))]
    tail = text.encode(f"\n\nQuestion: {q}\nAnswer:")
    ids = ((head + text.shuffled(n))[:max(0, n - len(tail))] + tail)[-n:]
    return w1, BenchRequest("rag", [int(i) for i in ids], shapes.output)


def _agreement(recs, ref) -> float | None:
    """Fraction of requests whose first ``AGREEMENT_TOKENS`` tokens equal ``ref``'s."""
    pairs = [(a.token_ids, b.token_ids) for a, b in zip(recs, ref or [])
             if a.token_ids is not None and b.token_ids is not None]
    if not pairs:
        return None
    return sum(a[:AGREEMENT_TOKENS] == b[:AGREEMENT_TOKENS] for a, b in pairs) / len(pairs)


def w1_figures(records) -> dict:
    """Output tok/s of W1 = output tokens / (first send to last token)."""
    from jaxserve.bench import stats
    wall = stats.duration_s(records)
    out_tokens = sum(r.output_tokens for r in records)
    s = stats.summarize(records)
    return {"requests": len(records), "completed": s["completed"], "output_tokens": out_tokens,
            "output_tokens_each": sorted({r.output_tokens for r in records}), "wall_s": wall,
            "output_tok_per_s": out_tokens / wall if wall > 0 else None,
            "ttft_ms_p50": s["ttft_ms"]["p50"], "tpot_ms_mean": s["tpot_ms"]["mean"]}


def w2_figures(records) -> dict:
    """TTFT and TPOT (mean gap after the first token) of W2's one request, ms."""
    r = records[0]
    return {"ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms, "e2e_ms": r.e2e_ms,
            "output_tokens": r.output_tokens}


def run_jaxserve(engine, w1, w2, t0: float, warmup: bool = True) -> tuple[dict, dict]:
    """Warm-up (unless ``warmup`` is False: the untimed pass then compiles
    what W1 and W2 need, and the timed passes still count 0), then W1 and W2
    untimed and timed on ``engine``; returns (entry, {"w1": records, "w2": records})."""
    from jaxserve.bench import serving
    t = time.monotonic()
    comp = engine.stats().num_compilations
    if warmup:
        engine.warmup(lambda i, T, s: _log(t0, f"warm-up: step of {T} tokens ready ({s:.1f} s)")
                      if i % 8 == 0 else None)
    entry = {"how": HOW["jaxserve"], "warmup": {
        "seconds": time.monotonic() - t, "step_token_counts": len(engine.step_token_counts()),
        "compilations": engine.stats().num_compilations - comp}}
    t = time.monotonic()
    comp = engine.stats().num_compilations
    serving.run_inprocess(engine, w1, len(w1))
    serving.run_inprocess(engine, [w2], 1)
    entry["untimed_pass"] = {"seconds": time.monotonic() - t,
                             "compilations": engine.stats().num_compilations - comp}
    _log(t0, f"jaxserve untimed W1+W2: {entry['untimed_pass']['compilations']} compilations")
    records = {}
    for name, reqs, conc, fig in (("w1", w1, len(w1), w1_figures), ("w2", [w2], 1, w2_figures)):
        before = engine.stats().num_compilations
        run = serving.run_inprocess(engine, reqs, conc)  # empties the prefix cache first
        after = engine.stats().num_compilations
        entry[name] = dict(fig(run.records), compilations_before=before,
                           compilations_after=after, compilations=after - before,
                           preemptions=run.preemptions)
        records[name] = run.records
        _log(t0, f"jaxserve {name}: {json.dumps(_brief(entry[name]))}; XLA compilations "
                 f"{before} -> {after}")
    return entry, records


def _brief(fig: dict) -> dict:
    keys = ("output_tok_per_s", "wall_s", "ttft_ms", "tpot_ms")
    return {k: round(fig[k], 2) for k in keys if fig.get(k) is not None}


def _serve(name: str, model, reqs):
    """All of ``reqs`` through a peer: HF one static batch, llama.cpp one by one."""
    if name == "hf":
        return peers_mod.run_hf(model, reqs, len(reqs))
    return peers_mod.run_llama_cpp(model, reqs)


def run_peer(name: str, path: str, w1, w2, ref: dict, t0: float) -> dict:
    """One peer on W1 and W2 (after a 2-token warm-up); ``ref``: jaxserve's
    records, for token agreement."""
    entry = {"version": peers_mod.version(name), "how": HOW[name]}
    why = peers_mod.available(name)
    if why is None and name == "llama_cpp" and not path.endswith(".gguf"):
        why = "llama.cpp needs a .gguf model"
    if why is not None:
        entry["skipped"] = why
        _log(t0, f"peer {name} skipped: {why}")
        return entry
    t = time.monotonic()
    warm = [dataclasses.replace(w1[0], output_len=2)]
    if name == "hf":
        model = peers_mod.load_hf(path)
    else:
        n_ctx = max(len(r.prompt_ids) + r.output_len for r in [*w1, w2]) + 16
        model = peers_mod.load_llama_cpp(path, n_ctx=n_ctx)
    _serve(name, model, warm)
    entry["load_and_warmup_s"] = time.monotonic() - t
    for key, reqs, fig in (("w1", w1, w1_figures), ("w2", [w2], w2_figures)):
        recs = _serve(name, model, reqs)
        entry[key] = dict(fig(recs), token_agreement=_agreement(recs, ref.get(key)))
        _log(t0, f"peer {name} {key}: {json.dumps(_brief(entry[key]))}")
    del model
    gc.collect()
    return entry


def git_commit() -> str | None:
    """``git describe --always --dirty`` of the checkout this module runs from."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=False,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _model_file(model: str) -> str:
    if os.path.isdir(model):
        return model
    from checkpoints.fetch import resolve_model
    return str(resolve_model(model))


# ---- 4. targets, report, plot ---------------------------------------------------------

def targets(result: dict) -> list[dict]:
    """The issue's targets: {"target", "value", "limit", "met"} (met None
    when a figure is missing)."""
    eng = result.get("workloads", {}).get("engines", {})
    js, hf = eng.get("jaxserve", {}), eng.get("hf", {})
    def g(e, w, k):
        return (e.get(w) or {}).get(k)

    def ratio(a, b):
        return a / b if a is not None and b else None
    weights_ms = result.get("weights_ms")
    out = [
        ("W2 TPOT / HF's", ratio(g(js, "w2", "tpot_ms"), g(hf, "w2", "tpot_ms")), "<= 0.45",
         lambda v: v <= 0.45),
        ("W2 TPOT / f32 weight-streaming time", ratio(g(js, "w2", "tpot_ms"), weights_ms),
         "<= 1.6", lambda v: v <= 1.6),
        ("W2 TTFT / HF's", ratio(g(js, "w2", "ttft_ms"), g(hf, "w2", "ttft_ms")), "<= 0.7",
         lambda v: v <= 0.7),
        ("W1 output tok/s / HF's", ratio(g(js, "w1", "output_tok_per_s"),
                                         g(hf, "w1", "output_tok_per_s")), ">= 2.5",
         lambda v: v >= 2.5)]
    pts = [p for p in result.get("sweep", {}).get("points", []) if "step_ms" in p]
    ratios = [p["smooth_ratio"] for p in pts if p.get("smooth_ratio") is not None]
    out.append(("sweep: worst step / line between neighbours", max(ratios) if ratios else None,
                f"<= {SMOOTH_LIMIT}", lambda v: v <= SMOOTH_LIMIT))
    comps = [p["compilations_timed"] for p in pts]
    comps += [js[w]["compilations"] for w in ("w1", "w2") if w in js]
    out.append(("XLA compilations in timed passes", sum(comps) if comps else None, "== 0",
                lambda v: v == 0))
    return [{"target": t, "value": v, "limit": lim, "met": None if v is None else bool(ok(v))}
            for t, v, lim, ok in out]


def _f(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    """The report's tables (see the module docstring)."""
    m, lim = result["machine"], result.get("limits") or {}
    name = f"{m['cpu_model']} ({m['cpu_count']} cores)"
    smoke = " (smoke: tiny random config)" if result["smoke"] else ""
    load0 = _f((m["load_average_start"] or [None])[0], "{:.2f}")
    load1 = _f((result.get("load_average_end") or [None])[0], "{:.2f}")
    g = lambda k: _f(lim[k] / 1e9 if k in lim else None)
    lines = [f"# jaxserve writer benchmark (issue 16) on {name}", "",
             (f"Model `{result['model']}`, f32{smoke}; jax {m['jax']} ({m['jax_backend']}); "
              f"commit {result.get('git_commit')}; load average at start {load0}, at end "
              f"{load1}; run took {result.get('wall_s', 0):.0f} s."), "",
             "## Machine", "", "| | |", "|---|---|",
             f"| CPU | {m['cpu_model']}, {m['cpu_count']} cores |",
             f"| AVX flags | {' '.join(m['avx_flags']) or '-'} |",
             f"| memory available at start | "
             f"{_f((m['mem_available_bytes'] or 0) / 2**30, '{:.1f}')} GiB |",
             f"| jax | {m['jax']} |",
             f"| matmul ({lim.get('matmul', '-')}) | {g('matmul_flops_per_s')} GFLOP/s |",
             f"| matvec ({lim.get('matvec', '-')}) | {g('matvec_bytes_per_s')} GB/s |",
             f"| copy (x + 1 in place, read + write) | {g('copy_bytes_per_s')} GB/s |",
             (f"| model params | {result.get('param_bytes', 0) / 1e6:.1f} MB -> weight-streaming "
              f"time {_f(result.get('weights_ms'), '{:.2f}')} ms at the matvec bytes/s |"), ""]
    sw = result.get("sweep")
    if sw:
        lines += ["## Decode sweep", "",
                  f"Median of {sw['iters']} timed `runner.execute` steps after one untimed call; "
                  "every row has `ctx` tokens in its cache. Roofline = weights + attention bytes "
                  "at the matvec bytes/s. `smooth`: step / the straight line between its "
                  f"neighbours; **flagged** above {SMOOTH_LIMIT}x. Weights "
                  f"{sw.get('quantization', 'none')} (none = f32), KV f32.", ""]
        if sw.get("cap_note"):
            lines += [f"**{sw['cap_note']}.**", ""]
        lines += ["| ctx | rows | step ms | out tok/s | weights ms | attention ms | roofline ms "
                  "| step / roofline | smooth | compiles (timed) |", "|" + "---:|" * 10]
        for p in sw["points"]:
            if "step_ms" not in p:
                lines.append(f"| {p['ctx']} | {p['rows']} | skipped: {p['skipped']} "
                             "| | | | | | | |")
                continue
            sm = _f(p.get("smooth_ratio"), "{:.2f}x")
            if p.get("smooth_flag"):
                sm = f"**{sm} flagged**"
            lines.append(f"| {p['ctx']} | {p['rows']} | {p['step_ms']:.2f} | "
                         f"{p['tokens_per_s']:.1f} | {p['weights_ms']:.2f} | "
                         f"{p['attention_ms']:.2f} | {p['roofline_ms']:.2f} | "
                         f"{p['vs_roofline']:.2f}x | {sm} | {p['compilations_timed']} |")
        lines.append("")
    wl = result.get("workloads")
    if wl:
        pr = wl["prompts"]
        eng = wl["engines"]
        lines += ["## W1 and W2", "",
                  f"W1: {pr['w1']['requests']} requests of {pr['w1']['prompt_tokens_mean']:.0f} "
                  f"prompt tokens on average ({pr['w1']['prompt_tokens_min']}-"
                  f"{pr['w1']['prompt_tokens_max']}) x {pr['w1']['output_tokens']} output tokens, "
                  "all sent at once; out tok/s = output tokens / (first send to last token). "
                  f"W2: one {pr['w2']['prompt_tokens']}-token prompt, "
                  f"{pr['w2']['output_tokens']} output tokens: TTFT, and TPOT = mean gap "
                  "after the first token. Greedy, EOS ignored, same token ids for every engine.",
                  ""]
        for k, e in eng.items():
            extra = ""
            if k == "jaxserve":
                extra = (f"; warm-up {e['warmup']['compilations']} compilations "
                         f"({e['warmup']['seconds']:.0f} s), untimed pass "
                         f"{e['untimed_pass']['compilations']}, timed W1 "
                         f"{e['w1']['compilations']} (count {e['w1']['compilations_before']} -> "
                         f"{e['w1']['compilations_after']}), timed W2 {e['w2']['compilations']}")
            elif "skipped" not in e:
                agree = [e[w].get("token_agreement") for w in ("w1", "w2")]
                extra = (f"; first {AGREEMENT_TOKENS} greedy tokens equal jaxserve's in "
                         f"{_f(agree[0], '{:.0%}')} of W1 and {_f(agree[1], '{:.0%}')} of W2")
            lines.append(f"- **{LABEL[k]}** {e.get('version', result.get('git_commit', ''))}: "
                         + (f"skipped: {e['skipped']}" if "skipped" in e else e["how"] + extra))
        lines += ["", "| engine | W1 out tok/s | W1 wall s | W1 TTFT p50 ms | W2 TTFT ms | "
                  "W2 TPOT ms | tokens per request |", "|---|---:|---:|---:|---:|---:|---|"]
        ran = {k: e for k, e in eng.items() if "skipped" not in e}
        for k, e in ran.items():
            toks = sorted(set(e["w1"]["output_tokens_each"]) | {e["w2"]["output_tokens"]})
            lines.append(f"| {LABEL[k]} | {_f(e['w1']['output_tok_per_s'])} | "
                         f"{_f(e['w1']['wall_s'], '{:.2f}')} | "
                         f"{_f(e['w1']['ttft_ms_p50'], '{:.0f}')} | "
                         f"{_f(e['w2']['ttft_ms'], '{:.0f}')} | "
                         f"{_f(e['w2']['tpot_ms'])} | {', '.join(map(str, toks))} |")
        js = ran.get("jaxserve")
        for k, e in ran.items():
            if k == "jaxserve" or js is None:
                continue
            r = [_f(js[w][f] / e[w][f] if js[w][f] and e[w][f] else None, "{:.2f}x")
                 for w, f in (("w1", "output_tok_per_s"), ("w1", "wall_s"), ("w1", "ttft_ms_p50"),
                              ("w2", "ttft_ms"), ("w2", "tpot_ms"))]
            lines.append(f"| jaxserve / {LABEL[k]} | {' | '.join(r)} | |")
        if js is not None and len(ran) > 1:
            lines += ["", "Ratio rows: jaxserve's figure / the peer's (out tok/s: > 1 is jaxserve "
                      "faster; s and ms: < 1 is jaxserve faster)."]
        lines.append("")
    lines += quant_bench.markdown(result)
    lines += ["## Issue 16 targets", "", "| target | value | limit | met |", "|---|---:|---:|---|"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {_f(t['value'], '{:.3g}')} | {t['limit']} | {met} |")
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """``sweep.png``: step ms against rows, one panel per context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


# ---- main ---------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.writer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="folder for result.json, report.md, sweep.png")
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf or HF folder")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per sweep point "
                    "(default 10; smoke 2)")
    ap.add_argument("--rows", default=None, help=f"default {DEFAULT_ROWS} (smoke 1,2,4)")
    ap.add_argument("--contexts", default=None, help=f"default {DEFAULT_CONTEXTS} (smoke 16,40)")
    ap.add_argument("--peers", default="hf,llama.cpp", help="hf, llama.cpp, both, or none")
    ap.add_argument("--format_warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="warm every step shape up before each format's passes (--no-format_warmup: "
                    "the untimed pass compiles only what W1/W2 need; saves minutes per format)")
    ap.add_argument("--formats", default="none", help="weight formats for W1/W2 (issue 17), "
                    "e.g. none,int8,w8a8,int4,gguf; f32 (none) always runs")
    ap.add_argument("--kv_cache_dtypes", default="auto", help="KV cache dtypes crossed with "
                    "--formats, e.g. auto,int8")
    ap.add_argument("--kv_cache_mib", type=int, default=None, help="KV cache budget of every "
                    "W1/W2 engine, MiB (default 1024; smoke 1)")
    ap.add_argument("--sweep_format", default="none", help="weight format of the decode sweep")
    ap.add_argument("--skip_sweep", action="store_true")
    ap.add_argument("--skip_workloads", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny random config, tiny shapes, "
                    "no peers (checks the script; figures mean nothing)")
    a = ap.parse_args(argv)
    smoke = a.smoke
    try:
        rows = _int_list(a.rows or ("1,2,4" if smoke else DEFAULT_ROWS), "--rows")
        contexts = _int_list(a.contexts or ("16,40" if smoke else DEFAULT_CONTEXTS), "--contexts")
        peer_names = [] if smoke else peers_mod.parse_peers(a.peers.replace("llama.cpp",
                                                                            "llama_cpp"))
        pairs = quant_bench.parse_formats(a.formats, a.kv_cache_dtypes)
        quant_bench.parse_list(a.sweep_format, ("none", "int8", "w8a8", "int4", "gguf"),
                               "--sweep_format")
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    iters = a.iters or (2 if smoke else 10)
    if iters < 1:
        ap.error(f"--iters must be >= 1, got {iters}")
    kv_mib = a.kv_cache_mib or (1 if smoke else 1024)
    shapes = SMOKE_SHAPES if smoke else Shapes()
    t0 = time.monotonic()
    os.makedirs(a.output, exist_ok=True)

    import jax

    from jaxserve import LLM
    from jaxserve.bench.device import SMOKE
    notes = []
    result: dict = {"benchmark": "jaxserve writer benchmark (python -m jaxserve.bench.writer)",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "smoke": smoke,
                    "model": "random tiny config" if smoke else a.model,
                    "git_commit": git_commit(), "flags": vars(a),
                    "shapes": dataclasses.asdict(shapes)}
    result["machine"] = machine()
    _log(t0, f"{result['machine']['cpu_model']}, {result['machine']['cpu_count']} cores, "
             f"{' '.join(result['machine']['avx_flags'])}; jax {jax.__version__}")
    result["limits"] = measure_limits(shapes)
    lim = result["limits"]
    _log(t0, f"matmul {lim['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, matvec "
             f"{lim['matvec_bytes_per_s'] / 1e9:.2f} GB/s, copy "
             f"{lim['copy_bytes_per_s'] / 1e9:.2f} GB/s")

    if smoke:
        parts = dict(model_config=SMOKE, params=None)
        name = "random-smoke"
    else:
        from checkpoints.loader import load_checkpoint
        ck = load_checkpoint(a.model, show_progress=False)
        parts = dict(model_config=ck.config, params=ck.params, tokenizer=ck.tokenizer,
                     chat_template=ck.chat_template)
        name = a.model
        _log(t0, f"{a.model} loaded")
    cfg = parts["model_config"]
    parts_for = quant_bench.GgufParams(parts, a.model, smoke)  # gguf: the file's blocks
    xla_dir = os.path.join(os.environ.get("JAXSERVE_CACHE",
                                          os.path.expanduser("~/.cache/jaxserve")), "xla")
    page = 16

    if not a.skip_sweep:
        want, got, cap = sweep_pages(cfg, rows, contexts, page)
        if cap:
            _log(t0, cap)
        llm = LLM(name, **parts_for(a.sweep_format), dtype="float32", page_size=page,
                  quantization=a.sweep_format,
                  kv_cache_memory_bytes=got * kv_bytes_per_token(cfg) * page,
                  max_num_seqs=max(rows), max_model_len=max(contexts) + 1,
                  enable_prefix_caching=False, compilation_cache_dir=xla_dir)
        engine = llm.engine
        result["param_bytes"] = param_bytes(engine)
        result["weights_ms"] = 1e3 * result["param_bytes"] / lim["matvec_bytes_per_s"]
        _log(t0, f"sweep engine: {engine.allocator.num_pages} KV pages "
                 f"({engine.allocator.num_pages * page} tokens)")
        result["sweep"] = {"iters": iters, "rows": rows, "contexts": contexts,
                           "kv_pages": engine.allocator.num_pages, "kv_pages_wanted": want,
                           "page_size": page, "max_model_len": engine.max_model_len,
                           "cap_note": cap, "quantization": a.sweep_format,
                           "points": run_sweep(engine, rows, contexts, iters, lim, t0)}
        if any(p.get("smooth_flag") for p in result["sweep"]["points"]):
            notes.append("the sweep has flagged row counts (step > "
                         f"{SMOOTH_LIMIT}x the line between its neighbours)")
        del llm, engine
        gc.collect()
        jax.clear_caches()

    if not a.skip_workloads:
        wl_args = dict(max_num_seqs=4, max_num_batched_tokens=8,
                       max_model_len=128) if smoke else {}

        def build(quantization="none", kv_cache_dtype="auto"):
            return LLM(name, **parts_for(quantization), dtype="float32",
                       compilation_cache_dir=xla_dir, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=kv_mib << 20,
                       **wl_args)
        llm = build()
        engine = llm.engine
        result["param_bytes"] = param_bytes(engine)
        result["weights_ms"] = 1e3 * result["param_bytes"] / lim["matvec_bytes_per_s"]
        w1, w2 = make_prompts(engine.tokenizer, cfg.vocab_size, shapes)
        lens = [len(r.prompt_ids) for r in w1]
        sc = engine.config.scheduler
        result["workloads"] = {
            "prompts": {"w1": {"requests": len(w1), "prompt_tokens_mean": sum(lens) / len(lens),
                               "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens),
                               "output_tokens": shapes.output},
                        "w2": {"prompt_tokens": len(w2.prompt_ids),
                               "output_tokens": shapes.output}},
            "jaxserve_settings": {"max_num_seqs": sc.max_num_seqs,
                                  "max_num_batched_tokens": sc.max_num_batched_tokens,
                                  "max_model_len": engine.max_model_len,
                                  "kv_pages": engine.allocator.num_pages,
                                  "page_size": engine.allocator.page_size,
                                  "attention_impl": engine.attention_impl,
                                  "async_scheduling": getattr(engine.config,
                                                              "async_scheduling", None)},
            "engines": {}}
        entry, ref = run_jaxserve(engine, w1, w2, t0)
        result["workloads"]["engines"]["jaxserve"] = entry
        if len(pairs) > 1:
            base = dict(quant_bench.describe(engine, *quant_bench.BASELINE, kv_mib), **entry)
        del llm, engine
        gc.collect()
        if len(pairs) > 1:
            jax.clear_caches()
            result["quant"] = {"kv_cache_mib": kv_mib, "pairs": pairs,
                               "warmup": a.format_warmup, "formats": [base] +
                               quant_bench.run(build, pairs, w1, w2, ref, kv_mib, t0,
                                               warmup=a.format_warmup)}
        if peer_names:
            try:
                path = _model_file(a.model)
            except ValueError as e:
                path, why = None, str(e)
            for p in peer_names:
                if path is None:
                    result["workloads"]["engines"][p] = {"version": peers_mod.version(p),
                                                         "how": HOW[p], "skipped": why}
                    continue
                result["workloads"]["engines"][p] = run_peer(p, path, w1, w2, ref, t0)
        if "llama_cpp" in peer_names:
            notes.append("llama.cpp runs W1 sequentially (one request at a time: its Python "
                         "API runs one sequence), in the GGUF's own quantization, not f32")
        if "hf" in peer_names:
            notes.append("HF transformers runs W1 as one static batch of all requests (left "
                         "padded, no continuous batching), f32")
    if smoke:
        notes.append("smoke run: a tiny random config at tiny shapes; the figures mean nothing")
    load = (result["machine"]["load_average_start"] or [0.0])[0]
    if load > BUSY_LOAD:
        notes.append(f"**the machine was busy**: 1-minute load average {load:.2f} at the start "
                     f"on {os.cpu_count()} cores; other processes skew every figure (llama.cpp's "
                     "and torch's thread pools most): run it again on a quiet machine")
    result["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["wall_s"] = time.monotonic() - t0
    result["notes"] = notes
    result["targets"] = targets(result)
    quant_bench.summarize(result)
    paths = [os.path.join(a.output, "result.json"), os.path.join(a.output, "report.md")]
    if result.get("sweep"):
        try:
            plot(result, os.path.join(a.output, "sweep.png"))
            paths.append(os.path.join(a.output, "sweep.png"))
        except ImportError:
            notes.append("no sweep.png: matplotlib is not installed")
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(paths[1], "w") as f:
        f.write(text)
    print(text)
    _log(t0, "wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
