"""Sentencepiece GGUF tokenizers (``tokenizer.ggml.model == "llama"``) vs transformers.

1. Tiny sentencepiece GGUFs written here (pieces, scores, token types, the 256
   ``<0xNN>`` byte pieces; no tensors), one per pipeline of ``tokenizer_spm``
   (llama, mistral, phi3, gemma3; with and without merges in the file): the whole
   ``tokenizers`` pipeline, ids, decodes and streaming equal what
   ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds from the same file.
2. ``@pytest.mark.real_model``: the Gemma 3 270M GGUF (262,144 pieces, no merges):
   the same, over strings chosen to break a tokenizer (whitespace runs, byte
   fallback, emoji sequences, special tokens written in the text ...).
3. Bad metadata is a ValueError naming the field.

Known id sequences (``test_tiny_llama_known_pieces``, ``test_gemma3_known_pieces``)
pin the behaviour that a wrong pipeline would change: the "▁" dummy prefix,
merges by score vs by position, byte fallback.
"""

from __future__ import annotations

import json

import gguf
import pytest

from checkpoints.tokenizer import Tokenizer
from checkpoints.tokenizer_spm import derive_merges
from jaxserve.engine.detokenizer import IncrementalDetokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # transformers' tokenizers are the reference


# ------------------------------------------------------------------ helpers


def stream(tok, ids, skip_special_tokens):
    """Feed ``ids`` one at a time to an ``IncrementalDetokenizer``; return the deltas.

    Checks at every step that the text so far is a prefix of ``tok.decode(ids)``
    and carries no U+FFFD the final text has not (a split UTF-8 character)."""
    final = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens)
    deltas = []
    for n, i in enumerate(ids):
        deltas.append(d.add(i))
        text = "".join(deltas)
        assert final.startswith(text), (n, text, final)
        assert text.count("\ufffd") <= final.count("\ufffd"), (n, text)
    deltas.append(d.finish())
    assert "".join(deltas) == d.output_text == final
    return deltas


def check_like_hf(tok, hf, text):
    """ids (with and without special tokens), decodes (skipping specials or not)
    and the round trip of ``text`` equal transformers'."""
    for add in (True, False):
        ids = tok.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add), (text, add)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), (text, add, skip)
    ids = tok.encode(text, add_special_tokens=False)
    ours = tok.decode(ids, skip_special_tokens=False)
    assert ours == hf.decode(ids, skip_special_tokens=False)
    return ours == text


def backend_json(backend) -> dict:
    return json.loads(backend.to_str())


# ------------------------------------------------------ 1. tiny sentencepiece GGUFs

LLAMA_SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]  # (piece, llama.cpp token type)
GEMMA_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3)]
# (piece, score, type). Scores and file order disagree on "ab" vs "bc": by score
# (llama) "abc" is "ab" + "c", by position (gemma) "a" + "bc".
PIECES = ([(p, -float(i), 1) for i, p in enumerate(
    ["▁t", "he", "▁the", "▁", "e", "t", "h", "l", "o", "w", "r", "d", "a", "b", "c", "x",
     "ll", "llo", "▁he", "▁hello", "▁w", "or", "ld", "▁world", "bc"])]
    + [("ab", 10.0, 1)]
    + [(p, -30.0 - i, 1) for i, p in enumerate(["▁▁", "▁▁▁▁", "é", "世", "界", "世界", "\t"])]
    + [("<|im_start|>", 0.0, 3), ("<|im_end|>", 0.0, 3), ("<tool>", 0.0, 4),
       ("  ", 0.0, 4), ("\n\n", 0.0, 4)])
TINY_TEXTS = [
    "", "hello world", " hello", "  hi", "hello   world  ", "   ", "\n", "abc", "a\tb\n\nc",
    "the héllo 世界 ∑x\n", "世界世界 é\u0301", "😀 emoji 👩\u200d👩\u200d👧", "x<s>y</s>",
    "<|im_start|>hello<tool> the<|im_end|>\n", "<bos>hi<eos> <pad>", "\x00\x7f\ue000",
]


