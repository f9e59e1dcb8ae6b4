"""Analysis and report of a soak run (``jaxserve/bench/soak.py`` runs the
traffic and calls these): plain functions of its records and samples, no I/O
but ``plot``'s file.

Inputs, as ``soak.run`` collects them:

* records: one dict per call ended, from the client processes: ``api``
  ("grpc" or "http"), ``case`` (``soak_traffic.CASES`` / ``soak_http.CASES``,
  or ``client`` for a client process's own fault), ``code`` (a gRPC status
  name, an HTTP status as a string, ``CANCELLED`` / ``TIMEOUT`` on the HTTP
  side, ``HANGING`` or ``CLIENT_ERROR``), ``expect`` (a hostile case's own
  expected codes), monotonic ``t0`` /
  ``t1`` and ``e2e`` (s), ``ttft`` (s, streams that sent a token), ``lost`` /
  ``hanging`` flags, ``sub`` (the malformed or oversized variant).
* samples: one dict per ``--sample_s``: monotonic ``t``, ``t_rel`` (s since
  traffic began), server RSS figures (MB), KV pages, running / waiting, XLA
  executables so far; one taken after ``malloc_trim(0)`` has
  ``after_malloc_trim`` (plotted apart; ``run`` keeps it out of the RSS
  figures and windows).

Functions:

* ``summarize(records)``: counters per API x case x code, split by
  ``EXPECTED`` (the codes each case may end with) or the record's own
  ``expect``; totals overall and per API; the sub-cases with their expected
  and actual codes; marks every record ``expected``.
* ``latency(records, after)``: TTFT / E2E p50 and p99 of OK ``generate``
  calls per API after the warm-up.
* ``windows(records, samples)``: per sample interval, calls/s, TTFT and E2E
  p50/p99 of OK ``generate`` calls, non-OK codes, unexpected ones, calls in
  flight per API at the sample (call after ``summarize``: it reads
  ``expected``).
* ``rss_figures(samples, warmup_end)``: RSS at start, end of warm-up, end,
  peak; drift = (end - end of warm-up) / end of warm-up; least-squares slope
  (MB/min) after the warm-up.
* ``rss_by_executables``: the part of that drift new XLA executables explain
  (MB per executable) and the rest (growth at a constant executable count).
* ``criteria(result, max_drift)``: the failed pass criteria, as sentences.
* ``markdown(result)`` -> ``report.md`` (per API, cases in ``EXPECTED``'s
  order; the sub-case table; latency per API).
* ``plot(result, path, plt)`` -> ``soak.png`` (RSS, calls in flight per API,
  pages used, TTFT p50/p99, errors per window).
"""

from __future__ import annotations

import itertools

import numpy as np

