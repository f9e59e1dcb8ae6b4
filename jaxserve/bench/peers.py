"""The engines users would pick instead, on the same prompts and the same
model file: HF transformers (torch), llama.cpp (``llama-cpp-python``) in
this process, and llama.cpp's own OpenAI-compatible server.

Both are driven greedily with EOS ignored and each request's own output
length, like jaxserve, and produce ``RequestRecord``s for
``jaxserve.bench.stats``. How each figure is measured:

* ``hf``: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``
  (the GGUF dequantized to f32 by transformers; an HF folder is loaded as
  is), one batched ``generate`` per group of ``concurrency`` requests taken in
  order (left padding, attention mask, ``do_sample=False``, ``max_new_tokens``
  = the group's longest output, the model's EOS id unset so that, as with
  ``ignore_eos``, EOS can be generated and does not stop it). There is
  no continuous batching: a group starts when the previous one has finished
  and its shorter requests ride along until the longest is done. A
  ``BaseStreamer`` stamps every decoding step on the host: request ``i``'s
  first token is the first step, it ends at its own ``output_len``-th step,
  ITL = the steps' spacing.
* ``llama_cpp``: ``llama_cpp.Llama(model_path=the .gguf)`` on all CPU cores,
  one request at a time (its Python API runs one sequence): ``generate`` with
  ``temp=0`` (greedy), each yielded token stamped, stopped after
  ``output_len`` tokens. llama-cpp-python keeps the previous prompt's KV and
  reuses the common prefix, its form of prefix caching (within one run; the
  cache is reset at the start of each). It computes in the
  file's own quantized format (jaxserve and transformers dequantize).

Both are then seen by the same clients as jaxserve (``client_view``). In a
closed loop request ``k`` is sent when request ``k - C`` (its client's
previous one) finished, the first ``C`` at the start; in an open loop at its
Poisson arrival (the same times jaxserve's requests had), or when request
``k - C`` finished if later. A static batch starts when all of its requests
have been sent and the batch before it has finished; a sequential request
when it has been sent and the one before it has finished. The peers are run
back to back and their measured service times are placed on that timeline,
so the time a request waits for the engine (a static batch to fill or end,
the sequence before it to finish) counts as queue time in its TTFT and E2E.
A sequential engine's service does not depend on C, so llama.cpp runs once
and each level is a view of that run.

``llama_cpp_server``: ``python -m llama_cpp.server`` (``pip install
'llama-cpp-python[server]'``) on the same GGUF, spawned by
``spawn_llama_cpp_server`` and driven over HTTP by
``openai_load.run_openai`` at every level's concurrency and arrivals, real
clients like jaxserve's (no ``client_view``). Its ``/v1/completions`` takes
only text prompts (``prompt: str | list[str]``), so each prompt is its ids
detokenized by the server and tokenized again by it (BOS added when the GGUF
asks); it streams no usage and does not know ``ignore_eos``, so a request
can end at EOS (counted as a short output). It serves one request at a time
(a lock around the model); the others wait in their open streams. The
serving benchmark drives it from ``serving_peers``; the start-up benchmark
times its start.

Any other OpenAI-compatible server (vLLM, another jaxserve) is measured by
giving its URL as the serving benchmark's ``--target`` (``--backend
openai``): the same client as ``llama_cpp_server``'s.

Shared by every benchmark that runs peers: ``available`` / ``version``
(skip a missing package, name the one that ran), ``model_file`` (the file
an alias names), ``agreement`` (first greedy tokens equal to jaxserve's) and
the 2-token untimed warm-up ``warm_up``.

``token_ids`` of each record are kept so the report can say how often the
peers' greedy tokens agree with jaxserve's.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import httpx

from checkpoints.fetch import resolve_model
from jaxserve.bench import serving
from jaxserve.bench.stats import RequestRecord
from jaxserve.bench.workloads import BenchRequest

AGREEMENT_TOKENS = 16  # first greedy tokens compared with jaxserve's

PEERS = ("hf", "llama_cpp", "llama_cpp_server", "colocated")
HOW = {
    "colocated": "jaxserve itself, prefill and decode in one server (--role both) on every "
                 "CPU, same engine flags, warmed up and driven by the same gRPC client: the "
                 "baseline of a disaggregated (--role decode) run",
    "hf": "transformers generate, static batches of `concurrency` requests (no continuous "
          "batching), f32, streamer-stamped steps",
    "llama_cpp": "llama-cpp-python, one request at a time (sequential) whatever the "
                 "concurrency, the GGUF's own quantization",
    "llama_cpp_server": "llama.cpp's OpenAI server (python -m llama_cpp.server), driven "
                        "over HTTP by the same client at the same concurrency (it serves one "
                        "request at a time), text prompts, the GGUF's own quantization",
}


def parse_peers(spec: str | None) -> list[str]:
    """``"hf,llama_cpp"`` -> ["hf", "llama_cpp"]; "" or "none" -> [].

    Raises:
      ValueError: an unknown peer name, or one named twice.
    """
    names = [p.strip() for p in (spec or "").split(",") if p.strip() and p.strip() != "none"]
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise ValueError(f"unknown peer(s) {bad}; choose from {', '.join(PEERS)} or none")
    if len(set(names)) != len(names):
        raise ValueError(f"a peer is named twice in {spec!r}")
    return names


def available(name: str) -> str | None:
    """None when peer ``name`` can run here, else why not."""
    mods = {"hf": ("torch", "transformers"), "llama_cpp": ("llama_cpp",), "colocated": (),
            # what ``python -m llama_cpp.server`` imports beyond llama_cpp (its [server] extra)
            "llama_cpp_server": ("llama_cpp", "fastapi", "uvicorn", "sse_starlette",
                                 "starlette_context", "pydantic_settings")}[name]
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        how = "pip install -e '.[test]'" if name == "hf" else \
            "pip install -e '.[peers]', which compiles llama.cpp"
        what = ", ".join(missing) if name != "llama_cpp_server" or "llama_cpp" in missing \
            else f"llama_cpp.server's {', '.join(missing)}"
        return f"{what} not installed ({how})"
    return None


def version(name: str) -> str:
    pkg = {"hf": "transformers", "llama_cpp": "llama_cpp_python", "colocated": "jaxserve",
           "llama_cpp_server": "llama_cpp_python"}[name]
    try:
        v = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        v = "?"
    if name == "hf":
        try:
            v += f" (torch {importlib.metadata.version('torch')})"
        except importlib.metadata.PackageNotFoundError:
            pass
    return v


def model_file(model: str) -> str:
    """The file (or HF folder) ``model`` names: a folder or file as given, an
    alias fetched into the cache (``checkpoints.fetch.resolve_model``).

    Raises:
      ValueError: an unknown alias.
    """
    if os.path.isdir(model):
        return model
    return str(resolve_model(model))


def agreement(peer_recs, jax_recs) -> tuple[int, int]:
    """(requests whose first ``AGREEMENT_TOKENS`` tokens equal jaxserve's,
    requests compared): pairs in order, those with both token lists; a
    shorter output (a server that stopped at EOS) is compared on its length."""
    same = n = 0
    for a, b in zip(peer_recs, jax_recs or []):
        if a.token_ids is None or b.token_ids is None:
            continue
        k = min(AGREEMENT_TOKENS, len(a.token_ids), len(b.token_ids))
        same += a.token_ids[:k] == b.token_ids[:k]
        n += 1
    return same, n


def warm_up(name: str, model, first: BenchRequest) -> None:
    """A 2-token untimed request of ``first``'s prompt through an in-process
    peer (``hf`` or ``llama_cpp``)."""
    warm = [dataclasses.replace(first, output_len=2)]
    if name == "hf":
        run_hf(model, warm, 1)
    else:
        run_llama_cpp(model, warm)


# ---- HF transformers ------------------------------------------------------------

def load_hf(model_path: str | os.PathLike):
    """The HF model of a ``.gguf`` file (dequantized, f32) or an HF folder, eval mode.

    Raises:
      ValueError: neither a ``.gguf`` file nor a folder.
    """
    import torch  # here, not at the top: torch is an optional extra and slow to import
    import transformers
    p = pathlib.Path(model_path)
    if p.is_file() and p.suffix == ".gguf":
        kw = dict(gguf_file=p.name)
        p = p.parent
    elif p.is_dir():
        kw = {}
    else:
        raise ValueError(f"the hf peer needs a .gguf file or an HF folder, got {model_path!r}")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(p), dtype=torch.float32, **kw).eval()
    # vLLM's ignore_eos: EOS may be generated and generation goes on past it
    # (``min_new_tokens`` would instead forbid EOS, changing the tokens).
    model.generation_config.eos_token_id = None
    return model


def client_view(records: list[RequestRecord], concurrency: int,
                arrivals=None) -> list[RequestRecord]:
    """The records as ``concurrency`` clients see them, closed or open loop.

    ``records`` come in serving order with ``send_time`` = when the engine
    started on each; records sharing one start are one static batch, the
    others are served one at a time. A request is sent at its arrival
    (``arrivals[k]``, same clock; None: all at the first record's start, the
    closed loop), and not before its client's previous request, ``k - C``,
    ended. A unit (batch or single request) starts when all of its requests
    have been sent and the unit before it has ended (plus the host gap measured
    between the two), so its measured service is shifted later when it has to
    wait for an arrival; in a closed loop nothing moves. ``queue_ms`` becomes
    start - send, ``prefill_ms`` first token - start. The input is not changed.

    Raises:
      ValueError: ``arrivals`` is not one time per record.
    """
    n = len(records)
    if not records:
        return []
    arr = [records[0].send_time] * n if arrivals is None else [float(a) for a in arrivals]
    if len(arr) != n:
        raise ValueError(f"got {len(arr)} arrival times for {n} records")
    units: list[list[int]] = []
    for k, r in enumerate(records):
        if units and records[units[-1][0]].send_time == r.send_time:
            units[-1].append(k)
        else:
            units.append([k])
    out: list[RequestRecord | None] = [None] * n
    prev = None  # (measured end, shifted end) of the unit before
    for unit in units:
        start = records[unit[0]].send_time
        sends = {}
        for k in unit:
            s = arr[k]
            if k >= concurrency and out[k - concurrency] is not None:
                s = max(s, out[k - concurrency].end_time)
            sends[k] = s
        ready = start if prev is None else prev[1] + (start - prev[0])
        new_start = max(ready, max(sends.values()))
        shift = new_start - start
        end = max((records[k].end_time or start) for k in unit)
        for k in unit:
            r = records[k]
            chunks = [t + shift for t in r.chunk_times]
            send = min(sends[k], new_start)
            out[k] = dataclasses.replace(
                r, send_time=send, chunk_times=chunks, chunk_tokens=list(r.chunk_tokens),
                end_time=None if r.end_time is None else r.end_time + shift,
                queue_ms=(new_start - send) * 1e3,
                prefill_ms=(chunks[0] - new_start) * 1e3 if chunks else None)
        prev = (end, end + shift)
    return out


def run_hf(model, requests: list[BenchRequest], concurrency: int) -> list[RequestRecord]:
    """Static batches of ``concurrency`` requests; see the module docstring.
    Records are in request order with ``send_time`` = their batch's start
    (``client_view`` makes them client-side)."""
    import torch  # optional extra (see load_hf)
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # first call: the prompt; then one call per step
            self.times.append(time.monotonic())

        def end(self):
            pass

    records = []
    for lo in range(0, len(requests), concurrency):
        group = requests[lo:lo + concurrency]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        n_new = max(r.output_len for r in group)
        stamps = Stamps()
        t0 = time.monotonic()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new,
                                 do_sample=False, pad_token_id=0, streamer=stamps)
        steps = stamps.times[1:]
        for i, r in enumerate(group):
            k = min(r.output_len, len(steps))
            rec = RequestRecord(f"hf-{lo + i}", r.workload, len(r.prompt_ids), t0,
                                chunk_times=steps[:k], chunk_tokens=[1] * k,
                                end_time=steps[k - 1] if k else None)
            rec.token_ids = out[i, width:width + k].tolist()
            records.append(rec)
    return records


# ---- llama.cpp -------------------------------------------------------------------

def load_llama_cpp(gguf_path: str | os.PathLike, n_ctx: int):
    """A ``llama_cpp.Llama`` over the file, ``n_ctx`` tokens of context, all cores.

    Raises:
      ValueError: not a ``.gguf`` file.
    """
    import llama_cpp  # optional extra (.[peers], compiles llama.cpp): only when it runs
    p = pathlib.Path(gguf_path)
    if not (p.is_file() and p.suffix == ".gguf"):
        raise ValueError(f"the llama_cpp peer needs a .gguf file, got {gguf_path!r}")
    return llama_cpp.Llama(model_path=str(p), n_ctx=n_ctx, n_batch=512,
                           n_threads=os.cpu_count(), verbose=False)


def run_llama_cpp(llm, requests: list[BenchRequest]) -> list[RequestRecord]:
    """One request at a time; see the module docstring. Records are in request
    order with ``send_time`` = when each started (``client_view`` makes
    them client-side)."""
    records = []
    # Forget what ran before (a warm-up on the same prompt, an earlier level):
    # a prefix match with it would be a cache hit jaxserve did not get.
    llm.reset()
    for i, r in enumerate(requests):
        rec = RequestRecord(f"llama_cpp-{i}", r.workload, len(r.prompt_ids), time.monotonic())
        toks = []
        for tok in llm.generate(r.prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0):
            toks.append(int(tok))
            rec.chunk_times.append(time.monotonic())
            rec.chunk_tokens.append(1)
            if len(toks) >= r.output_len:
                break
        rec.end_time = rec.chunk_times[-1] if rec.chunk_times else None
        rec.token_ids = toks
        records.append(rec)
    return records


# ---- llama.cpp's server (python -m llama_cpp.server) ---------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_llama_cpp_server(gguf_path: str | os.PathLike, n_ctx: int, port: int = 0,
                           timeout_s: float = 300.0, n_threads: int | None = None,
                           poll_s: float = 0.5):
    """Start ``python -m llama_cpp.server`` on ``gguf_path`` and wait until
    ``GET /v1/models`` answers; returns (process, base URL ``http://127.0.0.1:P``).

    Settings: ``n_ctx`` tokens of context, ``n_threads`` (default all cores)
    for decode and prompt batches as the in-process ``llama_cpp`` peer,
    ``--interrupt_requests false`` (its default cancels a running stream when
    another request arrives, which would cut every stream short at
    concurrency > 1), ``--logits_all false`` (the server's default keeps
    every prompt position's logits; the in-process peer does not). ``port``
    0 picks a free one. ``poll_s``: seconds between two ``GET /v1/models``
    (the start-up benchmark's time to ready is good to this). Its output is
    kept (the last 40 lines) and shown only if it fails; stop it with
    ``serving.stop_server``.

    Raises:
      RuntimeError: it exited, or did not answer within ``timeout_s``.
    """
    port = port or free_port()
    threads = str(n_threads or os.cpu_count() or 1)
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path),
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
           "--n_threads", threads, "--n_threads_batch", threads,
           "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque = collections.deque(maxlen=40)

    def pump():
        for line in proc.stdout:
            tail.append(line)
    threading.Thread(target=pump, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(base + "/v1/models", timeout=2.0).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        exited = proc.poll() is not None
        if exited or time.monotonic() > deadline:
            why = f"exited with status {proc.returncode}" if exited else \
                f"did not answer GET /v1/models within {timeout_s:.0f} s"
            serving.stop_server(proc)
            raise RuntimeError(f"llama_cpp.server on {gguf_path} {why}; its last output:\n"
                               + "".join(tail))
        time.sleep(poll_s)
