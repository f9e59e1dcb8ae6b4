"""Soak benchmark: hours of mixed, partly hostile gRPC traffic against one
server, watching for leaks (RSS, KV pages) and for calls that end wrongly.

    python -m jaxserve.bench.soak --minutes 30 --output /tmp/soak
    python -m jaxserve.bench.soak --minutes 5 --clients 2 -- --max_num_seqs 16   # engine flags after --
    python -m jaxserve.bench.soak --target 127.0.0.1:50051 \\
        --metrics_url http://127.0.0.1:8000/metrics --server_pid 1234

Processes::

  main process                                   server (spawn_server, or --target)
  ------------                                   ------
  every --sample_s: RSS of the server pid  ◀──── /proc/PID/status (psutil if installed)
  scrape /metrics (pages, running, waiting) ◀─── prometheus page
  counts XLA compilations in the server's  ◀──── stderr (JAX_LOG_COMPILES=1 on a spawned
    stderr (the compile lines are hidden)          server; every executable built or loaded)
  K client processes (multiprocessing, spawn)
    each: --inflight asyncio workers on one AsyncClient ──gRPC──▶ 127.0.0.1
    each worker: draw a case (seeded), run it, record it; until --minutes have passed

Cases, drawn per call with fixed weights (``CASES``), each with the gRPC codes
it may end with (``soak_report.EXPECTED``):

* ``generate``: a streaming request of varied shape: text / token ids / chat,
  greedy or seeded sampling, n = 1..2, logprobs and prompt logprobs sometimes,
  stop strings, every output kind. OK (and the stream must end properly: a
  final message with ``finished`` and a ``finish_reason`` for every choice,
  else it is *lost*) or RESOURCE_EXHAUSTED (the waiting queue is shared, so a
  burst elsewhere may fill it).
* ``cancel``: a stream the client cancels after 1-3 messages or 0.05-2 s
  (CANCELLED, or OK when it finished first). ``deadline``: a long request
  with a 0.05-1.5 s gRPC timeout (DEADLINE_EXCEEDED or OK).
* ``bad``: a malformed request (``BAD_CASES``: empty prompt, out-of-vocab id,
  negative temperature, unknown role, ...) -> INVALID_ARGUMENT.
  ``oversized``: a prompt of max_prompt_len + 1.. tokens -> INVALID_ARGUMENT.
* ``burst``: ``--burst`` one-or-two-token requests at once, more than the
  waiting-queue bound (a spawned server gets ``--max_waiting_requests 16``
  unless the engine flags say otherwise): OK or RESOURCE_EXHAUSTED.
* ``tokenize`` / ``detokenize`` / ``model_info`` / ``health``: OK.

The hostile cases of issue 15 are in the mix too: ``n`` far above
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

This module makes the traffic and runs the soak (``run``, ``main``);
``soak_probe.py`` measures the server (memory, XLA executables, ``/metrics``,
the glibc probe, the machine); ``soak_report.py`` turns the records and
samples into counters, latency windows, memory figures (the RSS drift, and how
much of it the new XLA executables explain), the pass verdict, ``report.md``
and ``soak.png``.

Memory figures: RSS at start (server ready, no traffic), at the end of the
warm-up (``--warmup_minutes``; default max(10% of the run, min(2 min, half
of it))), at the end and the peak; drift = (end - end of warm-up) / end of
warm-up; slope = least-squares MB/min over the samples after the warm-up.

Pass criteria (exit 0, else 1 with the failing ones listed): no lost and no
hanging call, every status code expected for its case, pages free == total
after settling, RSS drift < ``--max_rss_drift``, server exit status 0.

Output in ``--output`` (new or empty): ``soak.json`` (config, machine, every
sample, counters per case x code, latency windows, anomalies), ``report.md``
(printed too) and ``soak.png`` (RSS, pages used, TTFT p50/p99, errors per
window; needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time

import numpy as np

from jaxserve.bench.soak_probe import (
    SITECUSTOMIZE,
    CompileCounter,
    machine,
    malloc_probe,
    sample,
)
from jaxserve.bench.soak_report import (
    criteria,
    markdown,
    plot,
    rss_figures,
    summarize,
    windows,
)

# (case, weight): the draw of every call; soak_report.EXPECTED has each one's codes.
CASES = (("generate", 0.50), ("cancel", 0.10), ("deadline", 0.08), ("bad", 0.10),
         ("oversized", 0.03), ("burst", 0.015), ("tokenize", 0.06), ("detokenize", 0.04),
         ("model_info", 0.035), ("health", 0.04))
# Malformed requests (the ``bad`` case): name -> what is wrong.
BAD_CASES = ("empty_text", "empty_token_ids", "no_prompt", "oov_token_id", "negative_token_id",
             "negative_temperature", "unknown_role", "empty_chat", "max_tokens_zero",
             "top_p_above_1", "logprobs_above_20", "unknown_output_kind", "oov_stop_token_id",
             "n_zero", "detokenize_oov", "tokenize_unknown_role", "n_above_max_num_seqs",
             "request_id_too_long", "cumulative_logprobs_too_big", "undecodable_bytes",
             "invalid_utf8")
# Request ids of unusual characters that must round-trip (some normal requests).
ODD_REQUEST_IDS = ("caf\u00e9-\u65e5\u672c-\U0001F600", "tab\tnl\nnul\x00del\x7f%25",
                   "\U0001F600" * 256, "x" * 256, "a b/c?d=e&f#g%h")

# ---- the client processes -----------------------------------------------------------

class _Ctx:
    """One client process's fixed inputs and its records."""

    def __init__(self, cfg: dict, client_id: int):
        self.cfg = cfg
        self.cid = client_id
        self.rng = np.random.default_rng([cfg["seed"], client_id])
        self.records: list[dict] = []
        self.started = 0  # calls begun; each must end as one record
        self.n = 0
        names, w = zip(*CASES)
        self.case_names, self.case_p = names, np.array(w) / sum(w)
        from jaxserve.bench.workloads import SENTENCES
        self.sentences = SENTENCES

    def text(self, lo: int, hi: int) -> str:
        k = int(self.rng.integers(lo, hi + 1))
        return " ".join(self.sentences[i] for i in self.rng.integers(0, len(self.sentences), k))

    def ids(self, lo: int, hi: int) -> list[int]:
        return self.rng.integers(0, self.cfg["vocab_size"], int(self.rng.integers(lo, hi + 1))).tolist()


