"""The serving benchmark's peers, each on every concurrency level's
requests (``run_peers``), beside jaxserve's records of the same levels (for
token agreement). The engines themselves are ``peers``:

* ``hf`` (static batches of C) and ``llama_cpp`` (one request at a time,
  in-process; it runs once and every level is a view of that run when the
  levels' requests nest), placed on the clients' timeline by
  ``peers.client_view`` (closed loop, or jaxserve's Poisson arrivals);
* ``llama_cpp_server``: llama.cpp's OpenAI server spawned on the same GGUF
  and driven by ``openai_load.run_openai`` at every level's concurrency and
  arrivals, real clients, no ``client_view``;
* ``colocated``: jaxserve itself, the same engine flags in one ``--role
  both`` server on every CPU, warmed up and driven like the main run over
  gRPC: the baseline of a disaggregated (``--role decode``) run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from jaxserve.bench import openai_load, serving, stats
from jaxserve.bench import peers as peers_mod
from jaxserve.bench.serving_levels import level_dict, log, request_dict, slices
from jaxserve.bench.serving_options import BenchOptions
from jaxserve.bench.workloads import BenchRequest, make_requests
from jaxserve.server.client import AsyncClient, Client


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
                path = peers_mod.model_file(opts.model)
            except ValueError as e:
                why = str(e)
        if why is None and name.startswith("llama_cpp") and not path.endswith(".gguf"):
            why = "llama.cpp needs a .gguf model"
        if why is not None:
            entry["skipped"] = why
            log(f"peer {name} skipped: {why}")
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
            a, b = peers_mod.agreement(recs, jax_records[j])
            same, total = same + a, total + b
            entry["levels"].append({
                "concurrency": c,
                "mode": f"static batches of {c}" if name == "hf" else "sequential",
                "summary": stats.summarize(recs, slo=opts.slo),
                "token_agreement": a / b if b else None,
                "requests": [request_dict(r, recs[0].send_time) for r in recs]})
            s = entry["levels"][-1]["summary"]
            log(f"peer {name} C={c}: {s['completed']} requests in {s['duration_s']:.1f} s, "
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
        proc, base = peers_mod.spawn_llama_cpp_server(path, n_ctx)
    except RuntimeError as e:
        entry["skipped"] = str(e).splitlines()[0]
        log(f"peer llama_cpp_server skipped: {e}")
        return
    tok = openai_load.HttpTokenizer(base)
    try:
        model = openai_load.server_model(base)["id"]
        prompt_as = openai_load.prompt_as(base, model, per_level[0][0].prompt_ids, tok)
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
            a, b = peers_mod.agreement(recs, jax_records[j])
            same, total = same + a, total + b
            entry["levels"].append({
                "concurrency": c, "mode": f"HTTP, up to {c} streams open (served one at a time)",
                "summary": stats.summarize(recs, slo=opts.slo),
                "token_agreement": a / b if b else None, "http": run.http,
                "requests": [request_dict(r, run.t0) for r in recs]})
            s = entry["levels"][-1]["summary"]
            log(f"peer llama_cpp_server C={c}: {s['completed']} requests in "
                f"{s['duration_s']:.1f} s, {s['output_throughput']:.1f} output tok/s, "
                f"{run.http['short_outputs']} short")
        entry["token_agreement"] = same / total if total else None
    finally:
        tok.close()
        serving.stop_server(proc)


def _run_colocated(entry: dict, opts: BenchOptions, per_level, jax_records,
                   scale: float) -> None:
    """The ``colocated`` peer: the same engine flags in one ``--role both``
    server on every CPU, warmed up (on other prompts of the same shapes)
    and driven like the main run; fills ``entry``."""
    t = time.monotonic()
    proc, target, metrics_url = serving.spawn_server(opts.model, list(opts.engine_flags),
                                                     tag="colocated")
    try:
        entry.update(load_s=time.monotonic() - t, target=target, levels=[])
        counts = [len(r) for r in per_level]
        with Client(target) as client:
            vocab = getattr(client.model_info(), "vocab_size", 0) or 32000
            tok = serving.RpcTokenizer(client)
            try:
                tok.encode("a")
            except Exception:  # no tokenizer on the server: random ids
                tok = None
            warm = make_requests(tok, vocab, opts.workload, sum(counts), seed=opts.seed + 1000,
                                 scale=scale) if opts.warmup else []

        async def go():
            async with AsyncClient(target) as client:
                if opts.warmup:
                    for c, reqs in zip(opts.concurrency, slices(warm, counts)):
                        await serving.run_grpc(client, reqs, c, opts.request_rate, opts.seed)
                same = total = 0
                for j, (c, reqs) in enumerate(zip(opts.concurrency, per_level)):
                    run = await serving.run_grpc(client, reqs, c, opts.request_rate,
                                                 opts.seed, metrics_url)
                    a, b = peers_mod.agreement(run.records, jax_records[j])
                    same, total = same + a, total + b
                    entry["levels"].append({**level_dict(run, opts.slo),
                                            "mode": "continuous batching, colocated",
                                            "token_agreement": a / b if b else None})
                    s = entry["levels"][-1]["summary"]
                    log(f"peer colocated C={c}: {s['completed']} requests in "
                        f"{s['duration_s']:.1f} s, {s['output_throughput']:.1f} output tok/s")
                entry["token_agreement"] = same / total if total else None
        asyncio.run(go())
    finally:
        serving.stop_server(proc)
