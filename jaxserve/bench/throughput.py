"""Batch throughput, two ways.

``python -m jaxserve.bench throughput`` (``run``): jaxserve beside HF
transformers and llama.cpp on W1 (a batch of requests sent at once: output
tok/s) and W2 (one long prompt: TTFT, TPOT), in one process on the machine
at hand (``comparison``), optionally once per weight format and KV cache
dtype (``--formats``, ``--kv_cache_dtypes``: ``formats``) and with the decode
sweep (``--sweep``: ``decode_sweep``; ``python -m jaxserve.bench sweep`` runs
the sweep alone). First the machine is named and its limits measured
(``machine.describe``, ``machine.measure_limits``); the model is loaded once
(``checkpoints.loader``) and every engine is built from those parts, one at
a time. ``result.json`` (every figure), ``report.md`` (the tables: the
figures with the machine named, the ratios jaxserve/HF and
jaxserve/llama.cpp, the targets evaluated) and ``sweep.png`` go to
``--output``; the report is printed too. Targets (``targets``): W2 TPOT <=
0.45x HF's and <= 1.6x the f32 weight-streaming time; W2 TTFT <= 0.7x HF's;
W1 output tok/s >= 2.5x HF's; a smooth sweep; zero compilations in timed
passes. ``--smoke`` runs a tiny random config at tiny shapes with no peers
(under a minute; its figures mean nothing).

``python -m jaxserve.main --mode bench`` (``make_prompts``, ``run_once``,
``format_result``): the offline pass on the engine the CLI built, N
concurrent requests of a fixed shape. All requests arrive at once (vLLM's ``benchmark_throughput`` shape). Prompts
are slices of real English text re-tokenized, with lengths drawn uniformly
within +-10% of ``input_len``; EOS is ignored so every request produces
exactly ``output_len`` tokens. The first (warm-up) pass compiles every bucket
the workload touches; the second pass is timed. Reports output tokens/s,
median and p90 TTFT / TPOT (ms), peak host memory (RSS, MiB), KV occupancy,
and the number of XLA compilations.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import statistics
import time

import jax
import numpy as np

from checkpoints.loader import load_checkpoint
from jaxserve import LLM
from jaxserve.bench import comparison, decode_sweep, formats, machine, report, workloads
from jaxserve.bench import peers as peers_mod
from jaxserve.bench.comparison import HOW, SMOKE_SHAPES, Shapes, log
from jaxserve.bench.device import SMOKE
from jaxserve.bench.report import fmt as _f
from jaxserve.engine import kernel_widths
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class BenchResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    tpot_ms_p50: float
    tpot_ms_p90: float
    peak_kv_occupancy: float
    num_compilations: int
    peak_rss_mib: float


def make_prompts(engine: Engine, num_requests: int, input_len: int, seed: int) -> list[list[int]]:
    """Token-id prompts of about ``input_len`` tokens (+-10%), from real text
    (``workloads.corpus_slices``)."""
    return workloads.corpus_slices(engine.tokenizer, engine.model_config.vocab_size,
                                   num_requests, input_len, seed)


def run_once(engine: Engine, prompts, output_len: int) -> BenchResult:
    """One pass over ``prompts``, all arriving at once. The prefix cache is
    emptied first, so a repeated pass does not reuse the previous one's pages."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    t0 = time.monotonic()
    for p in prompts:
        engine.add_request(None, p, params)
    finals, peak_occ = [], 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals.append(out)
        peak_occ = max(peak_occ, engine.kv_occupancy)
    wall = time.monotonic() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in finals)
    n_in = sum(len(p) for p in prompts)
    ttft = [o.metrics.ttft_ms for o in finals]
    tpot = [o.metrics.tpot_ms for o in finals if o.metrics.tpot_ms is not None]
    q = lambda xs, f: float(np.percentile(xs, f)) if xs else float("nan")  # noqa: E731
    return BenchResult(
        num_requests=len(prompts), input_tokens=n_in, output_tokens=n_out, wall_s=wall,
        output_tok_s=n_out / wall, total_tok_s=(n_in + n_out) / wall,
        ttft_ms_p50=statistics.median(ttft), ttft_ms_p90=q(ttft, 90),
        tpot_ms_p50=statistics.median(tpot) if tpot else float("nan"), tpot_ms_p90=q(tpot, 90),
        peak_kv_occupancy=peak_occ, num_compilations=engine.num_compilations,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def format_result(label: str, r: BenchResult) -> str:
    return (f"{label}: {r.num_requests} requests, {r.input_tokens} prompt + {r.output_tokens} "
            f"output tokens in {r.wall_s:.2f} s\n"
            f"  output tokens/s     {r.output_tok_s:8.1f}   (total tokens/s {r.total_tok_s:.1f})\n"
            f"  TTFT ms  p50 {r.ttft_ms_p50:9.1f}   p90 {r.ttft_ms_p90:9.1f}\n"
            f"  TPOT ms  p50 {r.tpot_ms_p50:9.1f}   p90 {r.tpot_ms_p90:9.1f}\n"
            f"  peak KV occupancy   {100 * r.peak_kv_occupancy:6.1f} %\n"
            f"  XLA compilations    {r.num_compilations:6d} (cumulative)\n"
            f"  peak RSS            {r.peak_rss_mib:8.0f} MiB")


# ---- python -m jaxserve.bench throughput / sweep --------------------------------

def int_list(spec: str, name: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4].

    Raises:
      ValueError: empty, or an entry that is not an integer >= 1.
    """
    try:
        xs = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        raise ValueError(f"{name} wants a comma list of integers >= 1, got {spec!r}")
    return xs


def add_arguments(ap, sweep_only: bool) -> None:
    """The options of ``throughput`` (``sweep_only`` False) or ``sweep``."""
    ap.add_argument("--output", required=True, help="folder for result.json, report.md"
                    + (", sweep.png" if sweep_only else " (and sweep.png with --sweep)"))
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf or HF folder")
    ap.add_argument("--smoke", action="store_true", help="tiny random config, tiny shapes, "
                    "no peers (checks the script; figures mean nothing)")
    if not sweep_only:
        ap.add_argument("--sweep", action="store_true", help="run the decode sweep too, into "
                        "the same report")
        ap.add_argument("--peers", default="hf,llama.cpp", help="hf, llama.cpp (a comma list), or none")
        ap.add_argument("--formats", default="none", help="weight formats for W1/W2, e.g. "
                        "none,int8,w8a8,int4,gguf, or q:kv pairs; f32 (none) always runs")
        ap.add_argument("--kv_cache_dtypes", default="auto", help="KV cache dtypes crossed "
                        "with --formats, e.g. auto,int8")
        ap.add_argument("--kv_cache_mib", type=int, default=None, help="KV cache budget of "
                        "every W1/W2 engine, MiB (default 1024; smoke 1)")
        ap.add_argument("--format_warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="warm every step shape up before each format's passes "
                        "(--no-format_warmup: the untimed pass compiles only what W1/W2 need)")
    ap.add_argument("--iters", type=int, default=None, help="sweep: timed steps per point "
                    "(default 10; smoke 2)")
    ap.add_argument("--rows", default=None, help=f"sweep: batch rows (default "
                    f"{decode_sweep.DEFAULT_ROWS}; smoke 1,2,4)")
    ap.add_argument("--contexts", default=None, help=f"sweep: tokens in each row's cache "
                    f"(default {decode_sweep.DEFAULT_CONTEXTS}; smoke 16,40)")
    ap.add_argument("--sweep_format", default="none", help="sweep: weight format")
    if sweep_only:
        ap.set_defaults(sweep=True, workloads=False)
    else:
        ap.set_defaults(workloads=True)


def _load(a) -> tuple[str, dict]:
    """(engine name, ``LLM`` parts): a tiny random config in smoke, else the
    checkpoint loaded once."""
    if a.smoke:
        return "random-smoke", dict(model_config=SMOKE, params=None)
    ck = load_checkpoint(a.model, show_progress=False)
    return a.model, dict(model_config=ck.config, params=ck.params, tokenizer=ck.tokenizer,
                         chat_template=ck.chat_template)


def run(a) -> int:
    """The whole run (see the module docstring); ``a``: ``add_arguments``'
    namespace. Returns the exit status.

    Raises:
      ValueError: a bad option (before anything long runs).
    """
    smoke = a.smoke
    rows = int_list(a.rows or ("1,2,4" if smoke else decode_sweep.DEFAULT_ROWS), "--rows")
    contexts = int_list(a.contexts or ("16,40" if smoke else decode_sweep.DEFAULT_CONTEXTS),
                        "--contexts")
    wl = a.workloads
    peer_names = [] if smoke or not wl else peers_mod.parse_peers(
        a.peers.replace("llama.cpp", "llama_cpp"))
    pairs = formats.parse_formats(a.formats, a.kv_cache_dtypes) if wl else [formats.BASELINE]
    formats.parse_list(a.sweep_format,
                       ("none", "int8", "w8a8", "int4", "gguf", "gguf_a16", "gguf_a8"),
                       "--sweep_format")
    iters = a.iters or (2 if smoke else 10)
    if iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    kv_mib = (getattr(a, "kv_cache_mib", None) or (1 if smoke else 1024))
    shapes = SMOKE_SHAPES if smoke else Shapes()
    t0 = time.monotonic()
    os.makedirs(a.output, exist_ok=True)
    notes = []
    result: dict = {"benchmark": "jaxserve decode benchmark (python -m jaxserve.bench "
                                 + ("throughput)" if wl else "sweep)"),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "smoke": smoke,
                    "model": "random tiny config" if smoke else a.model,
                    "git_commit": machine.git_commit(), "flags": vars(a),
                    "shapes": dataclasses.asdict(shapes), "machine": machine.describe()}
    m = result["machine"]
    m["peer_versions"] = {n: peers_mod.version(n) if peers_mod.available(n) is None else None
                          for n in peers_mod.PEERS}
    log(t0, f"{m['cpu_model']}, {m['cpu_count']} cores, {' '.join(m['avx_flags'])}; "
            f"jax {jax.__version__}")
    result["limits"] = lim = machine.measure_limits(shapes.matmul_n, shapes.matvec_n,
                                                    shapes.copy_mib)
    log(t0, f"matmul {lim['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, matvec "
            f"{lim['matvec_bytes_per_s'] / 1e9:.2f} GB/s, copy "
            f"{lim['copy_bytes_per_s'] / 1e9:.2f} GB/s")
    name, parts = _load(a)
    cfg = parts["model_config"]
    parts_for = formats.GgufParams(parts, a.model, smoke)  # gguf: the file's blocks
    xla_dir = os.path.join(os.environ.get("JAXSERVE_CACHE",
                                          os.path.expanduser("~/.cache/jaxserve")), "xla")
    if a.sweep:
        result["sweep"], pbytes = decode_sweep.run(name, parts_for(a.sweep_format),
                                                   a.sweep_format, rows, contexts, iters, lim,
                                                   xla_dir, t0)
        result["param_bytes"] = pbytes
        result["weights_ms"] = 1e3 * pbytes / lim["matvec_bytes_per_s"]
        if any(p.get("smooth_flag") for p in result["sweep"]["points"]):
            notes.append("the sweep has flagged row counts (step > "
                         f"{decode_sweep.SMOOTH_LIMIT}x the line between its neighbours)")
    if wl:
        wl_args = dict(max_num_seqs=4, max_num_batched_tokens=8,
                       max_model_len=128) if smoke else {}

        def build(quantization="none", kv_cache_dtype="auto"):
            return LLM(name, **parts_for(quantization), dtype="float32",
                       compilation_cache_dir=xla_dir, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=kv_mib << 20,
                       **wl_args)
        notes += _workloads(result, build, cfg, shapes, pairs, kv_mib, a, peer_names, t0)
    if smoke:
        notes.append("smoke run: a tiny random config at tiny shapes; the figures mean nothing")
    # Which column counts the CPU kernels served in this process (kernel_widths).
    result["kernel_widths"] = {k: {"max_columns": w.max_columns, "source": w.source,
                                   "wide_form": w.wide_form}
                               for k, w in kernel_widths.resolved().items()}
    if busy := machine.busy_note(m):
        notes.append(busy)
    result["load_average_end"] = machine.load_average()
    result["wall_s"] = time.monotonic() - t0
    result["notes"] = notes
    result["targets"] = targets(result)
    formats.summarize(result)
    plots = {"sweep.png": decode_sweep.plot} if result.get("sweep") else {}
    paths = report.write(a.output, result, markdown, plots)
    print(report.read_report(paths))
    log(t0, "wrote " + ", ".join(paths))
    return 0


def _workloads(result, build, cfg, shapes, pairs, kv_mib, a, peer_names, t0) -> list[str]:
    """W1 and W2: jaxserve f32, every other format pair, then the peers;
    fills ``result["workloads"]`` (and ``"quant"``); returns report notes."""
    llm = build()
    engine = llm.engine
    result["param_bytes"] = decode_sweep.param_bytes(engine)
    result["weights_ms"] = 1e3 * result["param_bytes"] / result["limits"]["matvec_bytes_per_s"]
    w1, w2 = comparison.make_prompts(engine.tokenizer, cfg.vocab_size, shapes)
    lens = [len(r.prompt_ids) for r in w1]
    sc = engine.config.scheduler
    result["workloads"] = {
        "prompts": {"w1": {"requests": len(w1), "prompt_tokens_mean": sum(lens) / len(lens),
                           "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens),
                           "output_tokens": shapes.output},
                    "w2": {"prompt_tokens": len(w2.prompt_ids), "output_tokens": shapes.output}},
        "jaxserve_settings": {"max_num_seqs": sc.max_num_seqs,
                              "max_num_batched_tokens": sc.max_num_batched_tokens,
                              "max_model_len": engine.max_model_len,
                              "kv_pages": engine.num_pages, "page_size": engine.page_size,
                              "attention_impl": engine.attention_impl,
                              "async_scheduling": engine.config.async_scheduling},
        "engines": {}}
    entry, ref = comparison.run_jaxserve(engine, w1, w2, t0)
    engines = result["workloads"]["engines"]
    engines["jaxserve"] = entry
    if len(pairs) > 1:
        base = dict(formats.describe(engine, *formats.BASELINE, kv_mib), **entry)
    del llm, engine
    gc.collect()
    if len(pairs) > 1:
        jax.clear_caches()
        result["quant"] = {"kv_cache_mib": kv_mib, "pairs": pairs, "warmup": a.format_warmup,
                           "formats": [base] + formats.run(build, pairs, w1, w2, ref, kv_mib, t0,
                                                           warmup=a.format_warmup)}
    notes = []
    if peer_names:
        try:
            path, why = peers_mod.model_file(a.model), None
        except ValueError as e:
            path, why = None, str(e)
        for p in peer_names:
            engines[p] = {"version": peers_mod.version(p), "how": HOW[p], "skipped": why} \
                if path is None else comparison.run_peer(p, path, w1, w2, ref, t0)
    if "llama_cpp" in peer_names:
        notes.append("llama.cpp runs W1 sequentially (one request at a time: its Python "
                     "API runs one sequence), in the GGUF's own quantization, not f32")
    if "hf" in peer_names:
        notes.append("HF transformers runs W1 as one static batch of all requests (left "
                     "padded, no continuous batching), f32")
    return notes


def targets(result: dict) -> list[dict]:
    """The run's targets (module docstring): {"target", "value", "limit",
    "met"} (met None when a figure is missing)."""
    eng = result.get("workloads", {}).get("engines", {})
    js, hf = eng.get("jaxserve", {}), eng.get("hf", {})

    def g(e, w, k):
        return (e.get(w) or {}).get(k)
    ratio, weights_ms = report.ratio, result.get("weights_ms")
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
    lim = decode_sweep.SMOOTH_LIMIT
    out.append(("sweep: worst step / line between neighbours", max(ratios) if ratios else None,
                f"<= {lim}", lambda v: v <= lim))
    comps = [p["compilations_timed"] for p in pts]
    comps += [js[w]["compilations"] for w in ("w1", "w2") if w in js]
    out.append(("XLA compilations in timed passes", sum(comps) if comps else None, "== 0",
                lambda v: v == 0))
    return [{"target": t, "value": v, "limit": lim, "met": None if v is None else bool(ok(v))}
            for t, v, lim, ok in out]


def _widths(result: dict) -> str:
    """The CPU kernel's column limits this run used, one kind after another."""
    ws = result.get("kernel_widths") or {}
    return ", ".join(
        f"{k} {w['max_columns']}" + (f" (then XLA: {w['wide_form']})" if w["wide_form"] else "")
        + f" [{w['source']}]" for k, w in sorted(ws.items())) or "-"


