"""The serving benchmark's Markdown report (``markdown(result)``; the plots
are ``serving_plots``, the files ``report.write``).

The engine measured by the levels is named by its backend (``main_label``):
"jaxserve" in-process, "jaxserve (gRPC)", "jaxserve (HTTP)", or the URL of
another OpenAI-compatible server (``serve --backend openai --target URL``);
the ``llama_cpp_server`` peer is "llama.cpp server (HTTP)". Levels driven
over HTTP carry ``http`` notes (``openai_load``): how output tokens were
counted and how many requests ended before their ``max_tokens``, both said
under the tables.
"""

from __future__ import annotations

from jaxserve.bench import serving_lora
from jaxserve.bench.report import fmt as _f

ENGINE_LABEL = {"jaxserve": "jaxserve", "hf": "HF transformers", "llama_cpp": "llama.cpp",
                "llama_cpp_server": "llama.cpp server (HTTP)",
                "colocated": "jaxserve colocated (--role both)"}


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def main_label(result: dict) -> str:
    """The name of the engine behind ``result["levels"]``: its backend, and
    the target when it was not spawned (see the module docstring)."""
    cfg = result["config"]
    server = result["env"].get("server") or {}
    target = cfg.get("target")
    if cfg["backend"] == "grpc":
        if cfg.get("role") == "decode":
            return "jaxserve disaggregated (gRPC" + (f" at {target})" if target else ")")
        return "jaxserve (gRPC" + (f" at {target})" if target else ")")
    if cfg["backend"] == "openai":
        if server.get("owned_by") == "jaxserve":
            return "jaxserve (HTTP" + (f" at {target})" if target else ")")
        return f"{target or server.get('base_url', 'server')} (HTTP)"
    return "jaxserve"


def label(result: dict, name: str) -> str:
    return main_label(result) if name == "jaxserve" else ENGINE_LABEL.get(name, name)


def _http_notes(result: dict) -> list[str]:
    """Lines on how HTTP-driven levels counted tokens, and their short outputs."""
    lines = []
    for name, levels in engine_levels(result).items():
        notes = [lv["http"] for lv in levels if lv.get("http")]
        if not notes:
            continue
        name_ = label(result, name)
        sources: dict[str, int] = {}
        for n in notes:
            for k, v in n["token_count"].items():
                sources[k] = sources.get(k, 0) + v
        how = {"usage": "the server's usage", "length": "max_tokens (finish_reason length)",
               "tokenizer": "the output text re-tokenized", "chunks": "one per text chunk"}
        lines.append(f"- {name_}: OpenAI HTTP API, prompts as {notes[0]['prompt_as']}; TTFT "
                     "and ITL from each SSE chunk carrying text as it arrived; output tokens "
                     "from " + ", ".join(f"{how.get(k, k)} ({v} requests)"
                                         for k, v in sources.items()) + ".")
        short = sum(n["short_outputs"] for n in notes)
        if short:
            total = sum(sum(n["token_count"].values()) for n in notes)
            lines.append(f"- **{name_}: {short} of {total} requests ended before their "
                         "max_tokens (the server stops at EOS: it does not know ignore_eos); "
                         "its figures count the tokens it did generate.**")
    return lines


def engine_levels(result: dict) -> dict[str, list[dict]]:
    """{engine: [level dicts with "concurrency" and "summary"]}."""
    out = {"jaxserve": result["levels"]}
    for name, p in result.get("peers", {}).items():
        if p.get("levels"):
            out[name] = p["levels"]
    return out


