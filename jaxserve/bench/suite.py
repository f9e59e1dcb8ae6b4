"""The serving benchmark behind ``python -m jaxserve.main --mode bench --workload W``.

Steps of a run:

1. Requests: ``workloads.make_requests`` draws the workload's requests
   (seeded); level ``C`` runs ``n_C`` of them (``--num_prompts``, default
   ``max(4, C)``): in-process the first ``n_C`` (the prefix cache is emptied
   between levels), over gRPC its own slice (the server's cache cannot be
   emptied). Every peer gets exactly the level's requests.
2. Warm-up (untimed, ``--warmup``): in-process, the whole sweep runs once on
   the same prompts first. Closed-loop scheduling depends only on the steps,
   not on the clock, so the timed pass meets the same batch shapes and XLA
   compiles nothing more (the per-level ``compilations`` column shows it).
   An open loop's shapes depend on the clock: a level that still compiled is
   run again, up to ``MAX_RERUNS`` times (``reruns`` in the JSON), and the
   report flags a level that compiled in the end. Over gRPC every level runs
   once on other prompts of the same shapes.
3. jaxserve, level by level (``serving.run_inprocess`` / ``run_grpc``), the
   prefix cache emptied before each in-process level.
4. Roofline: the device's ceilings (measured: ``roofline.measure_ceilings``,
   or given) and ``roofline.analyze`` of the recorded steps, per level and
   over all levels (in-process only), in the bytes as stored: the mean bytes
   per weight element (``quant_bench.weight_bytes`` / ``num_params``: int8
   or int4 values with their f32 scales) and per KV element (int8/fp8
   scales included); the weight bytes and the format are in the JSON.
5. Peers (``peers``), each on every level's slice, seen by the same clients
   (closed loop, or jaxserve's Poisson arrival times: ``peers.client_view``).
6. ``report.write``: ``result.json``, ``report.md``, PNGs.

``scale`` defaults to 1 on GPU and TPU and to 0.2 on CPU, where the named
shapes at full length would take far longer than the 10 minutes a CPU run is
meant to take; the report says which scale ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sys
import time

from jaxserve.bench import peers as peers_mod
from jaxserve.bench import quant_bench, report, roofline, serving, stats
from jaxserve.bench.workloads import SHAPES, WORKLOADS, BenchRequest, make_requests

CPU_SCALE = 0.2
MAX_RERUNS = 2  # times a level that compiled is run again
AGREEMENT_TOKENS = 16


def parse_levels(spec: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> (1, 8, 32).

    Raises:
      ValueError: empty, or an entry that is not an integer >= 1.
    """
    try:
        levels = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency wants a comma list of integers >= 1, got {spec!r}")
    return levels


