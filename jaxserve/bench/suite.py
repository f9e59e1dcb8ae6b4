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
   report flags a level that compiled in the end. Over gRPC and HTTP every
   level runs once on other prompts of the same shapes.
3. jaxserve, level by level (``serving.run_inprocess`` / ``run_grpc`` /
   ``openai_load.run_openai``), the prefix cache emptied before each
   in-process level. ``backend="openai"`` drives OpenAI's HTTP API: a spawned
   jaxserve's ``--http_port``, or with ``target`` any running
   OpenAI-compatible server (named from ``GET /v1/models``), its prompts
   made with the server's ``/tokenize`` and sent as token ids where it takes
   them, else as text; ``backend="grpc"`` with ``target`` drives a running
   gRPC server.
4. Roofline: the device's ceilings (measured: ``roofline.measure_ceilings``,
   or given) and ``roofline.analyze`` of the recorded steps, per level and
   over all levels (in-process only), in the bytes as stored: the mean bytes
   per weight element (``quant_bench.weight_bytes`` / ``num_params``: int8
   or int4 values with their f32 scales) and per KV element (int8/fp8
   scales included); the weight bytes and the format are in the JSON.
5. Peers (``peers``), each on every level's slice, seen by the same clients
   (closed loop, or jaxserve's Poisson arrival times: ``peers.client_view``);
   ``llama_cpp_server`` is llama.cpp's own HTTP server on the same GGUF,
   spawned and driven by ``run_openai`` at every level's concurrency (real
   clients, real arrivals, no ``client_view``).
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