# Statuses each case may end with, per API (gRPC code names; HTTP statuses as
# strings, or a client-side outcome, see ``soak_http``); anything else is an
# unexpected status. A ``hostile`` record carries its own (``rec["expect"]``,
# from ``soak_hostile``): the admission rule, whatever the server answers.
EXPECTED = {
    "grpc": {
        "generate": {"OK", "RESOURCE_EXHAUSTED"},
        "cancel": {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"},
        "deadline": {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"},
        "bad": {"INVALID_ARGUMENT"},
        "hostile": set(),
        "oversized": {"INVALID_ARGUMENT"},
        "unread": {"CANCELLED", "OK", "RESOURCE_EXHAUSTED", "ABORTED"},
        "burst": {"OK", "RESOURCE_EXHAUSTED"},
        "tokenize": {"OK"}, "detokenize": {"OK"}, "model_info": {"OK"}, "health": {"OK"},
    },
    "http": {
        "generate": {"200", "429"},
        "cancel": {"200", "CANCELLED", "429"},
        "deadline": {"200", "TIMEOUT", "429"},
        "hostile": set(),
        "oversized": {"400"},
        "unread": {"200", "429"},
        "tokenize": {"200"}, "models": {"200"}, "health": {"200"},
    },
}
# Cases whose calls are generation streams (``ok_streams`` counts their OK ends).
STREAMING = ("generate", "cancel", "deadline", "burst")
OK_CODES = ("OK", "200")


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def expected(rec: dict) -> bool:
    """Whether ``rec`` ended with a status its case may end with."""
    api = rec.get("api", "grpc")
    allowed = rec["expect"] if "expect" in rec else EXPECTED[api].get(rec["case"], ())
    return rec.get("code", "NONE") in allowed


def summarize(records: list[dict]) -> dict:
    """Counters: per API per case {code: count} split expected / unexpected,
    the totals of calls, lost, hanging, unexpected (overall and per API); the
    hostile, malformed and oversized sub-cases with their expected codes and
    the codes they got. Marks every record ``expected``."""
    by, subs, per_api = {}, {}, {}
    tot = {"calls": len(records), "lost": 0, "hanging": 0, "unexpected": 0, "ok_streams": 0,
           "client_faults": sum(r["case"] == "client" for r in records)}
    for rec in records:
        api, case, code = rec.get("api", "grpc"), rec["case"], rec.get("code", "NONE")
        exp = rec["expected"] = expected(rec)
        d = by.setdefault(api, {}).setdefault(
            case, {"expected": {}, "unexpected": {}, "lost": 0, "hanging": 0})
        side = d["expected" if exp else "unexpected"]
        side[code] = side.get(code, 0) + 1
        t = per_api.setdefault(api, {"calls": 0, "lost": 0, "hanging": 0, "unexpected": 0})
        t["calls"] += 1
        for key, hit in (("lost", rec.get("lost")), ("hanging", rec.get("hanging")),
                         ("unexpected", not exp)):
            if hit:
                if key != "unexpected":
                    d[key] += 1
                tot[key] += 1
                t[key] += 1
        if case in STREAMING and code in OK_CODES:
            tot["ok_streams"] += 1
        if "sub" in rec:
            default = EXPECTED[api].get(case, set())
            s = subs.setdefault(f"{api}:{case}:{rec['sub']}", {
                "expected": sorted(rec.get("expect", default)), "codes": {}})
            s["codes"][code] = s["codes"].get(code, 0) + 1
    return {"totals": tot, "per_api": per_api, "by_case": by, "sub_cases": subs}


def latency(records: list[dict], after: float) -> dict:
    """Per API: TTFT and E2E p50/p99 (s) of the ``generate`` calls that
    ended OK and began at monotonic ``after`` or later (after the warm-up),
    and their count."""
    out = {}
    for api in sorted({r.get("api", "grpc") for r in records}):
        gen = [r for r in records if r.get("api", "grpc") == api and r["case"] == "generate"
               and r.get("code") in OK_CODES and r["t0"] >= after]
        ttft = [r["ttft"] for r in gen if r.get("ttft") is not None]
        e2e = [r["e2e"] for r in gen]
        out[api] = {"calls": len(gen), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
                    "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99)}
    return out


def windows(records: list[dict], samples: list[dict]) -> list[dict]:
    """Per sample interval (previous sample, this one]: calls ended,
    calls/s, TTFT and E2E p50/p99 (s) of OK ``generate`` calls (both APIs),
    errors by code (every non-OK code) and the unexpected ones; and at the
    sample's time the calls in flight per API (begun, not ended)."""
    out = []
    ends = np.array([r["t1"] for r in records]) if records else np.zeros(0)
    starts = np.array([r["t0"] for r in records]) if records else np.zeros(0)
    apis = np.array([r.get("api", "grpc") for r in records])
    for a, b in itertools.pairwise(samples):
        sel = [records[i] for i in np.nonzero((ends > a["t"]) & (ends <= b["t"]))[0]]
        gen = [r for r in sel if r["case"] == "generate" and r.get("code") in OK_CODES]
        ttft = [r["ttft"] for r in gen if r.get("ttft") is not None]
        e2e = [r["e2e"] for r in gen]
        errs = {}
        for r in sel:
            if r.get("code") not in OK_CODES:
                errs[r.get("code")] = errs.get(r.get("code"), 0) + 1
        live = (starts <= b["t"]) & (ends > b["t"])
        out.append({"t": b["t_rel"], "calls": len(sel), "calls_per_s": len(sel) / (b["t"] - a["t"]),
                    "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
                    "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99),
                    "errors": errs, "unexpected": sum(not r["expected"] for r in sel),
                    "in_flight": {api: int(np.sum(live & (apis == api)))
                                  for api in ("grpc", "http")}})
    return out


def rss_figures(samples: list[dict], warmup_end: float) -> dict:
    """RSS (MB) at start, at the end of the warm-up (the last sample at or
    before ``warmup_end`` s), at the end, the peak; drift (fraction) and the
    least-squares slope (MB/min) over the samples after the warm-up."""
    pts = [(s["t_rel"], s["rss"]) for s in samples if s.get("rss") is not None]
    if len(pts) < 2:
        return {}
    start, end = pts[0][1], pts[-1][1]
    warm = [p for p in pts if p[0] <= warmup_end][-1][1]
    post = [p for p in pts if p[0] >= warmup_end]
    slope = float(np.polyfit([p[0] / 60 for p in post], [p[1] for p in post], 1)[0]) \
        if len(post) >= 3 else None
    out = {"start_mb": start, "warmup_end_mb": warm, "end_mb": end,
           "peak_mb": max(p[1] for p in pts), "drift": (end - warm) / warm,
           "slope_mb_per_min": slope, "post_warmup_samples": len(post)}
    out.update(rss_by_executables(samples, warmup_end, warm))
    return out


def rss_by_executables(samples: list[dict], warmup_end: float, warm_mb: float) -> dict:
    """Split the RSS change after the warm-up between consecutive samples into
    the intervals in which new XLA executables were built or loaded and the
    intervals in which none were. ``mb_per_executable``: the first sum over
    the executables built; ``drift_without_executables``: the second sum (RSS
    growth at a constant executable count, where a leak shows) over the RSS
    at the end of the warm-up. Empty without compilation counts."""
    post = [s for s in samples if s.get("rss") is not None and s.get("compilations") is not None
            and s["t_rel"] >= warmup_end]
    if len(post) < 2:
        return {}
    with_exe = without = 0.0
    for prev, cur in itertools.pairwise(post):
        d = cur["rss"] - prev["rss"]
        if cur["compilations"] > prev["compilations"]:
            with_exe += d
        else:
            without += d
    new = post[-1]["compilations"] - post[0]["compilations"]
    return {"executables_after_warmup": int(new),
            "mb_per_executable": with_exe / new if new else None,
            "mb_without_executables": without, "drift_without_executables": without / warm_mb}


def criteria(result: dict, max_drift: float) -> list[str]:
    """The failed pass criteria, as sentences ([] = passed)."""
    fails = []
    t = result["counters"]["totals"]
    if t["lost"]:
        fails.append(f"{t['lost']} lost streams (OK status, no final message with finish_reason)")
    if t.get("started", t["calls"]) != t["calls"] - t.get("client_faults", 0):
        fails.append(f"{t['started']} calls started but {t['calls']} recorded")
    if t["hanging"]:
        fails.append(f"{t['hanging']} hanging calls (not ended by deadline + slack)")
    if t["unexpected"]:
        fails.append(f"{t['unexpected']} calls ended with a status code not expected for their case")
    end = result["end"]
    if end.get("pages_free") is None or end["pages_free"] != end.get("pages_total"):
        fails.append(f"pages free {end.get('pages_free')} != total {end.get('pages_total')} "
                     "after settling")
    if end.get("paused"):
        fails.append(f"{end['paused']} sequences still paused after settling")
    rss = result["rss"]
    if rss and rss["drift"] >= max_drift:
        fails.append(f"RSS drift {100 * rss['drift']:.1f}% >= {100 * max_drift:.1f}%")
    if result["server"].get("tracebacks"):
        fails.append(f"{result['server']['tracebacks']} tracebacks in the server's log")
    if result["server"].get("exit_status") not in (0, None):
        fails.append(f"server exit status {result['server']['exit_status']} after SIGTERM")
    if result["client_processes_missing"]:
        fails.append(f"client processes that never reported: {result['client_processes_missing']}")
    return fails


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def markdown(res: dict) -> str:
    """The report: verdict, calls per case x code, end state, memory, latency over time."""
    c, cfg, m = res["counters"], res["config"], res["machine"]
    lines = [(f"# Soak: {cfg['model'] or cfg['target']}, {res['duration_s'] / 60:.1f} min, "
             f"{cfg['clients']} gRPC + {cfg.get('http_clients', 0)} HTTP client processes x "
             f"{cfg['inflight']} in flight"),
             "", (f"Machine: {m['cpu_model']} ({m['cpu_count']} CPUs; "
             f"{' '.join(m['avx_flags']) or 'no AVX'}); load average at start/end "
             f"{m['load_average_start']} / {m.get('load_average_end')}."),
             f"Server flags: `{' '.join(cfg['engine_flags']) or '(defaults)'}`"
             + (f"; env `{' '.join(cfg['server_env'])}`" if cfg["server_env"] else ""),
             "", "**PASSED**" if not res["failed"] else
             "**FAILED**: " + "; ".join(res["failed"]), "",
             "## Calls by API, case and status code", "",
             "| API | case | expected codes (count) | unexpected codes (count) | lost | hanging |",
             "|---|---|---|---|---|---|"]
    fmt = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"  # noqa: E731
    for api, cases in sorted(c["by_case"].items()):
        order = list(EXPECTED.get(api, {})) + sorted(set(cases) - set(EXPECTED.get(api, {})))
        for case in (x for x in order if x in cases):
            d = cases[case]
            lines.append(f"| {api} | {case} | {fmt(d['expected'])} | "
                         f"{fmt(d['unexpected']) if not d['unexpected'] else '**' + fmt(d['unexpected']) + '**'}"
                         f" | {d['lost']} | {d['hanging']} |")
    t = c["totals"]
    lines += ["", (f"{t['calls']} calls ({t.get('started')} started), {t['ok_streams']} streams "
              f"ended OK; lost {t['lost']}, "
              f"hanging {t['hanging']}, unexpected codes {t['unexpected']}; per API: "
              + "; ".join(f"{api} {v['calls']} calls, lost {v['lost']}, hanging {v['hanging']}, "
                          f"unexpected {v['unexpected']}" for api, v in
                          sorted(c.get("per_api", {}).items())) + "."), ""]
    subs = c["sub_cases"]
    if subs:
        lines += ["## Hostile, malformed and oversized requests", "",
                  "| API | case | sub-case | expected | got | as expected |", "|---|---|---|---|---|---|"]
        for key in sorted(subs):
            api, case, sub = key.split(":", 2)
            v = subs[key]
            ok = set(v["codes"]) <= set(v["expected"])
            lines.append(f"| {api} | {case} | {sub} | {', '.join(v['expected'])} | "
                         f"{fmt(v['codes'])} | {'yes' if ok else '**no**'} |")
        lines.append("")
    if res.get("latency"):
        lines += ["## Latency of normal requests after the warm-up (generate, ended OK)", "",
                  "| API | calls | TTFT p50 s | TTFT p99 s | E2E p50 s | E2E p99 s |",
                  "|---|---|---|---|---|---|"]
        for api, v in sorted(res["latency"].items()):
            lines.append(f"| {api} | {v['calls']} | {_f(v['ttft_p50'], '{:.3f}')} | "
                         f"{_f(v['ttft_p99'], '{:.3f}')} | {_f(v['e2e_p50'], '{:.3f}')} | "
                         f"{_f(v['e2e_p99'], '{:.3f}')} |")
        lines.append("")
    e, s, rss = res["end"], res["server"], res["rss"]
    lines += ["## End state and memory", "",
              (f"- KV pages free / total after settling: {e.get('pages_free')} / "
              f"{e.get('pages_total')} (running {e.get('running')}, waiting {e.get('waiting')}; "
              f"settled in {_f(e.get('settle_s'))} s)"),
              (f"- streams nobody read: paused {e.get('streams_paused', '-')}, resumed "
               f"{e.get('streams_resumed', '-')}, aborted stalled {e.get('streams_stalled', '-')}"
               f" / buffer full {e.get('streams_buffer_full', '-')}; paused at the end "
               f"{e.get('paused', '-')}"),
              f"- tracebacks in the server's log: {s.get('tracebacks', '-')}",
              (f"- server exit status after SIGTERM: {s.get('exit_status')}"
               f" ({_f(s.get('stop_s'))} s)" if "exit_status" in s else
               "- server: attached with --target, not stopped by this run")]
    if rss:
        lines += [(f"- RSS, MB: start {rss['start_mb']:.0f}, end of warm-up "
                  f"({res['warmup_s'] / 60:.1f} min) {rss['warmup_end_mb']:.0f}, end "
                  f"{rss['end_mb']:.0f}, peak {rss['peak_mb']:.0f}; drift "
                  f"{100 * rss['drift']:+.1f}% (limit {100 * cfg['max_rss_drift']:.0f}%); "
                  f"slope after warm-up {_f(rss['slope_mb_per_min'], '{:+.2f}')} MB/min "
                  f"over {rss['post_warmup_samples']} samples")]
        if "mb_without_executables" in rss:
            lines.append(
                f"- RSS after the warm-up, split by sample interval: "
                f"{rss['executables_after_warmup']} new XLA executables, "
                f"{_f(rss['mb_per_executable'])} MB each in the intervals that built them; "
                f"{rss['mb_without_executables']:+.0f} MB in the intervals that built none "
                f"(drift without executables {100 * rss['drift_without_executables']:+.1f}%)")
    else:
        lines.append("- RSS: not measured (no server pid: give --server_pid with --target)")
    if res.get("compilations") is not None:
        cm = res["compilations"]
        lines.append(f"- XLA executables built or loaded: {cm['total']} "
                     f"({cm['after_warmup']} after the warm-up; persistent-cache hits "
                     f"{cm['cache_hits']}); by jit: "
                     + ", ".join(f"{k} {v}" for k, v in sorted(cm["by_name"].items())))
    if res.get("malloc_probe"):
        p = res["malloc_probe"]
        lines.append(f"- glibc after settling: heap in use {p['in_use_mb']:.0f} MB, free in "
                     f"arenas {p['free_mb']:.0f} MB, mmapped {p['mmap_mb']:.0f} MB; "
                     f"malloc_trim(0) took RSS {p['rss_before_mb']:.0f} -> "
                     f"{p['rss_after_mb']:.0f} MB in {_f(p.get('trim_s'), '{:.2f}')} s")
    lines += ["", "## Over time", "",
              ("| t (min) | RSS MB | anon MB | pages used | running | waiting | in flight "
               "gRPC / HTTP | XLA exes | calls/s | TTFT p50 / p99 s | E2E p50 / p99 s | errors |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = list(zip(res["samples"][1:], res["windows"]))
    step = max(1, len(rows) // 30)
    for smp, w in rows[::step] + ([rows[-1]] if rows and (len(rows) - 1) % step else []):
        lines.append(
            f"| {smp['t_rel'] / 60:.2f} | {_f(smp.get('rss'), '{:.0f}')} | "
            f"{_f(smp.get('rss_anon'), '{:.0f}')} | {smp.get('pages_used', '-')} | "
            f"{smp.get('running', '-')} | {smp.get('waiting', '-')} | "
            f"{w.get('in_flight', {}).get('grpc', '-')} / {w.get('in_flight', {}).get('http', '-')} | "
            f"{smp.get('compilations', '-')} | {w['calls_per_s']:.1f} | "
            f"{_f(w['ttft_p50'], '{:.2f}')} / {_f(w['ttft_p99'], '{:.2f}')} | "
            f"{_f(w['e2e_p50'], '{:.2f}')} / {_f(w['e2e_p99'], '{:.2f}')} | "
            f"{fmt(w['errors'])} |")
    if step > 1:
        lines.append(f"\n(one row every {step} windows of {res['config']['sample_s']} s; all in soak.json)")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str, plt) -> None:
    """``soak.png``: RSS, calls in flight per API (and the server's running
    / waiting), pages used, TTFT p50/p99 and errors per window against
    minutes (``report.write`` gives matplotlib's ``plt``)."""
    trimmed = [s for s in res["samples"] if s.get("after_malloc_trim")]
    sm = [s for s in res["samples"] if not s.get("after_malloc_trim")]
    ws = res["windows"]
    fig, axes = plt.subplots(5, 1, figsize=(10, 13.5), sharex=True)
    t = [s["t_rel"] / 60 for s in sm]
    ax = axes[0]
    ax.plot(t, [s.get("rss") for s in sm], label="RSS")
    ax.plot(t, [s.get("rss_anon") for s in sm], label="anonymous", ls="--")
    ax.axvline(res["warmup_s"] / 60, color="grey", ls=":", label="end of warm-up")
    if trimmed:
        ax.plot([s["t_rel"] / 60 for s in trimmed], [s.get("rss") for s in trimmed], "v",
                color="tab:green", label="after malloc_trim(0)")
    if any(s.get("compilations") is not None for s in sm):
        ax2 = ax.twinx()
        ax2.plot(t, [s.get("compilations") for s in sm], color="tab:red", lw=1,
                 drawstyle="steps-post", label="XLA executables")
        ax2.set_ylabel("XLA executables", color="tab:red")
    ax.set(ylabel="server RSS, MB", title="Server memory")
    ax.legend(fontsize=8, loc="lower right")
    tw = [w["t"] / 60 for w in ws]
    ax = axes[1]
    for api in ("grpc", "http"):
        ax.plot(tw, [w.get("in_flight", {}).get(api) for w in ws], label=f"{api} calls in flight")
    ax.plot(t, [s.get("running") for s in sm], ls="--", label="server: running")
    ax.plot(t, [s.get("waiting") for s in sm], ls=":", label="server: waiting")
    ax.set(ylabel="requests", title="In flight (client side, per API) and in the engine")
    ax.legend(fontsize=8)
    axes = axes[1:]
    ax = axes[1]
    ax.plot(t, [s.get("pages_used") for s in sm], drawstyle="steps-post", label="used")
    if sm and sm[-1].get("pages_total"):
        ax.axhline(sm[-1]["pages_total"], color="k", ls="--", lw=1, label="total")
    ax.set(ylabel="KV pages", yscale="symlog", title="KV pages used")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(tw, [w["ttft_p50"] for w in ws], marker=".", label="TTFT p50")
    ax.plot(tw, [w["ttft_p99"] for w in ws], marker=".", label="TTFT p99")
    ax.set(ylabel="s", yscale="log", title="TTFT of OK generate calls (both APIs), per window")
    ax.legend(fontsize=8)
    ax = axes[3]
    codes = sorted({c for w in ws for c in w["errors"]})
    bottom = np.zeros(len(ws))
    width = (tw[1] - tw[0]) * 0.9 if len(tw) > 1 else 0.05
    for code in codes:
        ys = np.array([w["errors"].get(code, 0) for w in ws])
        ax.bar(tw, ys, width, bottom=bottom, label=code)
        bottom += ys
    bad = [(x, w["unexpected"]) for x, w in zip(tw, ws) if w["unexpected"]]
    if bad:
        ax.plot(*zip(*bad), color="k", marker="x", ls="", label="unexpected")
    ax.set(xlabel="minutes", ylabel="calls", title="Non-OK calls per window")
    if codes or bad:
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
