"""The soak run's traffic (``soak`` spawns the processes and keeps the
score): each client process (``client_main``, started with multiprocessing's
``spawn``) runs ``--inflight`` asyncio workers on one ``AsyncClient``; each
worker draws a case (``CASES``, seeded per client), runs it with every call
bounded in time, and records how it ended, until ``cfg["stop_at"]``.

Cases and what they send are in ``soak``'s docstring; the status codes each
may end with are ``soak_report.EXPECTED`` (a hostile case carries its own, from
``soak_hostile``). This module imports no JAX: it is
what every client process loads.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from jaxserve.bench.soak_hostile import GRPC_HOSTILE, unread_shape
from jaxserve.bench.soak_hostile import names as hostile_names
from jaxserve.bench.workloads import SENTENCES
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server.client import AsyncClient, make_request

# (case, weight): the draw of every call; soak_report.EXPECTED has each one's codes.
CASES = (("generate", 0.45), ("cancel", 0.10), ("deadline", 0.08), ("bad", 0.07),
         ("hostile", 0.08), ("unread", 0.02), ("oversized", 0.03), ("burst", 0.015),
         ("tokenize", 0.05), ("detokenize", 0.04), ("model_info", 0.035), ("health", 0.04))
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
        self.sentences = SENTENCES
        self.hostile = hostile_names(GRPC_HOSTILE, cfg)
        # The coverage pass: a client process named in cfg["coverage_clients"]
        # first runs every case once and every hostile sub-case once (so that
        # even a short run has a status for each), then draws.
        self.forced = ([(c, None) for c in self.case_names if c != "hostile"]
                       + [("hostile", h) for h in self.hostile]
                       if client_id in cfg.get("coverage_clients", ()) else [])

    def text(self, lo: int, hi: int) -> str:
        k = int(self.rng.integers(lo, hi + 1))
        return " ".join(self.sentences[i] for i in self.rng.integers(0, len(self.sentences), k))

    def ids(self, lo: int, hi: int) -> list[int]:
        return self.rng.integers(0, self.cfg["vocab_size"], int(self.rng.integers(lo, hi + 1))).tolist()


def _normal_request(ctx: _Ctx, max_tokens_hi: int = 40):
    """A well-formed GenerateRequest of a drawn shape and its choice count."""
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
    return make_request(**prompt, request_id=rid, output_kind=kind, **kw), n


def _bad_request(ctx: _Ctx, sub: str):
    """(rpc name, request) of the malformed case ``sub``."""
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


async def _one(ctx: _Ctx, client, case: str, sub: str | None = None) -> list[dict]:
    """Run one drawn call (a burst is several); returns its records."""
    cfg, r = ctx.cfg, ctx.rng
    t0 = time.monotonic()
    rec = {"api": "grpc", "case": case, "client": ctx.cid, "t0": t0}
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
        elif case == "hostile":
            sub = sub or str(r.choice(ctx.hostile))
            expect, build = GRPC_HOSTILE[sub]
            rec["sub"], rec["expect"] = sub, sorted(expect)
            data, md = build(cfg)
            call = client.channel.unary_stream(
                "/jaxserve.v1.Generation/Generate",
                response_deserializer=pb.GenerateResponse.FromString)(
                data, timeout=timeout, metadata=client.metadata if md is None else md)
            await asyncio.wait_for(_stream(call, 1, t0, rec), timeout + cfg["slack_s"])
        elif case == "unread":
            await _unread(ctx, client, rec)
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


async def _unread(ctx: _Ctx, client, rec: dict) -> None:
    """A stream (``soak_hostile.unread_shape``) never read, then cancelled
    2-8 s later; its code is the one it had ended with by then, or CANCELLED."""
    r = ctx.rng
    rec["shape"] = shape = unread_shape(r, ctx.cfg)
    req = make_request(token_ids=ctx.ids(4, 32), **shape)
    call = client.stub.Generate(req, timeout=ctx.cfg["request_timeout_s"],
                                metadata=client.metadata)
    rec["hold_s"] = float(r.uniform(2, 8))
    await asyncio.sleep(rec["hold_s"])
    if call.done():
        rec["code"] = (await call.code()).name
    else:
        call.cancel()
        rec["code"] = "CANCELLED"


async def _burst(ctx: _Ctx, client) -> list[dict]:
    """``--burst`` tiny requests at once (1-2 tokens, short text prompts)."""
    cfg, r = ctx.cfg, ctx.rng

    async def one(i):
        ctx.started += 1
        t0 = time.monotonic()
        rec = {"api": "grpc", "case": "burst", "client": ctx.cid, "t0": t0, "n": 1}
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
    cfg = ctx.cfg
    async with AsyncClient(cfg["target"], token=cfg.get("token")) as client:
        async def worker():
            last_burst = -1e9
            while time.monotonic() < cfg["stop_at"]:
                forced = bool(ctx.forced)
                case, sub = ctx.forced.pop(0) if forced else (
                    str(ctx.rng.choice(ctx.case_names, p=ctx.case_p)), None)
                if case == "burst":  # at most one burst per worker per 20 s
                    if not forced and time.monotonic() - last_burst < 20:
                        case = "generate"
                    else:
                        last_burst = time.monotonic()
                recs = await _one(ctx, client, case, sub)
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
        ctx.records.append({"api": "grpc", "case": "client", "client": client_id, "code": "CLIENT_ERROR",
                            "error": f"{type(e).__name__}: {e}"[:300],
                            "t0": time.monotonic(), "t1": time.monotonic(), "e2e": 0.0})
    out.put((client_id, ctx.records, ctx.started))
