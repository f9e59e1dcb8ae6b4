"""Host-side token masks: what a request may sample next, as a packed bitmask.

A step's sampler takes one int32 word row per sampled row, ``W =
ceil(V / 32)`` words (``bitmask_width``): bit ``j`` of word ``i`` set means
token ``32 * i + j`` may be sampled (the layout of llguidance's and
xgrammar's token bitmasks, so a grammar matcher fills rows in place). A row
of all ones (-1 words) is unconstrained; bits past ``V`` are ignored.

``TokenConstraint`` is what a request carries when the host must fill its
row each step (structured outputs, ``allowed_token_ids``, ``bad_words``):
the engine calls ``fill`` when it plans a step that samples the request,
``advance`` with each token the request keeps, and ``rollback`` when
speculative tokens are rejected.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """W: int32 words per bitmask row for a vocabulary of ``vocab_size``."""
    return (vocab_size + 31) // 32


def pack_token_ids(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A bitmask row (i32[W]) with exactly ``token_ids`` allowed.

    Raises:
      ValueError: an id outside [0, vocab_size).
    """
    ids = np.asarray(list(token_ids), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    words = np.zeros(bitmask_width(vocab_size), np.uint32)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def unpack_bitmask(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[V] of a bitmask row (i32[W]): True where a token may be sampled."""
    bits = np.unpackbits(np.asarray(row, np.int32).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


class TokenConstraint(Protocol):
    """What a constrained request carries (``Request.constraint``)."""

    def fill(self, row: np.ndarray) -> None:
        """AND this constraint's allowed tokens into ``row`` (i32[W], modified
        in place) for the request's next token."""

    def advance(self, token_id: int) -> bool:
        """Take a token the request keeps; False if the constraint did not
        allow it (the engine then ends the request)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` ``advance`` calls (rejected drafts)."""

    def forced_tokens(self) -> list[int]:
        """Tokens that are the only legal continuation from here, in order
        ([] when more than one token may come next)."""

    @property
    def is_done(self) -> bool:
        """The constraint is complete and allows nothing but EOS."""


__all__ = ["TokenConstraint", "bitmask_width", "pack_token_ids", "unpack_bitmask"]
