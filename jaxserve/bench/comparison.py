"""W1 and W2: jaxserve beside HF transformers and llama.cpp on the same
prompts, in one process, one engine at a time (``python -m jaxserve.bench
throughput``; the run is ``throughput.run``).

* **W1** (batch throughput): ``Shapes.w1_requests`` (32) requests of
  ~``w1_prompt`` (118) prompt tokens (``chat``-shaped, +-10%) x ``output``
  (128) output tokens, all sent at once; output tok/s = all output tokens /
  (first send to last token).
* **W2** (long-prompt latency): one ``w2_prompt`` (940)-token prompt
  (``rag``-shaped: documents, then a question) then ``output`` tokens: TTFT ms
  (send to first token) and TPOT ms (mean gap between tokens after the first).

Greedy, EOS ignored: every engine writes exactly ``output`` tokens per
request. jaxserve runs in-process with ``LLM``'s default serving settings
(``run_jaxserve``: ``Engine.warmup()`` first; each workload once untimed, then
timed through ``serving.run_inprocess``; XLA compilations are counted around
every timed pass and must be 0). HF transformers loads the same GGUF
(``gguf_file=``, dequantized to f32) and runs W1 as one static batch
(``peers.run_hf``); llama.cpp (``llama-cpp-python``, the GGUF's own
quantization, e.g. Q4_1 -- not f32) runs W1 one request at a time
(``peers.run_llama_cpp``: its Python API runs one sequence). Each peer gets a
2-token untimed warm-up (``peers.warm_up``). The first
``peers.AGREEMENT_TOKENS`` greedy tokens are compared with jaxserve's (token
agreement). Times are ``time.monotonic`` seconds, shown in ms.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time

import numpy as np

from jaxserve.bench import peers as peers_mod
from jaxserve.bench import serving, stats, workloads
from jaxserve.bench.report import fmt as _f
from jaxserve.bench.workloads import BenchRequest, make_requests


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The workloads' sizes: W1 ``w1_requests`` x ~``w1_prompt`` -> ``output``
    tokens, W2 one ``w2_prompt`` -> ``output``; and the machine limits' sizes
    (``machine.measure_limits``)."""

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


def log(t0: float, msg: str) -> None:
    print(f"bench [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def make_prompts(tokenizer, vocab_size: int, shapes: Shapes, seed: int = 0):
    """(W1 requests, W2 request): see the module docstring. Without a
    tokenizer the ids are random (seeded)."""
    w1 = [dataclasses.replace(r, output_len=shapes.output) for r in make_requests(
        tokenizer, vocab_size, "chat", shapes.w1_requests, seed=seed,
        scale=shapes.w1_prompt / workloads.SHAPES["chat"].input_len)]
    rng = np.random.default_rng(seed + 1)
    text = workloads.Text(tokenizer, vocab_size, rng)
    head = text.encode(workloads.DOCS_INTRO)
    q = workloads.QUESTIONS[int(rng.integers(len(workloads.QUESTIONS)))]
    ids = workloads.question_prompt(text, q, shapes.w2_prompt, head)
    return w1, BenchRequest("rag", ids, shapes.output)


def agreement(recs, ref) -> float | None:
    """Fraction of requests whose first tokens equal ``ref``'s (``peers.agreement``)."""
    same, n = peers_mod.agreement(recs, ref)
    return same / n if n else None


def w1_figures(records) -> dict:
    """Output tok/s of W1 = output tokens / (first send to last token)."""
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
    t = time.monotonic()
    comp = engine.stats().num_compilations
    if warmup:
        engine.warmup(lambda i, T, s: log(t0, f"warm-up: step of {T} tokens ready ({s:.1f} s)")
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
    log(t0, f"jaxserve untimed W1+W2: {entry['untimed_pass']['compilations']} compilations")
    records = {}
    for name, reqs, conc, fig in (("w1", w1, len(w1), w1_figures), ("w2", [w2], 1, w2_figures)):
        before = engine.stats().num_compilations
        run = serving.run_inprocess(engine, reqs, conc)  # empties the prefix cache first
        after = engine.stats().num_compilations
        entry[name] = dict(fig(run.records), compilations_before=before,
                           compilations_after=after, compilations=after - before,
                           preemptions=run.preemptions)
        records[name] = run.records
        log(t0, f"jaxserve {name}: {json.dumps(_brief(entry[name]))}; XLA compilations "
                f"{before} -> {after}")
    return entry, records


def _brief(fig: dict) -> dict:
    keys = ("output_tok_per_s", "wall_s", "ttft_ms", "tpot_ms")
    return {k: round(fig[k], 2) for k in keys if fig.get(k) is not None}


def run_peer(name: str, path: str, w1, w2, ref: dict, t0: float) -> dict:
    """One peer on W1 and W2 (after a 2-token warm-up); ``ref``: jaxserve's
    records, for token agreement."""
    entry = {"version": peers_mod.version(name), "how": HOW[name]}
    why = peers_mod.available(name)
    if why is None and name == "llama_cpp" and not path.endswith(".gguf"):
        why = "llama.cpp needs a .gguf model"
    if why is not None:
        entry["skipped"] = why
        log(t0, f"peer {name} skipped: {why}")
        return entry
    t = time.monotonic()
    if name == "hf":
        model = peers_mod.load_hf(path)
    else:
        n_ctx = max(len(r.prompt_ids) + r.output_len for r in [*w1, w2]) + 16
        model = peers_mod.load_llama_cpp(path, n_ctx=n_ctx)
    peers_mod.warm_up(name, model, w1[0])
    entry["load_and_warmup_s"] = time.monotonic() - t
    for key, reqs, fig in (("w1", w1, w1_figures), ("w2", [w2], w2_figures)):
        # HF: one static batch of all of them; llama.cpp: one by one
        recs = peers_mod.run_hf(model, reqs, len(reqs)) if name == "hf" else \
            peers_mod.run_llama_cpp(model, reqs)
        entry[key] = dict(fig(recs), token_agreement=agreement(recs, ref.get(key)))
        log(t0, f"peer {name} {key}: {json.dumps(_brief(entry[key]))}")
    del model
    gc.collect()
    return entry


def markdown(result: dict) -> list[str]:
    """The report's ``## W1 and W2`` section (lines), or [] when they did not run."""
    wl = result.get("workloads")
    if not wl:
        return []
    lines = []
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
            extra = (f"; first {peers_mod.AGREEMENT_TOKENS} greedy tokens equal jaxserve's in "
                     f"{_f(agree[0], '{:.0%}')} of W1 and {_f(agree[1], '{:.0%}')} of W2")
        lines.append(f"- **{LABEL[k]}** {e.get('version', result.get('git_commit') or '')}: "
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
    return lines
