"""Load generator over OpenAI's HTTP API: the serving benchmark's load
pattern and figures for any OpenAI-compatible server (jaxserve's
``--http_port``, llama.cpp's ``python -m llama_cpp.server``, vLLM, ...).

``run_openai`` is ``serving.run_grpc`` with HTTP underneath: the same
arrival offsets (closed loop, or Poisson with at most ``concurrency`` in
flight), the same ``RequestRecord``s and ``LevelRun``. Every request is one
streamed ``POST {base}/v1/completions`` on a shared ``httpx.AsyncClient``
(one keep-alive connection per slot)::

    {"model", "prompt", "max_tokens": output_len, "temperature": 0, "stream": true,
     "stream_options": {"include_usage": true}, "ignore_eos": true,
     "skip_special_tokens": false, **extra_body}

``ignore_eos`` and ``skip_special_tokens`` are vLLM's extras (jaxserve knows
them; a server that does not ignores them and may stop at EOS: see "short
outputs"). ``min_tokens`` is not sent: it would mask EOS and change the
greedy tokens, and llama_cpp.server implements it as a per-token Python
logits processor.

What the client measures (``time.monotonic()`` s):

* send: when the request takes its slot and is posted (as ``run_grpc``).
* chunks: the stream is parsed as server-sent events (``SSEParser``); every
  event whose first choice carries non-empty ``text`` is stamped when it is
  read, as vLLM's ``benchmark_serving`` does. TTFT = first stamp - send; ITL =
  the stamps' gaps. Events without text (a finish, the usage chunk,
  ``: ping`` comments) are not stamped.
* end: the event carrying ``finish_reason`` (else ``data: [DONE]``).
* tokens per chunk: SSE carries text, not token counts. Output tokens are
  ``usage.completion_tokens`` when the server reports it (the last chunk
  under ``include_usage``: jaxserve, vLLM); else ``max_tokens`` when
  ``finish_reason`` is "length" (exact by definition; llama_cpp.server
  streams no usage); else the output text re-tokenized with ``tokenizer``
  (vLLM's fallback: exact for text that round-trips, low for byte-level
  garbage whose bytes the server never showed); else one per text chunk.
  That total is spread evenly over the text chunks
  (each ``total // n``, the first ``total % n`` one more; one each when the
  total is below ``n``), so TPOT is exact and ITL stays per chunk, like
  ``run_grpc``'s per message. ``LevelRun.http["token_count"]`` says which.
* prompt tokens: ``usage.prompt_tokens`` when reported, else the server's
  own count of a text prompt (``tokenizer``), else ``len(prompt_ids)``.
* cached tokens: ``usage.prompt_tokens_details.cached_tokens`` (0 without).
  ``queue_ms`` / ``prefill_ms`` are not visible over HTTP (None).
* errors: an HTTP status other than 200 (with the body's message), an
  ``{"error": ...}`` event, ``finish_reason`` "abort", a stream that ends
  without a finish or ``[DONE]``, no text at all, a transport exception.
* short outputs: a request that finished with fewer tokens than asked (a
  server that stops at EOS) still completes; ``LevelRun.http["short_outputs"]``
  counts them and the report says so.
* ``token_ids``: with ``tokenizer``, the output text re-tokenized after the
  level (for the report's token agreement; None when the text holds U+FFFD,
  bytes that were not valid UTF-8, which cannot give the ids back);
  ``LevelRun.texts`` keeps the text.

Prompts: ``prompt_as="ids"`` sends ``prompt_ids`` as a list of ints (OpenAI's
API allows token-id prompts; jaxserve and vLLM take them exactly);
``"text"`` sends ``tokenizer.decode(prompt_ids)``, decoded before the level
starts, for servers that take only text: llama_cpp.server's
``CreateCompletionRequest.prompt`` is ``str | list[str]`` (a list of ints is a
422), and it tokenizes the text itself, adding BOS when the GGUF asks.
``accepts_token_ids`` probes a server with a one-token request.

``HttpTokenizer`` speaks both tokenizer shapes: vLLM's and jaxserve's
(``/tokenize`` ``{prompt, add_special_tokens}`` -> ``{tokens}``;
``/detokenize`` ``{tokens}`` -> ``{prompt}``) and llama_cpp.server's
(``/extras/tokenize`` ``{input}`` -> ``{tokens}``, BOS always added;
``/extras/detokenize`` ``{tokens}`` -> ``{text}``).

``metrics_url``: a jaxserve Prometheus page, polled every 0.25 s for KV pages
and running/waiting, and read before and after the level for the prefix
cache, preemptions and speculation, as ``run_grpc`` does; None for a
foreign server (those figures are then 0).

``peers.spawn_llama_cpp_server`` starts llama.cpp's server on a GGUF for the
``llama_cpp_server`` peer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import time

import httpx

from jaxserve.bench import serving
from jaxserve.bench.stats import RequestRecord
from jaxserve.bench.workloads import BenchRequest

_TIMEOUT = httpx.Timeout(None, connect=30.0)  # a stream may wait long for its turn


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- server-sent events ---------------------------------------------------------

class SSEParser:
    """Server-sent events, line by line (the WHATWG rules a completion stream
    needs): ``data:`` lines of one event are joined by newlines, a blank line
    ends the event, ``:`` lines are comments (pings), other fields (``event``,
    ``id``, ``retry``) are ignored; one space after the colon is dropped."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line without its line ending; the data of the event it ends, or None."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """The pending event's data (the stream ended without a blank line), or None."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclasses.dataclass
class StreamState:
    """What one completion stream said (its first choice)."""

    times: list[float] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    done: bool = False
    end: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def on_event(st: StreamState, data: str, now: float) -> None:
    """Apply one event's data (``[DONE]`` or a JSON chunk) received at ``now``."""
    if data.strip() == "[DONE]":
        st.done = True
        st.end = now if st.end is None else st.end
        return
    try:
        obj = json.loads(data)
    except ValueError:
        st.error = st.error or f"not a JSON event: {data[:80]!r}"
        return
    if not isinstance(obj, dict):
        return
    if obj.get("error") is not None:
        err = obj["error"]
        st.error = st.error or "stream error: " + (
            str(err.get("message", err)) if isinstance(err, dict) else str(err))
        return
    if obj.get("usage"):
        st.usage = obj["usage"]
    for ch in obj.get("choices") or ():
        if ch.get("index", 0) != 0:
            continue
        text = ch.get("text")
        if text is None:  # a chat chunk
            text = (ch.get("delta") or {}).get("content")
        if text:
            st.times.append(now)
            st.texts.append(text)
        if ch.get("finish_reason") and st.finish_reason is None:
            st.finish_reason = ch["finish_reason"]
            st.end = now


