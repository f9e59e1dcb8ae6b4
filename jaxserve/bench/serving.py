"""Load generators: drive jaxserve with a list of ``BenchRequest`` at a
concurrency level, closed-loop or open-loop, and record what a client sees.

* **closed loop** (``request_rate=inf``): ``concurrency`` requests in flight;
  when one finishes the next is sent at once.
* **open loop**: request ``i`` arrives at ``t0 + sum of i exponential gaps``
  of mean ``1 / request_rate`` s (a Poisson process, seeded), and is sent then,
  or when a slot frees if ``concurrency`` are already in flight (vLLM's
  ``--request-rate`` with ``--max-concurrency``).

Two backends:

* ``run_inprocess``: one thread runs ``Engine.step()`` in a loop and adds
  requests between steps with ``arrival_time`` = their send time, so queueing
  behind a running step counts in TTFT. After every step it stamps each
  request's new tokens (``time.monotonic()``), and records the step's shape
  and wall time (``Engine.last_step``, for the roofline), the KV pages in
  use (``Engine.stats()``), and sums the steps' device, device-idle and host
  times (``StepInfo``) into the level's device idle fraction.
* ``run_grpc``: asyncio tasks stream ``Generate`` calls (token-id prompts,
  DELTA outputs) through ``jaxserve.server.client.AsyncClient`` to a server
  (``spawn_server`` starts one); each streamed message carrying tokens is
  stamped on arrival. KV pages, prefix-cache counters and preemptions are
  polled from the server's Prometheus page every 0.25 s. Step shapes are not
  visible from outside the server, so there is no roofline for this backend.
* ``openai_load.run_openai``: the same over OpenAI's HTTP API (SSE streams),
  for jaxserve's ``--http_port`` or any other OpenAI-compatible server.

Every request is greedy with EOS ignored, ``max_tokens`` = its output length.
Times are ``time.monotonic()`` seconds; the records feed
``jaxserve.bench.stats``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench.roofline import StepRecord
from jaxserve.bench.stats import RequestRecord
from jaxserve.bench.workloads import BenchRequest
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.server import jaxserve_pb2 as pb


@dataclasses.dataclass
class LevelRun:
    """One concurrency level's raw results.

    Attributes:
      concurrency: most requests in flight.
      request_rate: requests/s of the open loop (inf: closed loop).
      records: one per request, in request order.
      steps: engine steps (in-process only; [] over gRPC).
      kv_series: (s since the level began, pages used, running, waiting)
        after every step (in-process) or every poll (gRPC; running/waiting
        are the server's gauges).
      pages_total: KV pages in the cache.
      prefix_hits, prefix_queries: prompt tokens served from / looked up in
        the prefix cache during the level.
      preemptions: sequences preempted during the level.
      compilations: XLA compilations during the level (in-process; None over gRPC).
      t0: the level's start, monotonic s.
      device_s, idle_s, host_s: the steps' ``StepInfo.device_ms``,
        ``idle_ms`` and ``host_ms`` summed, s (in-process; 0 over gRPC).
      overlapped_steps: steps whose successor was launched before their
        results were read (async scheduling).
      spec_drafts, spec_draft_tokens, spec_accepted_tokens: speculative
        decoding during the level (rows that verified drafts, drafts
        verified, drafts accepted; 0 without speculation).
      texts: each request's output text (OpenAI HTTP only; None elsewhere).
      http: how an OpenAI HTTP level was driven and counted (``openai_load``:
        prompt_as, token_count sources, short_outputs, ...; None elsewhere).
    """

    concurrency: int
    request_rate: float
    records: list[RequestRecord]
    steps: list[StepRecord]
    kv_series: list[tuple[float, int, int, int]]
    pages_total: int
    prefix_hits: int
    prefix_queries: int
    preemptions: int
    compilations: int | None
    t0: float
    device_s: float = 0.0
    idle_s: float = 0.0
    host_s: float = 0.0
    overlapped_steps: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    texts: list[str] | None = None
    http: dict | None = None

    def spec_dict(self) -> dict | None:
        """The level's speculation figures for the JSON (None without drafts):
        acceptance rate (accepted / drafted tokens) and mean acceptance
        length (1 + accepted / verification rows, vLLM's)."""
        if not self.spec_draft_tokens:
            return None
        return {"drafts": self.spec_drafts, "draft_tokens": self.spec_draft_tokens,
                "accepted_tokens": self.spec_accepted_tokens,
                "acceptance_rate": self.spec_accepted_tokens / self.spec_draft_tokens,
                "mean_acceptance_length": 1 + self.spec_accepted_tokens / self.spec_drafts
                if self.spec_drafts else None}

    @property
    def idle_fraction(self) -> float | None:
        """Share of the steps' device timeline the device sat idle between
        steps with requests unfinished: idle / (idle + device); None without
        steps (gRPC)."""
        total = self.idle_s + self.device_s
        return self.idle_s / total if self.steps and total > 0 else None

    def device_dict(self) -> dict | None:
        """The level's device timeline for the JSON (None over gRPC)."""
        if not self.steps:
            return None
        return {"device_s": self.device_s, "idle_s": self.idle_s, "host_s": self.host_s,
                "idle_fraction": self.idle_fraction, "overlapped_steps": self.overlapped_steps,
                "steps": len(self.steps)}


def arrival_offsets(n: int, request_rate: float, seed: int) -> np.ndarray:
    """f64[n] arrival times, s after the start: all 0 for ``inf``, else the
    first at 0 and exponential gaps of mean ``1 / request_rate`` after it."""
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=max(0, n - 1))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _params(req: BenchRequest):
    return SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)


