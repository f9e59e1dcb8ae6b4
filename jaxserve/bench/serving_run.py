"""The serving benchmark's run: ``python -m jaxserve.bench serve`` (and
``python -m jaxserve.main --mode bench --workload W``).

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
   With ``--lora_mix`` (``serving_lora``) every level runs twice, the base
   alone then the same requests with adapters round-robin (the warm-up
   likewise), and the level's ``lora_mix`` entry holds both output tok/s,
   their ratio and the slot swaps of the mix pass; no peers then.
4. Roofline: the device's ceilings (measured: ``roofline.measure_ceilings``,
   or given) and ``roofline.analyze`` of the recorded steps, per level and
   over all levels (in-process only), in the bytes as stored: the mean bytes
   per weight element (``formats.weight_bytes`` / ``num_params``: int8
   or int4 values with their f32 scales) and per KV element (int8/fp8
   scales included); the weight bytes and the format are in the JSON.
5. Peers (``serving_peers``, the engines in ``peers``), each on every level's slice, seen by the same clients
   (closed loop, or jaxserve's Poisson arrival times: ``peers.client_view``);
   ``llama_cpp_server`` is llama.cpp's own HTTP server on the same GGUF,
   spawned and driven by ``run_openai`` at every level's concurrency (real
   clients, real arrivals, no ``client_view``).
6. ``report.write``: ``result.json``, ``report.md`` (``serving_report``), PNGs
   (``serving_plots``).

Options: ``serving_options.BenchOptions``; the JSON's level and request
dicts: ``serving_levels``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time

import jax

from jaxserve.bench import formats, machine, openai_load, report, roofline, serving, stats
from jaxserve.bench import serving_lora, serving_plots, serving_report
from jaxserve.bench.serving_levels import level_dict, log, shapes, slices
from jaxserve.bench.serving_options import BenchOptions, run_scale
from jaxserve.bench.serving_peers import run_peers
from jaxserve.bench.workloads import SHAPES, make_requests
from jaxserve.server.client import AsyncClient, Client

MAX_RERUNS = 2  # times a level that compiled is run again



def _client_warmup(t0: float, warmed: bool) -> dict:
    """The report's warm-up entry for a client-driven run that started its
    warm-up at ``time.monotonic()`` ``t0`` (compilations are the server's,
    unseen from here)."""
    dt = time.monotonic() - t0
    return {"seconds": dt, "compilations": None,
            "note": "every level once, untimed, on other prompts of the same shapes "
                    f"({dt:.0f} s)" if warmed else "none"}

def _passes(reqs, names) -> list:
    """A level's requests for the base pass, and with ``names`` the mix pass."""
    return [reqs] + ([serving_lora.assign(reqs, names)] if names else [])


def _client_entry(opts: BenchOptions) -> dict:
    """The result's ``lora_mix`` for a server: a spawned one's slots and rank
    (from its flags), None for a target's."""
    slots = [int(f.partition("=")[2]) for f in opts.engine_flags if f.startswith("--max_loras=")]
    return serving_lora.result_entry(opts, None if opts.target else opts.max_lora_rank,
                                     None if opts.target or not slots else slots[-1])


def _client_mix(lv: dict, c: int, mix, slo: dict, sw0, metrics_url) -> None:
    """A client-driven level's ``lora_mix`` entry from its mix pass ``mix``."""
    lv["lora_mix"] = serving_lora.pair_dict(
        lv["summary"], stats.summarize(mix.records, slo=slo),
        serving_lora.swaps_between(sw0, serving_lora.metric_swaps(metrics_url)))
    _log_mix(c, lv["lora_mix"])


def _log_mix(c: int, p: dict) -> None:
    ratio = "-" if p["ratio"] is None else f"{p['ratio']:.2f}x"
    log(f"C={c} with the LoRA mix: {p['mix_output_tok_s']:.1f} output tok/s ({ratio} the "
        f"base's), {p['swaps']} slot swaps")


