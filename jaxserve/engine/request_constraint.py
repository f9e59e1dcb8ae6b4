"""One request's token constraint: grammar, ``allowed_token_ids`` and ``bad_words`` together.

``build_constraint(params, backend, tokenizer, vocab_size)`` turns a
request's ``SamplingParams`` into a ``RequestConstraint`` (or None when the
request needs no host-filled mask, ``params.has_token_mask`` False). The
constraint is a ``token_mask.TokenConstraint``: ``fill`` ANDs, in order,

1. the grammar matcher's allowed tokens (``structured.GrammarMatcher``),
2. the fixed row of ``allowed_token_ids`` (vLLM's: only these may be
   sampled; EOS too must be listed to end early),
3. the ``bad_words`` bans (vLLM's ``get_bad_words_logits_processors``,
   ``vllm/logits_process.py``): each word is tokenized as written (leading
   spaces stripped) and with one leading space, the second kept only when
   its first token differs and its length equals the first's; a word of one
   token is always banned; a word of n tokens bans its last token whenever
   the output so far ends with its first n - 1 tokens,

and if that leaves nothing, allows the EOS ids, so the sampler never gets
an empty row: the EOS it samples there is refused by ``advance`` (no part
allowed it), and the engine ends the request on a refused token.

``advance`` checks the token against all three before taking it, and
leaves every part unchanged when one refuses; ``rollback`` undoes advances
in all parts (speculative tokens rejected). ``fill_rows`` gives the rows a
verification pass needs, one per draft position, stopping at the first
draft the constraint refuses.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.token_mask import TokenConstraint, bitmask_width, pack_token_ids

# structured.py imports this module (and re-exports it), so the grammar types
# are not imported here: ``grammar`` is a ``structured.GrammarMatcher`` and
# ``backend`` a ``structured.GrammarBackend``.


def bad_words_token_ids(bad_words: Sequence[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """The token sequences ``bad_words`` bans (vLLM's rule, module docstring).

    Args:
      tokenizer: has ``encode(text, add_special_tokens=False) -> list[int]``.
      vocab_size: V; every id must lie in [0, V).

    Raises:
      ValueError: no tokenizer, a word that tokenizes to nothing, or an id
        outside the vocabulary (naming ``bad_words[i]``).
    """
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer; this engine has none")
    out: list[list[int]] = []
    for i, word in enumerate(bad_words):
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words[{i}] = {word!r:.80} tokenizes to no tokens")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
        for ids in out[-2:]:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"bad_words[{i}] = {word!r:.80} tokenizes to id {bad[0]}, "
                                 f"outside the model's vocabulary [0, {vocab_size})")
    return out


class RequestConstraint:
    """A request's ``TokenConstraint``: grammar and/or allowed ids and/or bad words.

    Args:
      vocab_size: V of the model (rows are i32[ceil(V/32)]).
      eos_token_ids: allowed when the parts together allow nothing.
      grammar: a ``GrammarMatcher`` or None.
      allowed_row: i32[W] packed ``allowed_token_ids`` or None.
      bad_words: token sequences (``bad_words_token_ids``) or None.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int],
                 grammar: TokenConstraint | None = None, allowed_row: np.ndarray | None = None,
                 bad_words: Sequence[Sequence[int]] | None = None):
        self.vocab_size = int(vocab_size)
        self.grammar = grammar
        self.allowed_row = allowed_row
        words = [tuple(int(t) for t in w) for w in (bad_words or ())]
        self._banned_always = np.array(sorted({w[0] for w in words if len(w) == 1}), np.int64)
        self._bad_prefixed = [(w[:-1], w[-1]) for w in words if len(w) > 1]
        self._eos = [int(i) for i in eos_token_ids if 0 <= int(i) < self.vocab_size]
        self.output: list[int] = []  # tokens advanced (bad words look at its tail)
        tail = self.vocab_size % 32  # bits of the last word past V are not tokens
        self._last_word_mask = np.uint32((1 << tail) - 1 if tail else 0xFFFFFFFF)

    def _banned(self) -> list[int]:
        """Tokens the bad words ban after ``self.output`` (one per matching word)."""
        out = self._banned_always.tolist()
        n = len(self.output)
        for prefix, last in self._bad_prefixed:
            k = len(prefix)
            if k <= n and tuple(self.output[n - k:]) == prefix:
                out.append(last)
        return out

    def fill(self, row: np.ndarray) -> None:
        """AND the allowed next tokens into ``row`` (i32[W], in place); EOS
        only if the parts together allow nothing."""
        if self.grammar is not None:
            self.grammar.fill(row)
        if self.allowed_row is not None:
            np.bitwise_and(row, self.allowed_row[:row.shape[0]], out=row)
        banned = self._banned()
        words = row.view(np.uint32)
        if banned:
            ids = np.asarray(banned, np.int64)
            np.bitwise_and.at(words, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
        if (self.allowed_row is not None or banned) and not (
                words[:-1].any() or words[-1] & self._last_word_mask):
            for e in self._eos:
                words[e // 32] |= np.uint32(1 << (e % 32))

    def allows(self, token_id: int) -> bool:
        """Whether ``allowed_token_ids`` and ``bad_words`` allow ``token_id``
        next (the grammar is asked by ``advance``)."""
        t = int(token_id)
        if not 0 <= t < self.vocab_size:
            return False
        if self.allowed_row is not None and not (int(self.allowed_row[t // 32]) >> (t % 32)) & 1:
            return False
        return t not in self._banned()

    def advance(self, token_id: int) -> bool:
        """Take ``token_id``; False, with nothing changed, if a part refuses it."""
        if not self.allows(token_id):
            return False
        if self.grammar is not None and not self.grammar.advance(token_id):
            return False
        self.output.append(int(token_id))
        return True

    def fill_rows(self, rows: np.ndarray, draft_tokens: Sequence[int]) -> int:
        """Rows for verifying drafts: AND into ``rows[k]`` (rows: i32[K, W],
        K >= 1 + len(draft_tokens)) the tokens allowed after the first ``k``
        drafts, for k = 0 .. n, where n is the number of leading drafts the
        constraint accepts (rows past n are left as they are). The state is
        the same on return.

        Returns:
          n, the accepted drafts: a verifier keeps at most n drafts, and
          the token sampled at position n from ``rows[n]``.
        """
        self.fill(rows[0])
        n = 0
        for t in draft_tokens:
            if not self.advance(t):
                break
            n += 1
            self.fill(rows[n])
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances.

        Raises:
          ValueError: more than were advanced, or a negative count.
        """
        if num_tokens < 0 or num_tokens > len(self.output):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self.output)} advanced")
        if num_tokens:
            if self.grammar is not None:
                self.grammar.rollback(num_tokens)
            del self.output[-num_tokens:]

    def forced_tokens(self) -> list[int]:
        """The grammar's forced tokens, cut at the first one ``allowed_token_ids``
        or ``bad_words`` would refuse ([] without a grammar); counted in
        ``GrammarStats.forced_tokens``."""
        if self.grammar is None:
            return []
        kept = self.grammar.forced_tokens()
        if self.allowed_row is not None or self._banned_always.size or self._bad_prefixed:
            forced, kept = kept, []
            for t in forced:
                if not self.allows(t):
                    break
                kept.append(t)
                self.output.append(t)  # bad words look at the tail, forced tokens included
            if kept:
                del self.output[-len(kept):]
        self.grammar.stats.forced_tokens += len(kept)
        return kept

    @property
    def is_done(self) -> bool:
        """The grammar is complete (nothing but EOS may follow); False without one."""
        return self.grammar is not None and self.grammar.is_done


def build_constraint(params: SamplingParams, backend, tokenizer,
                     vocab_size: int, eos_token_ids: Sequence[int] | None = None
                     ) -> RequestConstraint | None:
    """The ``RequestConstraint`` of one request, or None when it needs none.

    Compiles ``params.structured_outputs`` through ``backend`` (cached; call
    from a worker thread when the grammar may be new).

    Args:
      params: the request's ``SamplingParams`` (already checked).
      backend: the engine's ``GrammarBackend``; None when it has no tokenizer.
      tokenizer: for ``bad_words`` (``encode(text, add_special_tokens=False)``).
      vocab_size: V of the model.
      eos_token_ids: default ``backend.eos_token_ids`` (or none without a
        backend); allowed when the parts allow nothing.

    Raises:
      ValueError: structured outputs without a backend, an invalid schema /
        regex / grammar (``GrammarBackend.compile``), ``allowed_token_ids``
        outside [0, V), or a bad word that tokenizes to nothing or outside the
        vocabulary; each names its field.
    """
    if not params.has_token_mask:
        return None
    if eos_token_ids is None:
        eos_token_ids = backend.eos_token_ids if backend is not None else ()
    grammar = None
    if params.structured_outputs is not None:
        if backend is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this engine has "
                             "none")
        grammar = backend.matcher(backend.compile(params.structured_outputs))
    allowed_row = None
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids: token id {bad[0]} is outside the model's "
                             f"vocabulary [0, {vocab_size})")
        allowed_row = pack_token_ids(params.allowed_token_ids, vocab_size)
        assert allowed_row.shape == (bitmask_width(vocab_size),)
    words = (bad_words_token_ids(params.bad_words, tokenizer, vocab_size)
             if params.bad_words else None)
    return RequestConstraint(vocab_size, eos_token_ids, grammar, allowed_row, words)


__all__ = ["RequestConstraint", "bad_words_token_ids", "build_constraint"]