def run_inprocess(engine, requests: list[BenchRequest], concurrency: int,
                  request_rate: float = math.inf, seed: int = 0) -> LevelRun:
    """Run ``requests`` through ``engine`` (idle on entry); see the module docstring.

    The prefix cache is emptied first so one level does not reuse another's
    pages. Every step's ``Engine.last_step`` is kept in ``LevelRun.steps``.

    Raises:
      ValueError: ``concurrency < 1``, or the engine rejects a request.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    engine.reset_prefix_cache()
    s0 = engine.stats()
    comp0 = engine.num_compilations
    offsets = arrival_offsets(len(requests), request_rate, seed)
    t0 = time.monotonic()
    steps: list[StepRecord] = []
    last_step = engine.last_step
    records: dict[str, RequestRecord] = {}
    order: list[str] = []
    in_flight: set[str] = set()
    freed_at = t0
    kv = [(0.0, s0.pages_used, s0.num_running, s0.num_waiting)]
    i = 0
    device_s = idle_s = host_s = 0.0
    overlapped = 0
    while i < len(requests) or in_flight:
        now = time.monotonic()
        while i < len(requests) and len(in_flight) < concurrency and t0 + offsets[i] <= now:
            # Sent on arrival, or when a slot freed if all were taken then.
            send = max(t0 + offsets[i], freed_at)
            req = requests[i]
            rid = engine.add_request(None, req.prompt_ids, _params(req), arrival_time=send,
                                     lora=req.lora)
            records[rid] = RequestRecord(rid, req.workload, len(req.prompt_ids), send)
            order.append(rid)
            in_flight.add(rid)
            i += 1
        if not engine.has_unfinished_requests():
            if i == len(requests):
                break  # (cannot happen: a request in flight is unfinished)
            time.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
            continue
        outs = engine.step()
        now = time.monotonic()
        if (info := engine.last_step) is not last_step:  # a step ran (not an empty schedule)
            last_step = info
            steps.append(StepRecord(info.start - t0, info.seconds, list(info.q_lens),
                                    list(info.kv_lens), info.num_decode, info.compiled))
            device_s += info.device_ms / 1e3
            idle_s += info.idle_ms / 1e3
            host_s += info.host_ms / 1e3
            overlapped += info.overlapped
        for o in outs:
            rec = records.get(o.request_id)
            if rec is None:
                continue
            k = len(o.outputs[0].delta_token_ids)
            if k:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(k)
            if o.finished:
                m = o.metrics
                rec.end_time, rec.cached_tokens = now, m.num_cached_tokens
                rec.queue_ms, rec.prefill_ms = m.queue_ms, m.prefill_ms
                rec.token_ids = list(o.outputs[0].token_ids)
                if o.outputs[0].finish_reason == "abort":
                    rec.error = "aborted"
                if len(in_flight) == concurrency:  # the cap stops binding now
                    freed_at = now
                in_flight.discard(o.request_id)
        st = engine.stats()
        kv.append((now - t0, st.pages_used, st.num_running, st.num_waiting))
    s1 = engine.stats()
    return LevelRun(concurrency, request_rate, [records[r] for r in order],
                    steps, kv, s1.pages_total,
                    s1.prefix_cache_hits - s0.prefix_cache_hits,
                    s1.prefix_cache_queries - s0.prefix_cache_queries,
                    s1.num_preemptions - s0.num_preemptions,
                    engine.num_compilations - comp0, t0, device_s, idle_s, host_s,
                    overlapped, s1.spec_num_drafts - s0.spec_num_drafts,
                    s1.spec_num_draft_tokens - s0.spec_num_draft_tokens,
                    s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens)


# ---- gRPC ----------------------------------------------------------------------

class RpcTokenizer:
    """``encode`` through a server's Tokenize RPC (``workloads.make_requests``'
    tokenizer interface); ``client`` is a ``jaxserve.server.client.Client``."""

    def __init__(self, client):
        self.client = client

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.client.tokenize(text, add_special_tokens=add_special_tokens)


def spawn_server(model: str, engine_flags: list[str], timeout_s: float = 900.0,
                 http: bool = False, cpus: list[int] | None = None, tag: str = "server"):
    """Start ``python -m jaxserve.main --mode serve`` on free ports with
    ``engine_flags``; returns (process, "host:port", metrics URL) once it
    prints ``jaxserve: serving``, and with ``http`` (``--http_port 0``: the
    OpenAI API too) a fourth item, its base URL ``http://host:port``. Its
    stderr is echoed to ours, tagged ``[tag]``. ``cpus``: pin it to these
    CPUs (``os.sched_setaffinity``; XLA sizes its thread pool by them).

    Raises:
      RuntimeError: it exited, or was not ready within ``timeout_s``.
    """
    cmd = [sys.executable, "-m", "jaxserve.main", "--mode", "serve", "--port", "0",
           "--metrics_port", "0", "--model", model, *engine_flags,
           *(["--http_port", "0"] if http else [])]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, preexec_fn=pin)
    found, ready = {}, threading.Event()

    def pump():
        for line in proc.stderr:
            sys.stderr.write(f"[{tag}] " + line)
            if m := re.match(r"jaxserve: HTTP on (https?://\S+)", line):
                found["http"] = m[1]
            if m := re.match(r"jaxserve: gRPC on (\S+):(\d+) ", line):
                found["target"] = f"{m[1]}:{m[2]}"
                if u := re.search(r"metrics on (http://\S+/metrics)", line):
                    found["metrics"] = u[1]
            if line.startswith("jaxserve: serving"):
                ready.set()
    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"server not ready (exit status {proc.returncode})")
    if http:
        return proc, found["target"], found.get("metrics"), found["http"]
    return proc, found["target"], found.get("metrics")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape(url: str | None, labelled: bool = False) -> dict[str, float]:
    """Unlabelled samples of a Prometheus ``/metrics`` page: {name: value}
    (parsed with ``prometheus_client.parser``; {} when unreachable); with
    ``labelled`` also the labelled ones, as ``name{k="v",...}`` in the page's
    label order."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=2) as f:
            text = f.read().decode()
    except OSError:
        return {}
    return {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in s.labels.items()) + "}"
                      if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples if labelled or not s.labels}


