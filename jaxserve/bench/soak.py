"""Soak benchmark: long mixed, partly hostile traffic over both APIs at once
(gRPC and the OpenAI HTTP API of one server), watching for leaks (RSS, KV
pages) and for calls that end wrongly.

    python -m jaxserve.bench soak --minutes 20 --output /tmp/soak
    python -m jaxserve.bench soak --minutes 0.5 --clients 1 --http_clients 1 -- --num_pages 128
    python -m jaxserve.bench soak --target 127.0.0.1:50051 --http_url http://127.0.0.1:8080 \\
        --metrics_url http://127.0.0.1:8000/metrics --server_pid 1234 --token T

Processes::

  main process                                   server (spawn_server(http=True), or --target)
  ------------                                   ------
  every --sample_s: RSS of the server pid  ◀──── /proc/PID/status (psutil if installed)
  scrape /metrics (pages, running, waiting) ◀─── prometheus page
  counts XLA compilations in the server's  ◀──── stderr (JAX_LOG_COMPILES=1 on a spawned
    stderr (the compile lines are hidden)          server; every executable built or loaded)
  --clients gRPC client processes (spawn)
    each: --inflight asyncio workers on one AsyncClient ──gRPC──▶ --port
  --http_clients HTTP client processes (spawn)
    each: --inflight asyncio workers on one httpx.AsyncClient ──HTTP──▶ --http_port
    (and raw sockets for the unread streams)
  each worker: draw a case (seeded), run it, record it; until --minutes have passed

A spawned server gets a random bearer token ($JAXSERVE_AUTH_TOKEN) unless
``--token`` names one, so that the ``auth_*`` hostile cases have a token to
get wrong; every other call carries the right one.

The first client process of each API starts with a coverage pass: every
case once, then every hostile sub-case once, so that even a 30 s run has a
status for each; then it draws like the others.

gRPC cases (``soak_traffic.CASES``), with the codes each may end with
(``soak_report.EXPECTED["grpc"]``):

* ``generate``: a streaming request of varied shape: text / token ids / chat,
  greedy or seeded sampling, n = 1..2, logprobs and prompt logprobs sometimes,
  stop strings, every output kind. OK (and the stream must end properly: a
  final message with ``finished`` and a ``finish_reason`` for every choice,
  else it is *lost*) or RESOURCE_EXHAUSTED (the waiting queue is shared, so a
  burst elsewhere may fill it).
* ``cancel``: a stream the client cancels after 1-3 messages or 0.05-2 s
  (CANCELLED, or OK when it finished first). ``deadline``: a long request
  with a 0.05-1.5 s gRPC timeout (DEADLINE_EXCEEDED or OK).
* ``bad``: a malformed request (``soak_traffic.BAD_CASES``: empty prompt, out-of-vocab id,
  negative temperature, unknown role, ...) -> INVALID_ARGUMENT.
  ``oversized``: a prompt of max_prompt_len + 1.. tokens -> INVALID_ARGUMENT.
* ``hostile``: one of ``soak_hostile.GRPC_HOSTILE`` (the hostile kinds: lone
  surrogates as bytes, groups nested 100,000 deep, float32 overflows,
  max_tokens 2^31-1, n 129, authorization metadata), each with its own
  expected codes.
* ``unread``: a stream (n 1-4 and up to 300 tokens, or one in four the
  issue's n 16 / logprobs 20 / up to 1,500 tokens) never read, cancelled 2-8 s
  later (CANCELLED, or whatever ended it first).
* ``burst``: ``--burst`` one-or-two-token requests at once, more than the
  waiting-queue bound (a spawned server gets ``--max_waiting_requests 16``
  unless the engine flags say otherwise): OK or RESOURCE_EXHAUSTED.
* ``tokenize`` / ``detokenize`` / ``model_info`` / ``health``: OK.

HTTP cases (``soak_http.CASES``, statuses in ``EXPECTED["http"]``): the
same kinds over ``/v1/completions`` and ``/v1/chat/completions``, streamed
and not: ``generate`` (200 or 429), ``cancel`` (the client closes the
stream), ``deadline`` (an httpx timeout), ``hostile``
(``soak_hostile.HTTP_HOSTILE``: surrogates in model / prompt / stop /
messages, JSON nested 100,000 deep, temperature 3e38 / 1e308 / 1e999,
repetition_penalty 1e-300, max_tokens 2^31-1 and 2^63, 1,000 prompts, 100
prompts x n 64, authorization headers ...), ``oversized`` (400),
``unread`` (a raw-socket stream read only to its status line, closed 2-8 s
later), ``tokenize`` / ``models`` / ``health`` (200).

The hostile cases expect what the admission rule says (bad input -> 400 /
INVALID_ARGUMENT, never 500; too large to ever hold -> 400, not 429; one
auth rule for both APIs), not what today's server answers: a different
answer is counted as an unexpected status and fails the run.

Hostile requests are in the gRPC ``bad`` mix too: ``n`` far above
``max_num_seqs``, request ids over 256 characters, CUMULATIVE streams asking
for more logprob entries than allowed and bytes that are not a request (all
INVALID_ARGUMENT); normal requests sometimes carry ids of any characters
(control, non-ASCII, ``%``, up to the 256-character limit), and some oversized
prompts are 2 MB texts, refused on their size before tokenizing.

Every call is bounded: a gRPC timeout (``--request_timeout_s`` for normal
streams) and, around it, ``asyncio.wait_for`` of that timeout +
``--slack_s``; a call still running then is *hanging* (cancelled, counted).
Workers stop drawing after ``--minutes``; the run then waits for the calls in
flight (the drain, at most timeout + slack), lets the server settle (idle,
``pages_free == pages_total``, up to ``--settle_s``), optionally probes glibc
(``--malloc_probe``: a ``sitecustomize`` on the server's PYTHONPATH answers
SIGUSR1 with ``mallinfo2`` before and after ``malloc_trim(0)``), then sends
SIGTERM and records the exit status.

This module runs the soak (``run``: the server, the client processes of
``soak_traffic.py`` and ``soak_http.py``, the samples, the end); ``soak_probe.py`` measures the server (memory, XLA executables, ``/metrics``,
the glibc probe); ``soak_report.py`` turns the records and
samples into counters, latency windows, memory figures (the RSS drift, and how
much of it the new XLA executables explain), the pass verdict, ``report.md``
and ``soak.png``.

Memory figures: RSS at start (server ready, no traffic), at the end of the
warm-up (``--warmup_minutes``; default max(10% of the run, min(2 min, half
of it))), at the end and the peak; drift = (end - end of warm-up) / end of
warm-up; slope = least-squares MB/min over the samples after the warm-up.

Pass criteria (exit 0, else 1 with the failing ones listed): no lost and no
hanging call on either API, every status code expected for its case, no
traceback in a spawned server's log, pages free == total
after settling, RSS drift < ``--max_rss_drift``, server exit status 0.

Output in ``--output`` (new or empty): ``soak.json`` (config, machine, every
sample, counters per case x code, latency windows, anomalies), ``report.md``
(printed too) and ``soak.png`` (RSS, calls in flight per API, pages used, TTFT
p50/p99, errors per window; needs matplotlib). The report has, per API and
case, the counts by status (expected / unexpected), lost and hanging calls;
each hostile / malformed sub-case with its expected and actual statuses; the
latency of normal requests after the warm-up per API; pages free at the end;
the RSS figures.
"""


