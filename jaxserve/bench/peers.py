"""The engines users would pick instead, on the same prompts and the same
model file: HF transformers (torch) and llama.cpp (``llama-cpp-python``).

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
  reuses the common prefix, its form of prefix caching. It computes in the
  file's own quantized format (jaxserve and transformers dequantize).

Both are then seen by ``concurrency`` closed-loop clients, as jaxserve is
(``closed_loop_view``): request ``k`` is sent when request ``k - C`` (its
client's previous one) finished, the first ``C`` at the start, so the time a
request waits for the engine (a static batch to end, the sequence before it
to finish) counts as queue time in its TTFT and E2E. A sequential engine's
timeline does not depend on C, so llama.cpp runs once and each level is a
view of that run.

``token_ids`` of each record are kept so the report can say how often the
peers' greedy tokens agree with jaxserve's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import time

from jaxserve.bench.stats import RequestRecord
from jaxserve.bench.workloads import BenchRequest

PEERS = ("hf", "llama_cpp")
HOW = {
    "hf": "transformers generate, static batches of `concurrency` requests (no continuous "
          "batching), f32, streamer-stamped steps",
    "llama_cpp": "llama-cpp-python, one request at a time (sequential) whatever the "
                 "concurrency, the GGUF's own quantization",
}


def parse_peers(spec: str | None) -> list[str]:
    """``"hf,llama_cpp"`` -> ["hf", "llama_cpp"]; "" or "none" -> [].

    Raises:
      ValueError: an unknown peer name.
    """
    names = [p.strip() for p in (spec or "").split(",") if p.strip() and p.strip() != "none"]
    bad = [p for p in names if p not in PEERS]
    if bad:
        raise ValueError(f"unknown peer(s) {bad}; choose from {', '.join(PEERS)} or none")
    return names


def available(name: str) -> str | None:
    """None when peer ``name`` can run here, else why not."""
    mods = {"hf": ("torch", "transformers"), "llama_cpp": ("llama_cpp",)}[name]
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        how = "pip install -e '.[test]'" if name == "hf" else \
            "pip install -e '.[peers]', which compiles llama.cpp"
        return f"{', '.join(missing)} not installed ({how})"
    return None


def version(name: str) -> str:
    pkg = {"hf": "transformers", "llama_cpp": "llama_cpp_python"}[name]
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


# ---- HF transformers ------------------------------------------------------------

def load_hf(model_path: str | os.PathLike):
    """The HF model of a ``.gguf`` file (dequantized, f32) or an HF folder, eval mode.

    Raises:
      ValueError: neither a ``.gguf`` file nor a folder.
    """
    import torch
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


def closed_loop_view(records: list[RequestRecord], concurrency: int) -> list[RequestRecord]:
    """The records as ``concurrency`` closed-loop clients see them.

    ``records`` come in serving order with ``send_time`` = when the engine
    started on each; request ``k`` is re-sent at the first record's start for
    ``k < C``, else at request ``k - C``'s end (never after its start).
    ``queue_ms`` becomes start - send, ``prefill_ms`` first token - start.
    """
    if not records:
        return []
    t0 = records[0].send_time
    out = []
    for k, r in enumerate(records):
        start = r.send_time
        send = t0 if k < concurrency else min(records[k - concurrency].end_time, start)
        out.append(dataclasses.replace(
            r, send_time=send, queue_ms=(start - send) * 1e3,
            prefill_ms=(r.chunk_times[0] - start) * 1e3 if r.chunk_times else None))
    return out


def run_hf(model, requests: list[BenchRequest], concurrency: int) -> list[RequestRecord]:
    """Static batches of ``concurrency`` requests; see the module docstring.
    Records are in request order with ``send_time`` = their batch's start
    (``closed_loop_view`` makes them client-side)."""
    import torch
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
    import llama_cpp
    p = pathlib.Path(gguf_path)
    if not (p.is_file() and p.suffix == ".gguf"):
        raise ValueError(f"the llama_cpp peer needs a .gguf file, got {gguf_path!r}")
    return llama_cpp.Llama(model_path=str(p), n_ctx=n_ctx, n_batch=512,
                           n_threads=os.cpu_count(), verbose=False)


def run_llama_cpp(llm, requests: list[BenchRequest]) -> list[RequestRecord]:
    """One request at a time; see the module docstring. Records are in request
    order with ``send_time`` = when each started (``closed_loop_view`` makes
    them client-side)."""
    records = []
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
