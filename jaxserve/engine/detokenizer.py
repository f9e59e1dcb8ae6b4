"""Incremental detokenization with stop strings and UTF-8 hold-back.

Decoding each new token alone breaks multi-byte characters and BPE merges
across token boundaries, so (like vLLM's ``detokenize_incrementally``) we
decode a short window ``ids[prefix_offset:]`` and keep only what extends the
decode of ``ids[prefix_offset:read_offset]``. A window whose decode ends in
U+FFFD ends in an unfinished UTF-8 sequence: the text before that trailing
U+FFFD run is taken now, the run itself waits for the token that completes it
(or for ``finish()``, which releases it as the honest U+FFFD of orphan bytes).

The detokenizer sees output ids only, never the prompt: if the prompt ends
inside a multi-byte character, the output's leading continuation bytes decode
to U+FFFD, exactly as ``tokenizer.decode(output_ids)`` does.

Stop strings (vLLM semantics; with ``include_stop_str=True``, vLLM's
``include_stop_str_in_output``, the cut falls after the matched stop string
instead of before it):

- a stop string matches anywhere in the text, as a raw substring: across token
  boundaries, inside one token, inside a word ("the" stops "there");
- the text is cut before the earliest match (ties: the first in ``stop``);
  the stop string and everything after it never reach a delta;
- a text tail that is a proper prefix of some stop string is held back until
  it is decided, so a delta never has to be taken back;
- ``add(..., check_stop=False)`` (``min_tokens`` not reached) searches nothing,
  but the hold-back still applies. Like vLLM, each search looks only at matches
  that end in the text new since the previous ``add``, so a stop string
  completed while ``check_stop`` was False never stops the request, while one
  that starts then and completes later does. Each search scans only the last
  ``len(new) + len(stop) - 1`` characters, so long outputs cost O(new text).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    The deltas returned by ``add`` and ``finish`` concatenate to
    ``output_text``; after ``finish`` that equals ``tokenizer.decode(ids)``
    cut before the first stop string matched.

    Args:
      tokenizer: object with ``decode(ids, skip_special_tokens: bool) -> str``,
        or None (text stays empty; token ids still flow).
      stop: stop strings (non-empty; empty ones are ignored).
      skip_special_tokens: leave special tokens (EOS, chat markers) out of
        the text (vLLM's default True).
      include_stop_str: keep the matched stop string at the end of the text.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str = include_stop_str
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context window
        self.read_offset = 0    # ids before this are in ``text`` for good
        self.read_chars = 0     # len(text) when read_offset was last moved
        self.text = ""          # decoded text, incl. the held-back tail
        self.emitted = 0        # chars of ``text`` already handed out
        self.stopped_on: str | None = None
        self.finished = False

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _read(self, final: bool) -> int:
        """Extend ``text`` with the decode of the unread ids; return its old length."""
        n_before = len(self.text)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        new = full[len(prefix):]  # "" while the window decodes no longer
        complete = final or not new.endswith("\ufffd")
        if not complete:
            new = new.rstrip("\ufffd")  # an unfinished character: wait for its bytes
        self.text = self.text[:self.read_chars] + new
        if complete and new:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.read_chars = len(self.text)
        return n_before

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Append one output token; return the newly final text (maybe "").

        ``check_stop=False`` (while ``min_tokens`` is not reached) skips the
        stop-string search for this token's text, as vLLM does."""
        self.ids.append(token_id)
        if self.tokenizer is None or self.stopped_on is not None or self.finished:
            return ""
        n_before = self._read(final=False)
        if check_stop:
            self._match(n_before)
        return self._flush(final=False)

    def _match(self, n_before: int):
        """Cut ``text`` before the earliest stop string ending past ``n_before``."""
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, n_before - len(s) + 1))
            if i != -1 and (best is None or i < best):
                best, self.stopped_on = i, s
        if best is not None:
            # The hold-back kept text[best:n_before] (a proper prefix of the
            # stop string) unemitted, so nothing streamed is cut.
            assert best >= self.emitted, (best, self.emitted)
            self.text = self.text[:best + (len(self.stopped_on) if self.include_stop_str else 0)]

    def _flush(self, final: bool) -> str:
        end = len(self.text)
        if self.stopped_on is None and not final:
            # Hold back the longest tail that is a proper prefix of a stop string.
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), hold, -1):
                    if self.text.endswith(s[:k]):
                        hold = k
                        break
            end -= hold
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def finish(self) -> str:
        """Release all held-back text at the end of the request.

        Searches no stop strings: the request has already ended for another
        reason, and the only new text here is U+FFFD for unfinished bytes."""
        if self.tokenizer is None or self.finished:
            return ""
        self.finished = True
        if self.stopped_on is None:
            self._read(final=True)
        return self._flush(final=True)

    @property
    def output_text(self) -> str:
        """All text handed out so far (the final text after ``finish``)."""
        return self.text[:self.emitted]
