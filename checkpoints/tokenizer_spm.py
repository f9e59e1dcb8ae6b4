"""SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) rebuilt as transformers does.

A sentencepiece GGUF (Llama 2, Mistral v0.1, Gemma 1-3, Phi-3 ...) holds the pieces,
their scores and token types, often no merges. transformers v5
(``integrations/gguf/gguf_tokenizer_mapping.py``) hands them to ``LlamaTokenizer``
or, by ``general.architecture``, ``GemmaTokenizer``; we build the same
``tokenizers`` pipeline without importing transformers. Three styles:

================  =======================  ==========================  =====================
                  llama (any other arch)   gemma (gemma, 2, 3)         phi3
================  =======================  ==========================  =====================
vocab             pieces as spelled        pieces made of spaces       as llama
                                           respelled "▁" * len
merges            the file's, else derived the file's, else derived    as llama
                  best score first         first-listed token first
BPE unk_token     none                     ``<unk>``                   none
normalizer        none                     Replace(" ", "▁")           Prepend("▁") +
                                                                       Replace(" ", "▁")
pre-tokenizer     Metaspace("▁", first)    Split(" ") (a no-op: the    none
                                           normalizer left no spaces)
decoder           "▁"->" ", ByteFallback,  "▁"->" ", ByteFallback,     as llama
                  Fuse, Strip(1 left " ")  Fuse
================  =======================  ==========================  =====================

All three are BPE with ``byte_fallback`` (a character missing from the
vocabulary becomes its UTF-8 bytes ``<0xNN>``) and ``fuse_unk``. "Derived" merges
are transformers' ``generate_merges``: every split of a piece into two pieces of the
vocabulary, ordered by the piece's score (llama) or by minus its position (gemma:
its scores do not follow its merge order, its token order does), ties by the
lengths of the two halves, longest first.

transformers ignores ``tokenizer.ggml.add_space_prefix``, and so do we: the
llama style always writes the "▁" dummy prefix before the text (not after a
special token: ``prepend_scheme="first"``; not a second one before a leading
space) and its decoder strips one leading space, so " hello" comes back as
"hello", as in SentencePiece; the gemma style never does. llama.cpp does read the flag, so a
llama-architecture file with ``add_space_prefix = false`` tokenizes differently
there. For this kind ``tokenizer.ggml.add_bos_token`` defaults to True (as in
llama.cpp and transformers); ``tokenizer.py`` adds the special tokens and the
post-processor.
"""

from __future__ import annotations

from typing import Any, Mapping

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # transformers' GGUF_SENTENCEPIECE_BUILDERS
PHI3_ARCHITECTURES = ("phi3",)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # GemmaTokenizer's defaults


def spm_style(architecture: Any) -> str:
    """The pipeline ``general.architecture`` gets: "gemma", "phi3" or "llama"."""
    if architecture in GEMMA_ARCHITECTURES:
        return "gemma"
    return "phi3" if architecture in PHI3_ARCHITECTURES else "llama"


def derive_merges(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """transformers' ``generate_merges(vocab, vocab_scores=ranks)``, same order.

    Args:
      vocab: piece -> id.
      ranks: piece -> score, higher merges first; iterated in its own order.

    Returns:
      ``(left, right)`` for every split of a ranked piece into two pieces of
      ``vocab``: by rank, then longer left, then longer right, descending; a
      stable sort over the pieces in ``ranks`` order, each piece's splits by
      ``(id of left, id of right)``.
    """
    merges: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        local = [(piece[:i], piece[i:], rank) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        if len(local) > 1:
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def spm_backend(fields: Mapping[str, Any]
                ) -> tuple[tokenizers.Tokenizer, dict[str, int], list[str]]:
    """The ``tokenizers`` model, normalizer, pre-tokenizer and decoder of a
    sentencepiece GGUF (no added tokens, no post-processor yet).

    Args:
      fields: GGUF metadata, already passed through ``check_tokenizer_fields``;
        reads ``general.architecture`` and ``tokenizer.ggml.{tokens, scores, merges}``.

    Returns:
      ``(backend, vocab, extra_specials)``: vocab is piece -> id as the model
      spells it (gemma's space pieces respelled); extra_specials are named
      special tokens transformers' tokenizer class adds beyond bos/eos/unk/pad
      (``GemmaTokenizer``'s defaults ``<pad> <eos> <bos> <unk> <mask>`` for gemma,
      those in the vocabulary: transformers appends the others as new ids past
      the vocabulary, we leave them out).

    Raises:
      ValueError: no merges and no ``tokenizer.ggml.scores`` (llama and phi3
        styles need one of them), or ``tokenizers`` refuses the vocabulary.
    """
    style = spm_style(fields.get("general.architecture"))
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    if style == "gemma":
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated piece keeps its last id, as in HF
    if "tokenizer.ggml.merges" in fields:  # present, even empty: used as is (HF)
        pairs = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]
    elif style == "gemma":
        pairs = derive_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("a sentencepiece GGUF without tokenizer.ggml.merges needs "
                             "tokenizer.ggml.scores (one per token) to derive them")
        pairs = derive_merges(vocab, dict(zip(tokens, scores)))
    unk = "<unk>" if style == "gemma" and "<unk>" in vocab else None
    try:
        backend = tokenizers.Tokenizer(models.BPE(
            vocab=vocab, merges=pairs, dropout=None, unk_token=unk, fuse_unk=True,
            byte_fallback=True))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ValueError(f"cannot build the sentencepiece BPE from tokenizer.ggml.tokens / "
                         f"merges: {' '.join(str(e).split())}") from None
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if style == "gemma":
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(steps)
        return backend, vocab, [t for t in GEMMA_SPECIALS if t in vocab]
    if style == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)])
    return backend, vocab, []


__all__ = ["GEMMA_ARCHITECTURES", "PHI3_ARCHITECTURES", "derive_merges", "spm_backend",
           "spm_style"]