def write_spm_gguf(path, arch="llama", merges=None, scores=True, add_space_prefix=True):
    """A tokenizer-only sentencepiece GGUF: specials, ``<0x00>``..``<0xFF>``, ``PIECES``."""
    specials = GEMMA_SPECIALS if arch.startswith("gemma") else LLAMA_SPECIALS
    entries = ([(p, 0.0, t) for p, t in specials] + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
               + PIECES)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p for p, _, _ in entries])
    if scores:
        writer.add_token_scores([s for _, s, _ in entries])
    writer.add_token_types([t for _, _, t in entries])
    if merges is not None:
        writer.add_token_merges(merges)
    names = [p for p, _ in specials]
    if arch.startswith("gemma"):
        writer.add_bos_token_id(names.index("<bos>"))
        writer.add_eos_token_id(names.index("<eos>"))
        writer.add_pad_token_id(names.index("<pad>"))
    else:
        writer.add_bos_token_id(names.index("<s>"))
        writer.add_eos_token_id(names.index("</s>"))
    writer.add_unk_token_id(names.index("<unk>"))
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TINY_VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-merges": dict(arch="llama", merges=["h e", "l l", "▁ he", "ll o", "▁he llo", "b c",
                                                "a b", "▁ w", "o r"], scores=False),
    "mistral": dict(arch="mistral"),
    "phi3": dict(arch="phi3"),
    "gemma3": dict(arch="gemma3", add_space_prefix=False),
}


@pytest.fixture(scope="module", params=list(TINY_VARIANTS))
def tiny_pair(request, tmp_path_factory):
    """(ours, transformers') tokenizer of one tiny sentencepiece GGUF, and its variant name."""
    path = tmp_path_factory.mktemp("spm") / f"{request.param}.gguf"
    write_spm_gguf(path, **TINY_VARIANTS[request.param])
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(path), hf, request.param


def test_tiny_pipeline_equals_hf(tiny_pair):
    """Model (vocab, merges, byte fallback, unk), normalizer, pre-tokenizer, decoder,
    added tokens and post-processor: the serialized pipelines are equal."""
    tok, hf, _ = tiny_pair
    assert backend_json(tok.backend) == backend_json(hf.backend_tokenizer)


def test_tiny_ids_and_decode_equal_hf(tiny_pair):
    tok, hf, name = tiny_pair
    round_trips = [text for text in TINY_TEXTS if check_like_hf(tok, hf, text)]
    assert len(round_trips) >= 8, (name, round_trips)  # the check above is not vacuous
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id)
    assert tok.vocab_size == len(hf)
    for skip in (True, False):
        for text in TINY_TEXTS:
            stream(tok, tok.encode(text), skip)


def test_tiny_llama_known_pieces(tmp_path):
    """Pinned pieces: the "▁" dummy prefix before the text (not after a special
    token), merges by score ("ab"+"c"), byte fallback ("i", "∑"), the decoder
    stripping the dummy space; add_space_prefix=false is ignored, as HF does."""
    path = tmp_path / "tiny.gguf"
    write_spm_gguf(path, add_space_prefix=False)
    tok = Tokenizer.from_gguf(path)

    def pieces(text):
        return [tok.id_to_token(i) for i in tok.encode(text)]

    assert pieces("hello world") == ["<s>", "▁hello", "▁w", "or", "ld"]
    assert pieces("abc") == ["<s>", "▁", "ab", "c"]
    assert pieces("hi∑") == ["<s>", "▁", "h", "<0x69>", "<0xE2>", "<0x88>", "<0x91>"]
    assert pieces("<|im_start|>hello") == ["<s>", "<|im_start|>", "he", "llo"]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.decode(tok.encode(" hello")) == "hello"  # SentencePiece's (and HF's) own loss


def test_tiny_gemma_known_pieces(tmp_path):
    """Gemma style: no dummy prefix, merges by file position ("a"+"bc"), space
    pieces respelled "▁▁", the decoder keeps leading spaces."""
    path = tmp_path / "tiny.gguf"
    write_spm_gguf(path, arch="gemma3", add_space_prefix=False)
    tok = Tokenizer.from_gguf(path)
    assert [tok.id_to_token(i) for i in tok.encode("abc  hello")] == [
        "<bos>", "a", "bc", "▁", "▁hello"]
    # The user-defined piece "  " is respelled "▁▁" and, listed last, takes that id.
    assert tok.encode("a  b", add_special_tokens=False) == [
        tok.backend.token_to_id("a"), 5 + 256 + len(PIECES) - 2, tok.backend.token_to_id("b")]
    assert tok.decode(tok.encode(" hello")) == " hello"


def test_derive_merges_matches_transformers():
    """Ties in score, in left/right length and in ids all ordered as HF's generate_merges."""
    from transformers.tokenization_utils_base import generate_merges
    pieces = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca", "abca", "d", "dd", "ddd",
              "dddd", "▁", "▁a", "▁▁", "▁▁a"]
    vocab = {p: i for i, p in enumerate(pieces)}
    for scores in ({p: 0.0 for p in pieces}, {p: -float(i) for i, p in enumerate(pieces)},
                   {p: float(len(p) % 3) for p in pieces}):
        assert derive_merges(vocab, scores) == generate_merges(vocab, scores)


