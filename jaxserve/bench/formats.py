"""Weight formats and KV cache dtypes on W1 and W2
(``python -m jaxserve.bench throughput --formats none,int8,w8a8,int4,gguf
--kv_cache_dtypes auto,int8``): jaxserve's W1 and W2 once per (weight
format, KV cache dtype), beside f32 and the peers.

Every pair of the two lists runs (the f32 / ``auto`` pair is the throughput
run's own jaxserve run, done once). Each pair is one engine at a time: built
with the run's serving settings and the same ``--kv_cache_mib`` budget,
warmed up and run exactly as the f32 engine (``comparison.run_jaxserve``:
warm-up, W1 and W2 untimed, then timed, XLA compilations counted around
every timed pass), then freed (``del``, ``gc.collect``, ``jax.clear_caches``)
before the next one loads. ``gguf`` loads the GGUF again with its blocks kept
(``keep_blocks=True``); a pair the engine refuses (``gguf`` of a random init,
an fp8 KV cache the device lacks) is recorded as skipped with the engine's
reason.

Figures per pair (``result["quant"]["formats"]``):

* **weight bytes**: the whole model as stored (every array of
  ``Engine.weights``: quantized ``q`` and its f32 scales and zeros, the f32
  embedding / LM head and norms) and the projections only (the arrays under
  q/k/v/o and gate/up/down, the tensors ``quant.is_projection`` names), each
  also as a ratio to f32's. The byte targets are evaluated on both.
* **KV**: bytes per token over all layers (K and V, int8/fp8 scales
  included: one f32 per token per kv head) and the pages the same
  ``--kv_cache_mib`` budget holds.
* **W1** output tok/s, **W2** TTFT and TPOT, as ratios to f32 jaxserve, HF
  transformers (f32) and llama.cpp (the GGUF's own type, Q4_1 for
  ``smollm2-135m``); first-16-token agreement with f32 jaxserve.
* **MBU** of W2's decode: bytes moved per decode step = the weights as
  stored (whole model) + the KV read at W2's mean decode context (prompt +
  output / 2 tokens, in the cache dtype with its scales), divided by TPOT and
  by the matvec bytes/s the run measured (``limits``). ``tpot_floor_ms``
  is the same bytes at the matvec bytes/s.

Targets (``targets``; printed, not tests): W2 TPOT of int8 / w8a8 <= 1.0x
llama.cpp's, of int4 / gguf / gguf_a16 / gguf_a8 <= 0.8x; W1 of w8a8 >= 1.5x W1 of f32 (same KV
dtype when that pair ran, else f32 / ``auto``); weight bytes of int8 <= 0.27x
f32's and of int4 <= 0.16x, whole model and projections each.
"""

from __future__ import annotations

import gc
import math
import time

import jax
import numpy as np

from checkpoints.loader import load_checkpoint
from jaxserve.bench import comparison
from jaxserve.bench import peers as peers_mod
from jaxserve.bench.report import fmt as _f
from jaxserve.bench.report import ratio as _ratio
from jaxserve.bench.report import targets_table
from jaxserve.config import GGUF_BLOCK_METHODS, QUANTIZATION_METHODS
from pallas_kernels.ragged_paged_attention.quant import is_quantized

KV_NAMES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
BASELINE = ("none", "auto")
LABEL = {"none": "f32", "int8": "int8", "w8a8": "w8a8", "int4": "int4", "gguf": "gguf",
         "gguf_a16": "gguf_a16", "gguf_a8": "gguf_a8"}
# The projections' attribute names in every model family (``quant.is_projection``'s
# q/k/v/o and gate/up/down, experts' stacked ones included).
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"})


def parse_list(spec: str, choices, name: str) -> list[str]:
    """``"none,int8"`` -> ["none", "int8"].

    Raises:
      ValueError: empty, a name not in ``choices``, or one named twice.
    """
    xs = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in xs if x not in choices]
    if not xs or bad or len(set(xs)) != len(xs):
        raise ValueError(f"{name} wants a comma list of distinct names from "
                         f"{', '.join(choices)}; got {spec!r}")
    return xs