from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import secrets
import sys
import time

from jaxserve.bench import machine, report
from jaxserve.bench.serving import spawn_server, stop_server
from jaxserve.bench.soak_probe import SITECUSTOMIZE, CompileCounter, malloc_probe, sample
from jaxserve.bench.soak_http import http_client_main
from jaxserve.bench.soak_report import (criteria, latency, markdown, plot, rss_figures, summarize,
                                        windows)
from jaxserve.bench.soak_traffic import client_main
from jaxserve.server.client import Client

# ---- the run ------------------------------------------------------------------------------

def soak(a) -> dict:
    """The whole soak (see the module docstring); returns the result dict."""
    mach = machine.describe(devices=False)
    proc, counter, pid, saved_stderr, probe_file = None, None, a.server_pid, sys.stderr, None
    flags = list(a.engine_flags)
    token, http_url = a.token, a.http_url
    if not a.target:
        # A token, so that the auth cases have one to get wrong.
        token = token or f"soak-{secrets.token_hex(8)}"
        if not any(f.split("=")[0] == "--max_waiting_requests" for f in flags):
            flags += ["--max_waiting_requests", "16"]
        env_saved = dict(os.environ)
        os.environ["JAX_LOG_COMPILES"] = "1"
        os.environ["JAXSERVE_AUTH_TOKEN"] = token
        for kv in a.server_env:
            k, _, v = kv.partition("=")
            os.environ[k] = v
        if a.malloc_probe:
            site = os.path.join(a.output, "_probe")
            os.makedirs(site, exist_ok=True)
            with open(os.path.join(site, "sitecustomize.py"), "w") as f:
                f.write(SITECUSTOMIZE)
            probe_file = os.path.join(a.output, "malloc_probe.jsonl")
            os.environ["SOAK_MALLOC_FILE"] = probe_file
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        counter = CompileCounter(sys.stderr)
        sys.stderr = counter
        try:
            t_spawn = time.monotonic()
            proc, target, url, http_url = spawn_server(a.model, flags, http=True)
            load_s = time.monotonic() - t_spawn
        finally:
            os.environ.clear()
            os.environ.update(env_saved)
        pid = proc.pid
    else:
        target, url, load_s = a.target, a.metrics_url, None
    try:
        with Client(target, token=token) as c:
            info = c.model_info()
        t0 = time.monotonic()
        warmup_s = 60 * (a.warmup_minutes if a.warmup_minutes is not None
                         else max(0.1 * a.minutes, min(2.0, 0.5 * a.minutes)))
        samples = [sample(t0, pid, url, counter)]
        compiles_at_start = counter.count() if counter else None
        cfg = {"target": target, "http_url": http_url, "token": token, "seed": a.seed, "inflight": a.inflight,
               "burst": a.burst, "request_timeout_s": a.request_timeout_s, "slack_s": a.slack_s,
               "vocab_size": info.vocab_size, "max_prompt_len": info.max_prompt_len,
               "max_model_len": info.max_model_len, "stop_at": t0 + 60 * a.minutes,
               "kv_tokens": info.num_pages * info.page_size,
               "coverage_clients": [0, a.clients]}  # the first of each API
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        n_clients = a.clients + a.http_clients  # ids: gRPC 0..clients-1, then HTTP
        procs = [ctx.Process(target=client_main if i < a.clients else http_client_main,
                             args=(cfg, i, out), daemon=True) for i in range(n_clients)]
        for p in procs:
            p.start()
        records, got, started = [], set(), 0
        hard_end = cfg["stop_at"] + a.request_timeout_s + a.slack_s + 60
        next_sample = t0 + a.sample_s
        while len(got) < n_clients and time.monotonic() < hard_end:
            try:
                cid, recs, n = out.get(timeout=max(0.05, next_sample - time.monotonic()))
                got.add(cid)
                records += recs
                started += n
            except queue_mod.Empty:
                pass
            if time.monotonic() >= next_sample:
                samples.append(sample(t0, pid, url, counter))
                next_sample += a.sample_s
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        traffic_end = time.monotonic()
        # Settle: idle and every page free, or --settle_s passed.
        settle_deadline = time.monotonic() + a.settle_s
        while True:
            time.sleep(1.0)
            s = sample(t0, pid, url, counter)
            idle = (s.get("running") == 0 and s.get("waiting") == 0 and not s.get("paused")
                    and s.get("pages_free") == s.get("pages_total"))
            if idle or time.monotonic() > settle_deadline:
                break
        time.sleep(min(3.0, a.settle_s))  # let freed memory settle too
        s = sample(t0, pid, url, counter)
        samples.append(s)
        end = {k: s.get(k) for k in ("pages_free", "pages_total", "pages_used", "running",
                                     "waiting", "paused", "streams_paused", "streams_resumed",
                                     "streams_stalled", "streams_buffer_full")}
        end["settle_s"] = time.monotonic() - traffic_end
        probe = malloc_probe(proc, probe_file) if proc is not None and probe_file else None
        if probe:
            samples.append(sample(t0, pid, url, counter) | {"after_malloc_trim": True})
    finally:
        server = {"load_s": load_s, "pid": pid}
        if proc is not None:
            t_stop = time.monotonic()
            stop_server(proc)
            server.update(exit_status=proc.returncode, stop_s=time.monotonic() - t_stop)
            time.sleep(0.3)  # the last stderr lines
        sys.stderr = saved_stderr
    mach["load_average_end"] = machine.load_average()
    records.sort(key=lambda r: r["t1"])
    counters = summarize(records)
    counters["totals"]["started"] = started
    rss_samples = [x for x in samples if not x.get("after_malloc_trim")]
    res = {"config": {**vars(a), "engine_flags": flags, "warmup_s": warmup_s},
           "machine": mach, "server": server,
           "model_info": {"vocab_size": info.vocab_size, "max_prompt_len": info.max_prompt_len,
                          "max_model_len": info.max_model_len, "num_pages": info.num_pages,
                          "page_size": info.page_size, "backend": info.backend},
           "duration_s": traffic_end - t0, "warmup_s": warmup_s, "samples": samples,
           "windows": windows(records, rss_samples), "counters": counters, "end": end,
           "latency": latency(records, t0 + warmup_s), "http_url": http_url,
           "rss": rss_figures(rss_samples, warmup_s), "malloc_probe": probe,
           "client_processes_missing": sorted(set(range(n_clients)) - got),
           "anomalies": [r for r in records if not r["expected"] or r.get("lost")
                         or r.get("hanging")][:200]}
    if counter is not None:
        by_name = {}
        for _, name in counter.events:
            by_name[name] = by_name.get(name, 0) + 1
        server["tracebacks"] = counter.tracebacks
        res["compilations"] = {"total": len(counter.events), "at_start": compiles_at_start,
                               "after_warmup": len(counter.events) - counter.count(t0 + warmup_s),
                               "cache_hits": counter.cache_hits, "by_name": by_name,
                               "times_s": [round(t - t0, 2) for t, _ in counter.events]}
    res["config"].pop("token", None)
    res["failed"] = criteria(res, a.max_rss_drift)
    return res