from jaxserve.bench import openai_load
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
      backend: ``"inprocess"``, ``"grpc"`` or ``"openai"`` (a jaxserve server
        is spawned unless ``target`` is given).
      target: grpc: ``host:port`` of a running server; openai: the base URL
        (``http://host:port``) of a running OpenAI-compatible server.
      api_key: bearer token for ``target`` (openai).
      scale: prompt and output length multiplier; None = 1, or 0.2 on CPU.
      seed: requests and arrivals.
      warmup: run the sweep once untimed first.
      peak_flops, peak_bytes: device ceilings, FLOP/s and bytes/s; None = measure.
      model, dtype: what the engine runs (for the peers, the report, the server).
      quantization, kv_cache_dtype: its weight format and KV cache dtype (the
        in-process result takes them from the engine itself).
      engine_flags: ``jaxserve.main`` flags for a spawned server.
      role: ``"both"``, or ``"decode"``: the grpc backend drives a
        disaggregated pair (``jaxserve.disagg``): spawned, a prefill worker
        and a decode worker on half the CPUs each, or ``target`` (a decode
        worker); the ``colocated`` peer runs the same engine flags with
        prefill and decode in one server on all the CPUs.
      disagg_flags: ``jaxserve.main`` flags both spawned workers get.
    """

    workload: str = "mixed"
    concurrency: tuple[int, ...] = (1, 8, 32)
    request_rate: float = math.inf
    num_prompts: int | None = None
    slo: dict = dataclasses.field(default_factory=dict)
    peers: tuple[str, ...] = ("hf", "llama_cpp")
    backend: str = "inprocess"
    target: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
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
    role: str = "both"
    disagg_flags: tuple[str, ...] = ()

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
        if self.backend not in ("inprocess", "grpc", "openai"):
            raise ValueError(f"--backend must be inprocess, grpc or openai, got "
                             f"{self.backend!r}")
        if self.target is not None and self.backend == "inprocess":
            raise ValueError("--target needs --backend grpc (host:port) or openai (a URL)")
        if self.target is not None and self.backend == "openai" and \
                not self.target.startswith(("http://", "https://")):
            raise ValueError(f"--target for --backend openai is a URL such as "
                             f"http://127.0.0.1:8000, got {self.target!r}")
        if self.role not in ("both", "decode"):
            raise ValueError(f"--role for a benchmark must be both or decode (drive a "
                             f"disaggregated pair), got {self.role!r}")
        if self.role == "decode" and self.backend != "grpc":
            raise ValueError("--role decode benchmarks a disaggregated pair over gRPC: "
                             "add --backend grpc")
        if "colocated" in self.peers and self.backend != "grpc":
            raise ValueError("the colocated peer is a spawned gRPC server: add --backend grpc")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        for name, v in (("peak_flops", self.peak_flops), ("peak_bytes", self.peak_bytes)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        peers_mod.parse_peers(",".join(self.peers))

    def prompts_per_level(self) -> list[int]:
        return [self.num_prompts or max(4, c) for c in self.concurrency]


# ``jaxserve.main`` flags a spawned server gets as given (with their values),
# and the speculation flags it gets when --speculative_method is not none.
SERVER_FLAGS = ("dtype", "page_size", "kv_cache_mib", "max_num_seqs", "max_num_batched_tokens",
                "enable_prefix_caching", "enable_chunked_prefill", "quantization",
                "quantization_group_size", "kv_cache_dtype")
SPEC_FLAGS = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min",
              "prompt_lookup_max", "draft_quantization", "speculative_adaptive")
OPTIONAL_FLAGS = ("num_pages", "max_model_len", "mesh", "num_devices", "seed", "draft_model")
BENCH_FLAGS = ("workload", "concurrency", "request_rate", "num_prompts", "slo", "peers",
               "backend", "target", "scale", "seed", "warmup", "peak_tflops", "peak_gbps",
               "model", "role")
DISAGG_FLAGS = ("disagg_min_prefill_tokens", "disagg_max_cached_ratio", "kv_lease_s")
FLAG_NAMES = tuple(dict.fromkeys(SERVER_FLAGS + SPEC_FLAGS + OPTIONAL_FLAGS + BENCH_FLAGS
                                 + DISAGG_FLAGS))


def options_from_flags(values: dict, api_key: str | None = None) -> BenchOptions:
    """``BenchOptions`` of ``jaxserve.main``'s flag values ({name: value} for
    every name of ``FLAG_NAMES``), with the flags a spawned server gets.

    Raises:
      ValueError: a bad level list, SLO, peer name or option.
    """
    def server_args(names):  # absl takes --name=value for every kind, bools included
        return [f"--{n}={values[n]}" for n in names]
    flag_args = server_args(SERVER_FLAGS)
    if values["speculative_method"] != "none":
        flag_args += server_args(SPEC_FLAGS)
    flag_args += server_args([n for n in OPTIONAL_FLAGS if values[n] is not None])
    return BenchOptions(
        workload=values["workload"], concurrency=parse_levels(values["concurrency"]),
        request_rate=values["request_rate"], num_prompts=values["num_prompts"],
        slo=stats.parse_slo(values["slo"]), peers=tuple(peers_mod.parse_peers(values["peers"])),
        backend=values["backend"], target=values["target"], api_key=api_key,
        scale=values["scale"], seed=values["seed"] or 0, warmup=values["warmup"],
        peak_flops=values["peak_tflops"] * 1e12 if values["peak_tflops"] else None,
        peak_bytes=values["peak_gbps"] * 1e9 if values["peak_gbps"] else None,
        model=values["model"], dtype=values["dtype"], quantization=values["quantization"],
        kv_cache_dtype=values["kv_cache_dtype"], engine_flags=tuple(flag_args),
        role=values["role"], disagg_flags=tuple(server_args(DISAGG_FLAGS)))


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
            "chunk_times_s": [rel(t) for t in r.chunk_times], "chunk_tokens": r.chunk_tokens,
            "disagg_route": r.disagg_route, "kv_transfer_ms": r.kv_transfer_ms,
            "kv_transfer_bytes": r.kv_transfer_bytes}


def _level_dict(run: serving.LevelRun, slo: dict, mode: str = "continuous batching") -> dict:
    pages = [s[1] for s in run.kv_series]
    return {
        "concurrency": run.concurrency,
        "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
        "mode": mode,
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
        "disagg": stats.disagg_summary(run.records),
        "http": run.http,
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
                   "backend": opts.backend, "target": opts.target,
                   "concurrency": list(opts.concurrency),
                   "num_prompts": counts if len(set(counts)) > 1 else counts[0],
                   "request_rate": None if math.isinf(opts.request_rate) else opts.request_rate,
                   "slo": opts.slo, "peers": list(opts.peers), "scale": scale,
                   "seed": opts.seed, "warmup": opts.warmup,
                   "engine_flags": list(opts.engine_flags), "role": opts.role},
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
    """Spawn a server with ``opts.engine_flags`` (or use ``opts.target``: no
    metrics page then), warm it up, run the levels; returns what
    ``run_inprocess`` does."""
    from jaxserve.server.client import AsyncClient, Client
    procs, disagg = [], None
    if opts.target:
        target, metrics_url = opts.target, None
    elif opts.role == "decode":
        procs, target, metrics_url, disagg = _spawn_pair(opts)
    else:
        proc, target, metrics_url = serving.spawn_server(opts.model, list(opts.engine_flags))
        procs = [proc]
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
                       "attention_impl": info.attention_impl, "disagg": disagg}})
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
        for proc in procs:
            serving.stop_server(proc)
    result["roofline_note"] = ("the gRPC backend cannot see the server's steps; run "
                               "--backend inprocess for the roofline")
    return result, per_level, records


def _cpu_halves() -> tuple[list[int], list[int]]:
    """This process's CPUs split in two (prefill worker, decode worker)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return [], []
    return cpus[:len(cpus) // 2], cpus[len(cpus) // 2:]


def _spawn_pair(opts: BenchOptions):
    """A prefill worker and a decode worker (``--role``), each pinned to half
    the CPUs; returns (processes, decode target, decode metrics URL, what
    was spawned)."""
    pcpu, dcpu = _cpu_halves()
    flags = list(opts.engine_flags) + list(opts.disagg_flags)
    prefill, ptarget, _ = serving.spawn_server(opts.model, flags + ["--role", "prefill"],
                                               cpus=pcpu, tag="prefill")
    try:
        decode, target, metrics_url = serving.spawn_server(
            opts.model, flags + ["--role", "decode", "--prefill_workers", ptarget],
            cpus=dcpu, tag="decode")
    except BaseException:
        serving.stop_server(prefill)
        raise
    # The decode worker routes locally until its first health poll of the prefill worker.
    time.sleep(2.0)
    return [decode, prefill], target, metrics_url, {
        "prefill_worker": ptarget, "prefill_cpus": pcpu, "decode_cpus": dcpu,
        "flags": list(opts.disagg_flags)}


def _run_colocated(entry: dict, opts: BenchOptions, per_level, jax_records,
                   scale: float) -> None:
    """The ``colocated`` peer: the same engine flags in one ``--role both``
    server on every CPU, warmed up (on other prompts of the same shapes)
    and driven like the main run; fills ``entry``."""
    from jaxserve.server.client import AsyncClient, Client
    t = time.monotonic()
    proc, target, metrics_url = serving.spawn_server(opts.model, list(opts.engine_flags),
                                                     tag="colocated")
    try:
        entry.update(load_s=time.monotonic() - t, target=target, levels=[])
        counts = [len(r) for r in per_level]
        with Client(target) as client:
            vocab = getattr(client.model_info(), "vocab_size", 0) or 32000
            tok = _RpcTokenizer(client)
            try:
                tok.encode("a")
            except Exception:  # no tokenizer on the server: random ids
                tok = None
            warm = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed + 1000,
                                 scale=scale) if opts.warmup else []

        async def go():
            async with AsyncClient(target) as client:
                if opts.warmup:
                    for c, reqs in zip(opts.concurrency, _slices(warm, counts)):
                        await serving.run_grpc(client, reqs, c, opts.request_rate, opts.seed)
                same = total = 0
                for j, (c, reqs) in enumerate(zip(opts.concurrency, per_level)):
                    run = await serving.run_grpc(client, reqs, c, opts.request_rate,
                                                 opts.seed, metrics_url)
                    a, b = _agreement(run.records, jax_records[j])
                    same, total = same + a, total + b
                    entry["levels"].append({**_level_dict(run, opts.slo),
                                            "mode": "continuous batching, colocated",
                                            "token_agreement": a / b if b else None})
                    s = entry["levels"][-1]["summary"]
                    _log(f"peer colocated C={c}: {s['completed']} requests in "
                         f"{s['duration_s']:.1f} s, {s['output_throughput']:.1f} output tok/s")
                entry["token_agreement"] = same / total if total else None
        asyncio.run(go())
    finally:
        serving.stop_server(proc)


