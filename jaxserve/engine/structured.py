"""Structured outputs on the host: grammars compiled to token bitmasks (llguidance).

One ``GrammarBackend`` per engine wraps the model's tokenizer for
llguidance (``LLTokenizer``, built once: ~0.2 s at SmolLM2's 49,152 ids,
~2.6 s at Gemma 3's 262,144). Per request:

    StructuredOutputsParams --compile (thread pool, cached)--> CompiledGrammar
    CompiledGrammar --matcher (engine thread, ~20 us)--> GrammarMatcher
    GrammarMatcher.fill(row)  each planned step: AND the allowed tokens into
                              the request's i32[W] row (``token_mask``)
    GrammarMatcher.advance / rollback / forced_tokens as tokens are kept

``compile`` turns the spec into an llguidance grammar and validates it
against the tokenizer, then builds one template ``LLMatcher``; ``matcher``
deep-copies it. Compiled grammars are cached by a canonical key of the spec
(LRU, ``cache_size`` entries) under a lock, so ``compile`` may run in any
thread while the engine thread creates matchers. A matcher and the
``RequestConstraint`` holding it belong to one request, used by one thread
at a time.

``RequestConstraint`` (``request_constraint.py``) joins a request's grammar matcher,
``allowed_token_ids`` and ``bad_words`` into one ``TokenConstraint``;
``build_constraint`` makes it from ``SamplingParams``.

Why llguidance, not xgrammar (``benchmarks/structured/backends.py``; the
figures, in ``backends.json`` and the README there, from a 2-core Xeon,
llguidance 1.9.1, xgrammar 0.2.9; a 24-passenger tool-call JSON Schema, a
phone-list regex, a 16-way choice):

- compile, grammar text to first mask: llguidance 1.7 / 1.8 ms (JSON) at
  49k / 262k ids; xgrammar 15 / 57 ms. Agents send a new tool schema on
  most calls, and the compile is on the request's path.
- per-token fill: xgrammar is faster (JSON median 1.4 / 2.4 us, p99 13 /
  46 us) than llguidance (9.8 / 13.9 us, p99 145 / 483 us); a batch of 32
  at llguidance's median is ~0.5 ms of host time per step, overlapped with
  the device step (async scheduling), well inside a decode step.
- forced tokens: llguidance's ``compute_ff_tokens`` forces at more
  positions of the JSON output (343 of 607 vs 285 at 49k), which is what
  forced-token drafting spends.
- dependencies: ``import xgrammar`` imports torch (2.4 s, a GB-size wheel
  in a JAX server, and the test suite's fast tier forbids torch);
  llguidance is a 27 ms import of one Rust extension. sglang-jax uses it.

What each spec becomes is ``grammar_spec.py``'s: JSON Schema grammars are
rigid (separators ``", "`` and ``": "``, what ``json.dumps`` writes and
models are trained on; no other whitespace), so a small model at
temperature 1 cannot wander into whitespace until ``max_tokens``, and a
schema's fixed keys are forced tokens; object schemas that say nothing of
extra keys are closed (OpenAI strict mode, xgrammar's ``strict_mode``),
so every output still validates against the user's schema; ``\\d`` in
regexes and patterns is ASCII (ECMA-262, xgrammar).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Sequence

import llguidance
import numpy as np
import tokenizers

from jaxserve.engine.grammar_spec import JSON_SEPARATORS, canonical_spec, llguidance_grammar
from jaxserve.engine.sampling_params import StructuredOutputsParams
from jaxserve.engine.token_mask import bitmask_width

DEFAULT_CACHE_SIZE = 256


@dataclasses.dataclass
class GrammarStats:
    """Counters of one backend (monotonic; the engine exports them).

    Attributes:
      compiled: grammars compiled (cache misses that succeeded).
      compile_seconds: wall seconds spent compiling them (sum).
      cache_hits: ``compile`` calls answered from the cache.
      compile_errors: specs refused with ValueError.
      fills / fill_seconds: bitmask rows filled by grammar matchers, and
        their wall seconds (sum).
      forced_tokens: tokens ``RequestConstraint.forced_tokens`` returned
        (the engine asks when it will use them).
    """

    compiled: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    compile_errors: int = 0
    fills: int = 0
    fill_seconds: float = 0.0
    forced_tokens: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated grammar ready for matchers (cached; shared by requests).

    Attributes:
      kind: the spec's field ("json", "regex", "choice", "grammar",
        "json_object").
      key: the canonical cache key.
      grammar: the llguidance grammar (JSON text).
    """

    kind: str
    key: str
    grammar: str
    _template: Any = dataclasses.field(repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)