def spread(total: int, n: int) -> list[int]:
    """``total`` tokens over ``n`` chunks, evenly, the first ones one more;
    one each when ``total < n``."""
    if total < n:
        return [1] * n
    q, r = divmod(total, n)
    return [q + (i < r) for i in range(n)]


def finish_record(rec: RequestRecord, st: StreamState, asked: int,
                  text_tokens: int | None = None) -> str:
    """Fill ``rec`` from a finished stream of a request for ``asked`` tokens;
    returns where the token count came from ("usage", "length" (finished at
    max_tokens), "tokenizer" with ``text_tokens``, or "chunks")."""
    rec.chunk_times = list(st.times)
    rec.end_time = st.end
    source = "chunks"
    total = len(st.times)
    usage = st.usage or {}
    if usage.get("completion_tokens") is not None:
        total, source = int(usage["completion_tokens"]), "usage"
    elif st.finish_reason == "length":
        total, source = asked, "length"
    elif text_tokens is not None:
        total, source = text_tokens, "tokenizer"
    rec.chunk_tokens = spread(total, len(st.times)) if st.times else []
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                            or 0)
    if st.error:
        rec.error = st.error
    elif st.finish_reason == "abort":
        rec.error = "aborted"
    elif not st.done and st.finish_reason is None:
        rec.error = "the stream ended without a finish_reason or [DONE]"
    elif not st.times:  # e.g. tokens that are not valid UTF-8, which a server may drop
        rec.error = (f"finished (finish_reason {st.finish_reason}) without any text: no "
                     "token time to measure")
    return source


# ---- the server's tokenizer -----------------------------------------------------

