"""The soak's HTTP traffic: the OpenAI API of the same server the gRPC
clients of ``soak_traffic.py`` call, at the same time (``soak`` starts
``--http_clients`` processes running ``http_client_main``).

Each process runs ``--inflight`` asyncio workers on one ``httpx.AsyncClient``
(the right bearer token on every call unless the case is about the token);
each worker draws a case (``CASES``, seeded per process), runs it and records
it, until ``cfg["stop_at"]``. Records are the gRPC ones' shape with
``"api": "http"`` and the HTTP status as a string ("200", "400", ...) or a
client-side outcome: ``CANCELLED`` (this client closed the stream),
``TIMEOUT`` (an httpx timeout: expected only in a ``deadline`` case),
``CONNECTION_ERROR`` (the connection broke or closed under the call: after
an unhandled exception in the server, uvicorn drops the connection, and the
next call on it fails so), ``HANGING`` (not
ended by timeout + ``slack_s``), ``CLIENT_ERROR``; a 200 whose stream
carried an error event is ``200_ERROR_EVENT``.

Cases (``soak_report.EXPECTED["http"]`` has each one's statuses):

* ``generate``: /v1/completions (a text, token ids, or 2 texts) or
  /v1/chat/completions, streamed or not, n 1-2, greedy or seeded sampling,
  logprobs and usage sometimes. A 200 must end properly (streamed: a
  ``finish_reason`` for every choice and ``data: [DONE]``; else: every
  choice with a ``finish_reason``), else it is *lost*.
* ``cancel``: a stream this client closes after 1-3 events or 0.05-2 s.
* ``deadline``: a longer request with an httpx timeout of 0.05-1.5 s.
* ``hostile``: one of ``soak_hostile.HTTP_HOSTILE``, expecting its statuses.
* ``oversized``: token ids past ``max_prompt_len`` -> 400.
* ``unread``: a raw-socket streamed request (``soak_hostile.unread_shape``:
  n 1-4 or the issue's n 16 / logprobs 20) of which only the status line is read; the socket is
  closed 2-8 s later (the server must abort it and free its pages).
* ``tokenize`` / ``models`` / ``health``: 200.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import httpx
import numpy as np

from jaxserve.bench.soak_hostile import HTTP_HOSTILE, names, unread_shape
from jaxserve.bench.workloads import SENTENCES

CASES = (("generate", 0.50), ("cancel", 0.10), ("deadline", 0.08), ("hostile", 0.15),
         ("oversized", 0.03), ("unread", 0.02), ("tokenize", 0.04), ("models", 0.04),
         ("health", 0.04))


class _Ctx:
    """One HTTP client process's fixed inputs and its records."""

    def __init__(self, cfg: dict, client_id: int):
        self.cfg, self.cid = cfg, client_id
        self.rng = np.random.default_rng([cfg["seed"], 1000 + client_id])
        self.records: list[dict] = []
        self.started = 0
        names_, w = zip(*CASES)
        self.case_names, self.case_p = names_, np.array(w) / sum(w)
        self.hostile = names(HTTP_HOSTILE, cfg)
        # The coverage pass: a client process named in cfg["coverage_clients"]
        # first runs every case once and every hostile sub-case once (so that
        # even a short run has a status for each), then draws.
        self.forced = ([(c, None) for c in self.case_names if c != "hostile"]
                       + [("hostile", h) for h in self.hostile]
                       if client_id in cfg.get("coverage_clients", ()) else [])
        tok = cfg.get("token")
        self.headers = {"authorization": f"Bearer {tok}"} if tok else {}

    def text(self, lo: int, hi: int) -> str:
        k = int(self.rng.integers(lo, hi + 1))
        return " ".join(SENTENCES[i] for i in self.rng.integers(0, len(SENTENCES), k))

    def ids(self, lo: int, hi: int) -> list[int]:
        return self.rng.integers(0, self.cfg["vocab_size"],
                                 int(self.rng.integers(lo, hi + 1))).tolist()


