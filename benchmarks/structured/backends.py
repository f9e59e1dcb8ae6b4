"""Grammar backends compared: llguidance vs xgrammar, at SmolLM2's and Gemma 3's vocabularies.

Issue 34 asks to pick the backend of ``jaxserve/engine/structured.py`` by
measurement. For each vocabulary (SmolLM2-135M: 49,152 ids; Gemma 3 270M:
262,144 ids, both read from the project's GGUF aliases, no network) and each
of three constraints,

- ``json``: a nested tool-call JSON Schema (object with an enum name, a
  pattern-constrained string, an array of 1..40 objects with integer
  ranges and enums, optional fields), rigid separators ``", "`` / ``": "``,
- ``regex``: a list of US phone numbers and a date,
- ``choice``: one of 16 strings,

it measures:

- ``compile_cold_ms``: from the grammar text to a matcher whose first mask
  is filled (median of ``--cold`` runs, the backend's cache cleared each
  time). llguidance builds its lexer lazily, so its first mask is part of
  this figure; xgrammar precomputes masks at compile time.
- ``compile_cached_ms``: the same once the backend (or our cache of the
  grammar text, for llguidance) holds the grammar.
- ``fill_us`` median / p99: one bitmask row (i32[ceil(V/32)]) filled into a
  numpy buffer, per token, over the tokens of a valid output (the output's
  own tokenization, each token consumed after its mask is filled; every
  token checked allowed by the mask).
- ``advance_us`` median: consuming one token.
- ``forced_positions``: positions of the output where the backend's
  forced-token call (llguidance ``compute_ff_tokens``, xgrammar
  ``find_jump_forward_tokens``) returns at least one token, and
  ``forced_tokens_total`` the sum of their lengths.

Backends: ``llguidance`` and ``xgrammar`` called directly, and ``jaxserve``:
``structured.GrammarBackend`` / ``GrammarMatcher`` (llguidance plus the
spec cache, the deep-copied matcher, the row reset to all-allowed and the
AND into it, EOS bits), what the engine pays per row.

Usage (the machine must be otherwise idle; it writes ``backends.json`` next
to this file)::

    python benchmarks/structured/backends.py [--vocab smollm2 gemma3] [--cold 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from checkpoints.fetch import resolve_model  # noqa: E402
from checkpoints.tokenizer import Tokenizer  # noqa: E402

VOCABS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
SEPARATORS = (", ", ": ")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["book_flight", "search_flights", "cancel"]},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
                "flexible": {"type": "boolean"},
                "max_price": {"type": "number"},
                "passengers": {
                    "type": "array", "minItems": 1, "maxItems": 40,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 40},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "seat": {"type": "string", "enum": ["aisle", "window", "middle"]},
                            "meal": {"type": "string"},
                        },
                        "required": ["name", "age", "seat"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["origin", "destination", "date", "passengers"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov",
         "Donald Knuth", "Frances Allen", "John Backus"]
INSTANCE = {
    "name": "book_flight",
    "arguments": {
        "origin": "SFO", "destination": "CDG", "date": "2026-12-24", "cabin": "business",
        "flexible": True, "max_price": 1234.5,
        "passengers": [{"name": NAMES[i % len(NAMES)], "age": 20 + 3 * i,
                        "seat": ["aisle", "window", "middle"][i % 3]} for i in range(24)],
    },
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
REGEX = rf"Call ({PHONE}, )*{PHONE} before \d{{4}}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\."
REGEX_TEXT = ("Call " + ", ".join(f"({200 + i}) 555-{1000 + 37 * i:04d}" for i in range(30))
              + " before 2026-12-24.")
CHOICES = [f"option {c} ({i})" for i, c in enumerate("alpha beta gamma delta epsilon zeta eta "
                                                     "theta iota kappa lambda mu nu xi omicron pi"
                                                     .split())]
CASES = {"json": (json.dumps(INSTANCE, separators=SEPARATORS)),
         "regex": REGEX_TEXT, "choice": CHOICES[11]}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class LLGuidance:
    """llguidance: a grammar string per constraint; LLMatcher per request."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab_size: int, eos: int):
        import llguidance
        self.llg = llguidance
        t = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=eos)
        self.init_s = time.perf_counter() - t
        self.cache: dict[str, str] = {}

    def grammar(self, kind: str) -> str:
        m = self.llg.LLMatcher
        if kind == "json":
            return m.grammar_from_json_schema(SCHEMA, overrides={
                "whitespace_flexible": False, "item_separator": SEPARATORS[0],
                "key_separator": SEPARATORS[1]})
        if kind == "regex":
            return m.grammar_from_regex(REGEX)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in CHOICES))

    def clear_cache(self) -> None:
        self.cache.clear()

    def matcher(self, kind: str):
        g = self.cache.get(kind)
        if g is None:
            g = self.grammar(kind)
            err = self.llg.LLMatcher.validate_grammar(g, self.tokenizer)
            assert not err, err
            self.cache[kind] = g
        m = self.llg.LLMatcher(self.tokenizer, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    @staticmethod
    def fill(m, row: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @staticmethod
    def advance(m, token: int) -> bool:
        return m.consume_token(token)

    @staticmethod
    def forced(m) -> list[int]:
        return m.compute_ff_tokens()


class XGrammar:
    """xgrammar: GrammarCompiler (with its own cache) -> GrammarMatcher per request."""

    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab_size: int, eos: int):
        t = time.perf_counter()
        import xgrammar  # imports torch
        self.import_s = time.perf_counter() - t
        self.xgr = xgrammar
        t = time.perf_counter()
        backend = tok.backend
        n = backend.get_vocab_size(with_added_tokens=True)
        vocab = [backend.id_to_token(i) or "" for i in range(n)]
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgrammar.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=[eos],
                                      add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
        self.init_s = time.perf_counter() - t

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, kind: str):
        c = self.compiler
        if kind == "json":
            g = c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                      separators=SEPARATORS)
        elif kind == "regex":
            g = c.compile_regex(REGEX)
        else:
            g = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in CHOICES))
        return self.xgr.GrammarMatcher(g)

    @staticmethod
    def fill(m, row: np.ndarray) -> None:
        m.fill_next_token_bitmask(row[None, :])

    @staticmethod
    def advance(m, token: int) -> bool:
        return m.accept_token(token)

    @staticmethod
    def forced(m) -> list[int]:
        return m.find_jump_forward_tokens()


