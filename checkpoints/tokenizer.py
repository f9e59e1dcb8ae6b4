"""A tokenizer rebuilt from GGUF metadata, id-for-id equal to transformers'.

GGUF files carry no ``tokenizer.json``: they hold the vocabulary, merges, scores,
token types and special ids under llama.cpp's ``tokenizer.ggml.*`` keys. We rebuild
the ``tokenizers`` pipeline that ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
builds (transformers v5, ``integrations/gguf/gguf_tokenizer_mapping.py`` +
``GPT2Tokenizer`` / ``LlamaTokenizer`` / ``GemmaTokenizer`` + ``TokenizersBackend``).
Two kinds of ``tokenizer.ggml.model``:

``"gpt2"``, byte-level BPE (SmolLM2, Llama 3, Qwen2), built here:

- model: byte-level BPE over the file's tokens and merges; a token spelled outside
  the GPT-2 byte alphabet is respelled byte by byte (``byte_level_tokenizer``).
- pre-tokenizer: ``ByteLevel(add_prefix_space=False)`` with GPT-2's own regex,
  unless ``tokenizer.ggml.pre`` names a split regex HF knows (llama-bpe, qwen2,
  tekken, gpt-4o ...), then ``Split(regex, isolated)`` + ``ByteLevel(use_regex=False)``.
- decoder: ``ByteLevel``; no clean-up of spaces (HF skips it for BPE).

``"llama"``, sentencepiece (Llama 2, Mistral v0.1, Gemma 1-3, Phi-3): BPE with byte
fallback over the pieces, merges from the file or derived from scores, "▁" for
spaces; model, normalizer, pre-tokenizer and decoder are built by
``checkpoints/tokenizer_spm.py``, which picks Llama's, Gemma's or Phi-3's pipeline by
``general.architecture`` as transformers does.

Both kinds then get:

- added tokens: control tokens (type 3) and the bos/eos/unk/pad tokens are special
  (for gpt2, only control tokens spelled in the byte alphabet); user-defined
  tokens (type 4) are added as plain tokens. All are matched whole in the input text.
- post-processor: prepend BOS only if ``tokenizer.ggml.add_bos_token`` (default
  False for gpt2, True for llama), append EOS only if ``tokenizer.ggml.add_eos_token``.

Other kinds (``"t5"``, ``"gemma4"``, ``"bert"``, ``"rwkv"`` ...) raise ``ValueError``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterable, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from checkpoints.chat_template import (TRANSCRIPT_STOP, render_chat_template, render_transcript,
                                       tool_messages)
from checkpoints.tokenizer_spm import spm_backend

SUPPORTED_KINDS = ("gpt2", "llama")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Split regexes per ``tokenizer.ggml.pre``, copied from transformers'
# GGUF_PRE_TOKENIZER_SPLITS; any other value keeps GPT-2's ByteLevel regex.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (256 entries)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _byte_level_spelling(token: str, alphabet: frozenset[str]) -> str:
    if set(token) <= alphabet:
        return token
    table = bytes_to_unicode()
    return "".join(table[b] for b in token.encode("utf-8"))


def check_tokenizer_fields(fields: Mapping[str, Any]) -> None:
    """Check the types and lengths of the ``tokenizer.*`` GGUF metadata this
    module reads: tokens a list of strings; merges a list of ``"a b"`` strings
    (two parts, one space); ``token_type`` and ``scores``, when present, one
    int / number per token; special token ids ints inside the vocabulary;
    ``add_bos_token`` / ``add_eos_token`` bools; ``pre`` and ``chat_template``
    strings. (Whether a kind needs merges or scores is its builder's check.)

    Raises:
      ValueError: the first field that is wrong, named with what is wrong.
    """
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("tokenizer.ggml.tokens must be a list of strings")
    merges = fields.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ValueError("tokenizer.ggml.merges must be a list of strings")
    bad = next((i for i, m in enumerate(merges) if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise ValueError(f"tokenizer.ggml.merges[{bad}] = {merges[bad]!r:.80} is not two "
                         "tokens separated by one space")
    for key, kind in (("token_type", int), ("scores", (int, float))):
        values = fields.get(f"tokenizer.ggml.{key}")
        if values is None:
            continue
        if not isinstance(values, list) or len(values) != len(tokens):
            length = len(values) if isinstance(values, list) else type(values).__name__
            raise ValueError(f"tokenizer.ggml.{key} has {length} entries, "
                             f"tokenizer.ggml.tokens {len(tokens)}")
        if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise ValueError(f"tokenizer.ggml.{key} must hold "
                             f"{'integers' if kind is int else 'numbers'}, one per token")
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
                "eot_token_id", "eom_token_id"):
        i = fields.get(f"tokenizer.ggml.{key}")
        if i is not None and (not isinstance(i, int) or isinstance(i, bool)
                              or not 0 <= i < len(tokens)):
            raise ValueError(f"tokenizer.ggml.{key} = {i!r:.80} is not a token id in "
                             f"[0, {len(tokens)})")
    for key in ("add_bos_token", "add_eos_token"):
        flag = fields.get(f"tokenizer.ggml.{key}")
        if flag is not None and not isinstance(flag, bool):
            raise ValueError(f"tokenizer.ggml.{key} must be a bool, got {flag!r:.80}")
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in fields and not isinstance(fields[key], str):
            raise ValueError(f"{key} must be a string, got {type(fields[key]).__name__}")


def _byte_level_backend(fields: Mapping[str, Any], alphabet: frozenset[str]
                        ) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """Model, pre-tokenizer and decoder of a ``gpt2`` GGUF, and its vocabulary
    (token -> id, in the byte alphabet)."""
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges: list[str] = fields.get("tokenizer.ggml.merges") or []
    if not merges:
        raise ValueError("GGUF byte-level BPE tokenizer needs tokenizer.ggml.tokens and "
                         "tokenizer.ggml.merges")
    vocab = {_byte_level_spelling(t, alphabet): i for i, t in enumerate(tokens)}
    try:
        backend = tokenizers.Tokenizer(models.BPE(
            vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"cannot build the BPE tokenizer from tokenizer.ggml.tokens / "
                         f"merges: {' '.join(str(e).split())}") from None
    split = PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


class Tokenizer:
    """Text <-> token ids for one GGUF model, plus its chat template.

    Build with ``Tokenizer.from_gguf(path)`` or ``Tokenizer.from_gguf_fields(fields)``.

    Attributes:
      backend: the ``tokenizers.Tokenizer`` doing the work.
      bos_token_id / eos_token_id / unk_token_id / pad_token_id: int or None.
      chat_template: Jinja source from ``tokenizer.chat_template``, or None.
      special_token_ids: ids of all special added tokens (skipped by
        ``decode(skip_special_tokens=True)``).
    """

    def __init__(self, backend: tokenizers.Tokenizer, special_ids: Mapping[str, int | None],
                 chat_template: str | None = None):
        self.backend = backend
        self.bos_token_id = special_ids.get("bos")
        self.eos_token_id = special_ids.get("eos")
        self.unk_token_id = special_ids.get("unk")
        self.pad_token_id = special_ids.get("pad")
        self.chat_template = chat_template
        self.special_token_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read only the metadata of a GGUF file and build its tokenizer.

        Raises:
          ValueError: as ``from_gguf_fields``, or a truncated or corrupt file
            (``checkpoints.gguf_check``); the message starts with the path.
        """
        from checkpoints.gguf_check import load_gguf_fields  # local: only GGUF needs gguf

        path = os.fspath(path)
        fields = load_gguf_fields(path)
        try:
            return cls.from_gguf_fields(fields)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> Python value): the ``tokenizer.*`` keys,
        and ``general.architecture`` for a sentencepiece vocabulary (``tokenizer_spm``).

        Raises:
          ValueError: no token list, a tokenizer kind not in ``SUPPORTED_KINDS``
            (names it), a gpt2 vocabulary without merges, a sentencepiece one without
            merges or scores, or metadata of the wrong type or length
            (``check_tokenizer_fields``).
        """
        kind = fields.get("tokenizer.ggml.model")
        if not isinstance(kind, str) or kind not in SUPPORTED_KINDS:
            raise ValueError(f"unsupported GGUF tokenizer kind tokenizer.ggml.model={kind!r:.80}; "
                             f"supported: {list(SUPPORTED_KINDS)}")
        tokens: list[str] = fields.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ValueError("GGUF tokenizer needs tokenizer.ggml.tokens")
        check_tokenizer_fields(fields)
        if kind == "gpt2":
            alphabet: frozenset[str] | None = frozenset(bytes_to_unicode().values())
            backend, vocab = _byte_level_backend(fields, alphabet)
            extra: list[str] = []
        else:
            alphabet = None
            backend, vocab, extra = spm_backend(fields)
        token_types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)

        ids = {name: fields.get(f"tokenizer.ggml.{key}") for name, key in (
            ("bos", "bos_token_id"), ("eos", "eos_token_id"),
            ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
        ids = {name: None if i is None else int(i) for name, i in ids.items()}
        # A byte-level vocabulary spells every real token in its alphabet; a control
        # token that is not is a llama.cpp mislabel (HF skips it too).
        backend.add_special_tokens([
            AddedToken(t, normalized=False, special=True)
            for t, ttype in zip(tokens, token_types)
            if ttype == _CONTROL and (alphabet is None or set(t) <= alphabet)])
        backend.add_tokens([
            AddedToken(t, normalized=False, special=False)
            for t, ttype in zip(tokens, token_types) if ttype == _USER_DEFINED and t in vocab])
        added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
        named = [tokens[i] for i in ids.values() if i is not None] + extra
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t in dict.fromkeys(named) if t not in added])

        # llama.cpp and HF add BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos = fields.get("tokenizer.ggml.add_bos_token", kind == "llama")
        add_bos = bool(add_bos) and ids["bos"] is not None
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None
        bos = tokens[ids["bos"]] if add_bos else None
        eos = tokens[ids["eos"]] if add_eos else None
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"]
                          + ([f"{eos}:0"] if add_eos else []))
        pair = " ".join([single] + ([f"{bos}:1"] if add_bos else []) + ["$B:1"]
                        + ([f"{eos}:1"] if add_eos else []))
        specials = ([(bos, ids["bos"])] if add_bos else []) + ([(eos, ids["eos"])] if add_eos else [])
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)
        return cls(backend, ids, fields.get("tokenizer.chat_template"))

    # -- ids ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry for id ``i`` as the model spells it (byte alphabet for
        gpt2, "▁" for spaces and ``<0xNN>`` bytes for sentencepiece), None if out of range."""
        return self.backend.id_to_token(int(i))

    # -- text -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched whole.

        ``add_special_tokens`` adds BOS/EOS only where the file asks for them.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte runs become U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------

    @property
    def chat_stop(self) -> tuple[str, ...]:
        """Stop strings every chat request adds: () with a chat template;
        ``TRANSCRIPT_STOP`` (the next ``User:`` line) for the transcript of a
        model without one."""
        return () if self.chat_template else TRANSCRIPT_STOP

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tokenize: bool = False,
                            tools: list[dict] | None = None) -> str | list[int]:
        """Render the model's chat template over ``messages`` as HF does; a
        model without one gets a plain transcript (``render_transcript``),
        whose assistant turn ends at ``chat_stop``.

        Args:
          messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
          add_generation_prompt: end with the opening of an assistant turn.
          tokenize: return ids (a template's text encoded with
            ``add_special_tokens=False``, HF semantics; a transcript with
            them, like any completion prompt) instead of text.
          tools: OpenAI function tools, the template's ``tools`` variable (a
            template or transcript without tools support gets them in the
            system prompt, ``chat_template.tool_messages``).

        Raises:
          ValueError: a transcript message with an unknown role.
          jinja2.TemplateError: the template rejected the conversation.
        """
        messages, tools = tool_messages(self.chat_template, messages, tools)
        if not self.chat_template:
            text = render_transcript(messages, add_generation_prompt)
            return self.encode(text) if tokenize else text
        names = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id,
                 "unk_token": self.unk_token_id, "pad_token": self.pad_token_id}
        variables = {k: self.id_to_token(i) for k, i in names.items() if i is not None}
        text = render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                    **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


__all__ = ["PRE_TOKENIZER_SPLITS", "SUPPORTED_KINDS", "Tokenizer", "bytes_to_unicode",
           "check_tokenizer_fields"]