@dataclasses.dataclass
class BenchOptions:
    """What to run; see the module docstring.

    Attributes:
      workload: one of ``workloads.WORKLOADS``.
      concurrency: levels, most requests in flight.
      request_rate: open-loop Poisson rate, requests/s; inf = closed loop.
      num_prompts: requests per level; None = max(4, C).
      slo: ``stats.parse_slo`` output, for goodput.
      peers: names from ``peers.PEERS``; missing packages are skipped, said so.
      backend: ``"inprocess"`` or ``"grpc"`` (a server is spawned).
      scale: prompt and output length multiplier; None = 1, or 0.2 on CPU.
      seed: requests and arrivals.
      warmup: run the sweep once untimed first.
      peak_flops, peak_bytes: device ceilings, FLOP/s and bytes/s; None = measure.
      model, dtype: what the engine runs (for the peers, the report, the server).
      quantization, kv_cache_dtype: its weight format and KV cache dtype (the
        in-process result takes them from the engine itself).
      engine_flags: ``jaxserve.main`` flags for a spawned server.
    """

    workload: str = "mixed"
    concurrency: tuple[int, ...] = (1, 8, 32)
    request_rate: float = math.inf
    num_prompts: int | None = None
    slo: dict = dataclasses.field(default_factory=dict)
    peers: tuple[str, ...] = ("hf", "llama_cpp")
    backend: str = "inprocess"
    scale: float | None = None
    seed: int = 0
    warmup: bool = True
    peak_flops: float | None = None
    peak_bytes: float | None = None
    model: str = "smollm2-135m"
    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    engine_flags: tuple[str, ...] = ()

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request_rate must be > 0 (inf: closed loop), "
                             f"got {self.request_rate}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num_prompts must be >= 1, got {self.num_prompts}")
        if self.backend not in ("inprocess", "grpc"):
            raise ValueError(f"--backend must be inprocess or grpc, got {self.backend!r}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        for name, v in (("peak_flops", self.peak_flops), ("peak_bytes", self.peak_bytes)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        peers_mod.parse_peers(",".join(self.peers))

    def prompts_per_level(self) -> list[int]:
        return [self.num_prompts or max(4, c) for c in self.concurrency]


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _slices(requests: list[BenchRequest], counts: list[int]) -> list[list[BenchRequest]]:
    out, lo = [], 0
    for n in counts:
        out.append(requests[lo:lo + n])
        lo += n
    return out


def _request_dict(r: stats.RequestRecord, t0: float) -> dict:
    rel = lambda t: None if t is None else round(t - t0, 6)
    return {"id": r.request_id, "workload": r.workload, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens,
            "send_s": rel(r.send_time), "first_token_s": rel(r.chunk_times[0]) if r.chunk_times
            else None, "end_s": rel(r.end_time), "queue_ms": r.queue_ms,
            "prefill_ms": r.prefill_ms, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
            "e2e_ms": r.e2e_ms, "error": r.error,
            "chunk_times_s": [rel(t) for t in r.chunk_times], "chunk_tokens": r.chunk_tokens}


def _level_dict(run: serving.LevelRun, slo: dict) -> dict:
    pages = [s[1] for s in run.kv_series]
    return {
        "concurrency": run.concurrency,
        "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
        "mode": "continuous batching",
        "summary": stats.summarize(run.records, slo=slo),
        "by_workload": stats.by_workload(run.records, slo),
        "kv": {"pages_total": run.pages_total, "peak_pages": max(pages, default=0),
               "mean_pages": sum(pages) / len(pages) if pages else 0.0,
               "series": [[round(t, 4), p, a, w] for t, p, a, w in run.kv_series]},
        "prefix_cache": {"hits": run.prefix_hits, "queries": run.prefix_queries,
                         "hit_rate": run.prefix_hits / run.prefix_queries
                         if run.prefix_queries else None},
        "preemptions": run.preemptions,
        "compilations": run.compilations,
        "num_steps": len(run.steps) if run.steps else None,
        "device": run.device_dict(),
        "speculation": run.spec_dict(),
        "requests": [_request_dict(r, run.t0) for r in run.records],
    }


def _shapes(requests: list[BenchRequest]) -> dict:
    out = {}
    for w in SHAPES:
        rs = [r for r in requests if r.workload == w]
        if rs:
            out[w] = {"requests": len(rs),
                      "prompt_tokens_mean": sum(len(r.prompt_ids) for r in rs) / len(rs),
                      "output_tokens": sum(r.output_len for r in rs) / len(rs)}
    return out


def _scale(opts: BenchOptions, platform: str) -> float:
    if opts.scale is not None:
        return opts.scale
    return CPU_SCALE if platform == "cpu" else 1.0


def _base_result(opts: BenchOptions, scale: float, requests, counts, extra_env) -> dict:
    return {
        "benchmark": "jaxserve serving benchmark (python -m jaxserve.main --mode bench)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"workload": opts.workload, "model": opts.model, "dtype": opts.dtype,
                   "quantization": opts.quantization, "kv_cache_dtype": opts.kv_cache_dtype,
                   "backend": opts.backend, "concurrency": list(opts.concurrency),
                   "num_prompts": counts if len(set(counts)) > 1 else counts[0],
                   "request_rate": None if math.isinf(opts.request_rate) else opts.request_rate,
                   "slo": opts.slo, "peers": list(opts.peers), "scale": scale,
                   "seed": opts.seed, "warmup": opts.warmup,
                   "engine_flags": list(opts.engine_flags)},
        "env": report.environment(extra_env),
        "workload": {"shapes": _shapes(requests),
                     "nominal": {w: dataclasses.asdict(s) for w, s in SHAPES.items()}},
        "levels": [], "peers": {}, "roofline": None,
    }