async def _poll(url, t0, series, stop: asyncio.Event):
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        m = await loop.run_in_executor(None, scrape, url)
        if m:
            series.append((time.monotonic() - t0, int(m.get("jaxserve_kv_cache_pages_used", 0)),
                           int(m.get("jaxserve_num_requests_running", 0)),
                           int(m.get("jaxserve_num_requests_waiting", 0))))
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def run_grpc(client, requests: list[BenchRequest], concurrency: int,
                   request_rate: float = math.inf, seed: int = 0,
                   metrics_url: str | None = None) -> LevelRun:
    """Run ``requests`` against the server behind ``client`` (an
    ``AsyncClient``); see the module docstring. The server's prefix cache is
    not emptied between levels (no RPC for it): use fresh prompts per level."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, seed)
    m0 = await asyncio.get_running_loop().run_in_executor(None, scrape, metrics_url)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    records = [RequestRecord(str(i), r.workload, len(r.prompt_ids), t0)
               for i, r in enumerate(requests)]
    series: list = []
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll(metrics_url, t0, series, stop))

    async def one(i: int, req: BenchRequest):
        async with sem:
            rec = records[i]
            rec.send_time = time.monotonic()
            try:
                async for r in client.generate(token_ids=req.prompt_ids,
                                               max_tokens=req.output_len, temperature=0.0,
                                               ignore_eos=True, lora_name=req.lora or "",
                                               output_kind=pb.OUTPUT_KIND_DELTA):
                    now = time.monotonic()
                    toks = [t for c in r.completions for t in c.token_ids]
                    k = len(toks)
                    if k:
                        rec.token_ids = (rec.token_ids or []) + toks
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(k)
                    if r.finished:
                        rec.end_time = now
                        rec.cached_tokens = r.usage.cached_tokens
                        rec.queue_ms = r.timing.queue_ms
                        rec.prefill_ms = r.timing.ttft_ms - r.timing.queue_ms
                        if r.HasField("disagg"):
                            rec.disagg_route = r.disagg.route
                            rec.kv_transfer_ms = r.disagg.kv_transfer_ms
                            rec.kv_transfer_bytes = r.disagg.kv_transfer_bytes
            except Exception as e:  # grpc.aio.AioRpcError and friends: a failed request
                rec.error = f"{type(e).__name__}: {e}"

    tasks = []
    for i, req in enumerate(requests):
        delay = t0 + offsets[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    await asyncio.gather(*tasks)
    stop.set()
    await poller
    m1 = await asyncio.get_running_loop().run_in_executor(None, scrape, metrics_url)
    d = lambda k: int(m1.get(k, 0) - m0.get(k, 0))  # noqa: E731
    return LevelRun(concurrency, request_rate, records, [], series,
                    int(m1.get("jaxserve_kv_cache_pages_total", 0)),
                    d("jaxserve_cached_prompt_tokens_total"),
                    d("jaxserve_prefix_cache_queries_total"),
                    d("jaxserve_num_preemptions_total"), None, t0,
                    spec_drafts=d("jaxserve_spec_decode_num_drafts_total"),
                    spec_draft_tokens=d("jaxserve_spec_decode_num_draft_tokens_total"),
                    spec_accepted_tokens=d("jaxserve_spec_decode_num_accepted_tokens_total"))