def _normal_request(ctx: _Ctx, max_tokens_hi: int = 40):
    """A well-formed GenerateRequest of a drawn shape and its choice count."""
    from jaxserve.server import jaxserve_pb2 as pb
    r = ctx.rng
    # Prompt budget in characters: a token covers at least one byte of ASCII
    # text, so this many characters (less the chat template's margin) fit
    # max_prompt_len and leave room for the longest output.
    budget = min(ctx.cfg["max_prompt_len"], ctx.cfg["max_model_len"] - max_tokens_hi) - 32
    form = r.choice(["text", "text", "ids", "chat"])
    if form == "text":
        prompt = {"prompt": ctx.text(1, 60 if r.random() < 0.05 else 10)[:budget]}
    elif form == "ids":
        prompt = {"token_ids": ctx.ids(1, min(200, budget))}
    else:
        msgs = [{"role": "user", "content": ctx.text(1, 4)}]
        if r.random() < 0.5:
            msgs.insert(0, {"role": "system", "content": ctx.text(1, 3)})
        if r.random() < 0.3:
            msgs += [{"role": "assistant", "content": ctx.text(1, 2)},
                     {"role": "user", "content": ctx.text(1, 2)}]
        each = max(1, budget // len(msgs) - 32)
        prompt = {"messages": [{**m, "content": m["content"][:each]} for m in msgs]}
    n = 2 if r.random() < 0.2 else 1
    kw = {"max_tokens": int(r.integers(1, max_tokens_hi + 1)), "n": n}
    if r.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=float(r.uniform(0.5, 1.2)), seed=int(r.integers(0, 2**32)))
        if r.random() < 0.3:
            kw["top_p"] = 0.9
        if r.random() < 0.2:
            kw["top_k"] = int(r.integers(1, 50))
    if r.random() < 0.2:
        kw["logprobs"] = int(r.integers(0, 6))
    if r.random() < 0.05:
        kw["prompt_logprobs"] = int(r.integers(0, 3))
    if r.random() < 0.1:
        kw["stop"] = ["."]
    if r.random() < 0.3:
        kw["ignore_eos"] = True
    kind = int(r.choice([pb.OUTPUT_KIND_DELTA] * 7 + [pb.OUTPUT_KIND_CUMULATIVE] * 2
                        + [pb.OUTPUT_KIND_FINAL_ONLY]))
    ctx.n += 1
    rid = f"soak-{ctx.cid}-{ctx.n}" if r.random() < 0.3 else ""
    if r.random() < 0.1:
        rid = f"{ctx.cid}{ctx.n}" + str(r.choice(ODD_REQUEST_IDS))[:240]
    from jaxserve.server.client import make_request
    return make_request(**prompt, request_id=rid, output_kind=kind, **kw), n