# ----------------------------------------------------------- 2. the real Gemma 3

GEMMA_TEXTS = [
    "",
    "Hello world",
    " leading space",
    "trailing space ",
    "  two leading, three   inside, two trailing  ",
    " ",
    "      ",
    "line one\nline two",
    "\n",
    "\n\n\n",
    "para one\n\n\npara two\n\n",
    "\ttab\tseparated\t\tcolumns\t",
    " \t \n mixed \r\n whitespace\u00a0nbsp\u3000ideographic\u2009thin ",
    "rare CJK 𠜎𠜱𠝹𡃁, private use \ue000\U000f0001, unassigned \u0378, ꙮ",
    "control chars \x00\x01\x1b[31m\x7f and \u200b zero width \ufeff BOM",
    "中文分词测试，日本語のテキスト、한국어 텍스트。",
    "emoji 😀👍🏽👩‍👩‍👧‍👦🏳️‍🌈❤️‍🔥 🇯🇵🇫🇷 🧑🏿‍💻",
    "accents café naïve Zoë Ångström; combining e\u0301 a\u0308 n\u0303 \u1e9b\u0323",
    "Ünïcödé ÀÉÎÕÜ straße ﬁ ligature ½ ℃ ²",
    "RTL مرحبا بالعالم and עברית",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    "if (a && b) { return c->d[0]; }  // C++\n\t}\n",
    "https://example.com/a/b?q=1&r=%20x#frag and mailto:user@example.org",
    "numbers 3.14159 1,000,000 2024-01-01 0x1F -1e-9 ٣٤٥ 12345678901234567890",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<bos>text after a written bos",
    "text <eos> middle <pad> and <unk> and <mask>",
    "<start_of_turn> spaces around <end_of_turn> ",
    "no space<start_of_turn>user",
    "[multimodal] is user-defined",
    "\r\nwindows\r\nline endings\r\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    ("The quick brown fox jumps over the lazy dog. " * 3 + "Pack my box with five dozen "
     "liquor jugs! Sphinx of black quartz, judge my vow.\n\nIn 1905, Einstein published "
     "four papers — on the photoelectric effect, Brownian motion, special relativity, "
     "and E=mc²; “quotes”, ‘single’, «guillemets» and … ellipses.") * 4,
]


@pytest.fixture(scope="module")
def gemma3_tok(gemma3_path):
    return Tokenizer.from_gguf(gemma3_path)


@pytest.mark.real_model
def test_gemma3_pipeline_equals_hf(gemma3_tok, gemma3_hf_tokenizer):
    """262,144 pieces, 514,906 derived merges, 6,384 added tokens: equal to HF's."""
    ours = backend_json(gemma3_tok.backend)
    theirs = backend_json(gemma3_hf_tokenizer.backend_tokenizer)
    assert len(ours["model"]["merges"]) == len(theirs["model"]["merges"]) > 500_000
    assert ours == theirs


@pytest.mark.real_model
def test_gemma3_ids_and_decode_equal_hf(gemma3_tok, gemma3_hf_tokenizer):
    """Every text, with and without BOS: HF's ids; decodes equal HF's; the round
    trip returns the text wherever HF's does (and HF's does for these all)."""
    failed = [text for text in GEMMA_TEXTS
              if not check_like_hf(gemma3_tok, gemma3_hf_tokenizer, text)]
    assert failed == []


@pytest.mark.real_model
def test_gemma3_specials(gemma3_tok, gemma3_hf_tokenizer):
    tok, hf = gemma3_tok, gemma3_hf_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (2, 1, 3, 0)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.pad_token_id)
    assert tok.vocab_size == len(hf) == 262_144
    added = hf.backend_tokenizer.get_added_tokens_decoder()
    assert tok.special_token_ids == {i for i, t in added.items() if t.special}
    assert {105, 106} <= tok.special_token_ids  # <start_of_turn>, <end_of_turn>
    assert 107 not in tok.special_token_ids  # "\n" is user-defined, not special
    for i in (0, 2, 105, 107, 138, 236743, 238, 493, 262_143):
        assert tok.id_to_token(i) == hf.convert_ids_to_tokens(i)
    # The file carries no chat template (HF's tokenizer has none either): chat
    # is a plain transcript, encoded like a completion prompt (BOS first).
    assert tok.chat_template is None and hf.chat_template is None
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = "Be brief.\n\nUser: hi\nAssistant:"
    assert tok.apply_chat_template(conv) == text
    assert tok.apply_chat_template(conv, tokenize=True) == hf(text).input_ids
    assert tok.apply_chat_template(conv, tokenize=True)[0] == 2
    assert tok.chat_stop == ("\nUser:",)