class HttpTokenizer:
    """``encode`` / ``decode`` through a server's tokenizer routes (see the
    module docstring): vLLM's and jaxserve's ``/tokenize`` + ``/detokenize``,
    or llama_cpp.server's ``/extras/tokenize`` + ``/extras/detokenize`` (plain
    ``/tokenize`` in its older releases), whichever answers first.
    Synchronous: used before and after a level only."""

    # (shape, tokenize path, detokenize path), tried in this order
    ROUTES = (("vllm", "/tokenize", "/detokenize"),
              ("llama_cpp", "/extras/tokenize", "/extras/detokenize"),
              ("llama_cpp", "/tokenize", "/detokenize"))

    def __init__(self, base_url: str, api_key: str | None = None):
        self.base = base_url.rstrip("/")
        self.http = httpx.Client(timeout=60.0, headers=_headers(api_key))
        self.route: tuple[str, str, str] | None = None  # found by the first call
        self._special: list[int] | None = None  # what llama_cpp adds to every text

    @property
    def shape(self) -> str | None:
        return self.route[0] if self.route else None

    def available(self) -> bool:
        """Whether the server tokenizes (any of ``ROUTES``)."""
        try:
            self.encode("a")
            return True
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return False

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(self.base + path, json=body)
        r.raise_for_status()
        return r.json()

    def _tokenize(self, route, text: str, add_special_tokens: bool) -> list[int]:
        body = {"prompt": text, "add_special_tokens": add_special_tokens} \
            if route[0] == "vllm" else {"input": text}
        return [int(t) for t in self._post(route[1], body)["tokens"]]

    def _raw(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.route is not None:
            return self._tokenize(self.route, text, add_special_tokens)
        error: Exception | None = None
        for route in self.ROUTES:
            try:
                ids = self._tokenize(route, text, add_special_tokens)
            except (httpx.HTTPStatusError, KeyError, TypeError) as e:
                error = e
                continue
            self.route = route
            return ids
        raise error

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._raw(text, add_special_tokens)
        if self.shape == "llama_cpp" and not add_special_tokens:
            if self._special is None:  # BOS, when the GGUF adds one
                self._special = self._raw("", True)
            k = len(self._special)
            if k and ids[:k] == self._special:
                ids = ids[k:]
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.route is None:
            self._raw("a", False)
        out = self._post(self.route[2], {"tokens": [int(t) for t in ids]})
        return out["prompt"] if "prompt" in out else out["text"]

    def close(self) -> None:
        self.http.close()


# ---- probing a server -----------------------------------------------------------

def server_model(base_url: str, api_key: str | None = None) -> dict:
    """The first entry of ``GET /v1/models`` (``id``, ``owned_by``, ...).

    Raises:
      ValueError: unreachable, not 200, or no model listed.
    """
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key),
                      timeout=30.0)
        r.raise_for_status()
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise ValueError(f"--target {base_url}: GET /v1/models failed: {e}") from None
    if not data:
        raise ValueError(f"--target {base_url}: GET /v1/models lists no model")
    return data[0]


def accepts_token_ids(base_url: str, model: str, ids: list[int],
                      api_key: str | None = None) -> bool:
    """Whether ``/v1/completions`` takes a token-id prompt: a one-token
    request with ``ids`` answered 200."""
    try:
        r = httpx.post(base_url.rstrip("/") + "/v1/completions", headers=_headers(api_key),
                       json={"model": model, "prompt": [int(t) for t in ids], "max_tokens": 1,
                             "temperature": 0.0}, timeout=120.0)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def prompt_as(base: str, model: str, ids: list[int], tok, api_key=None) -> str:
    """"ids" when the server takes token-id prompts, else "text" (which needs ``tok``).

    Raises:
      ValueError: text only, and the server cannot detokenize.
    """
    if accepts_token_ids(base, model, ids[:1], api_key):  # no full page cached
        return "ids"
    if tok is None:
        raise ValueError(f"{base} takes no token-id prompts and has no /tokenize route to "
                         "make text ones")
    return "text"