def _normal_body(ctx: _Ctx, max_tokens_hi: int) -> tuple[str, dict, int]:
    """(path, body, choices expected) of a well-formed request of a drawn shape."""
    r = ctx.rng
    budget = min(ctx.cfg["max_prompt_len"], ctx.cfg["max_model_len"] - max_tokens_hi) - 32
    n = 2 if r.random() < 0.2 else 1
    body = {"max_tokens": int(r.integers(1, max_tokens_hi + 1)), "n": n,
            "stream": bool(r.random() < 0.6)}
    if r.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=float(r.uniform(0.5, 1.2)), seed=int(r.integers(0, 2**31)))
        if r.random() < 0.3:
            body["top_p"] = 0.9
    if body["stream"] and r.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if r.random() < 0.3:
        body["ignore_eos"] = True
    form = r.choice(["text", "ids", "texts", "chat", "chat"])
    if form == "chat":
        body["messages"] = [{"role": "user", "content": ctx.text(1, 4)[:budget - 32]}]
        if r.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, int(r.integers(0, 4))
        return "/v1/chat/completions", body, n
    prompts = 1
    if form == "text":
        body["prompt"] = ctx.text(1, 8)[:budget]
    elif form == "ids":
        body["prompt"] = ctx.ids(1, min(150, budget))
    else:
        body["prompt"], prompts = [ctx.text(1, 3)[:budget // 2] for _ in range(2)], 2
    if r.random() < 0.2:
        body["logprobs"] = int(r.integers(0, 4))
    return "/v1/completions", body, n * prompts


async def _read_stream(resp, choices: int, t0: float, rec: dict, cancel_at=None,
                       cancel_after=None) -> None:
    """Read an SSE response into ``rec``: TTFT, events, whether every choice
    finished and ``[DONE]`` came; closes it early at ``cancel_at`` / after
    ``cancel_after`` events (code ``CANCELLED`` unless it had ended)."""
    events, done, finished, err = 0, False, set(), None
    lines = resp.aiter_lines()
    while True:
        wait = None if cancel_at is None else max(0.0, cancel_at - time.monotonic())
        try:
            line = await asyncio.wait_for(anext(lines), wait)
        except StopAsyncIteration:
            break
        except TimeoutError:
            rec["code"] = "CANCELLED"
            return
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        events += 1
        obj = json.loads(line[6:])
        if "error" in obj:
            err = obj["error"]
            continue
        for ch in obj.get("choices", ()):
            piece = ch.get("text") or (ch.get("delta") or {}).get("content")
            if piece and rec.get("ttft") is None:
                rec["ttft"] = time.monotonic() - t0
            if ch.get("finish_reason"):
                finished.add(ch["index"])
        if cancel_after is not None and events >= cancel_after and not done:
            rec["code"] = "CANCELLED"
            return
    rec["events"] = events
    rec["code"] = "200" if err is None else "200_ERROR_EVENT"
    if err is not None:
        rec["details"] = str(err)[:300]
    rec["lost"] = err is None and not (done and finished >= set(range(choices)))


async def _generate(ctx: _Ctx, http: httpx.AsyncClient, case: str, rec: dict) -> None:
    cfg, r = ctx.cfg, ctx.rng
    path, body, choices = _normal_body(ctx, 40 if case == "generate" else 64)
    timeout = cfg["request_timeout_s"]
    if case == "deadline":
        timeout = float(r.uniform(0.05, 1.5))
    if case == "cancel":
        body["stream"] = True
    rec.update(n=choices, path=path, stream=body["stream"])
    kw = {}
    if case == "cancel":
        kw = {"cancel_after": int(r.integers(1, 4))} if r.random() < 0.5 else \
            {"cancel_at": rec["t0"] + float(r.uniform(0.05, 2.0))}
    try:
        async with http.stream("POST", path, json=body, headers=ctx.headers,
                               timeout=timeout) as resp:
            if resp.status_code != 200:
                rec["code"] = str(resp.status_code)
                rec["details"] = (await resp.aread()).decode("utf-8", "replace")[:300]
            elif body["stream"]:
                await _read_stream(resp, choices, rec["t0"], rec, **kw)
            else:
                out = json.loads(await resp.aread())
                rec["code"] = "200"
                rec["lost"] = len(out["choices"]) != choices or not all(
                    c.get("finish_reason") for c in out["choices"])
    except httpx.TimeoutException:
        rec["code"] = "TIMEOUT"


async def _hostile(ctx: _Ctx, http: httpx.AsyncClient, rec: dict, sub: str | None) -> None:
    sub = sub or str(ctx.rng.choice(ctx.hostile))
    expect, build = HTTP_HOSTILE[sub]
    path, data, auth = build(ctx.rng, ctx.cfg)
    rec.update(sub=sub, expect=sorted(expect))
    headers = [("content-type", "application/json")]
    headers += list(ctx.headers.items()) if auth == "ok" else auth
    resp = await http.post(path, content=data, headers=headers,
                           timeout=ctx.cfg["request_timeout_s"])
    rec["code"] = str(resp.status_code)
    if resp.status_code != 200:
        rec["details"] = resp.text[:300]
    else:
        out = resp.json()
        rec["lost"] = not all(c.get("finish_reason") for c in out.get("choices", [{}]))


async def _unread(ctx: _Ctx, rec: dict) -> None:
    """A stream whose response is never read past its status line, closed
    after 2-8 s (raw socket: httpx would read ahead)."""
    cfg, r = ctx.cfg, ctx.rng
    u = urlsplit(cfg["http_url"])
    rec["shape"] = shape = unread_shape(r, cfg)
    body = json.dumps({"prompt": ctx.ids(4, 32), "stream": True, **shape}).encode()
    head = ["POST /v1/completions HTTP/1.1", f"Host: {u.netloc}",
            "Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in ctx.headers.items()]
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), cfg["request_timeout_s"])
        parts = line.split()
        rec["code"] = parts[1].decode() if len(parts) > 1 else "NO_RESPONSE"
        rec["hold_s"] = float(r.uniform(2, 8))
        await asyncio.sleep(rec["hold_s"])
    finally:
        writer.transport.abort()  # close without reading what is buffered


async def _one(ctx: _Ctx, http: httpx.AsyncClient, case: str, sub: str | None = None) -> dict:
    cfg = ctx.cfg
    t0 = time.monotonic()
    rec = {"api": "http", "case": case, "client": ctx.cid, "t0": t0}
    ctx.started += 1
    try:
        if case in ("generate", "cancel", "deadline"):
            work = _generate(ctx, http, case, rec)
        elif case == "hostile":
            work = _hostile(ctx, http, rec, sub)
        elif case == "unread":
            work = _unread(ctx, rec)
        elif case == "oversized":
            ids = ctx.ids(cfg["max_prompt_len"] + 1, cfg["max_prompt_len"] + 64)
            work = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2},
                             headers=ctx.headers, timeout=30)
        elif case == "tokenize":
            work = http.post("/tokenize", json={"prompt": ctx.text(1, 8)},
                             headers=ctx.headers, timeout=30)
        else:
            work = http.get("/v1/models" if case == "models" else "/health",
                            headers=ctx.headers, timeout=30)
        got = await asyncio.wait_for(work, cfg["request_timeout_s"] + cfg["slack_s"] + 10)
        if isinstance(got, httpx.Response):
            rec["code"] = str(got.status_code)
            if got.status_code != 200:
                rec["details"] = got.text[:300]
    except TimeoutError:
        rec["code"], rec["hanging"] = "HANGING", True
    except httpx.TimeoutException as e:  # an httpx timeout outside the deadline case
        rec["code"], rec["error"] = "TIMEOUT", f"{type(e).__name__}: {e}"[:300]
    except httpx.TransportError as e:  # the server closed or broke the connection
        rec["code"], rec["error"] = "CONNECTION_ERROR", f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 (a client-side fault is a finding, not a crash)
        rec["code"], rec["error"] = "CLIENT_ERROR", f"{type(e).__name__}: {e}"[:300]
    rec["t1"] = time.monotonic()
    rec["e2e"] = rec["t1"] - t0
    return rec