def markdown(result: dict) -> str:
    """The report (see the module docstring)."""
    m, lim = result["machine"], result.get("limits") or {}
    name = f"{m['cpu_model']} ({m['cpu_count']} cores)"
    smoke = " (smoke: tiny random config)" if result["smoke"] else ""
    load0 = _f((m["load_average_start"] or [None])[0], "{:.2f}")
    load1 = _f((result.get("load_average_end") or [None])[0], "{:.2f}")
    g = lambda k: _f(lim[k] / 1e9 if k in lim else None)  # noqa: E731
    lines = [f"# jaxserve decode benchmark on {name}", "",
             (f"Model `{result['model']}`, f32{smoke}; jax {m['jax']} ({m['jax_backend']}); "
              f"commit {result.get('git_commit')}; load average at start {load0}, at end "
              f"{load1}; run took {result.get('wall_s', 0):.0f} s."), "",
             "## Machine", "", *report.machine_lines(m),
             f"| memory available at start | "
             f"{_f((m['mem_available_bytes'] or 0) / 2**30, '{:.1f}')} GiB |",
             f"| matmul ({lim.get('matmul', '-')}) | {g('matmul_flops_per_s')} GFLOP/s |",
             f"| matvec ({lim.get('matvec', '-')}) | {g('matvec_bytes_per_s')} GB/s |",
             f"| copy (x + 1 in place, read + write) | {g('copy_bytes_per_s')} GB/s |",
             (f"| model params | {result.get('param_bytes', 0) / 1e6:.1f} MB -> weight-streaming "
              f"time {_f(result.get('weights_ms'), '{:.2f}')} ms at the matvec bytes/s |"),
             f"| CPU kernel widths (largest M served) | {_widths(result)} |", ""]
    if result.get("sweep"):
        lines += decode_sweep.markdown(result["sweep"])
    lines += comparison.markdown(result)
    lines += formats.markdown(result)
    lines += report.targets_table(result["targets"])
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"