@pytest.mark.real_model
def test_gemma3_known_pieces(gemma3_tok):
    """Pinned: BOS first, no dummy prefix ("Hello" is not "▁Hello"),
    "\\n\\n\\n" one user-defined piece, a character missing from the vocabulary
    (U+A66E) as its three UTF-8 byte pieces, a written <start_of_turn> one id."""
    tok = gemma3_tok
    assert tok.encode("Hello") == [2, 9259]
    assert [tok.id_to_token(i) for i in tok.encode("Hello Hello", add_special_tokens=False)] == [
        "Hello", "▁Hello"]
    assert tok.encode("\n\n\n", add_special_tokens=False) == [109]
    assert tok.encode("\ua66e", add_special_tokens=False) == [238 + 0xEA, 238 + 0x99, 238 + 0xAE]
    assert tok.encode("<start_of_turn>user\n", add_special_tokens=False)[0] == 105


@pytest.mark.real_model
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_gemma3_streaming_equals_decode(gemma3_tok, skip):
    """One id at a time, the detokenizer's deltas concatenate to ``decode``; a
    byte-fallback run is held back until its character is whole."""
    held_back = 0
    for text in GEMMA_TEXTS:
        deltas = stream(gemma3_tok, gemma3_tok.encode(text), skip)
        held_back += sum(d == "" for d in deltas[1:-1])
    assert held_back > 0  # byte-fallback runs (rare CJK, private use) waited for their bytes
    ids = gemma3_tok.encode("\U000f0001 x", add_special_tokens=False)  # 4 byte pieces
    assert stream(gemma3_tok, ids, skip)[:4] == ["", "", "", "\U000f0001"]


# --------------------------------------------------------------- 3. bad metadata


def spm_fields(**overrides):
    tokens = ["<unk>", "<s>", "</s>", "▁", "a", "▁a"]
    fields = {"general.architecture": "llama", "tokenizer.ggml.model": "llama",
              "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0],
              "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1], "tokenizer.ggml.bos_token_id": 1,
              "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


def test_small_fields_build():
    tok = Tokenizer.from_gguf_fields(spm_fields())
    assert tok.encode("a a") == [1, 5, 5]
    assert tok.decode([1, 5, 5]) == "a a"


@pytest.mark.parametrize("overrides, message", [
    ({"tokenizer.ggml.scores": None}, r"needs tokenizer\.ggml\.scores"),
    ({"tokenizer.ggml.scores": [0.0] * 5}, r"tokenizer\.ggml\.scores has 5 entries, "
                                                   r"tokenizer\.ggml\.tokens 6"),
    ({"tokenizer.ggml.scores": ["x"] * 6}, r"tokenizer\.ggml\.scores must hold numbers"),
    ({"tokenizer.ggml.token_type": [1] * 7}, r"tokenizer\.ggml\.token_type has 7 entries"),
    ({"tokenizer.ggml.token_type": [1.5] * 6}, r"token_type must hold integers"),
    ({"tokenizer.ggml.tokens": ["a", 3]}, r"tokenizer\.ggml\.tokens must be a list of str"),
    ({"tokenizer.ggml.tokens": []}, r"needs tokenizer\.ggml\.tokens"),
    ({"tokenizer.ggml.merges": ["▁a"]}, r"tokenizer\.ggml\.merges\[0\] = '▁a' is not two"),
    ({"tokenizer.ggml.bos_token_id": 6}, r"tokenizer\.ggml\.bos_token_id = 6 is not a "
                                                 r"token id in \[0, 6\)"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, r"tokenizer\.ggml\.add_bos_token must be a bool"),
    ({"tokenizer.ggml.model": "t5"}, r"tokenizer\.ggml\.model='t5'.*'gpt2', 'llama'"),
])
def test_bad_metadata_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf_fields(spm_fields(**overrides))


def test_gemma_without_scores_builds():
    """Gemma derives its merges from token positions: scores are not needed."""
    fields = spm_fields(**{"general.architecture": "gemma3", "tokenizer.ggml.scores": None})
    assert Tokenizer.from_gguf_fields(fields).encode("a a", add_special_tokens=False) == [4, 5]
