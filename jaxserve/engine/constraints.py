"""Each sequence's token constraint, built from its request's params: the one
place the engine reaches the structured-outputs backend.

``ConstraintFactory.build`` gives a sequence of a request whose params need a
token mask (``SamplingParams.has_token_mask``: structured outputs,
``allowed_token_ids``, ``bad_words``) its own ``token_mask.TokenConstraint``
(choices advance separately), through ``structured.build_constraint(params,
backend, tokenizer, vocab_size)``; the backend
(``structured.GrammarBackend(tokenizer, vocab_size, eos_token_ids)``: the
tokenizer's vocabulary prepared for the grammar library, and its grammar
cache) is built once per engine, on the first constrained request, and
again only if the engine's EOS ids change. ``structured`` is imported there
too, so an engine that never sees a constrained request never loads the
grammar library. ``check_token_ids`` checks the params' token ids against
the vocabulary, which only the engine knows.
"""

from __future__ import annotations

from jaxserve.engine.request import SamplingParams


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Check that ``logit_bias`` keys and ``allowed_token_ids`` are token ids
    of a ``vocab_size``-token vocabulary.

    Raises:
      ValueError: an id outside [0, vocab_size), naming the field.
    """
    for field, ids in (("logit_bias", params.logit_bias or ()),
                       ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.{field}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab_size})")


class ConstraintFactory:
    """Builds sequences' token constraints (module docstring).

    Args:
      tokenizer: the model's tokenizer, or None (token ids only).
      vocab_size: V, the logits' width (the bitmask covers it).
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend = None
        self._eos: frozenset[int] | None = None

    def build(self, params: SamplingParams, eos_token_ids: frozenset[int]):
        """A new ``TokenConstraint`` for one sequence of a request with
        ``params``, or None when they need no token mask.

        Raises:
          ValueError: params the backend cannot serve (an invalid schema or
            regex, an unsupported grammar feature; the backend names the
            field), or no structured-outputs backend in this install.
        """
        if not params.has_token_mask:
            return None
        try:
            from jaxserve.engine import structured
        except ImportError as e:
            raise ValueError(f"structured outputs, allowed_token_ids and bad_words need the "
                             f"structured-outputs backend, which failed to load: {e}") from e
        if self._backend is None or self._eos != eos_token_ids:
            self._backend = structured.GrammarBackend(self.tokenizer, self.vocab_size,
                                                      eos_token_ids)
            self._eos = eos_token_ids
        return structured.build_constraint(params, self._backend, self.tokenizer,
                                           self.vocab_size)