# ---- jaxserve ---------------------------------------------------------------------

def run_inprocess(llm, opts: BenchOptions):
    """Warm-up, levels and roofline on ``llm``'s engine; returns the result
    dict (without peers), each level's requests and each level's records."""
    import jax
    engine = llm.engine
    scale = _scale(opts, jax.default_backend())
    counts = opts.prompts_per_level()
    requests = make_requests(engine.tokenizer, engine.model_config.vocab_size, opts.workload,
                             max(counts), seed=opts.seed, scale=scale)
    per_level = [requests[:n] for n in counts]  # the cache is emptied between levels
    wb = quant_bench.weight_bytes(engine)
    result = _base_result(dataclasses.replace(
        opts, quantization=engine.config.quantization,
        kv_cache_dtype=str(engine.runner.kv_dtype)), scale, requests, counts, {
        "weight_bytes": wb, "kv_bytes_per_token": quant_bench.kv_bytes_per_token(engine),
        "attention_impl": engine.attention_impl, "num_pages": engine.allocator.num_pages,
        "page_size": engine.allocator.page_size, "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "model_config": dataclasses.asdict(engine.model_config)})
    t = time.monotonic()
    comp = engine.runner.num_compilations
    if opts.warmup:
        engine.warmup()  # every step shape first, then the sweep once for the rest
        for c, reqs in zip(opts.concurrency, per_level):
            serving.run_inprocess(engine, reqs, c, opts.request_rate, opts.seed)
            _log(f"warm-up C={c} done ({time.monotonic() - t:.0f} s)")
    result["warmup"] = {
        "seconds": time.monotonic() - t, "compilations": engine.runner.num_compilations - comp,
        "note": ("the whole sweep once, untimed, on the same prompts "
                 f"({engine.runner.num_compilations - comp} XLA compilations, "
                 f"{time.monotonic() - t:.0f} s)") if opts.warmup else "none"}
    all_steps, records = [], []
    for c, reqs in zip(opts.concurrency, per_level):
        run = serving.run_inprocess(engine, reqs, c, opts.request_rate, opts.seed)
        reruns = 0
        # An open loop's batch shapes depend on the clock, so the warm-up may
        # not have met them all: a level that compiled is run again (its new
        # shapes are cached now), at most MAX_RERUNS times.
        while run.compilations and opts.warmup and reruns < MAX_RERUNS:
            _log(f"C={c}: XLA compiled {run.compilations} time(s) during the level; "
                 "running it again")
            run = serving.run_inprocess(engine, reqs, c, opts.request_rate, opts.seed)
            reruns += 1
        all_steps += run.steps
        records.append(run.records)
        lv = _level_dict(run, opts.slo)
        lv["steps"] = run.steps
        lv["reruns"] = reruns
        result["levels"].append(lv)
        s = lv["summary"]
        _log(f"C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
             f"{s['output_throughput']:.1f} output tok/s, TTFT p50 "
             f"{s['ttft_ms']['p50']:.0f} ms, {run.compilations} compilations")
    if opts.peak_flops and opts.peak_bytes:
        ceil = roofline.Ceilings(opts.peak_flops, opts.peak_bytes, "given (--peak_tflops, "
                                 "--peak_gbps)")
    else:
        measured = roofline.measure_ceilings(opts.dtype, device=engine.runner.mesh.devices.flat[0])
        ceil = roofline.Ceilings(opts.peak_flops or measured.flops_per_s,
                                 opts.peak_bytes or measured.bytes_per_s, measured.source)
    # Bytes as stored: the mean per parameter (quantized values, scales and
    # zeros over the logical weights) and per KV element (scales included).
    cfg = engine.model_config
    kw = dict(param_bytes=wb["total"] / quant_bench.num_params(engine),
              kv_bytes=quant_bench.kv_bytes_per_token(engine) / (
                  2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim))
    for lv in result["levels"]:
        lv["roofline"] = roofline.analyze(lv.pop("steps"), engine.model_config, ceil, **kw)
    result["roofline"] = roofline.analyze(all_steps, engine.model_config, ceil, **kw)
    return result, per_level, records


class _RpcTokenizer:
    """``encode`` through a server's Tokenize RPC (the workload builder's interface)."""

    def __init__(self, client):
        self.client = client

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.client.tokenize(text, add_special_tokens=add_special_tokens)


def run_grpc(opts: BenchOptions):
    """Spawn a server with ``opts.engine_flags``, warm it up, run the levels;
    returns what ``run_inprocess`` does."""
    from jaxserve.server.client import AsyncClient, Client
    proc, target, metrics_url = serving.spawn_server(opts.model, list(opts.engine_flags))
    try:
        with Client(target) as client:
            info = client.model_info()
            platform = info.backend
            scale = _scale(opts, platform)
            counts = opts.prompts_per_level()
            tok = _RpcTokenizer(client)
            try:
                tok.encode("a")
            except Exception:  # no tokenizer on the server: random ids
                tok = None
            vocab = getattr(info, "vocab_size", 0) or 32000
            requests = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed,
                                     scale=scale)
            warm = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed + 1000,
                                 scale=scale) if opts.warmup else []
        per_level = _slices(requests, counts)
        result = _base_result(opts, scale, requests, counts, {
            "server": {"target": target, "model": info.name, "backend": info.backend,
                       "num_devices": info.num_devices, "dtype": info.dtype,
                       "attention_impl": info.attention_impl}})
        records = []

        async def go():
            async with AsyncClient(target) as client:
                t = time.monotonic()
                for c, reqs in zip(opts.concurrency, _slices(warm, counts)):
                    await serving.run_grpc(client, reqs, c, opts.request_rate, opts.seed)
                    _log(f"warm-up C={c} done ({time.monotonic() - t:.0f} s)")
                result["warmup"] = {"seconds": time.monotonic() - t, "compilations": None,
                                    "note": "every level once, untimed, on other prompts of "
                                            f"the same shapes ({time.monotonic() - t:.0f} s)"
                                    if opts.warmup else "none"}
                for c, reqs in zip(opts.concurrency, per_level):
                    run = await serving.run_grpc(client, reqs, c, opts.request_rate, opts.seed,
                                                 metrics_url)
                    records.append(run.records)
                    result["levels"].append(_level_dict(run, opts.slo))
                    s = result["levels"][-1]["summary"]
                    _log(f"C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
                         f"{s['failed']} failed")
        asyncio.run(go())
    finally:
        serving.stop_server(proc)
    result["roofline_note"] = ("the gRPC backend cannot see the server's steps; run "
                               "--backend inprocess for the roofline")
    return result, per_level, records