def base_result(opts: BenchOptions, scale: float, requests, counts, extra_env) -> dict:
    return {
        "benchmark": "jaxserve serving benchmark (python -m jaxserve.bench serve)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"workload": opts.workload, "model": opts.model, "dtype": opts.dtype,
                   "quantization": opts.quantization, "kv_cache_dtype": opts.kv_cache_dtype,
                   "backend": opts.backend, "target": opts.target,
                   "concurrency": list(opts.concurrency),
                   "num_prompts": counts if len(set(counts)) > 1 else counts[0],
                   "request_rate": None if math.isinf(opts.request_rate) else opts.request_rate,
                   "slo": opts.slo, "peers": list(opts.peers), "scale": scale,
                   "seed": opts.seed, "warmup": opts.warmup,
                   "engine_flags": list(opts.engine_flags), "role": opts.role,
                   "lora_mix": opts.lora_mix},
        "env": machine.environment(extra_env),
        "workload": {"shapes": shapes(requests),
                     "nominal": {w: dataclasses.asdict(s) for w, s in SHAPES.items()}},
        "levels": [], "peers": {}, "roofline": None,
    }


# ---- jaxserve ---------------------------------------------------------------------

def run_inprocess(llm, opts: BenchOptions):
    """Warm-up, levels and roofline on ``llm``'s engine; returns the result
    dict (without peers), each level's requests and each level's records."""
    engine = llm.engine
    scale = run_scale(opts, jax.default_backend())
    counts = opts.prompts_per_level()
    requests = make_requests(engine.tokenizer, engine.model_config.vocab_size, opts.workload,
                             max(counts), seed=opts.seed, scale=scale)
    per_level = [requests[:n] for n in counts]  # the cache is emptied between levels
    wb = formats.weight_bytes(engine)
    result = base_result(dataclasses.replace(
        opts, quantization=engine.config.quantization,
        kv_cache_dtype=str(engine.kv_dtype)), scale, requests, counts, {
        "weight_bytes": wb, "kv_bytes_per_token": formats.kv_bytes_per_token(engine),
        "attention_impl": engine.attention_impl, "num_pages": engine.num_pages,
        "page_size": engine.page_size, "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "model_config": dataclasses.asdict(engine.model_config)})
    names = opts.lora_names()
    if names:
        lcfg = engine.config.lora
        if lcfg is None:
            raise ValueError("--lora_mix needs an engine with LoRA on (--enable_lora)")
        _, n_random = serving_lora.parse_lora_mix(opts.lora_mix)
        for name, path in serving_lora.write_random(engine.model_config, n_random,
                                                    lcfg.max_lora_rank) if n_random else ():
            engine.add_lora(name, path)
        result["lora_mix"] = serving_lora.result_entry(opts, lcfg.max_lora_rank,
                                                       lcfg.max_loras)
    t = time.monotonic()
    comp = engine.num_compilations
    if opts.warmup:
        engine.warmup()  # every step shape first, then the sweep once for the rest
        for c, reqs in zip(opts.concurrency, per_level):
            serving.run_inprocess(engine, reqs, c, opts.request_rate, opts.seed)
            if names:
                serving.run_inprocess(engine, serving_lora.assign(reqs, names), c,
                                      opts.request_rate, opts.seed)
            log(f"warm-up C={c} done ({time.monotonic() - t:.0f} s)")
    result["warmup"] = {
        "seconds": time.monotonic() - t, "compilations": engine.num_compilations - comp,
        "note": ("the whole sweep once, untimed, on the same prompts "
                 f"({engine.num_compilations - comp} XLA compilations, "
                 f"{time.monotonic() - t:.0f} s)") if opts.warmup else "none"}
    all_steps, records = [], []
    for c, reqs in zip(opts.concurrency, per_level):
        run = serving.run_inprocess(engine, reqs, c, opts.request_rate, opts.seed)
        reruns = 0
        # An open loop's batch shapes depend on the clock, so the warm-up may
        # not have met them all: a level that compiled is run again (its new
        # shapes are cached now), at most MAX_RERUNS times.
        while run.compilations and opts.warmup and reruns < MAX_RERUNS:
            log(f"C={c}: XLA compiled {run.compilations} time(s) during the level; "
                "running it again")
            run = serving.run_inprocess(engine, reqs, c, opts.request_rate, opts.seed)
            reruns += 1
        all_steps += run.steps
        records.append(run.records)
        lv = level_dict(run, opts.slo)
        lv["steps"] = run.steps
        lv["reruns"] = reruns
        if names:  # the same requests with the adapters, right after the base pass
            sw0 = serving_lora.engine_swaps(engine)
            mix = serving.run_inprocess(engine, serving_lora.assign(reqs, names), c,
                                        opts.request_rate, opts.seed)
            lv["lora_mix"] = serving_lora.pair_dict(
                lv["summary"], stats.summarize(mix.records, slo=opts.slo),
                serving_lora.engine_swaps(engine) - sw0)
            lv["lora_mix"]["compilations"] = mix.compilations
            _log_mix(c, lv["lora_mix"])
        result["levels"].append(lv)
        s = lv["summary"]
        log(f"C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
            f"{s['output_throughput']:.1f} output tok/s, TTFT p50 "
            f"{s['ttft_ms']['p50']:.0f} ms, {run.compilations} compilations")
    if opts.peak_flops and opts.peak_bytes:
        ceil = roofline.Ceilings(opts.peak_flops, opts.peak_bytes, "given (--peak_tflops, "
                                 "--peak_gbps)")
    else:
        measured = roofline.measure_ceilings(opts.dtype, device=engine.devices[0])
        ceil = roofline.Ceilings(opts.peak_flops or measured.flops_per_s,
                                 opts.peak_bytes or measured.bytes_per_s, measured.source)
    # Bytes as stored: the mean per parameter (quantized values, scales and
    # zeros over the logical weights) and per KV element (scales included).
    cfg = engine.model_config
    kw = dict(param_bytes=wb["total"] / formats.num_params(engine),
              kv_bytes=formats.kv_bytes_per_token(engine) / (
                  2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim))
    for lv in result["levels"]:
        lv["roofline"] = roofline.analyze(lv.pop("steps"), engine.model_config, ceil, **kw)
    result["roofline"] = roofline.analyze(all_steps, engine.model_config, ceil, **kw)
    return result, per_level, records


def run_grpc(opts: BenchOptions):
    """Spawn a server with ``opts.engine_flags`` (or use ``opts.target``: no
    metrics page then), warm it up, run the levels; returns what
    ``run_inprocess`` does."""
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
            scale = run_scale(opts, platform)
            counts = opts.prompts_per_level()
            tok = serving.RpcTokenizer(client)
            try:
                tok.encode("a")
            except Exception:  # no tokenizer on the server: random ids
                tok = None
            vocab = getattr(info, "vocab_size", 0) or 32000
            requests = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed,
                                     scale=scale)
            warm = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed + 1000,
                                 scale=scale) if opts.warmup else []
        per_level = slices(requests, counts)
        result = base_result(opts, scale, requests, counts, {
            "server": {"target": target, "model": info.name, "backend": info.backend,
                       "num_devices": info.num_devices, "dtype": info.dtype,
                       "attention_impl": info.attention_impl, "disagg": disagg}})
        records = []
        names = opts.lora_names()
        if names:
            result["lora_mix"] = _client_entry(opts)

        async def go():
            async with AsyncClient(target) as client:
                t = time.monotonic()
                for c, reqs in zip(opts.concurrency, slices(warm, counts)):
                    for rs in _passes(reqs, names):
                        await serving.run_grpc(client, rs, c, opts.request_rate, opts.seed)
                    log(f"warm-up C={c} done ({time.monotonic() - t:.0f} s)")
                result["warmup"] = _client_warmup(t, opts.warmup)
                for c, reqs in zip(opts.concurrency, per_level):
                    run = await serving.run_grpc(client, reqs, c, opts.request_rate, opts.seed,
                                                 metrics_url)
                    records.append(run.records)
                    result["levels"].append(level_dict(run, opts.slo))
                    if names:
                        sw0 = serving_lora.metric_swaps(metrics_url)
                        mix = await serving.run_grpc(client, serving_lora.assign(reqs, names), c,
                                                     opts.request_rate, opts.seed)
                        _client_mix(result["levels"][-1], c, mix, opts.slo, sw0, metrics_url)
                    s = result["levels"][-1]["summary"]
                    log(f"C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
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
            with Client(grpc_target) as client:
                info = client.model_info()
        # A spawned server says its platform; a target's is unknown: scale 1 unless given.
        scale = run_scale(opts, info.backend if info is not None else "target")
        counts = opts.prompts_per_level()
        tok = openai_load.HttpTokenizer(base, opts.api_key)
        if not tok.available():
            tok = None  # random ids
        vocab = getattr(info, "vocab_size", 0) or 32000
        requests = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed,
                                 scale=scale)
        warm = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed + 1000,
                             scale=scale) if opts.warmup else []
        prompt_as = openai_load.prompt_as(base, model["id"], requests[0].prompt_ids, tok,
                                          opts.api_key)
        per_level = slices(requests, counts)
        server = {"api": "openai", "base_url": base, "model": model["id"],
                  "owned_by": model.get("owned_by"), "spawned": proc is not None,
                  "prompt_as": prompt_as, "tokenizer": tok.shape if tok else None,
                  "metrics_url": metrics_url}
        if info is not None:
            server.update(grpc_target=grpc_target, backend=info.backend,
                          num_devices=info.num_devices, dtype=info.dtype,
                          attention_impl=info.attention_impl)
        result = base_result(opts, scale, requests, counts, {"server": server})
        jaxserve = model.get("owned_by") == "jaxserve"
        mode = "continuous batching" if jaxserve else "as served"
        records = []
        kw = dict(api_key=opts.api_key, prompt_as=prompt_as, tokenizer=tok)
        names = opts.lora_names()
        if names:
            result["lora_mix"] = _client_entry(opts)

        async def go():
            t = time.monotonic()
            for c, reqs in zip(opts.concurrency, slices(warm, counts)):
                for rs in _passes(reqs, names):
                    await openai_load.run_openai(base, model["id"], rs, c, opts.request_rate,
                                                 opts.seed, **kw)
                log(f"warm-up C={c} done ({time.monotonic() - t:.0f} s)")
            result["warmup"] = _client_warmup(t, opts.warmup)
            for c, reqs in zip(opts.concurrency, per_level):
                run = await openai_load.run_openai(base, model["id"], reqs, c,
                                                   opts.request_rate, opts.seed,
                                                   metrics_url, **kw)
                records.append(run.records)
                result["levels"].append(level_dict(run, opts.slo, mode))
                if names:
                    sw0 = serving_lora.metric_swaps(metrics_url)
                    mix = await openai_load.run_openai(
                        base, model["id"], serving_lora.assign(reqs, names), c,
                        opts.request_rate, opts.seed, **kw)
                    _client_mix(result["levels"][-1], c, mix, opts.slo, sw0, metrics_url)
                s = result["levels"][-1]["summary"]
                log(f"C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
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
    if opts.backend != "inprocess" and opts.lora_mix and not opts.target:
        opts = dataclasses.replace(opts, engine_flags=serving_lora.spawn_flags(opts))
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
    return result, report.write(output_dir, result, serving_report.markdown,
                                serving_plots.plots(result))