def parse_formats(formats: str, kv_dtypes: str) -> list[tuple[str, str]]:
    """Every (quantization, kv dtype) pair of the two lists, f32 / auto first.
    An entry ``q:kv`` of ``formats`` is one explicit pair (not crossed with
    ``kv_dtypes``), e.g. ``none,int8,w8a8,w8a8:int8``.

    Raises:
      ValueError: a name not known, or a pair named twice.
    """
    plain = ",".join(f for f in formats.split(",") if ":" not in f) or None
    explicit = [tuple(x.strip() for x in f.split(":", 1)) for f in formats.split(",")
                if ":" in f]
    pairs = []
    if plain or not explicit:  # (an empty spec is refused by parse_list)
        plain = plain or formats
        qs = parse_list(plain, QUANTIZATION_METHODS, "--formats")
        kvs = parse_list(kv_dtypes, KV_NAMES, "--kv_cache_dtypes")
        pairs = [(q, kv) for q in qs for kv in kvs]
    for q, kv in explicit:
        parse_list(q, QUANTIZATION_METHODS, "--formats")
        parse_list(kv, KV_NAMES, "--formats (kv dtype after ':')")
        if (q, kv) in pairs:
            raise ValueError(f"--formats names {q}:{kv} twice")
        pairs.append((q, kv))
    return [BASELINE] + [p for p in pairs if p != BASELINE]


def _leaves(engine):
    """(path names, array) of every array of ``Engine.weights``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(engine.weights)
    for path, x in flat:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        yield [n for n in names if n != "value"], x


def weight_bytes(engine) -> dict:
    """{"total": every array of the state, "projections": the arrays of the
    q/k/v/o and gate/up/down projections (a quantized one's values, scales
    and zeros)}, bytes as stored."""
    total = proj = 0
    for names, x in _leaves(engine):
        n = int(np.prod(x.shape)) * x.dtype.itemsize
        total += n
        proj += n if PROJECTIONS.intersection(names) else 0
    return {"total": total, "projections": proj}


def num_params(engine) -> int:
    """Logical weight elements of the model: a quantized projection counts
    its ``[..., F, D]`` shape (its values ``q``, two int4 values per uint8,
    not its scales and zeros), any other array its size."""
    n = 0
    for names, x in _leaves(engine):
        quantized = PROJECTIONS.intersection(names[:-1]) and names[-1] in ("q", "scale", "zero")
        if not quantized:
            n += math.prod(x.shape)
        elif names[-1] == "q":
            n += math.prod(x.shape) * (2 if x.dtype == np.uint8 else 1)
    return n


def kv_bytes_per_token(engine) -> float:
    """K and V of one token over all layers, int8/fp8 scales (one f32 per
    token per kv head) included, bytes."""
    cfg, dt = engine.model_config, engine.kv_dtype
    per_head = cfg.head_dim * dt.itemsize + (4 if is_quantized(dt) else 0)
    return float(2 * cfg.num_layers * cfg.num_kv_heads * per_head)


class GgufParams:
    """The checkpoint's params for each quantization: the run's float
    params, or (``gguf``, ``gguf_a16``, ``gguf_a8``) the GGUF loaded again
    with its blocks kept, once."""

    def __init__(self, parts: dict, model: str, smoke: bool):
        self.parts, self.model, self.smoke = parts, model, smoke
        self._blocks = None

    def __call__(self, quantization: str) -> dict:
        if quantization not in GGUF_BLOCK_METHODS or self.smoke:
            return self.parts  # smoke: random init, which the engine refuses for gguf
        if self._blocks is None:
            self._blocks = load_checkpoint(self.model, show_progress=False,
                                           keep_blocks=True).params
        return dict(self.parts, params=self._blocks)


def describe(engine, quantization: str, kv: str, kv_cache_mib: int) -> dict:
    """The format's static figures: weight bytes, KV bytes per token and pages."""
    return {"quantization": quantization, "kv_cache_dtype": kv,
            "kv_dtype_stored": str(engine.kv_dtype), "weight_bytes": weight_bytes(engine),
            "kv_bytes_per_token": kv_bytes_per_token(engine), "kv_cache_mib": kv_cache_mib,
            "kv_pages": engine.num_pages}


def run(build, pairs, w1, w2, ref: dict, kv_cache_mib: int, t0: float,
        warmup: bool = True) -> list[dict]:
    """Every pair but the baseline (the throughput run ran it):
    ``build(quantization, kv)`` makes the ``LLM``; one engine at a time,
    freed before the next."""
    out = []
    for q, kv in pairs:
        if (q, kv) == BASELINE:
            continue
        t = time.monotonic()
        try:
            llm = build(q, kv)
        except ValueError as e:
            comparison.log(t0, f"format {q} / KV {kv} skipped: {e}")
            out.append({"quantization": q, "kv_cache_dtype": kv, "skipped": str(e)})
            continue
        entry = describe(llm.engine, q, kv, kv_cache_mib)
        entry["load_s"] = time.monotonic() - t
        comparison.log(t0, f"format {q} / KV {kv}: {entry['weight_bytes']['total'] / 1e6:.1f} MB "
                       f"of weights ({entry['weight_bytes']['projections'] / 1e6:.1f} MB "
                       f"projections), {entry['kv_pages']} KV pages")
        figs, records = comparison.run_jaxserve(llm.engine, w1, w2, t0, warmup=warmup)
        figs["how"] = f"jaxserve, weights {q}, KV cache {kv}"
        for w in ("w1", "w2"):
            figs[w]["agreement_vs_f32"] = comparison.agreement(records[w], ref.get(w))
        entry.update(figs)
        out.append(entry)
        del llm, records
        gc.collect()
        jax.clear_caches()
    return out