class GrammarBackend:
    """Compiles ``StructuredOutputsParams`` and makes per-request matchers.

    Args:
      tokenizer: jaxserve's tokenizer (``checkpoints.tokenizer.Tokenizer``,
        GGUF byte-level BPE, sentencepiece, or an HF ``tokenizer.json``),
        or a bare ``tokenizers.Tokenizer``.
      vocab_size: V, the model's vocabulary (rows are i32[ceil(V/32)]); may
        exceed the tokenizer's: ids past the tokenizer are never allowed.
      eos_token_ids: the ids that end a request (model's and tokenizer's);
        the only tokens allowed once a grammar is complete.
      cache_size: compiled grammars kept (LRU).

    Cheap to build: llguidance reads the tokenizer on ``prepare`` (the
    first ``compile``), so an engine whose requests only use
    ``allowed_token_ids`` never pays for it. Without a tokenizer or EOS id
    the backend builds, and ``compile`` refuses every spec (ValueError).

    Raises:
      ValueError: an EOS id outside [0, vocab_size).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        eos = sorted({int(i) for i in eos_token_ids})
        if vocab_size < 1 or (eos and not 0 <= eos[0] <= eos[-1] < vocab_size):
            raise ValueError(f"EOS ids {eos} must lie in the vocabulary [0, {vocab_size})")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos)
        self._source = tokenizer
        self._tokenizer = None  # llguidance.LLTokenizer, built by prepare()
        self._llg_vocab = self.vocab_size
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._cache_size = int(cache_size)
        self._lock = threading.Lock()
        self._prepare_lock = threading.Lock()
        self.stats = GrammarStats()

    def prepare(self):
        """Build llguidance's view of the tokenizer now (once; ~0.2 s at 49k
        ids, ~2.6 s at 262k; ``compile`` calls it). Thread-safe.

        Raises:
          ValueError: no tokenizer or no EOS id (structured outputs need
            both), or a tokenizer llguidance cannot read.
        """
        with self._prepare_lock:
            if self._tokenizer is not None:
                return self._tokenizer
            if self._source is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this engine "
                                 "has none")
            if not self.eos_token_ids:
                raise ValueError("structured_outputs needs an EOS token id; this model has none")
            src = self._source
            backend = src if isinstance(src, tokenizers.Tokenizer) else src.backend
            if backend.padding is not None or backend.truncation is not None:
                backend = tokenizers.Tokenizer.from_str(backend.to_str())  # a copy to change
                backend.no_padding()
                backend.no_truncation()
            # llguidance indexes every tokenizer id; a model vocab may be larger.
            n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
            try:
                self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab,
                                                         eos_token=list(self.eos_token_ids))
            except Exception as e:  # noqa: BLE001 - the Rust side raises plain exceptions
                raise ValueError(f"llguidance cannot read this tokenizer: {e}") from None
            self._llg_vocab = n_vocab
            return self._tokenizer

    @property
    def mask_width(self) -> int:
        """W = ceil(vocab_size / 32): int32 words of a row."""
        return bitmask_width(self.vocab_size)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache when it holds it.

        Thread-safe; may block for milliseconds (large schemas: more), so the
        server calls it from a thread pool, off the event loop.

        Raises:
          ValueError: no tokenizer or EOS id (``prepare``); ``spec`` is not a
            ``StructuredOutputsParams``, or its
            schema / regex / grammar is invalid or uses a feature llguidance
            does not support; the message names the field
            (``structured_outputs.json`` ...) and the reason.
        """
        if not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(spec).__name__}")
        try:
            key, value = canonical_spec(spec)
        except ValueError:
            self._count_error()
            raise
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return hit
        try:
            ll_tokenizer = self.prepare()
        except ValueError:
            self._count_error()
            raise
        t = time.perf_counter()
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = llguidance_grammar(spec.kind, value)
        except ValueError as e:
            self._count_error()
            raise ValueError(f"{field}: {e}") from None
        template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        error = template.get_error() if template.is_error() else ""
        if error:
            self._count_error()
            raise ValueError(f"{field} cannot be used: {error.strip()}")
        compiled = CompiledGrammar(spec.kind, key, grammar, template)
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds += time.perf_counter() - t
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _count_error(self) -> None:
        with self._lock:
            self.stats.compile_errors += 1

    def matcher(self, compiled: CompiledGrammar) -> "GrammarMatcher":
        """A fresh matcher at the start of ``compiled``'s grammar (~20 us)."""
        with compiled._lock:
            m = compiled._template.deep_copy()
        return GrammarMatcher(self, m)

    def cache_info(self) -> dict[str, int]:
        """{"entries": cached grammars, "capacity": the LRU bound}."""
        with self._lock:
            return {"entries": len(self._cache), "capacity": self._cache_size}