def _bad_request(ctx: _Ctx, sub: str):
    """(rpc name, request) of the malformed case ``sub``."""
    from jaxserve.server import jaxserve_pb2 as pb
    from jaxserve.server.client import make_request
    v = ctx.cfg["vocab_size"]
    if sub == "detokenize_oov":
        return "Detokenize", pb.DetokenizeRequest(token_ids=[1, v + 7])
    if sub == "tokenize_unknown_role":
        req = pb.TokenizeRequest()
        req.chat.messages.add(role="wizard", content="hi")
        return "Tokenize", req
    req = make_request(token_ids=[1, 2, 3], max_tokens=4, temperature=0.0)
    if sub == "empty_text":
        req.text = ""
    elif sub == "empty_token_ids":
        req.token_ids.Clear()
        req.token_ids.SetInParent()
    elif sub == "no_prompt":
        req.ClearField("token_ids")
    elif sub == "oov_token_id":
        req.token_ids.ids.append(v + 5)
    elif sub == "negative_token_id":
        req.token_ids.ids.append(-1)
    elif sub == "negative_temperature":
        req.sampling.temperature = -1.0
    elif sub == "unknown_role":
        req.chat.messages.add(role="wizard", content="hi")
    elif sub == "empty_chat":
        req.chat.SetInParent()
    elif sub == "max_tokens_zero":
        req.sampling.max_tokens = 0
    elif sub == "top_p_above_1":
        req.sampling.top_p = 1.5
    elif sub == "logprobs_above_20":
        req.sampling.logprobs = 50
    elif sub == "unknown_output_kind":
        req.output_kind = 99
    elif sub == "oov_stop_token_id":
        req.sampling.stop_token_ids.append(v + 3)
    elif sub == "n_zero":
        req.sampling.n = 0
    elif sub == "n_above_max_num_seqs":
        req.sampling.n = 10_000
    elif sub == "request_id_too_long":
        req.request_id = "\u00e9" * 9000
    elif sub == "cumulative_logprobs_too_big":
        req.output_kind = pb.OUTPUT_KIND_CUMULATIVE
        req.sampling.max_tokens, req.sampling.logprobs = 100_000, 20
    elif sub == "undecodable_bytes":
        return "raw", b"\x0a\xff\xff\xff\xff"
    elif sub == "invalid_utf8":
        good = make_request("hello there", max_tokens=2).SerializeToString()
        return "raw", good.replace(b"hello", b"he\xffo")
    return "Generate", req


async def _stream(call, n_choices: int, t0: float, rec: dict, cancel_at: float | None = None,
                  cancel_after: int | None = None) -> None:
    """Read a Generate call to its end into ``rec``: code, first-token and end
    times, whether it ended properly (``finished`` and a finish_reason per
    choice). Cancels it at monotonic ``cancel_at`` or after ``cancel_after``
    messages."""
    import grpc
    msgs, finished, reasons = 0, False, set()
    try:
        while True:
            wait = None if cancel_at is None else max(0.0, cancel_at - time.monotonic())
            try:
                msg = await asyncio.wait_for(call.read(), wait)
            except TimeoutError:
                call.cancel()
                break
            if msg is grpc.aio.EOF:
                break
            msgs += 1
            if rec.get("ttft") is None and any(c.token_ids for c in msg.completions):
                rec["ttft"] = time.monotonic() - t0
            reasons |= {c.index for c in msg.completions if c.finish_reason}
            finished = finished or msg.finished
            if cancel_after is not None and msgs >= cancel_after and not msg.finished:
                call.cancel()
                break
        code = (await call.code()).name
        if code != "OK":
            rec["details"] = (await call.details() or "")[:300]
    except grpc.aio.AioRpcError as e:
        code = e.code().name
        rec["details"] = (e.details() or "")[:300]
    rec["code"] = code
    rec["messages"] = msgs
    if code == "OK":
        rec["lost"] = not (finished and reasons >= set(range(n_choices)))