def _prompt_as(base: str, model: str, ids: list[int], tok, api_key=None) -> str:
    """"ids" when the server takes token-id prompts, else "text" (which needs ``tok``).

    Raises:
      ValueError: text only, and the server cannot detokenize.
    """
    if openai_load.accepts_token_ids(base, model, ids[:1], api_key):  # no full page cached
        return "ids"
    if tok is None:
        raise ValueError(f"{base} takes no token-id prompts and has no /tokenize route to "
                         "make text ones")
    return "text"


def run_openai(opts: BenchOptions):
    """The jaxserve backend over OpenAI's HTTP API: a spawned server's
    ``--http_port`` (``opts.engine_flags``), or ``opts.target``, any
    OpenAI-compatible server; warm-up and levels as ``run_grpc``; returns
    what ``run_inprocess`` does."""
    proc, grpc_target, info = None, None, None
    if opts.target:
        base = opts.target.rstrip("/")
        metrics_url = openai_load.jaxserve_metrics(base)  # None for a foreign server
    else:
        proc, grpc_target, metrics_url, base = serving.spawn_server(
            opts.model, list(opts.engine_flags), http=True)
    tok = None
    try:
        model = openai_load.server_model(base, opts.api_key)
        if grpc_target is not None:
            from jaxserve.server.client import Client
            with Client(grpc_target) as client:
                info = client.model_info()
        # A spawned server says its platform; a target's is unknown: scale 1 unless given.
        scale = _scale(opts, info.backend if info is not None else "target")
        counts = opts.prompts_per_level()
        tok = openai_load.HttpTokenizer(base, opts.api_key)
        if not tok.available():
            tok = None  # random ids
        vocab = getattr(info, "vocab_size", 0) or 32000
        requests = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed,
                                 scale=scale)
        warm = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed + 1000,
                             scale=scale) if opts.warmup else []
        prompt_as = _prompt_as(base, model["id"], requests[0].prompt_ids, tok, opts.api_key)
        per_level = _slices(requests, counts)
        server = {"api": "openai", "base_url": base, "model": model["id"],
                  "owned_by": model.get("owned_by"), "spawned": proc is not None,
                  "prompt_as": prompt_as, "tokenizer": tok.shape if tok else None,
                  "metrics_url": metrics_url}
        if info is not None:
            server.update(grpc_target=grpc_target, backend=info.backend,
                          num_devices=info.num_devices, dtype=info.dtype,
                          attention_impl=info.attention_impl)
        result = _base_result(opts, scale, requests, counts, {"server": server})
        jaxserve = model.get("owned_by") == "jaxserve"
        mode = "continuous batching" if jaxserve else "as served"
        records = []
        kw = dict(api_key=opts.api_key, prompt_as=prompt_as, tokenizer=tok)

        async def go():
            t = time.monotonic()
            for c, reqs in zip(opts.concurrency, _slices(warm, counts)):
                await openai_load.run_openai(base, model["id"], reqs, c, opts.request_rate,
                                             opts.seed, **kw)
                _log(f"warm-up C={c} done ({time.monotonic() - t:.0f} s)")
            result["warmup"] = {"seconds": time.monotonic() - t, "compilations": None,
                                "note": "every level once, untimed, on other prompts of "
                                        f"the same shapes ({time.monotonic() - t:.0f} s)"
                                if opts.warmup else "none"}
            for c, reqs in zip(opts.concurrency, per_level):
                run = await openai_load.run_openai(base, model["id"], reqs, c,
                                                   opts.request_rate, opts.seed,
                                                   metrics_url, **kw)
                records.append(run.records)
                result["levels"].append(_level_dict(run, opts.slo, mode))
                s = result["levels"][-1]["summary"]
                _log(f"C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
                     f"{s['failed']} failed, {run.http['short_outputs']} short")
        asyncio.run(go())
    finally:
        if tok is not None:
            tok.close()
        if proc is not None:
            serving.stop_server(proc)
    result["roofline_note"] = ("the openai backend cannot see the server's steps; run "
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
        if why is None and name.startswith("llama_cpp") and not path.endswith(".gguf"):
            why = "llama.cpp needs a .gguf model"
        if why is not None:
            entry["skipped"] = why
            _log(f"peer {name} skipped: {why}")
            continue
        t = time.monotonic()
        n_ctx = max(len(r.prompt_ids) + r.output_len for reqs in per_level for r in reqs) + 16
        if name == "llama_cpp_server":
            _run_llama_cpp_server(entry, opts, per_level, jax_records, path, n_ctx)
            continue
        if name == "colocated":
            _run_colocated(entry, opts, per_level, jax_records, result["config"]["scale"])
            continue
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


# llama_cpp.server's sampling defaults that temperature 0 does not switch
# off: repeat_penalty 1.1 would change the greedy tokens.
LLAMA_CPP_SERVER_BODY = {"repeat_penalty": 1.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}


def _run_llama_cpp_server(entry: dict, opts: BenchOptions, per_level, jax_records,
                          path: str, n_ctx: int) -> None:
    """The ``llama_cpp_server`` peer: llama.cpp's server spawned on ``path``
    and driven by ``run_openai`` at every level's concurrency and arrival
    rate (its clients are real: no ``client_view``); fills ``entry``."""
    t = time.monotonic()
    try:
        proc, base = openai_load.spawn_llama_cpp_server(path, n_ctx)
    except RuntimeError as e:
        entry["skipped"] = str(e).splitlines()[0]
        _log(f"peer llama_cpp_server skipped: {e}")
        return
    tok = openai_load.HttpTokenizer(base)
    try:
        model = openai_load.server_model(base)["id"]
        prompt_as = _prompt_as(base, model, per_level[0][0].prompt_ids, tok)
        kw = dict(prompt_as=prompt_as, tokenizer=tok, extra_body=LLAMA_CPP_SERVER_BODY,
                  id_prefix="llama_cpp_server-")
        warm = [dataclasses.replace(per_level[0][0], output_len=2)]
        asyncio.run(openai_load.run_openai(base, model, warm, 1, **kw))
        entry.update(load_s=time.monotonic() - t, base_url=base, prompt_as=prompt_as,
                     extra_body=LLAMA_CPP_SERVER_BODY, levels=[])
        same = total = 0
        for j, (c, reqs) in enumerate(zip(opts.concurrency, per_level)):
            run = asyncio.run(openai_load.run_openai(base, model, reqs, c, opts.request_rate,
                                                     opts.seed, **kw))
            recs = run.records
            a, b = _agreement(recs, jax_records[j])
            same, total = same + a, total + b
            entry["levels"].append({
                "concurrency": c, "mode": f"HTTP, up to {c} streams open (served one at a time)",
                "summary": stats.summarize(recs, slo=opts.slo),
                "token_agreement": a / b if b else None, "http": run.http,
                "requests": [_request_dict(r, run.t0) for r in recs]})
            s = entry["levels"][-1]["summary"]
            _log(f"peer llama_cpp_server C={c}: {s['completed']} requests in "
                 f"{s['duration_s']:.1f} s, {s['output_throughput']:.1f} output tok/s, "
                 f"{run.http['short_outputs']} short")
        entry["token_agreement"] = same / total if total else None
    finally:
        tok.close()
        serving.stop_server(proc)


def run(opts: BenchOptions, output_dir: str, llm=None,
        started: float | None = None) -> tuple[dict, list[str]]:
    """The whole benchmark; returns the result and the paths written.

    Args:
      llm: the in-process ``LLM`` (``backend="inprocess"``); unused otherwise.
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
    elif opts.backend == "openai":
        result, per_level, records = run_openai(opts)
    else:
        result, per_level, records = run_grpc(opts)
    run_peers(result, opts, per_level, records)
    result["wall_s"] = time.monotonic() - started
    result["model_load_s"] = t0 - started
    result["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return result, report.write(result, output_dir)
