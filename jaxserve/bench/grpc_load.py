"""Closed-loop load benchmark of the gRPC server (``jaxserve.v1.Generation``).

For each concurrency level C, C asyncio workers share one ``AsyncClient``;
each takes the next request from a shared list and streams it (DELTA
outputs), so C requests are always in flight until the list runs out.
Prompts are real English text (seeded shuffles of the sentences of
``jaxserve.bench.workloads.CORPUS`` after a unique "Excerpt N:" opening,
so no two share prefix-cache pages), trimmed to ``--input_len`` tokens
with the server's Tokenize/Detokenize RPCs and sent as text; sampling is
greedy with ``ignore_eos`` so each request makes exactly ``--output_len``
tokens. Before the timed levels, every level runs once untimed (C requests
at concurrency C, full length) so XLA compilation stays out of the figures;
how the server splits a burst of arrivals over steps varies, so a timed step
can still meet a new shape and compile (it shows in p99).

Measured on the client, per request (ms): TTFT = first response carrying
tokens - send; TPOT = (last token - first token) / (tokens - 1); E2E = end of
stream - send. The server's own ``Timing`` (queue, TTFT, TPOT, E2E) comes from
the last message. Per level: duration (s), requests/s, output tokens/s, p50/p99
(numpy, linear). Run::

    python -m jaxserve.bench.grpc_load --concurrency 1,4,16 --json out.json
    python -m jaxserve.bench.grpc_load --target 127.0.0.1:50051   # running server
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import sys
import time

import grpc
import numpy as np

from jaxserve.bench.serving import spawn_server, stop_server
from jaxserve.bench.workloads import SENTENCES
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server.client import AsyncClient


async def make_prompts(client: AsyncClient, n: int, input_len: int, rng) -> tuple[list, str]:
    """``n`` prompt texts of about ``input_len`` tokens (BOS included) and how
    they were sized: trimmed with Tokenize/Detokenize, or by word count
    (0.75 words per token) when the server cannot tokenize."""
    # A unique opening (drawn afresh each run) so that no two prompts, in this
    # run or an earlier one on the same server, share a prefix-cache page.
    tags = np.random.default_rng().choice(10**6, size=n, replace=False)
    texts = [f"Excerpt {tag}: " + " ".join(
        SENTENCES[i] for _ in range(1 + input_len // 1000) for i in rng.permutation(len(SENTENCES)))
        for tag in tags]
    try:
        stub = client.stub
        n_special = [len((await stub.Tokenize(pb.TokenizeRequest(
            text="a", add_special_tokens=s))).token_ids) for s in (True, False)]
        bos = n_special[0] - n_special[1]
        out = []
        for t in texts:
            ids = (await stub.Tokenize(pb.TokenizeRequest(text=t))).token_ids
            req = pb.DetokenizeRequest(token_ids=ids[:max(1, input_len - bos)])
            out.append((await stub.Detokenize(req)).text.strip())
        return out, "Tokenize RPC (token-exact trim)"
    except grpc.RpcError:
        return [" ".join(t.split()[:max(1, round(input_len * 0.75))]) for t in texts], \
            "word count (~0.75 words/token)"


async def one_request(client: AsyncClient, prompt: str, output_len: int) -> dict:
    """Stream one request; client latencies in ms, server ``Timing`` in ms,
    token counts in tokens (or ``error``)."""
    t0 = time.perf_counter()
    first = last = final = None
    n = 0
    try:
        async for r in client.generate(prompt, max_tokens=output_len, temperature=0.0,
                                       ignore_eos=True, output_kind=pb.OUTPUT_KIND_DELTA):
            now = time.perf_counter()
            k = sum(len(c.token_ids) for c in r.completions)
            if k:
                first = now if first is None else first
                last, n = now, n + k
            if r.finished:
                final = r
    except grpc.RpcError as e:
        return {"error": f"{e.code().name}: {e.details()}"}
    end = time.perf_counter()
    ms = lambda a, b: None if a is None or b is None else 1e3 * (b - a)
    t = final.timing if final is not None else pb.Timing()
    u = final.usage if final is not None else pb.Usage()
    return {"ttft_ms": ms(t0, first), "e2e_ms": ms(t0, end), "output_tokens": n,
            "tpot_ms": ms(first, last) / (n - 1) if n > 1 else None,
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "server_queue_ms": t.queue_ms, "server_ttft_ms": t.ttft_ms,
            "server_tpot_ms": t.tpot_ms, "server_e2e_ms": t.e2e_ms}


async def closed_loop(client: AsyncClient, prompts: list[str], concurrency: int,
                      output_len: int) -> tuple[list[dict], float]:
    """``concurrency`` workers drain ``prompts``; returns the per-request
    records (in prompt order) and the wall time in s."""
    results: list[dict | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))

    async def worker():
        for i in todo:  # shared iterator: each index is taken once
            results[i] = await one_request(client, prompts[i], output_len)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def summarize(concurrency: int, recs: list[dict], duration_s: float) -> dict:
    """Level figures: throughput and p50/p99 latencies (ms)."""
    ok = [r for r in recs if "error" not in r]

    def pct(key, q):
        xs = [r[key] for r in ok if r.get(key) is not None]
        return float(np.percentile(xs, q)) if xs else float("nan")
    out_tok = sum(r["output_tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": len(ok), "errors": len(recs) - len(ok),
            "duration_s": duration_s, "requests_per_s": len(ok) / duration_s,
            "output_tokens_per_s": out_tok / duration_s, "output_tokens": out_tok,
            "prompt_tokens_mean": float(np.mean([r["prompt_tokens"] for r in ok] or [0])),
            "cached_tokens": sum(r["cached_tokens"] for r in ok),
            **{f"{k}_p{q}": pct(k, q) for k in ("ttft_ms", "tpot_ms", "e2e_ms",
                                                "server_queue_ms", "server_ttft_ms",
                                                "server_tpot_ms") for q in (50, 99)}}


def table(rows: list[dict]) -> str:
    """The Markdown table, one row per level."""
    head = ("| concurrency | requests | duration s | requests/s | output tok/s | TTFT p50 ms "
            "| TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | E2E p50 ms | server queue p50 ms |")
    lines = [head, "|" + "---:|" * head.count(" | ") + "---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['duration_s']:.2f} | "
                     f"{r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | {r['tpot_ms_p50']:.1f} "
                     f"| {r['tpot_ms_p99']:.1f} | {r['e2e_ms_p50']:.1f} | "
                     f"{r['server_queue_ms_p50']:.1f} |")
    return "\n".join(lines)


async def bench(a, target: str) -> dict:
    """Warm up, then run every level; returns everything for ``--json``."""
    levels = [int(c) for c in a.concurrency.split(",")]
    rng = np.random.default_rng(a.seed)
    async with AsyncClient(target) as client:
        info = await client.stub.ModelInfo(pb.ModelInfoRequest())
        counts = [a.num_requests or max(8, 2 * c) for c in levels]
        prompts, sizing = await make_prompts(client, sum(levels) + sum(counts), a.input_len, rng)
        warm, prompts = prompts[:sum(levels)], prompts[sum(levels):]
        t0 = time.perf_counter()
        for c in levels:  # untimed: compiles the shapes each level uses
            await closed_loop(client, warm[:c], c, a.output_len)
            warm = warm[c:]
        warm_s = time.perf_counter() - t0
        rows, per_request = [], {}
        for c, n in zip(levels, counts):
            recs, dur = await closed_loop(client, prompts[:n], c, a.output_len)
            prompts = prompts[n:]
            rows.append(summarize(c, recs, dur))
            per_request[str(c)] = recs
            print(f"level {c} done in {dur:.1f} s", file=sys.stderr, flush=True)
    env = {"jax_version": importlib.metadata.version("jax"), "server_backend": info.backend,
           "server_num_devices": info.num_devices, "model": info.name, "dtype": info.dtype,
           "attention_impl": info.attention_impl, "target": target, "flags": vars(a)}
    return {"env": env, "prompt_sizing": sizing, "warmup_s": warm_s, "levels": rows,
            "requests": per_request}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.grpc_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="host:port of a running server (default: --spawn one)")
    ap.add_argument("--spawn", action="store_true", help="start a server (default without "
                    "--target) and stop it at the end")
    ap.add_argument("--model", default="smollm2-135m", help="--spawn: model alias or .gguf")
    ap.add_argument("--max_num_seqs", type=int, default=None, help="--spawn: passed through")
    ap.add_argument("--concurrency", default="1,4,16", help="comma list of levels")
    ap.add_argument("--num_requests", type=int, default=None,
                    help="requests per level (default max(8, 2 x concurrency))")
    ap.add_argument("--input_len", type=int, default=100, help="prompt tokens (about)")
    ap.add_argument("--output_len", type=int, default=64, help="output tokens per request")
    ap.add_argument("--seed", type=int, default=0, help="prompt shuffle seed")
    ap.add_argument("--json", default=None, help="write all figures here")
    a = ap.parse_args(argv)
    if a.target and a.spawn:
        ap.error("give --target or --spawn, not both")
    flags = [] if a.max_num_seqs is None else ["--max_num_seqs", str(a.max_num_seqs)]
    proc, target = spawn_server(a.model, flags)[:2] if not a.target else (None, a.target)
    try:
        res = asyncio.run(bench(a, target))
    finally:
        if proc is not None:
            stop_server(proc)
    e = res["env"]
    print(f"\ngRPC closed-loop load: {e['model']} ({e['dtype']}, {e['server_backend']} x"
          f"{e['server_num_devices']}, jax {e['jax_version']}); prompts ~{a.input_len} tokens "
          f"sized by {res['prompt_sizing']}, {a.output_len} output tokens (greedy, ignore_eos); "
          f"warm-up (untimed, {res['warmup_s']:.1f} s): each level once, so its XLA compilation "
          f"is not in the figures (steps of shapes the warm-up missed may still compile).\n")
    print(table(res["levels"]))
    print("\n" + "\n".join(
        f"C={r['concurrency']}: mean prompt {r['prompt_tokens_mean']:.1f} tokens "
        f"({r['cached_tokens']} cached), {r['errors']} errors; server-side TTFT p50/p99 "
        f"{r['server_ttft_ms_p50']:.1f}/{r['server_ttft_ms_p99']:.1f} ms, TPOT p50 "
        f"{r['server_tpot_ms_p50']:.1f} ms" for r in res["levels"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(r["errors"] == 0 for r in res["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
