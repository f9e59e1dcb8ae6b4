"""The speculative decoding benchmark's figures and report (``speculation``
runs it): ratios to ``off`` and token agreement (``summarize_workload``), the
targets (``TARGETS``: W_copy ngram TPOT <= 0.55x off; W_chat draft TPOT <=
0.7x off, adaptive configurations; W_rare ngram adaptive tok/s >= 0.95x off;
printed, not tests) and ``report.md`` (``markdown``).
"""

from __future__ import annotations

import collections
import statistics

from jaxserve.bench import report
from jaxserve.bench.report import fmt as _f
from jaxserve.bench.report import ratio as _ratio

TARGETS = {"copy": ("ngram", "tpot", 0.55), "chat": ("draft", "tpot", 0.7),
           "rare": ("ngram", "tok_per_s", 0.95)}


def summarize_workload(result: dict) -> None:
    """Ratios to ``off``, per-kind TPOT and token agreement, in place."""
    off = result["configs"]["off"]
    for e in result["configs"].values():
        e["tpot_ratio"] = _ratio(e["tpot_ms_median"], off["tpot_ms_median"])
        e["tok_per_s_ratio"] = _ratio(e["tok_per_s"], off["tok_per_s"])
        same = [a["token_ids"] == b["token_ids"] for a, b in zip(e["requests"], off["requests"])]
        e["outputs_equal_off"] = sum(same)
        by_kind = collections.defaultdict(list)
        for r in e["requests"]:
            if r["tpot_ms"] is not None:
                by_kind[r["kind"]].append(r["tpot_ms"])
        e["tpot_ms_median_by_kind"] = {k: statistics.median(v) for k, v in by_kind.items()}


def targets(result: dict) -> list[dict]:
    """The targets (``TARGETS``) over the configurations that ran:
    {"target", "value", "limit", "met"}."""
    rows = []
    for w, (method, fig, lim) in TARGETS.items():
        for label, e in result["workloads"].get(w, {}).get("configs", {}).items():
            if not label.startswith(method) or label.endswith("-forced"):
                continue
            if fig == "tpot":
                rows.append({"target": f"W_{w} TPOT {label} / off", "limit": f"<= {lim}",
                             "value": e["tpot_ratio"]})
            else:
                rows.append({"target": f"W_{w} tok/s {label} / off", "limit": f">= {lim}",
                             "value": e["tok_per_s_ratio"]})
            v = rows[-1]["value"]
            rows[-1]["met"] = None if v is None else bool(v <= lim if fig == "tpot" else v >= lim)
    return rows


def markdown(result: dict) -> str:
    """The report (see the module docstring)."""
    m = result["machine"]
    sz = result["sizes"]
    quick = " (quick: sizes too small to mean anything)" if result["quick"] else ""
    lines = [f"# jaxserve speculative decoding benchmark on {m['cpu_model']} "
             f"({m['cpu_count']} cores)", "",
             f"Model `{result['model']}`, f32{quick}; jax {m['jax']} ({m['jax_backend']}); "
             f"commit {result.get('git_commit')}; load average at start "
             f"{_f((m['load_average_start'] or [None])[0], '{:.2f}')}, at end "
             f"{_f((result.get('load_average_end') or [None])[0], '{:.2f}')}; run took "
             f"{result['wall_s']:.0f} s.", "",
             *report.machine_lines(m),
             f"| sizes | W_copy / W_chat {sz['num_requests']} requests each, max_tokens "
             f"{sz['max_tokens']}, passage ~{sz['passage_tokens']} tokens; W_rare "
             f"{sz['rare_requests']} concurrent x {sz['rare_max_tokens']} tokens |",
             f"| warm-up | {result['warmup']} |", "",
             "Each configuration is a fresh engine, warmed up, then timed; ratios are over "
             "`off` in the same run (TPOT: < 1 is faster; tok/s: > 1 is faster). accept = "
             "accepted / draft tokens; length = 1 + accepted / drafts (tokens per verified "
             "row); per position j = drafts accepted at j / drafts reaching j; k: the policy's "
             "k at the end, and steps per k in the timed pass; draft share = the draft model's "
             "share of the wall time; step ms by T = the median device ms of the timed pass's "
             "steps of T tokens (the 4 most frequent T), which is what a verification of k + "
             "1 tokens costs against a plain decode step of 1; equal = requests whose tokens "
             "equal off's; compiles = XLA compilations in the timed pass (must be 0).", ""]
    titles = {"copy": "W_copy: repeat / edit / summarise a passage, batch 1, greedy",
              "chat": "W_chat: short questions, batch 1, greedy",
              "rare": "W_rare: drafts rarely right, concurrent, temperature 1"}
    for w, wr in result["workloads"].items():
        rare = w == "rare"
        n = len(wr["prompt_tokens"])
        lines += [f"## {titles[w]}", "",
                  f"{n} requests, prompts of {min(wr['prompt_tokens'])}-"
                  f"{max(wr['prompt_tokens'])} tokens" + (", all added at once." if rare
                                                         else ", one at a time."), "",
                  ("| config | tok/s | x off | TTFT p50 ms | " if rare else
                   "| config | TPOT p50 ms | x off | TPOT mean ms | by kind (p50 ms) | ")
                  + "accept | length | per position | k (steps per k) | step ms by T (steps) "
                  "| draft share | equal | compiles |", "|---|" + "---:|" * 3
                  + ("" if rare else "---|") + "---:|---:|---|---|---|---:|---:|---:|"]
        for label, e in wr["configs"].items():
            sp = e["spec"] or {}
            pp = ", ".join(_f(v, "{:.2f}") for v in sp.get("per_position_acceptance", []))
            k = (f"{sp['final_k']} ({', '.join(f'{a}: {b}' for a, b in e['policy_k_steps'].items())})"
                 if sp else "-")
            head = (f"{_f(e['tok_per_s'])} | {_f(e['tok_per_s_ratio'], '{:.2f}x')} | "
                    f"{_f(e['ttft_ms_median'], '{:.0f}')}" if rare else
                    f"{_f(e['tpot_ms_median'])} | {_f(e['tpot_ratio'], '{:.2f}x')} | "
                    f"{_f(e['tpot_ms_mean'])} | " + ", ".join(
                        f"{a} {b:.1f}" for a, b in e["tpot_ms_median_by_kind"].items()))
            top = sorted(sorted(e["steps_by_tokens"].items(), key=lambda x: -x[1]["steps"])[:4])
            st = ", ".join(f"{T}: {v['device_ms_median']:.1f} ({v['steps']})" for T, v in top)
            lines.append(f"| {label} | {head} | {_f(sp.get('acceptance_rate'), '{:.2f}')} | "
                         f"{_f(sp.get('mean_acceptance_length'), '{:.2f}')} | {pp or '-'} | "
                         f"{k} | {st or '-'} | {_f(sp.get('draft_model_share'), '{:.0%}')} | "
                         f"{e['outputs_equal_off']}/{n} | {e['compilations_timed']} |")
        lines.append("")
    lines += report.targets_table(result["targets"])
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {x}" for x in result["notes"]]
    return "\n".join(lines) + "\n"