class Jaxserve:
    """jaxserve's own path over llguidance (``jaxserve/engine/structured.py``):
    compile (cached by spec) -> GrammarMatcher (a deep copy); each fill sets
    the row to all-allowed first, then ANDs the grammar's row in."""

    name = "jaxserve"

    def __init__(self, tok: Tokenizer, vocab_size: int, eos: int):
        from jaxserve.engine.sampling_params import StructuredOutputsParams
        from jaxserve.engine.structured import GrammarBackend
        t = time.perf_counter()
        self.backend = GrammarBackend(tok, vocab_size, [eos])
        self.backend.prepare()
        self.init_s = time.perf_counter() - t
        self.specs = {"json": StructuredOutputsParams(json=SCHEMA),
                      "regex": StructuredOutputsParams(regex=REGEX),
                      "choice": StructuredOutputsParams(choice=CHOICES)}

    def clear_cache(self) -> None:
        self.backend._cache.clear()

    def matcher(self, kind: str):
        return self.backend.matcher(self.backend.compile(self.specs[kind]))

    @staticmethod
    def fill(m, row: np.ndarray) -> None:
        row.fill(-1)
        m.fill(row)

    @staticmethod
    def advance(m, token: int) -> bool:
        return m.advance(token)

    @staticmethod
    def forced(m) -> list[int]:
        return m.forced_tokens()