def _disagg_lines(result: dict) -> list[str]:
    """The routing split and KV transfers of a disaggregated run, and the
    transfer's cost per prompt token beside the prefill compute it replaced
    (the colocated peer's prefill ms per prompt token on the same requests)."""
    levels = [lv for lv in result["levels"] if lv.get("disagg")]
    if not levels:
        return []
    spawned = (result["env"].get("server") or {}).get("disagg") or {}
    lines = ["", "Disaggregated prefill/decode (`--role decode`"
             + (f"; spawned: prefill worker on CPUs {spawned.get('prefill_cpus')}, decode "
                f"worker on CPUs {spawned.get('decode_cpus')}, flags "
                f"{' '.join(spawned.get('flags', [])) or 'defaults'}" if spawned else "")
             + "). Transfer: the decode worker's Pull call to the pages in its cache; "
             "replaced prefill: the colocated peer's server-side prefill (first scheduled -> "
             "first token) of the same requests, per prompt token.", "",
             "| C | routes | handoffs | transfer ms p50 | p99 | MB per handoff | "
             "transfer ms/prompt tok p50 | colocated prefill ms/prompt tok p50 |",
             "|" + "---:|" * 8]
    colo = {lv["concurrency"]: lv for lv in
            (result.get("peers", {}).get("colocated") or {}).get("levels", [])}
    for lv in levels:
        d = lv["disagg"]
        routes = ", ".join(f"{k} {v}" for k, v in sorted(d["routes"].items()))
        hand = {r["id"] for r in lv["requests"] if r.get("disagg_route") == "handoff"}
        peer = colo.get(lv["concurrency"])
        per_tok = sorted(r["prefill_ms"] / max(1, r["prompt_tokens"] - r["cached_tokens"])
                         for r in (peer or {}).get("requests", [])
                         if r["id"] in hand and r.get("prefill_ms") is not None)
        med = per_tok[len(per_tok) // 2] if per_tok else None
        mb = d["bytes_per_handoff"] / 1e6 if d["bytes_per_handoff"] else None
        lines.append(f"| {lv['concurrency']} | {routes} | {d['handoffs']} | "
                     f"{_f(d['transfer_ms']['p50'])} | {_f(d['transfer_ms']['p99'])} | "
                     f"{_f(mb, '{:.2f}')} | {_f(d['transfer_ms_per_prompt_token']['p50'], '{:.3f}')}"
                     f" | {_f(med, '{:.3f}')} |")
    return lines


def _weight_note(env: dict) -> str:
    """``": 538.1 MB of weights as stored (projections 424.7 MB)"`` where the
    in-process run recorded them, else ``""``."""
    wb = env.get("weight_bytes")
    if not wb:
        return ""
    return (f": {wb['total'] / 1e6:.1f} MB of weights as stored (projections "
            f"{wb['projections'] / 1e6:.1f} MB), {env['kv_bytes_per_token']:.0f} KV bytes "
            "per token")


def markdown(result: dict) -> str:
    """The report: set-up, per-level table, side-by-side table with ratio
    columns, per-workload shape table and per-phase roofline table."""
    cfg, env = result["config"], result["env"]
    lines = [f"# jaxserve serving benchmark: `{cfg['workload']}`", ""]
    me = main_label(result)
    server = env.get("server") or {}
    via = {"grpc": "gRPC", "openai": "OpenAI HTTP API"}.get(cfg["backend"])
    if via:
        where = server.get("base_url") or server.get("target") or cfg.get("target") or ""
        via = (f" ({via} at {where}, " + ("spawned" if cfg.get("target") is None else "running")
               + (f", model `{server['model']}`" if server.get("model") else "")
               + (f", prompts as {server['prompt_as']}" if server.get("prompt_as") else "")
               + ")")
    shapes = ", ".join(f"{w} {s['prompt_tokens_mean']:.0f} -> {s['output_tokens']:.0f}"
                       for w, s in result["workload"]["shapes"].items())
    loop = "closed loop" if cfg["request_rate"] is None else \
        f"open loop, Poisson {cfg['request_rate']} requests/s"
    lines += [
        f"- model `{cfg['model']}` ({cfg['dtype']}; weights {cfg.get('quantization', 'none')}, "
        f"KV cache {cfg.get('kv_cache_dtype', 'auto')}{_weight_note(env)}), backend "
        f"`{cfg['backend']}`{via or ''}, devices "
        f"{', '.join(env.get('devices', []))}; jax {env['versions']['jax']}, "
        f"{env['cpu_count']} CPUs",
        f"- {cfg['num_prompts']} requests per level, {loop}, concurrency "
        f"{', '.join(map(str, cfg['concurrency']))}; greedy, EOS ignored, seed {cfg['seed']}",
        f"- request shapes (mean prompt -> output tokens): {shapes}; scale {cfg['scale']}"
        + (" (lengths scaled from the named shapes)" if cfg["scale"] != 1 else ""),
        "- SLO for goodput: " + (", ".join(f"{k} <= {v:g}" for k, v in cfg["slo"].items())
                                 or "none (every completed request counts)"),
        f"- warm-up: {result['warmup']['note']}",
        "",
        f"## {me} per level",
        "",
        "Latencies in ms (client side: TTFT and E2E from send; TPOT = (E2E - TTFT) / "
        "(tokens - 1); ITL between streamed outputs), throughputs per s. Device idle: the "
        "share of the device's step timeline it waited on the host between steps "
        "(in-process only; `StepInfo.idle_ms` / (idle + device ms)).",
        "",
        "| C | done | dur s | req/s | goodput | in tok/s | out tok/s | TTFT mean | p50 | p90 "
        "| p99 | TPOT p50 | p90 | p99 | ITL p50 | p99 | E2E p50 | p99 | KV peak pages | "
        "prefix hit | preempt | compiles | device idle |",
        "|" + "---:|" * 24,
    ]
    for lv in result["levels"]:
        s = lv["summary"]
        t, p, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
        lines.append(
            f"| {lv['concurrency']} | {s['completed']} | {s['duration_s']:.1f} | "
            f"{_f(s['request_throughput'], '{:.2f}')} | {_f(s['goodput'], '{:.2f}')} | "
            f"{_f(s['input_throughput'])} | {_f(s['output_throughput'])} | {_f(t['mean'], '{:.0f}')} "
            f"| {_f(t['p50'], '{:.0f}')} | {_f(t['p90'], '{:.0f}')} | {_f(t['p99'], '{:.0f}')} | "
            f"{_f(p['p50'])} | {_f(p['p90'])} | {_f(p['p99'])} | {_f(i['p50'])} | {_f(i['p99'])} | "
            f"{_f(e['p50'], '{:.0f}')} | {_f(e['p99'], '{:.0f}')} | "
            f"{lv['kv']['peak_pages']}/{lv['kv']['pages_total']} | "
            f"{_f(lv['prefix_cache']['hit_rate'], '{:.1%}')} | {lv['preemptions']} | "
            f"{_f(lv['compilations'], '{}')} | "
            f"{_f((lv.get('device') or {}).get('idle_fraction'), '{:.1%}')} |")
    spec = [lv for lv in result["levels"] if lv.get("speculation")]
    if spec:
        lines += ["", "Speculative decoding (drafts verified in the level; mean acceptance "
                  "length = 1 + accepted / verification rows):", "",
                  "| C | rows with drafts | draft tokens | accepted | acceptance rate | "
                  "mean acceptance length |", "|" + "---:|" * 6]
        for lv in spec:
            sp = lv["speculation"]
            lines.append(f"| {lv['concurrency']} | {sp['drafts']} | {sp['draft_tokens']} | "
                         f"{sp['accepted_tokens']} | {sp['acceptance_rate']:.1%} | "
                         f"{_f(sp['mean_acceptance_length'], '{:.2f}')} |")
    for lv in result["levels"]:
        if lv.get("reruns"):
            lines += ["", f"C={lv['concurrency']} was run {lv['reruns'] + 1} times: XLA "
                      "compiled during the earlier run(s) (shapes the warm-up had not met); "
                      "the figures are from the last run."]
        if lv.get("compilations"):
            lines += ["", f"**C={lv['concurrency']}: XLA compiled {lv['compilations']} time(s) "
                      "during the timed level: those steps' compile time is in its latencies "
                      "and goodput. Run again (the executables are cached now).**"]
    lines += _disagg_lines(result)
    if http := _http_notes(result):
        lines += ["", "Driven over HTTP:", "", *http]
    if mix := serving_lora.markdown(result):
        lines += ["", *mix]
    clients = ("C closed-loop clients (request k is sent when request k - C ends)"
               if cfg["request_rate"] is None else
               "the same Poisson arrival times, at most C requests in flight (request k is "
               "sent at its arrival, or when request k - C ends if later); a peer's measured "
               "service is placed on that timeline: a static batch starts when all its "
               "requests have been sent and the batch before it has ended, a sequential "
               "request when the one before it has ended")
    lines += ["", "## Side by side", ""]
    if not result.get("peers"):
        lines.append("No peers were run (`--peers none`).")
    else:
        lines += [f"Same prompts and the same model file, greedy, same max tokens, and for "
                  f"every engine {clients}, so time spent waiting for a peer's static batch or "
                  "for the request before it counts in its TTFT and E2E"
                  + (" (llama.cpp's server is driven by real HTTP clients, not placed on a "
                     "timeline: its requests wait in their open streams while it serves "
                     "another)" if "llama_cpp_server" in result["peers"] else "")
                  + f". Speed-up columns are {me}'s advantage (> 1: {me} better): peer's "
                  f"latency / {me}'s, {me}'s throughput / peer's. One run each: at low "
                  "concurrency, where the engines are close, a ratio can move by 30% from run "
                  "to run.", ""]
    for name, p in result.get("peers", {}).items():
        lines.append(f"- **{ENGINE_LABEL.get(name, name)}** {p.get('version', '')}: "
                     + (p["how"] if "skipped" not in p else f"skipped: {p['skipped']}")
                     + (f"; greedy tokens identical to {me}'s in {p['token_agreement']:.0%} "
                        f"of requests (first 16 tokens)" if p.get("token_agreement") is not None
                        else ""))
    engines = engine_levels(result)
    if len(engines) > 1:
        lines += ["", "| C | engine | mode | out tok/s | TTFT p50 | TPOT p50 | E2E p50 | "
                  "speed-up out tok/s | TTFT p50 | TPOT p50 | E2E p50 |", "|" + "---:|" * 11]
    for lv in result["levels"] if len(engines) > 1 else []:
        c, js = lv["concurrency"], lv["summary"]
        for name, levels in engines.items():
            row = next((x for x in levels if x["concurrency"] == c), None)
            if row is None:
                continue
            s = row["summary"]
            mode = row.get("mode", "continuous batching")
            g = lambda d, k="p50": d[k] if d else None  # noqa: E731
            lines.append(
                f"| {c} | {label(result, name)} | {mode} | {_f(s['output_throughput'])} "
                f"| {_f(g(s['ttft_ms']), '{:.0f}')} | {_f(g(s['tpot_ms']))} | "
                f"{_f(g(s['e2e_ms']), '{:.0f}')} | "
                + (" | | | |" if name == "jaxserve" else
                   f"{_ratio(js['output_throughput'], s['output_throughput'])} | "
                   f"{_ratio(g(s['ttft_ms']), g(js['ttft_ms']))} | "
                   f"{_ratio(g(s['tpot_ms']), g(js['tpot_ms']))} | "
                   f"{_ratio(g(s['e2e_ms']), g(js['e2e_ms']))} |"))
    top = result["levels"][-1]
    lines += ["", f"## Request shapes at C={top['concurrency']} ({me})", "",
              "queue: send -> first scheduled; prefill: first scheduled -> first token; "
              "decode: ms per output token after the first (= TPOT). Each request's TTFT "
              "is its queue + prefill; the columns are separate medians, which need not add "
              "up.", "",
              "| workload | requests | prompt tok | output tok | cached tok | queue p50 | "
              "prefill p50 | decode ms/tok p50 | TTFT p50 | E2E p50 |", "|" + "---:|" * 10]
    for w, s in top["by_workload"].items():
        n = max(1, s["completed"])
        lines.append(f"| {w} | {s['completed']} | {s['input_tokens'] / n:.0f} | "
                     f"{s['output_tokens'] / n:.0f} | {s['cached_tokens'] / n:.0f} | "
                     f"{_f(s['queue_ms']['p50'], '{:.0f}')} | {_f(s['prefill_ms']['p50'], '{:.0f}')} "
                     f"| {_f(s['decode_ms_per_token']['p50'])} | {_f(s['ttft_ms']['p50'], '{:.0f}')} "
                     f"| {_f(s['e2e_ms']['p50'], '{:.0f}')} |")
    roof = result.get("roofline")
    lines += ["", f"## Roofline per phase ({me}, all levels)", ""]
    if not roof:
        lines.append("Not available: " + result.get("roofline_note", "no engine steps seen."))
    else:
        c = roof["ceilings"]
        lines += [f"Device ceilings: {c['flops_per_s'] / 1e9:.1f} GFLOP/s, "
                  f"{c['bytes_per_s'] / 1e9:.1f} GB/s (ridge {c['ridge_flop_per_byte']:.1f} "
                  f"FLOP/byte); {c['source']}. FLOPs and bytes per step are counted from "
                  "the model config (`jaxserve/bench/roofline.py`); steps that compiled are "
                  "left out.", "",
                  "| phase | steps | tokens/step | ms/step | GFLOP/step | MB/step weights | "
                  "MB/step KV | GFLOP/s | GB/s | FLOP/byte | MFU | MBU | bound |",
                  "|---|" + "---:|" * 12]
        for phase in ("prefill", "mixed", "decode"):
            p = roof.get(phase)
            if not p:
                continue
            lines.append(
                f"| {phase} | {p['steps']} | {p['tokens_per_step']:.1f} | {p['ms_per_step']:.1f} "
                f"| {p['flops_per_step'] / 1e9:.3g} | {p['weight_bytes_per_step'] / 1e6:.3g} | "
                f"{p['kv_bytes_per_step'] / 1e6:.3g} | {p['flops_per_s'] / 1e9:.1f} | "
                f"{p['bytes_per_s'] / 1e9:.1f} | {p['intensity']:.1f} | {p['mfu']:.1%} | "
                f"{p['mbu']:.1%} | {p['bound']} |")
        for phase in ("prefill", "mixed", "decode"):
            if (roof.get(phase) or {}).get("warning"):
                lines += ["", f"**{phase}: {roof[phase]['warning']}.**"]
        dec = [p for p in roof["points"] if p["phase"] == "decode"]
        if dec:
            lines += ["", "Decode steps by batch rows (each figure the median step of the "
                      "group; the phase's bound above is over all its steps, where small "
                      "batches are usually the most numerous):", "",
                      "| rows | steps | ms/step | tokens/s | FLOP/byte | GFLOP/s | GB/s | MFU | "
                      "MBU | bound |", "|" + "---:|" * 9 + "---|"]
            for p in dec:
                lines.append(
                    f"| {p['group']} | {p['steps']} | {p['ms']:.1f} | "
                    f"{p['group'] / p['ms'] * 1e3:.1f} | {p['intensity']:.1f} | "
                    f"{p['flops_per_s'] / 1e9:.1f} | {p['bytes_per_s'] / 1e9:.1f} | "
                    f"{p['mfu']:.1%} | {p['mbu']:.1%} | {p['bound']} |")
    load, end = env.get("load_average_1_5_15_min"), result.get("load_average_end")
    lines += ["", f"Total wall time {result['wall_s']:.0f} s (model load "
              f"{result.get('model_load_s', 0):.0f} s)"
              + (f"; CPU load average (1 min) {load[0]:.1f} at the start, {end[0]:.1f} at the "
                 f"end, on {env['cpu_count']} CPUs" if load and end else "")
              + ". Every figure is in `result.json`."]
    if load and end and max(load[0], end[0]) > 1.5 + 0.5 * env["cpu_count"]:
        lines.append("**The CPUs were busy with other work during this run: every figure "
                     "above is skewed (llama.cpp's and torch's thread pools suffer most).**")
    return "\n".join(lines) + "\n"
