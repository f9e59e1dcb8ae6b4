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

Building runs where ``add_request`` runs (the engine's thread) unless the
caller built the constraints first: ``Engine.build_constraints(params)``
is safe on any thread (a server runs it in a worker thread, so a grammar
compile never stalls the step loop) and ``Engine.add_request(...,
constraints=...)`` takes its result.

Forced tokens ride as drafts. When a constrained sequence's
constraint has only one legal continuation for its next tokens
(``TokenConstraint.forced_tokens``: a JSON schema's fixed keys and
punctuation), ``forced_drafts`` offers up to ``MAX_FORCED_DRAFTS`` of them
as drafts of the next step, verified in the same ragged step as speculative
drafts (``speculation``'s slots: the row samples after its last token and
after each draft). Slot j's mask is the constraint's own after the first j
drafts (``SlotConstraint``), and a seeded draw folds the same output
position into its key, so each slot samples what plain constrained decoding
samples there, and the output is the same token for token. A forced draft
is almost always accepted (the slot before it allows it and little else);
it can be refused where the grammar allows another tokenization of the
forced text than the one ``forced_tokens`` gives (llguidance's fast-forward
tokens are the canonical one) and the model samples that instead: the
speculation rule then keeps the model's token and drops the rest. The
scheduler trims drafts as it trims speculative ones (budget, pages, logits
rows, ``max_tokens``); steps with drafts are synchronous, and so is a step
whose token starts a forced run (``async_step.sync_reason``: the next plan
needs the constraint's state after that token), so with async scheduling a
forced run that follows a free token starts riding one step later than
synchronously (the step after the free token was launched before it was
known). Logits rows bound them: an engine without
speculation has ``max_rows`` (``coarse_bucket(max_num_seqs)``) rows, so
forced drafts use the rows its running sequences leave free (all but one at
batch 1, none in a full batch); a speculating engine has twice as many.
"""

from __future__ import annotations

import threading

import numpy as np

from jaxserve.engine.request import decode_ready
from jaxserve.engine.sampling_params import SamplingParams

# Most forced tokens one step carries for a sequence as drafts.
MAX_FORCED_DRAFTS = 8


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
        self._lock = threading.Lock()  # build may run on a server's worker threads
        self.num_requests = 0  # requests given constraints (structured outputs, masks)

    def build_all(self, params: SamplingParams, eos_token_ids: frozenset[int]) -> list:
        """One ``build`` per sequence of a request (``params.n``): a list of
        constraints, or of None when the params need no mask."""
        if not params.has_token_mask:
            return [None] * params.n
        out = [self.build(params, eos_token_ids) for _ in range(params.n)]
        self.num_requests += 1
        return out

    def compile(self, spec, eos_token_ids: frozenset[int]):
        """Compile a ``StructuredOutputsParams`` with the engine's grammar
        backend (cached by spec; a later ``build`` of the same spec is a cache
        hit). Safe on any thread.

        Raises:
          ValueError: as ``build``.
        """
        return self._get_backend(eos_token_ids).compile(spec)

    def grammar_stats(self):
        """The grammar backend's counters (``structured.GrammarStats``), or
        None before the first constrained request."""
        return None if self._backend is None else self._backend.stats

    def _get_backend(self, eos_token_ids: frozenset[int]):
        try:
            from jaxserve.engine import structured
        except ImportError as e:
            raise ValueError(f"structured outputs, allowed_token_ids and bad_words need the "
                             f"structured-outputs backend, which failed to load: {e}") from e
        with self._lock:
            if self._backend is None or self._eos != eos_token_ids:
                self._backend = structured.GrammarBackend(self.tokenizer, self.vocab_size,
                                                          eos_token_ids)
                self._eos = eos_token_ids
            return self._backend

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
        backend = self._get_backend(eos_token_ids)
        from jaxserve.engine import structured
        return structured.build_constraint(params, backend, self.tokenizer, self.vocab_size)


def forced_drafts(running, max_drafts: int = MAX_FORCED_DRAFTS) -> dict:
    """{sequence: its forced tokens (at most ``max_drafts``;
    ``SchedulerConfig.max_forced_drafts``)} for the constrained sequences of
    ``running`` that can be drafted for (``request.decode_ready``) and whose
    constraint forces a token; {} when ``max_drafts`` is 0."""
    out = {}
    if max_drafts <= 0:
        return out
    for r in running:
        if r.constraint is not None and decode_ready(r):
            forced = list(r.constraint.forced_tokens()[:max_drafts])
            if forced:
                out[r] = forced
    return out


class SlotConstraint:
    """What ``make_sampling_tensors`` fills for the verification slot after
    the first ``j`` (1 <= j <= len(drafts)) of a constrained sequence's
    forced ``drafts``: the constraint's own mask after those j tokens
    (advanced, filled, rolled back), so the slot samples exactly what plain
    constrained decoding would there. A draft the constraint refuses leaves
    the later slots a mask allowing nothing; they are discarded anyway (the
    slot before samples under a mask without that draft, so it is rejected)."""

    def __init__(self, constraint, drafts, j: int):
        self.constraint, self.drafts, self.j = constraint, list(drafts), j

    def fill(self, row: np.ndarray) -> None:
        taken = 0
        for tok in self.drafts[:self.j]:
            if not self.constraint.advance(int(tok)):
                break
            taken += 1
        if taken == self.j:
            self.constraint.fill(row)
        else:
            row[:] = 0
        self.constraint.rollback(taken)