def summarize(result: dict) -> None:
    """Ratios, MBU and targets into ``result["quant"]`` (after the peers ran)."""
    qr = result.get("quant")
    if not qr:
        return
    eng = result["workloads"]["engines"]
    bps = result["limits"]["matvec_bytes_per_s"]
    w2 = result["workloads"]["prompts"]["w2"]
    ctx = w2["prompt_tokens"] + w2["output_tokens"] / 2  # mean KV length over the decode
    runs = [e for e in qr["formats"] if "skipped" not in e]
    base = qr["formats"][0]
    peers = {k: e for k, e in eng.items() if k in ("hf", "llama_cpp") and "skipped" not in e}
    for e in runs:
        b = e["weight_bytes"]["total"] + e["kv_bytes_per_token"] * ctx
        tpot = e["w2"]["tpot_ms"]
        e["decode_bytes_per_step"] = b
        e["w2_context_mean"] = ctx
        e["tpot_floor_ms"] = 1e3 * b / bps
        e["mbu"] = b / (tpot / 1e3) / bps if tpot else None
        refs = {"f32": base} | peers
        e["vs"] = {k: {"w1_tok_per_s": _ratio(e["w1"]["output_tok_per_s"],
                                              r["w1"]["output_tok_per_s"]),
                       "w2_ttft": _ratio(e["w2"]["ttft_ms"], r["w2"]["ttft_ms"]),
                       "w2_tpot": _ratio(e["w2"]["tpot_ms"], r["w2"]["tpot_ms"])}
                   for k, r in refs.items()}
        e["weight_bytes_vs_f32"] = {k: _ratio(v, base["weight_bytes"][k])
                                    for k, v in e["weight_bytes"].items()}
    qr["targets"] = targets(qr["formats"], peers.get("llama_cpp"))


def targets(formats: list[dict], llama: dict | None) -> list[dict]:
    """The formats' speed and size targets over the pairs that ran (see the
    module docstring): {"target", "value", "limit", "met"} (met None when a
    figure is missing, e.g. llama.cpp did not run)."""
    runs = [e for e in formats if "skipped" not in e]
    by = {(e["quantization"], e["kv_cache_dtype"]): e for e in runs}
    rows = []
    for e in runs:
        q, kv = e["quantization"], e["kv_cache_dtype"]
        if q in ("int8", "w8a8", "int4") + GGUF_BLOCK_METHODS:
            lim = 1.0 if q in ("int8", "w8a8") else 0.8
            v = _ratio(e["w2"]["tpot_ms"], (llama or {}).get("w2", {}).get("tpot_ms"))
            rows.append((f"W2 TPOT {q} (KV {kv}) / llama.cpp's", v, lim, "<="))
        if q == "w8a8":
            f32 = by.get(("none", kv), by[BASELINE])
            rows.append((f"W1 out tok/s w8a8 (KV {kv}) / f32 (KV {f32['kv_cache_dtype']})",
                         _ratio(e["w1"]["output_tok_per_s"], f32["w1"]["output_tok_per_s"]),
                         1.5, ">="))
    done = set()
    for e in runs:
        q = e["quantization"]
        if q in ("int8", "int4") and q not in done:  # bytes do not depend on the KV dtype
            done.add(q)
            lim = 0.27 if q == "int8" else 0.16
            for part, what in (("total", "whole model"), ("projections", "projections")):
                rows.append((f"weight bytes {q} / f32, {what}",
                             e["weight_bytes_vs_f32"][part], lim, "<="))
    return [{"target": t, "value": v, "limit": f"{op} {lim}",
             "met": None if v is None else bool(v <= lim if op == "<=" else v >= lim)}
            for t, v, lim, op in rows]