def add_arguments(ap) -> None:
    """The ``soak`` subcommand's options."""
    ap.add_argument("--minutes", type=float, required=True, help="traffic time, minutes")
    ap.add_argument("--model", default="smollm2-135m", help="spawned server: alias or .gguf")
    ap.add_argument("--target", help="host:port of a running server (default: spawn one)")
    ap.add_argument("--metrics_url", help="--target: its /metrics URL")
    ap.add_argument("--server_pid", type=int, help="--target: its pid, for RSS")
    ap.add_argument("--http_url", help="--target: base URL of its HTTP API (http://host:port)")
    ap.add_argument("--token", help="bearer token of the server (a spawned one gets a random "
                    "token unless this is given)")
    ap.add_argument("--clients", type=int, default=3, help="gRPC client processes")
    ap.add_argument("--http_clients", type=int, default=3, help="HTTP client processes")
    ap.add_argument("--inflight", type=int, default=2, help="calls in flight per client")
    ap.add_argument("--burst", type=int, default=40, help="requests per burst")
    ap.add_argument("--sample_s", type=float, default=5.0, help="sampling period, s")
    ap.add_argument("--warmup_minutes", type=float, default=None,
                    help="default max(10%% of the run, min(2, half of it))")
    ap.add_argument("--max_rss_drift", type=float, default=0.05,
                    help="largest passing RSS drift after warm-up (fraction)")
    ap.add_argument("--request_timeout_s", type=float, default=120.0,
                    help="gRPC timeout of normal streams, s")
    ap.add_argument("--slack_s", type=float, default=30.0,
                    help="a call not ended by its timeout + this is hanging")
    ap.add_argument("--settle_s", type=float, default=20.0,
                    help="most seconds to wait for an idle server at the end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server_env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of a spawned server, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    ap.add_argument("--malloc_probe", action="store_true",
                    help="spawned server: load a glibc probe (mallinfo2 + malloc_trim on "
                    "SIGUSR1) and use it after settling")
    ap.add_argument("--output", default=None, help="folder, new or empty "
                    "(default soak-results/<time>)")
    ap.add_argument("engine_flags", nargs="*", help="after --: flags of the spawned server")