def jaxserve_metrics(base_url: str) -> str | None:
    """``{base}/metrics`` when it is a jaxserve Prometheus page, else None."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        return url if "jaxserve_kv_cache_pages_total" in serving.scrape(url) else None
    except ValueError:  # a page that is not Prometheus text
        return None


# ---- the load generator ---------------------------------------------------------

async def run_openai(base_url: str, model: str, requests: list[BenchRequest], concurrency: int,
                     request_rate: float = math.inf, seed: int = 0,
                     metrics_url: str | None = None, api_key: str | None = None,
                     prompt_as: str = "ids", tokenizer: HttpTokenizer | None = None,
                     extra_body: dict | None = None,
                     id_prefix: str = "") -> serving.LevelRun:
    """Run ``requests`` against the OpenAI-compatible server at ``base_url``;
    see the module docstring. ``prompt_as="text"`` needs ``tokenizer``.

    Raises:
      ValueError: ``concurrency < 1``, a bad ``prompt_as``, text without a tokenizer.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if prompt_as not in ("ids", "text"):
        raise ValueError(f"prompt_as must be 'ids' or 'text', got {prompt_as!r}")
    if prompt_as == "text" and tokenizer is None:
        raise ValueError("text prompts need a tokenizer (the server's /detokenize)")
    loop = asyncio.get_running_loop()
    url = base_url.rstrip("/") + "/v1/completions"
    prompts: list = [list(map(int, r.prompt_ids)) for r in requests]
    prompt_lens = [len(r.prompt_ids) for r in requests]
    if prompt_as == "text":  # decoded (and counted by the server) before the clock starts
        prompts = await loop.run_in_executor(
            None, lambda: [tokenizer.decode(r.prompt_ids) for r in requests])
        prompt_lens = await loop.run_in_executor(
            None, lambda: [len(tokenizer.encode(t, add_special_tokens=True)) for t in prompts])
    offsets = serving.arrival_offsets(len(requests), request_rate, seed)
    m0 = await loop.run_in_executor(None, serving.scrape, metrics_url)
    sem = asyncio.Semaphore(concurrency)
    states = [StreamState() for _ in requests]
    t0 = time.monotonic()
    records = [RequestRecord(f"{id_prefix}{i}", r.workload, n, t0)
               for i, (r, n) in enumerate(zip(requests, prompt_lens))]
    series: list = []
    stop = asyncio.Event()
    poller = asyncio.create_task(serving._poll(metrics_url, t0, series, stop))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, i: int, req: BenchRequest):
        body = {"model": req.lora or model, "prompt": prompts[i], "max_tokens": req.output_len,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "skip_special_tokens": False, **(extra_body or {})}
        st, parser = states[i], SSEParser()
        async with sem:
            records[i].send_time = time.monotonic()
            try:
                async with client.stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        st.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                        return
                    async for line in resp.aiter_lines():
                        if (data := parser.feed(line)) is not None:
                            on_event(st, data, time.monotonic())
                    if (data := parser.flush()) is not None:
                        on_event(st, data, time.monotonic())
            except httpx.HTTPError as e:
                st.error = f"{type(e).__name__}: {e}"

    async with httpx.AsyncClient(timeout=_TIMEOUT, limits=limits,
                                 headers=_headers(api_key)) as client:
        tasks = []
        for i, req in enumerate(requests):
            delay = t0 + offsets[i] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, i, req)))
        await asyncio.gather(*tasks)
    stop.set()
    await poller
    m1 = await loop.run_in_executor(None, serving.scrape, metrics_url)
    # After the clock: output token ids (and counts without usage) by re-tokenizing.
    texts = [st.text for st in states]
    retok: list = [None] * len(states)
    if tokenizer is not None:
        def encode_all():
            out = []
            for st in states:
                try:
                    out.append(tokenizer.encode(st.text) if st.times and "\ufffd" not in
                               st.text else None)
                except (httpx.HTTPError, KeyError, ValueError):
                    out.append(None)
            return out
        retok = await loop.run_in_executor(None, encode_all)
    sources, finishes = collections.Counter(), collections.Counter()
    short = 0
    for rec, st, req, ids in zip(records, states, requests, retok):
        sources[finish_record(rec, st, req.output_len, None if ids is None else len(ids))] += 1
        finishes[str(st.finish_reason)] += 1
        rec.token_ids = ids
        short += rec.ok and rec.output_tokens < req.output_len
    d = lambda k: int(m1.get(k, 0) - m0.get(k, 0))  # noqa: E731
    run = serving.LevelRun(
        concurrency, request_rate, records, [], series,
        int(m1.get("jaxserve_kv_cache_pages_total", 0)),
        d("jaxserve_cached_prompt_tokens_total"), d("jaxserve_prefix_cache_queries_total"),
        d("jaxserve_num_preemptions_total"), None, t0,
        spec_drafts=d("jaxserve_spec_decode_num_drafts_total"),
        spec_draft_tokens=d("jaxserve_spec_decode_num_draft_tokens_total"),
        spec_accepted_tokens=d("jaxserve_spec_decode_num_accepted_tokens_total"))
    run.texts = texts
    run.http = {"base_url": base_url, "model": model, "prompt_as": prompt_as,
                "token_count": dict(sources), "finish_reasons": dict(finishes),
                "short_outputs": short,
                "asked_tokens": sum(r.output_len for r in requests),
                "token_ids": "output text re-tokenized by the server" if tokenizer else None,
                "extra_body": extra_body or {}}
    return run


def _error_message(body: bytes) -> str:
    """OpenAI's ``error.message`` of a body, else its first 300 characters
    (FastAPI's ``detail`` included)."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])[:300]
            if obj.get("detail") is not None:
                return json.dumps(obj["detail"])[:300]
    except ValueError:
        pass
    return text[:300]