# ---- peers ------------------------------------------------------------------------

def _model_file(model: str) -> str:
    if os.path.isdir(model):
        return model
    from checkpoints.fetch import resolve_model
    return str(resolve_model(model))


def _agreement(peer_recs, jax_recs) -> tuple[int, int]:
    """(requests whose first AGREEMENT_TOKENS tokens match, requests compared)."""
    same = n = 0
    for a, b in zip(peer_recs, jax_recs):
        if a.token_ids is None or b.token_ids is None:
            continue
        k = min(AGREEMENT_TOKENS, len(a.token_ids), len(b.token_ids))
        same += a.token_ids[:k] == b.token_ids[:k]
        n += 1
    return same, n


def run_peers(result: dict, opts: BenchOptions, per_level: list[list[BenchRequest]],
              jax_records: list[list[stats.RequestRecord]]) -> None:
    """Run each peer on every level's requests (``jax_records``: jaxserve's
    records of the same levels, for token agreement); fills ``result["peers"]``."""
    for name in opts.peers:
        entry = {"version": peers_mod.version(name), "how": peers_mod.HOW[name]}
        result["peers"][name] = entry
        why = peers_mod.available(name)
        path = None
        if why is None:
            try:
                path = _model_file(opts.model)
            except ValueError as e:
                why = str(e)
        if why is None and name == "llama_cpp" and not path.endswith(".gguf"):
            why = "llama.cpp needs a .gguf model"
        if why is not None:
            entry["skipped"] = why
            _log(f"peer {name} skipped: {why}")
            continue
        t = time.monotonic()
        n_ctx = max(len(r.prompt_ids) + r.output_len for reqs in per_level for r in reqs) + 16
        warm = [dataclasses.replace(per_level[0][0], output_len=2)]
        if name == "hf":
            model = peers_mod.load_hf(path)
            peers_mod.run_hf(model, warm, 1)
        else:
            model = peers_mod.load_llama_cpp(path, n_ctx=n_ctx)
            peers_mod.run_llama_cpp(model, warm)
        entry["load_s"] = time.monotonic() - t
        entry["levels"] = []
        longest = max(per_level, key=len)
        nested = all(lv == longest[:len(lv)] for lv in per_level)
        if name == "llama_cpp" and nested:  # sequential: one run serves every level
            served = peers_mod.run_llama_cpp(model, longest)
        same = total = 0
        for j, (c, reqs) in enumerate(zip(opts.concurrency, per_level)):
            if name == "hf":
                recs = peers_mod.run_hf(model, reqs, c)
            elif nested:
                recs = served[:len(reqs)]
            else:
                recs = peers_mod.run_llama_cpp(model, reqs)
            arrivals = None if math.isinf(opts.request_rate) else recs[0].send_time + \
                serving.arrival_offsets(len(recs), opts.request_rate, opts.seed)
            recs = peers_mod.client_view(recs, c, arrivals)  # jaxserve's arrivals
            a, b = _agreement(recs, jax_records[j])
            same, total = same + a, total + b
            entry["levels"].append({
                "concurrency": c,
                "mode": f"static batches of {c}" if name == "hf" else "sequential",
                "summary": stats.summarize(recs, slo=opts.slo),
                "token_agreement": a / b if b else None,
                "requests": [_request_dict(r, recs[0].send_time) for r in recs]})
            s = entry["levels"][-1]["summary"]
            _log(f"peer {name} C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
                 f"{s['output_throughput']:.1f} output tok/s")
        entry["token_agreement"] = same / total if total else None
        del model  # free its memory before the next peer loads


def run(opts: BenchOptions, output_dir: str, llm=None,
        started: float | None = None) -> tuple[dict, list[str]]:
    """The whole benchmark; returns the result and the paths written.

    Args:
      llm: the in-process ``LLM`` (``backend="inprocess"``); unused for gRPC.
      started: ``time.monotonic()`` before the model was loaded, so the
        wall time reported includes the load (default: now).

    Raises:
      ValueError: bad options or model (before anything long runs).
    """
    t0 = time.monotonic()
    started = t0 if started is None else started
    if opts.backend == "inprocess":
        if llm is None:
            raise ValueError("the in-process backend needs an LLM")
        result, per_level, records = run_inprocess(llm, opts)
    else:
        result, per_level, records = run_grpc(opts)
    run_peers(result, opts, per_level, records)
    result["wall_s"] = time.monotonic() - started
    result["model_load_s"] = t0 - started
    result["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return result, report.write(result, output_dir)