async def _client_async(ctx: _Ctx) -> None:
    cfg = ctx.cfg
    limits = httpx.Limits(max_connections=4 * cfg["inflight"])
    async with httpx.AsyncClient(base_url=cfg["http_url"], limits=limits) as http:
        async def worker():
            while time.monotonic() < cfg["stop_at"]:
                case, sub = ctx.forced.pop(0) if ctx.forced else (
                    str(ctx.rng.choice(ctx.case_names, p=ctx.case_p)), None)
                rec = await _one(ctx, http, case, sub)
                ctx.records.append(rec)
                full = rec.get("code") == "429"
                await asyncio.sleep(float(ctx.rng.uniform(0.5, 1.0) if full
                                          else ctx.rng.uniform(0, 0.05)))
        await asyncio.gather(*(worker() for _ in range(cfg["inflight"])))


def http_client_main(cfg: dict, client_id: int, out) -> None:
    """Body of one HTTP client process (``soak_traffic.client_main``'s
    contract): run drawn calls until ``cfg["stop_at"]``, then put
    ``(client_id, records, calls started)`` on ``out``."""
    ctx = _Ctx(cfg, client_id)
    try:
        asyncio.run(_client_async(ctx))
    except Exception as e:  # noqa: BLE001 (report what ran, and the fault)
        ctx.records.append({"api": "http", "case": "client", "client": client_id,
                            "code": "CLIENT_ERROR", "error": f"{type(e).__name__}: {e}"[:300],
                            "t0": time.monotonic(), "t1": time.monotonic(), "e2e": 0.0})
    out.put((client_id, ctx.records, ctx.started))


__all__ = ["CASES", "http_client_main"]