def _eos_row(eos_token_ids: Sequence[int], width: int) -> np.ndarray:
    """i32[width] with exactly the EOS bits set."""
    words = np.zeros(width, np.uint32)
    eos = np.asarray(list(eos_token_ids), np.int64)
    np.bitwise_or.at(words, eos // 32, np.uint32(1) << (eos % 32).astype(np.uint32))
    return words.view(np.int32)


class GrammarMatcher:
    """One request's position in a grammar; a ``token_mask.TokenConstraint``.

    Made by ``GrammarBackend.matcher``. Not thread-safe: one request's
    constraint is used by one thread at a time.
    """

    def __init__(self, backend: GrammarBackend, llg_matcher):
        self._backend = backend
        self._m = llg_matcher
        self._scratch = np.empty(bitmask_width(backend._llg_vocab), np.int32)
        self._eos_row = _eos_row(backend.eos_token_ids, backend.mask_width)
        self._eos_idx = np.flatnonzero(self._eos_row)  # the words holding an EOS bit
        self._num_advanced = 0

    def fill(self, row: np.ndarray) -> None:
        """AND the grammar's allowed next tokens into ``row`` (i32[W],
        in place). A complete grammar allows exactly the EOS ids; a matcher
        in an error state allows only EOS, so a row is never emptied here."""
        t = time.perf_counter()
        width = row.shape[0]
        if self._m.is_stopped():
            np.bitwise_and(row, self._eos_row[:width], out=row)
        else:
            self._m.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            if self._m.is_accepting():
                self._scratch[self._eos_idx] |= self._eos_row[self._eos_idx]
            np.bitwise_and(row, self._scratch[:width], out=row)
        stats = self._backend.stats
        stats.fills += 1
        stats.fill_seconds += time.perf_counter() - t

    def advance(self, token_id: int) -> bool:
        """Take ``token_id``; False (state unchanged) if the grammar does not
        allow it here. EOS is allowed once the grammar is complete."""
        t = int(token_id)
        if t in self._backend.eos_token_ids:  # try_consume_tokens refuses EOS once stopped
            if not self._m.is_accepting() or not self._m.consume_token(t):
                return False
        elif self._m.try_consume_tokens([t]) != 1:
            return False
        self._num_advanced += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances.

        Raises:
          ValueError: more tokens than were advanced, or a negative count.
        """
        if num_tokens < 0 or num_tokens > self._num_advanced:
            raise ValueError(f"cannot roll back {num_tokens} tokens: "
                             f"{self._num_advanced} advanced")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance refused to roll back {num_tokens} tokens: "
                               f"{self._m.get_error()}")
        self._num_advanced -= num_tokens

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here (llguidance's
        ``compute_ff_tokens``: the forced bytes tokenized canonically, the
        last token left out when a longer token could still extend it);
        [] when more than one token may come next or the grammar is done."""
        if self._m.is_stopped():
            return []
        return [t for t in self._m.compute_ff_tokens() if t < self._backend.vocab_size]

    @property
    def stats(self) -> GrammarStats:
        """The backend's counters."""
        return self._backend.stats

    @property
    def is_done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS may come next)."""
        return self._m.is_accepting()


# The per-request side lives in request_constraint.py; exported here too, the engine's one import.
from jaxserve.engine.request_constraint import RequestConstraint, build_constraint  # noqa: E402

__all__ = ["CompiledGrammar", "DEFAULT_CACHE_SIZE", "GrammarBackend", "GrammarMatcher",
           "GrammarStats", "JSON_SEPARATORS", "RequestConstraint", "build_constraint"]
