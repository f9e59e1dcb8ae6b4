"""The serving benchmark's plots (``report.write`` draws them with
matplotlib's Agg backend):

* ``latency_throughput.png``: TTFT, TPOT and E2E p50 (ms, log scale)
  against output tokens/s, one line per engine through its concurrency levels;
* ``timeline.png``: every request of each jaxserve level as a bar from send
  to finish: queue (grey), prefill (orange: first scheduled to first token),
  decode (blue: first token to finish), s since the level started;
* ``roofline.png``: achieved FLOP/s against arithmetic intensity (FLOP/byte)
  for groups of engine steps (decode by batch rows, prefill and mixed by
  token bucket) under the device's two roofs (in-process runs only);
* ``kv_pages.png``: KV pages in use over each level.
"""

from __future__ import annotations

import numpy as np

from jaxserve.bench.serving_report import engine_levels, label, main_label


def latency(result, path, plt):
    """``latency_throughput.png``."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, levels in engine_levels(result).items():
        xs = [lv["summary"]["output_throughput"] or 0 for lv in levels]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
            ys = [lv["summary"][key]["p50"] for lv in levels]
            ax.plot(xs, ys, "o-", label=label(result, name))
            for x, y, lv in zip(xs, ys, levels):
                if y is not None:
                    ax.annotate(f"C={lv['concurrency']}", (x, y), textcoords="offset points",
                                xytext=(4, 4), fontsize=7)
    for ax, title in zip(axes, ("TTFT p50", "TPOT p50", "E2E latency p50")):
        ax.set(xlabel="output tokens/s", ylabel="ms", title=title, yscale="log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend()
    fig.suptitle(f"{result['config']['workload']}: latency against throughput "
                 f"across concurrency levels")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(result, path, plt):
    """``timeline.png``."""
    levels = result["levels"]
    heights = [max(2.0, 0.18 * len(lv["requests"]) + 1) for lv in levels]
    fig, axes = plt.subplots(len(levels), 1, figsize=(12, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    colors = {"queue": "0.7", "prefill": "tab:orange", "decode": "tab:blue"}
    for ax, lv in zip(axes[:, 0], levels):
        for y, r in enumerate(lv["requests"]):
            if r["end_s"] is None or r["first_token_s"] is None:
                continue
            send = r["send_s"]
            sched = send + (r["queue_ms"] or 0) / 1e3
            first = r["first_token_s"]
            ax.barh(y, sched - send, left=send, color=colors["queue"], height=0.8)
            ax.barh(y, first - sched, left=sched, color=colors["prefill"], height=0.8)
            ax.barh(y, r["end_s"] - first, left=first, color=colors["decode"], height=0.8)
        ax.set_yticks(range(len(lv["requests"])))
        ax.set_yticklabels([r["workload"] for r in lv["requests"]], fontsize=6)
        ax.invert_yaxis()
        ax.set(title=f"{main_label(result)} C={lv['concurrency']}",
               xlabel="s since the level started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0, 0].legend(handles, list(colors), loc="lower left", bbox_to_anchor=(0, 1.08),
                      ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def roofline(result, path, plt):
    """``roofline.png``."""
    roof = result["roofline"]
    c = roof["ceilings"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    pts = roof["points"]
    lo = min([p["intensity"] for p in pts] + [c["ridge_flop_per_byte"]]) / 4
    hi = max([p["intensity"] for p in pts] + [c["ridge_flop_per_byte"]]) * 4
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(c["flops_per_s"], c["bytes_per_s"] * x), "k-", lw=1.5,
            label=f"roofs: {c['flops_per_s'] / 1e9:.0f} GFLOP/s, {c['bytes_per_s'] / 1e9:.0f} GB/s")
    style = {"decode": ("tab:blue", "o", "decode (B rows)"),
             "prefill": ("tab:orange", "s", "prefill (tokens)"),
             "mixed": ("tab:green", "^", "mixed (tokens)")}
    for phase, (color, marker, name) in style.items():
        ps = [p for p in pts if p["phase"] == phase]
        if not ps:
            continue
        ax.scatter([p["intensity"] for p in ps], [p["flops_per_s"] for p in ps], c=color,
                   marker=marker, label=name, s=[12 + 4 * min(p["steps"], 40) for p in ps])
        for p in ps:
            ax.annotate(str(p["group"]), (p["intensity"], p["flops_per_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -3))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="achieved FLOP/s", title="jaxserve steps on the device roofline")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kv_pages(result, path, plt):
    """``kv_pages.png``."""
    fig, ax = plt.subplots(figsize=(9, 4))
    for lv in result["levels"]:
        series = lv["kv"]["series"]
        ax.plot([s[0] for s in series], [s[1] for s in series], drawstyle="steps-post",
                label=f"C={lv['concurrency']}")
    total = result["levels"][0]["kv"]["pages_total"]
    ax.axhline(total, color="k", ls="--", lw=1, label=f"{total} pages in the cache")
    ax.set(xlabel="s since the level started", ylabel="KV pages in use",
           title="KV cache pages in use", yscale="symlog")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(result: dict) -> dict:
    """{file name: plot function} of ``result`` (the roofline in-process only)."""
    out = {"latency_throughput.png": latency, "timeline.png": timeline,
           "kv_pages.png": kv_pages}
    if result.get("roofline"):
        out["roofline.png"] = roofline
    return out