async def _one(ctx: _Ctx, client, case: str) -> list[dict]:
    """Run one drawn call (a burst is several); returns its records."""
    import grpc

    from jaxserve.server import jaxserve_pb2 as pb
    cfg, r = ctx.cfg, ctx.rng
    t0 = time.monotonic()
    rec = {"case": case, "client": ctx.cid, "t0": t0}
    timeout = cfg["request_timeout_s"]
    call = None
    if case != "burst":
        ctx.started += 1
    try:
        if case in ("generate", "cancel", "deadline"):
            req, n = _normal_request(ctx, 40 if case == "generate" else 64)
            if case == "deadline":
                timeout = float(r.uniform(0.05, 1.5))
            call = client.stub.Generate(req, timeout=timeout, metadata=client.metadata)
            kw = {}
            if case == "cancel":
                if r.random() < 0.5:
                    kw["cancel_after"] = int(r.integers(1, 4))
                else:
                    kw["cancel_at"] = t0 + float(r.uniform(0.05, 2.0))
            rec["n"] = n
            await asyncio.wait_for(_stream(call, n, t0, rec, **kw), timeout + cfg["slack_s"])
        elif case == "burst":
            return await _burst(ctx, client)
        elif case == "oversized":
            over = cfg["max_prompt_len"] + int(r.integers(1, 65))
            if r.random() < 0.1:  # 2 MB of text: refused on its size, never tokenized
                req = pb.GenerateRequest(text=(" ".join(ctx.sentences) + " ") * (
                    2_000_000 // (len(" ".join(ctx.sentences)) + 1) + 1))
                rec["sub"] = "huge_text"
            elif r.random() < 0.2:  # as text: ~1.3 tokens per word, so this many words is enough
                words = " ".join(ctx.sentences).split()
                text = " ".join(words * (1 + over // len(words)))[:8 * over]
                req = pb.GenerateRequest(text=text)
                rec["sub"] = "text"
            else:
                req = pb.GenerateRequest()
                req.token_ids.ids.extend(ctx.ids(over, over))
                rec["sub"] = "token_ids"
            call = client.stub.Generate(req, timeout=30, metadata=client.metadata)
            await asyncio.wait_for(_stream(call, 1, t0, rec), 30 + cfg["slack_s"])
        elif case == "bad":
            sub = str(r.choice(BAD_CASES))
            rec["sub"] = sub
            rpc, req = _bad_request(ctx, sub)
            if rpc in ("Generate", "raw"):
                gen = client.stub.Generate if rpc == "Generate" else \
                    client.channel.unary_stream("/jaxserve.v1.Generation/Generate")
                call = gen(req, timeout=30, metadata=client.metadata)
                await asyncio.wait_for(_stream(call, 1, t0, rec), 30 + cfg["slack_s"])
            else:
                await asyncio.wait_for(getattr(client.stub, rpc)(
                    req, timeout=30, metadata=client.metadata), 30 + cfg["slack_s"])
                rec["code"] = "OK"
        else:
            if case == "tokenize":
                c = client.tokenize(messages=[{"role": "user", "content": ctx.text(1, 3)}]) \
                    if r.random() < 0.3 else client.tokenize(ctx.text(1, 8))
            elif case == "detokenize":
                c = client.detokenize(ctx.ids(1, 64))
            elif case == "model_info":
                c = client.model_info()
            else:
                c = client.health()
            got = await asyncio.wait_for(c, 30)
            rec["code"] = "OK"
            if case == "health" and got != "SERVING":
                rec["code"] = f"OK_{got}"
    except grpc.aio.AioRpcError as e:
        rec["code"], rec["details"] = e.code().name, (e.details() or "")[:300]
    except TimeoutError:
        rec["code"], rec["hanging"] = "HANGING", True
        if call is not None:
            call.cancel()
    except Exception as e:  # noqa: BLE001 (a client-side fault is a finding, not a crash)
        rec["code"], rec["error"] = "CLIENT_ERROR", f"{type(e).__name__}: {e}"[:300]
    rec["t1"] = time.monotonic()
    rec["e2e"] = rec["t1"] - t0
    return [rec]


async def _burst(ctx: _Ctx, client) -> list[dict]:
    """``--burst`` tiny requests at once (1-2 tokens, short text prompts)."""
    cfg, r = ctx.cfg, ctx.rng

    async def one(i):
        from jaxserve.server.client import make_request
        ctx.started += 1
        t0 = time.monotonic()
        rec = {"case": "burst", "client": ctx.cid, "t0": t0, "n": 1}
        req = make_request(prompt=ctx.text(1, 2), max_tokens=int(r.integers(1, 3)),
                           temperature=0.0)
        call = client.stub.Generate(req, timeout=cfg["request_timeout_s"],
                                    metadata=client.metadata)
        try:
            await asyncio.wait_for(_stream(call, 1, t0, rec),
                                   cfg["request_timeout_s"] + cfg["slack_s"])
        except TimeoutError:
            call.cancel()
            rec["code"], rec["hanging"] = "HANGING", True
        rec["t1"] = time.monotonic()
        rec["e2e"] = rec["t1"] - t0
        return rec
    return list(await asyncio.gather(*(one(i) for i in range(cfg["burst"]))))


async def _client_async(ctx: _Ctx) -> None:
    from jaxserve.server.client import AsyncClient
    cfg = ctx.cfg
    async with AsyncClient(cfg["target"], token=cfg.get("token")) as client:
        async def worker():
            last_burst = -1e9
            while time.monotonic() < cfg["stop_at"]:
                case = str(ctx.rng.choice(ctx.case_names, p=ctx.case_p))
                if case == "burst":  # at most one burst per worker per 20 s
                    if time.monotonic() - last_burst < 20:
                        case = "generate"
                    else:
                        last_burst = time.monotonic()
                recs = await _one(ctx, client, case)
                ctx.records.extend(recs)
                # A full queue answers at once: back off as a client would, not spin.
                full = case != "burst" and recs[-1].get("code") == "RESOURCE_EXHAUSTED"
                await asyncio.sleep(float(ctx.rng.uniform(0.5, 1.0) if full
                                          else ctx.rng.uniform(0, 0.05)))
        await asyncio.gather(*(worker() for _ in range(cfg["inflight"])))


def client_main(cfg: dict, client_id: int, out) -> None:
    """Body of one client process: run the drawn calls until
    ``cfg["stop_at"]`` (monotonic, shared by every process on Linux), then
    put ``(client_id, records, calls started)`` on ``out``."""
    ctx = _Ctx(cfg, client_id)
    try:
        asyncio.run(_client_async(ctx))
    except Exception as e:  # noqa: BLE001 (report what ran, and the fault)
        ctx.records.append({"case": "client", "client": client_id, "code": "CLIENT_ERROR",
                            "error": f"{type(e).__name__}: {e}"[:300],
                            "t0": time.monotonic(), "t1": time.monotonic(), "e2e": 0.0})
    out.put((client_id, ctx.records, ctx.started))


# ---- the run ------------------------------------------------------------------------------

def run(a) -> dict:
    """The whole soak (see the module docstring); returns the result dict."""
    from jaxserve.bench.serving import spawn_server, stop_server
    from jaxserve.server.client import Client
    mach = machine()
    proc, counter, pid, saved_stderr, probe_file = None, None, a.server_pid, sys.stderr, None
    flags = list(a.engine_flags)
    if not a.target:
        if not any(f.split("=")[0] == "--max_waiting_requests" for f in flags):
            flags += ["--max_waiting_requests", "16"]
        env_saved = dict(os.environ)
        os.environ["JAX_LOG_COMPILES"] = "1"
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
            proc, target, url = spawn_server(a.model, flags)
            load_s = time.monotonic() - t_spawn
        finally:
            os.environ.clear()
            os.environ.update(env_saved)
        pid = proc.pid
    else:
        target, url, load_s = a.target, a.metrics_url, None
    try:
        with Client(target, token=a.token) as c:
            info = c.model_info()
        t0 = time.monotonic()
        warmup_s = 60 * (a.warmup_minutes if a.warmup_minutes is not None
                         else max(0.1 * a.minutes, min(2.0, 0.5 * a.minutes)))
        samples = [sample(t0, pid, url, counter)]
        compiles_at_start = counter.count() if counter else None
        cfg = {"target": target, "token": a.token, "seed": a.seed, "inflight": a.inflight,
               "burst": a.burst, "request_timeout_s": a.request_timeout_s, "slack_s": a.slack_s,
               "vocab_size": info.vocab_size, "max_prompt_len": info.max_prompt_len,
               "max_model_len": info.max_model_len, "stop_at": t0 + 60 * a.minutes}
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=client_main, args=(cfg, i, out), daemon=True)
                 for i in range(a.clients)]
        for p in procs:
            p.start()
        records, got, started = [], set(), 0
        hard_end = cfg["stop_at"] + a.request_timeout_s + a.slack_s + 60
        next_sample = t0 + a.sample_s
        while len(got) < a.clients and time.monotonic() < hard_end:
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
            idle = (s.get("running") == 0 and s.get("waiting") == 0
                    and s.get("pages_free") == s.get("pages_total"))
            if idle or time.monotonic() > settle_deadline:
                break
        time.sleep(min(3.0, a.settle_s))  # let freed memory settle too
        s = sample(t0, pid, url, counter)
        samples.append(s)
        end = {k: s.get(k) for k in ("pages_free", "pages_total", "pages_used", "running",
                                     "waiting")}
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
    mach["load_end"] = [round(x, 2) for x in os.getloadavg()]
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
           "rss": rss_figures(rss_samples, warmup_s), "malloc_probe": probe,
           "client_processes_missing": sorted(set(range(a.clients)) - got),
           "anomalies": [r for r in records if not r["expected"] or r.get("lost")
                         or r.get("hanging")][:200]}
    if counter is not None:
        by_name = {}
        for _, name in counter.events:
            by_name[name] = by_name.get(name, 0) + 1
        res["compilations"] = {"total": len(counter.events), "at_start": compiles_at_start,
                               "after_warmup": len(counter.events) - counter.count(t0 + warmup_s),
                               "cache_hits": counter.cache_hits, "by_name": by_name,
                               "times_s": [round(t - t0, 2) for t, _ in counter.events]}
    res["config"].pop("token", None)
    res["failed"] = criteria(res, a.max_rss_drift)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, required=True, help="traffic time, minutes")
    ap.add_argument("--model", default="smollm2-135m", help="spawned server: alias or .gguf")
    ap.add_argument("--target", help="host:port of a running server (default: spawn one)")
    ap.add_argument("--metrics_url", help="--target: its /metrics URL")
    ap.add_argument("--server_pid", type=int, help="--target: its pid, for RSS")
    ap.add_argument("--token", help="bearer token of the server")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
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
    a = ap.parse_args(argv)
    if a.target and not a.metrics_url:
        ap.error("--target needs --metrics_url (pages and running/waiting come from it)")
    if a.clients < 1 or a.inflight < 1 or a.minutes <= 0 or a.sample_s <= 0:
        ap.error("--clients, --inflight, --minutes and --sample_s must be positive")
    a.output = a.output or os.path.join("soak-results", time.strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(a.output) and os.listdir(a.output):
        ap.error(f"--output {a.output} is not empty")
    os.makedirs(a.output, exist_ok=True)
    res = run(a)
    with open(os.path.join(a.output, "soak.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    if not plot(res, os.path.join(a.output, "soak.png")):
        md += "\nNo plot: matplotlib is not installed (pip install -e '.[bench]').\n"
    with open(os.path.join(a.output, "report.md"), "w") as f:
        f.write(md)
    print(md)
    if res["failed"]:
        print("FAILED:\n" + "\n".join(f"- {x}" for x in res["failed"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