def markdown(result: dict) -> list[str]:
    """The report's per-format tables and the format targets (lines)."""
    qr = result.get("quant")
    if not qr:
        return []
    eng = result["workloads"]["engines"]
    peers = [k for k in ("hf", "llama_cpp") if k in eng and "skipped" not in eng[k]]
    names = {"hf": "HF", "llama_cpp": "llama.cpp"}
    lines = ["## Weight formats and KV cache dtypes", "",
             "jaxserve once per (weights, KV dtype), one engine at a time, "
             + ("each warmed up like f32" if qr.get("warmup", True) else
                "each compiled by its untimed pass (--no-format_warmup)")
             + "; same prompts, same serving settings, KV budget "
             f"{qr['kv_cache_mib']} MiB for all. Weight bytes as stored (quantized values + "
             "f32 per-channel scales, f16 group scales / zeros); *whole* = every array of the model (the f32 embedding / "
             "tied LM head and norms included), *proj* = the q/k/v/o and gate/up/down "
             "projections only.", "",
             "| weights | KV | whole MB | x f32 | proj MB | x f32 | KV B/token | KV pages |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in qr["formats"]:
        if "skipped" in e:
            lines.append(f"| {e['quantization']} | {e['kv_cache_dtype']} | skipped: "
                         f"{e['skipped']} | | | | | |")
            continue
        wb, r = e["weight_bytes"], e.get("weight_bytes_vs_f32", {})
        lines.append(f"| {e['quantization']} | {e['kv_cache_dtype']} | {wb['total'] / 1e6:.1f} | "
                     f"{_f(r.get('total'), '{:.3f}x')} | {wb['projections'] / 1e6:.1f} | "
                     f"{_f(r.get('projections'), '{:.3f}x')} | {e['kv_bytes_per_token']:.0f} | "
                     f"{e['kv_pages']} |")
    vs_cols = ["f32"] + peers
    head = " | ".join(f"x {names.get(k, k)}" for k in vs_cols)
    lines += ["", "Speed: ratios are this run's figure / the reference's (tok/s: > 1 is faster; "
              "ms: < 1 is faster). MBU = (whole weights + KV read at W2's mean decode context "
              f"of {_f(qr['formats'][0].get('w2_context_mean'), '{:.0f}')} tokens) / TPOT / "
              "the matvec bytes/s; floor = those bytes at the matvec bytes/s. compiles = XLA "
              "compilations in the timed W1 + W2 (must be 0); agree = first "
              f"{peers_mod.AGREEMENT_TOKENS} greedy tokens equal f32 jaxserve's (W1 share, "
              "W2).", "",
              f"| weights | KV | W1 tok/s | {head} | W2 TTFT ms | {head} | W2 TPOT ms | "
              f"{head} | floor ms | MBU | compiles | agree |",
              "|---|---|" + "---:|" * (3 * (1 + len(vs_cols)) + 3) + "---|"]
    for e in qr["formats"]:
        if "skipped" in e:
            continue
        vs = e.get("vs", {})
        cells = []
        for fig, key, fmt in (("w1", "output_tok_per_s", "{:.1f}"), ("w2", "ttft_ms", "{:.0f}"),
                              ("w2", "tpot_ms", "{:.1f}")):
            rk = {"output_tok_per_s": "w1_tok_per_s", "ttft_ms": "w2_ttft",
                  "tpot_ms": "w2_tpot"}[key]
            cells.append(_f(e[fig][key], fmt))
            cells += [_f(vs.get(k, {}).get(rk), "{:.2f}x") for k in vs_cols]
        comp = e["w1"]["compilations"] + e["w2"]["compilations"]
        agree = (f"{_f(e['w1'].get('agreement_vs_f32'), '{:.0%}')}, "
                 f"{_f(e['w2'].get('agreement_vs_f32'), '{:.0%}')}") \
            if (e["quantization"], e["kv_cache_dtype"]) != BASELINE else "(ref)"
        lines.append(f"| {e['quantization']} | {e['kv_cache_dtype']} | {' | '.join(cells)} | "
                     f"{_f(e.get('tpot_floor_ms'), '{:.1f}')} | {_f(e.get('mbu'), '{:.0%}')} | "
                     f"{comp} | {agree} |")
    for k in peers:  # the peers' own figures, for reading the ratios
        p, blank = eng[k], [""] * len(vs_cols)
        cells = [_f(p["w1"]["output_tok_per_s"]), *blank, _f(p["w2"]["ttft_ms"], "{:.0f}"),
                 *blank, _f(p["w2"]["tpot_ms"]), *blank, "", "", "", ""]
        lines.append(f"| {names[k]} | {'f32' if k == 'hf' else 'GGUF'} | {' | '.join(cells)} |")
    return lines + [""] + targets_table(qr.get("targets", []), "Weight format targets") + [""]