def run(a) -> int:
    """Check the options, soak, write ``soak.json``, ``report.md`` and
    ``soak.png`` (``report.write``); 0 when every pass criterion held, else 1.

    Raises:
      ValueError: a bad option (before any server starts).
    """
    if a.target and not a.metrics_url:
        raise ValueError("--target needs --metrics_url (pages and running/waiting come from it)")
    if a.target and a.http_clients and not a.http_url:
        raise ValueError("--target with --http_clients > 0 needs --http_url")
    if a.clients < 0 or a.http_clients < 0 or a.clients + a.http_clients < 1:
        raise ValueError(f"--clients {a.clients} / --http_clients {a.http_clients}: need >= 0 "
                         "each and one client at least")
    if a.inflight < 1 or a.minutes <= 0 or a.sample_s <= 0:
        raise ValueError("--inflight, --minutes and --sample_s must be positive")
    a.output = a.output or os.path.join("soak-results", time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(a.output) and os.listdir(a.output):
        raise ValueError(f"--output {a.output} is not empty")
    os.makedirs(a.output, exist_ok=True)
    res = soak(a)
    paths = report.write(a.output, res, markdown, {"soak.png": plot}, json_name="soak.json")
    print(report.read_report(paths))
    if res["failed"]:
        print("FAILED:\n" + "\n".join(f"- {x}" for x in res["failed"]), file=sys.stderr)
        return 1
    return 0

