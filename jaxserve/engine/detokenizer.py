"""Incremental detokenization with stop strings and UTF-8 hold-back.

Decoding each new token alone breaks multi-byte characters and BPE merges
across token boundaries, so (like vLLM's ``detokenize_incrementally``) we
decode a short window ``ids[prefix_offset:]`` and emit only what extends the
decode of ``ids[prefix_offset:read_offset]``. Text ending in U+FFFD (an
unfinished UTF-8 sequence) is held back until the next token completes it.
Stop strings are searched in the text; a match truncates the output before
the stop string, and text that could be the start of a stop string is held
back so that a streamed delta never has to be taken back.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
      tokenizer: object with ``decode(ids, skip_special_tokens=True) -> str``,
        or None (text stays empty; token ids still flow).
      stop: stop strings.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""      # all decoded text (may include held-back tail)
        self.emitted = 0    # chars of ``text`` already handed out
        self.stopped_on: str | None = None

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Append one token; return the newly final text (maybe "").

        ``check_stop=False`` (while ``min_tokens`` is not reached) skips the
        stop-string search for this token's text, as vLLM does."""
        self.ids.append(token_id)
        if self.tokenizer is None or self.stopped_on is not None:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return self._flush(final=False, check_stop=check_stop)
        self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self._flush(final=False, check_stop=check_stop)

    def _flush(self, final: bool, check_stop: bool = True) -> str:
        end = len(self.text)
        if not check_stop:
            delta = self.text[self.emitted:end]
            self.emitted = end
            return delta
        for s in self.stop:
            idx = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if idx != -1 and (self.stopped_on is None or idx < end):
                end, self.stopped_on = idx, s
        if self.stopped_on is not None:
            self.text = self.text[:end]
        elif not final:
            # Hold back a tail that might begin a stop string.
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def finish(self) -> str:
        """Release any held-back text at the end of the request."""
        if self.tokenizer is None:
            return ""
        if self.stopped_on is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
        return self._flush(final=True)

    @property
    def output_text(self) -> str:
        return self.text[:self.emitted]