BACKENDS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "jaxserve": Jaxserve}


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def measure(backend, kind: str, tokens: list[int], width: int, cold: int) -> dict:
    """Compile (cold and cached) and per-token fill/advance figures for one case."""
    row = np.zeros((width,), np.int32)
    colds, cached = [], []
    for i in range(cold + 3):
        if i < cold:
            backend.clear_cache()
        t = time.perf_counter()
        m = backend.matcher(kind)
        backend.fill(m, row)
        (colds if i < cold else cached).append(time.perf_counter() - t)
    m = backend.matcher(kind)
    fills, advances, forced, allowed = [], [], 0, 0
    for tok in tokens:
        t = time.perf_counter()
        backend.fill(m, row)
        t1 = time.perf_counter()
        if not _allowed(row, tok):
            raise AssertionError(f"{backend.name} {kind}: token {tok} not allowed")
        ok = backend.advance(m, tok)
        t2 = time.perf_counter()
        assert ok, f"{backend.name} {kind}: token {tok} refused"
        allowed += int(np.unpackbits(row.view(np.uint8)).sum())
        fills.append(t1 - t)
        advances.append(t2 - t1)
    m = backend.matcher(kind)
    t = time.perf_counter()
    forced_positions = 0
    for tok in tokens:
        n = len(backend.forced(m))
        forced += n
        forced_positions += n > 0
        backend.advance(m, tok)
    ff_s = time.perf_counter() - t
    fills_us = np.array(fills) * 1e6
    return {"tokens": len(tokens), "compile_cold_ms": _ms(float(np.median(colds))),
            "compile_cold_max_ms": _ms(max(colds)),
            "compile_cached_ms": _ms(float(np.median(cached))),
            "fill_us_median": round(float(np.median(fills_us)), 1),
            "fill_us_p99": round(float(np.percentile(fills_us, 99)), 1),
            "fill_us_max": round(float(fills_us.max()), 1),
            "advance_us_median": round(float(np.median(advances)) * 1e6, 1),
            "forced_tokens_total": forced,  # sum over positions of the forced run's length
            "forced_positions": forced_positions,  # positions with >= 1 forced token
            "allowed_per_step_mean": round(allowed / len(tokens), 1),
            "forced_plus_advance_us_per_token": round(ff_s / len(tokens) * 1e6, 1)}


def import_seconds(module: str) -> dict:
    """Wall seconds of ``import module`` in a fresh interpreter, and whether it imported torch."""
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            f"print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    return {"import_s": round(float(out[0]), 3), "imports_torch": out[1] == "True"}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", nargs="+", default=list(VOCABS), choices=list(VOCABS))
    ap.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--cold", type=int, default=5, help="cold compiles per case (median)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "backends.json"))
    args = ap.parse_args()
    import importlib.metadata as md
    result = {"machine": {"cpu": cpu_model(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "versions": {p: md.version(p) for p in args.backend if p != "jaxserve"},
              "imports": {p: import_seconds(p) for p in args.backend if p != "jaxserve"},
              "separators": SEPARATORS, "cases": {}, "init_s": {}}
    rows = []
    for vname in args.vocab:
        tok = Tokenizer.from_gguf(resolve_model(VOCABS[vname]))
        vocab_size, eos = tok.vocab_size, tok.eos_token_id
        width = (vocab_size + 31) // 32
        token_lists = {k: tok.encode(text, add_special_tokens=False) for k, text in CASES.items()}
        for bname in args.backend:
            backend = BACKENDS[bname](tok, vocab_size, eos)
            result["init_s"][f"{vname}/{bname}"] = round(backend.init_s, 3)
            for kind, tokens in token_lists.items():
                r = measure(backend, kind, tokens, width, args.cold)
                result["cases"][f"{vname}/{bname}/{kind}"] = {"vocab_size": vocab_size, **r}
                rows.append((vname, vocab_size, bname, kind, r))
                print(f"{vname:8s} {bname:10s} {kind:6s} done", file=sys.stderr, flush=True)
    head = (f"{'vocab':8s} {'V':>7s} {'backend':10s} {'case':6s} {'tok':>4s} {'cold ms':>9s} "
            f"{'cached ms':>9s} {'fill us p50':>11s} {'p99':>8s} {'max':>8s} {'adv us':>7s} "
            f"{'allowed':>8s} {'forced':>6s} {'fpos':>5s}")
    print(f"cpu: {result['machine']['cpu']} ({result['machine']['cpus']} cpus); "
          f"versions {result['versions']}")
    print(head)
    for vname, v, bname, kind, r in rows:
        print(f"{vname:8s} {v:7d} {bname:10s} {kind:6s} {r['tokens']:4d} "
              f"{r['compile_cold_ms']:9.1f} {r['compile_cached_ms']:9.2f} "
              f"{r['fill_us_median']:11.1f} {r['fill_us_p99']:8.1f} {r['fill_us_max']:8.1f} "
              f"{r['advance_us_median']:7.1f} {r['allowed_per_step_mean']:8.1f} "
              f"{r['forced_tokens_total']:6d} {r['forced_positions']:5d}")
    print("tokenizer/compiler init s:", result["init_s"])
    print("imports:", result["imports"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
