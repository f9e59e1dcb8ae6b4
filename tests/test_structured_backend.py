"""The grammar backend and the per-request token constraint, on the host (no engine, no jax).

``jaxserve/engine/structured.py`` (llguidance) and ``request_constraint.py``, on the
tiny GGUF tokenizer (``tiny_gguf.tokenizer_fields``: 256 byte tokens, a few
merges, ChatML specials; model vocab 352 > the tokenizer's 320, so ids
320..351 exist only in the model) and, marked real_model, SmolLM2's.

Random walks pick uniformly among the tokens a filled row allows (EOS as
soon as it is allowed) and check what they decode to: JSON that validates
against the schema (``jsonschema``), regex full matches (Python ``re``),
one of the choices, no bad word, only allowed ids.
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

from checkpoints.tokenizer import Tokenizer
from jaxserve.engine.request_constraint import bad_words_token_ids
from jaxserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.engine.structured import GrammarBackend, RequestConstraint, build_constraint
from jaxserve.engine.token_mask import bitmask_width, unpack_bitmask

from tiny_gguf import tokenizer_fields

jsonschema = pytest.importorskip("jsonschema")

V = 352  # model vocab; the tokenizer has 320 ids
EOS = 2  # <|im_end|>
EOT = 0  # <|endoftext|>, a second EOS id

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "units": {"enum": ["metric", "imperial"]},
                "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                "note": {"type": ["string", "null"], "maxLength": 3},
            },
            "required": ["city", "days"],
        },
    },
    "required": ["name", "arguments"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ('yes', 'yes sir', 'say "hi"', 'back\\slash', 'é ü', 'a|b', 'new\nline')


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf_fields(tokenizer_fields(320))


@pytest.fixture(scope="module")
def backend(tok):
    return GrammarBackend(tok, V, [EOS, EOT])


def allowed_ids(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(unpack_bitmask(row, V)).tolist())


def walk(constraint, rng, max_steps=600, closers=()) -> list[int]:
    """Token ids of a random walk through ``constraint`` (EOS excluded),
    checking every row is non-empty and every token is taken; with
    ``closers`` (ids), one allowed closer is taken with probability 0.2,
    so unbounded strings and numbers end."""
    out: list[int] = []
    for _ in range(max_steps):
        row = np.full(bitmask_width(V), -1, np.int32)
        constraint.fill(row)
        ids = sorted(allowed_ids(row))
        assert ids, f"empty row after {out}"
        assert max(ids) < 320, f"ids past the tokenizer allowed: {ids[-3:]}"
        eos = [i for i in ids if i in (EOS, EOT)]
        close = [i for i in closers if i in ids]
        tok_id = (eos[0] if eos else int(rng.choice(close)) if close and rng.random() < 0.2
                  else int(rng.choice(ids)))
        assert constraint.advance(tok_id), tok_id
        if tok_id in (EOS, EOT):
            return out
        out.append(tok_id)
    raise AssertionError(f"no EOS after {max_steps} tokens")


def constrain(backend, **spec) -> object:
    return backend.matcher(backend.compile(StructuredOutputsParams(**spec)))


def test_json_schema_walks_validate(backend, tok):
    rng = np.random.default_rng(0)
    texts = set()
    for _ in range(25):
        text = tok.decode(walk(constrain(backend, json=SCHEMA), rng))
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        # rigid separators and closed objects
        assert text == json.dumps(value, ensure_ascii=False), text
        assert set(value["arguments"]) <= set(SCHEMA["properties"]["arguments"]["properties"])
        texts.add(text)
    assert len(texts) > 20  # the walks are random, not one path


def test_pydantic_schema_walks(backend, tok):
    """A pydantic model's schema ($defs, $ref, enum, Optional, Literal
    default, bounded list and ints), as ``chat.completions.parse`` sends it:
    every walk validates and parses back into the model."""
    import enum
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Item(BaseModel):
        name: str = Field(max_length=8)
        qty: int = Field(ge=1, le=9)

    class Order(BaseModel):
        id: int
        color: Color
        items: list[Item] = Field(min_length=1, max_length=3)
        note: Optional[str] = None
        kind: Literal["a", "b"] = "a"

    schema = Order.model_json_schema()
    closers = [tok.encode(c, add_special_tokens=False)[0] for c in '"},]']
    rng = np.random.default_rng(8)
    for _ in range(15):
        text = tok.decode(walk(constrain(backend, json=schema), rng, 2000, closers))
        jsonschema.validate(json.loads(text), schema)
        Order.model_validate_json(text)


def test_closed_objects_and_ascii_patterns(backend, tok):
    """allOf members stay open (their properties merge); other objects close;
    pattern's \\d is ASCII (a Unicode digit is refused)."""
    schema = {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string", "pattern": r"^\d{2}$"}},
         "required": ["b"]}]}
    rng = np.random.default_rng(9)
    closers = [tok.encode(c, add_special_tokens=False)[0] for c in '"},]']
    for _ in range(5):
        value = json.loads(tok.decode(walk(constrain(backend, json=schema), rng, 3000, closers)))
        jsonschema.validate(value, schema)
        assert {"a", "b"} <= set(value)  # the merged object stays open
    m = constrain(backend, json=schema)
    prefix = '{"a": 1, "b": "'
    assert all(m.advance(t) for t in tok.encode(prefix, add_special_tokens=False))
    arabic_three = tok.encode("\u0663", add_special_tokens=False)
    assert len(arabic_three) == 2 and not m.advance(arabic_three[0])
    assert m.advance(tok.encode("3", add_special_tokens=False)[0])


def test_json_text_and_dict_share_one_compile(backend):
    a = backend.compile(StructuredOutputsParams(json=SCHEMA))
    hits = backend.stats.cache_hits
    b = backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)))
    assert a is b and backend.stats.cache_hits == hits + 1


def test_json_object_walks_parse(backend, tok):
    rng = np.random.default_rng(1)
    for _ in range(10):
        m = constrain(backend, json_object=True)
        value = json.loads(tok.decode(walk(m, rng, max_steps=2000)))
        assert isinstance(value, dict)


def test_regex_walks_fullmatch(backend, tok):
    rng = np.random.default_rng(2)
    pattern = rf"Call {PHONE} on {DATE}\."
    for _ in range(20):
        text = tok.decode(walk(constrain(backend, regex=pattern), rng))
        assert re.fullmatch(pattern, text), text


def test_choice_walks_and_escaping(backend, tok):
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(60):
        text = tok.decode(walk(constrain(backend, choice=CHOICES), rng))
        assert text in CHOICES, text
        seen.add(text)
    assert len(seen) >= 5
    # every choice, tokenized as the tokenizer does, is accepted to the end
    for c in CHOICES:
        m = constrain(backend, choice=CHOICES)
        assert all(m.advance(t) for t in tok.encode(c, add_special_tokens=False)), c
        assert m.is_accepting


def test_bitmask_rows_exact(backend, tok):
    """Exact allowed sets: first bytes of the choices, then "yes" complete
    allows EOS and " " (for "yes sir"), then a finished choice only EOS."""
    m = constrain(backend, choice=("yes", "yes sir", "no"))
    row = np.full(bitmask_width(V), -1, np.int32)
    m.fill(row)
    byte_id = {chr(b): tok.encode(chr(b), add_special_tokens=False)[0] for b in b"yesno ir"}
    assert allowed_ids(row) == {byte_id["y"], byte_id["n"]}
    for t in tok.encode("yes", add_special_tokens=False):
        assert m.advance(t)
    row[:] = -1
    m.fill(row)
    assert allowed_ids(row) == {EOS, EOT, tok.encode(" ", add_special_tokens=False)[0]}
    assert not m.is_done and m.forced_tokens() == []
    for t in tok.encode(" sir", add_special_tokens=False):
        assert m.advance(t)
    assert m.is_done
    row[:] = -1
    m.fill(row)
    assert allowed_ids(row) == {EOS, EOT}
    assert not m.advance(byte_id["n"])  # refused, state kept
    assert m.advance(EOS)
    # fill ANDs: bits already clear stay clear
    m = constrain(backend, choice=("yes", "no"))
    row = np.full(bitmask_width(V), -1, np.int32)
    row[byte_id["y"] // 32] &= ~np.int32(1 << (byte_id["y"] % 32))
    m.fill(row)
    assert allowed_ids(row) == {byte_id["n"]}


def test_lark_and_gbnf_grammars(backend, tok):
    rng = np.random.default_rng(4)
    lark = ('start: pair ("," pair)*\n'
            'pair: KEY "=" VALUE\n'
            'KEY: /[a-z]{1,4}/\n'
            'VALUE: /[0-9]{1,3}/\n')
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for _ in range(10):
        text = tok.decode(walk(constrain(backend, grammar=lark), rng, max_steps=2000))
        assert re.fullmatch(r"[a-z]{1,4}=[0-9]{1,3}(,[a-z]{1,4}=[0-9]{1,3})*", text), text
        text = tok.decode(walk(constrain(backend, grammar=gbnf), rng))
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_forced_tokens_of_fixed_keys(backend, tok):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}
    served = backend.stats.forced_tokens
    c = build_constraint(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)),
                         backend, tok, V)
    forced = c.forced_tokens()
    text = tok.decode(forced)
    assert len(text) >= 6 and '{"answer": '.startswith(text), text
    assert backend.stats.forced_tokens == served + len(forced)
    for t in forced:
        assert c.advance(t)
    for t in tok.encode('{"answer": '[len(text):], add_special_tokens=False):
        assert c.advance(t)
    assert c.forced_tokens() == []  # digits now: more than one continuation
    # a bad word cuts the forced run where its token would come
    quote = tok.encode('"', add_special_tokens=False)
    c = build_constraint(SamplingParams(
        bad_words=['"'], structured_outputs=StructuredOutputsParams(json=schema)), backend, tok, V)
    assert forced[:1] != quote and quote[0] in forced
    assert c.forced_tokens() == forced[:forced.index(quote[0])]


def test_rollback_restores_rows(backend, tok):
    m = constrain(backend, json=SCHEMA)
    text = '{"name": "search", "arguments": {"city": "Oslo", "days": 3}}'
    ids = tok.encode(text, add_special_tokens=False)
    rows = []
    for t in ids:
        row = np.full(bitmask_width(V), -1, np.int32)
        m.fill(row)
        rows.append(row)
        assert m.advance(t)
    for k in (1, 5, len(ids)):
        m.rollback(k)
        row = np.full(bitmask_width(V), -1, np.int32)
        m.fill(row)
        np.testing.assert_array_equal(row, rows[len(ids) - k])
        assert all(m.advance(t) for t in ids[len(ids) - k:])
    assert m.is_accepting
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(len(ids) + 1)


@pytest.mark.parametrize("spec, field, reason", [
    ({"json": {"type": "foo"}}, "structured_outputs.json", "foo"),
    ({"json": '{"type": "object",'}, "structured_outputs.json", "not valid JSON"),
    ({"json": False}, "structured_outputs.json", "no output satisfies it"),
    ({"json": {"type": "object", "not": {"type": "string"}}}, "structured_outputs.json", "not"),
    ({"json": {"$ref": "#/defs/x"}}, "structured_outputs.json", "defs"),
    ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "structured_outputs.json",
     "minLength"),
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"regex": r"\bfoo"}, "structured_outputs.regex", "lookaround"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar", "foo"),
    ({"grammar": 'root ::= "a" | b'}, "structured_outputs.grammar", "b"),
])
def test_invalid_specs_name_the_field(backend, spec, field, reason):
    errors = backend.stats.compile_errors
    with pytest.raises(ValueError, match=re.escape(field)) as e:
        backend.compile(StructuredOutputsParams(**spec))
    assert reason in str(e.value)
    assert backend.stats.compile_errors == errors + 1


def test_no_tokenizer_refused(tok):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    for b in (None, GrammarBackend(None, V, [EOS]), GrammarBackend(tok, V, [])):
        with pytest.raises(ValueError, match="structured_outputs needs"):
            build_constraint(params, b, None, V)
    with pytest.raises(ValueError, match="bad_words"):
        build_constraint(SamplingParams(bad_words=["x"]), None, None, V)
    assert build_constraint(SamplingParams(), None, None, V) is None
    # token ids alone need no tokenizer
    c = build_constraint(SamplingParams(allowed_token_ids=[3, 40]),
                         GrammarBackend(None, V, [EOS]), None, V)
    assert isinstance(c, RequestConstraint) and c.grammar is None
    row = np.full(bitmask_width(V), -1, np.int32)
    c.fill(row)
    assert allowed_ids(row) == {3, 40}
    with pytest.raises(ValueError, match="EOS"):
        GrammarBackend(tok, V, [V])


def test_allowed_token_ids(backend, tok):
    ids = [5, 9, 100, 300, EOS]
    c = build_constraint(SamplingParams(allowed_token_ids=ids), backend, tok, V)
    row = np.full(bitmask_width(V), -1, np.int32)
    c.fill(row)
    assert allowed_ids(row) == set(ids)
    assert not c.advance(6) and c.output == []
    assert c.advance(100) and c.output == [100]
    with pytest.raises(ValueError, match="allowed_token_ids.*352"):
        build_constraint(SamplingParams(allowed_token_ids=[1, V]), backend, tok, V)
    # with a grammar: the intersection; nothing left -> EOS only
    c = build_constraint(SamplingParams(
        allowed_token_ids=[tok.encode("n", add_special_tokens=False)[0], 7],
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), backend, tok, V)
    row = np.full(bitmask_width(V), -1, np.int32)
    c.fill(row)
    assert allowed_ids(row) == set(tok.encode("n", add_special_tokens=False))
    c = build_constraint(SamplingParams(
        allowed_token_ids=[7], structured_outputs=StructuredOutputsParams(choice=["yes"])),
        backend, tok, V)
    row = np.full(bitmask_width(V), -1, np.int32)
    c.fill(row)
    assert allowed_ids(row) == {EOS, EOT}


def test_bad_words_tokenization_follows_vllm(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # "the": t,h,e -> ["t", "he"]; " the" -> ["Ġthe"]: one token vs two, not added
    assert bad_words_token_ids(["the"], tok, V) == [enc("the")]
    assert len(enc("the")) == 2 and len(enc(" the")) == 1
    # "x": "x" vs "Ġ", "x": lengths differ, only the plain form
    assert bad_words_token_ids([" x"], tok, V) == [enc("x")]
    assert len(enc(" x")) == 2
    # "t" vs "Ġt" (a merge): one token each, first tokens differ -> both banned
    assert bad_words_token_ids([" t"], tok, V) == [enc("t"), enc(" t")]
    assert len(enc(" t")) == 1 and enc(" t") != enc("t")
    with pytest.raises(ValueError, match=r"bad_words\[0\].*outside"):
        bad_words_token_ids(["x"], tok, 50)


def test_bad_words_never_appear(backend, tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    params = SamplingParams(bad_words=["hello", "q"],
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{0,30}\."))
    banned = bad_words_token_ids(params.bad_words, tok, V)
    assert enc("hello") in banned and enc("q") in banned
    rng = np.random.default_rng(5)
    c0 = build_constraint(params, backend, tok, V)
    # the last token of "hello" is banned exactly after its prefix
    he, llo = enc("hello")
    assert c0.advance(he)
    row = np.full(bitmask_width(V), -1, np.int32)
    c0.fill(row)
    assert llo not in allowed_ids(row) and not c0.advance(llo)
    c0.rollback(1)
    assert c0.advance(llo)  # allowed when not after "he"
    for _ in range(20):
        c = build_constraint(params, backend, tok, V)
        out = walk(c, rng)
        for w in banned:
            n = len(w)
            assert all(out[i:i + n] != w for i in range(len(out) - n + 1)), (w, out)
        assert re.fullmatch(r"[a-z ]{0,30}\.", tok.decode(out))


def test_request_constraint_rollback(backend, tok):
    params = SamplingParams(bad_words=["hello"],
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{0,9}"))
    c = build_constraint(params, backend, tok, V)
    he, llo = tok.encode("hello", add_special_tokens=False)
    ids = tok.encode("abhe", add_special_tokens=False)
    assert all(c.advance(t) for t in ids)
    row_after = np.full(bitmask_width(V), -1, np.int32)
    c.fill(row_after)
    assert llo not in allowed_ids(row_after)
    c.rollback(2)
    row = np.full(bitmask_width(V), -1, np.int32)
    c.fill(row)
    assert llo in allowed_ids(row)
    assert all(c.advance(t) for t in ids[-2:])
    row[:] = -1
    c.fill(row)
    np.testing.assert_array_equal(row, row_after)
    assert c.forced_tokens() == [] and not c.is_done


def test_fill_rows_for_drafts(backend, tok):
    """Row k equals the row after advancing k drafts; a refused draft stops it."""
    params = SamplingParams(bad_words=["hello"],
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{0,9}"))
    c = build_constraint(params, backend, tok, V)
    assert c.advance(tok.encode("a", add_special_tokens=False)[0])
    drafts = tok.encode("bhe", add_special_tokens=False) + tok.encode("llo", add_special_tokens=False)
    rows = np.full((len(drafts) + 1, bitmask_width(V)), -1, np.int32)
    n = c.fill_rows(rows, drafts)
    assert n == len(drafts) - 1  # "llo" after "he" is the bad word
    assert c.output == tok.encode("a", add_special_tokens=False)  # state kept
    for k in range(n + 1):
        row = np.full(bitmask_width(V), -1, np.int32)
        c.fill(row)
        np.testing.assert_array_equal(rows[k], row)
        if k < n:
            assert c.advance(drafts[k])
    assert (rows[n + 1:] == -1).all()


def test_nothing_left_allows_eos_only():
    """Bad words banning the grammar's only token leave EOS; bits past V
    (the last word's padding) do not count as allowed tokens."""
    class OneToken:  # a grammar allowing token 5, plus padding bits past V
        def fill(self, row):
            row[:] = 0
            row[0] = 1 << 5
            row[-1] = np.uint32((0xFFFFFFFF << (330 % 32)) & 0xFFFFFFFF).view(np.int32)

    c = RequestConstraint(330, [2], OneToken(), bad_words=[[5]])
    row = np.full(bitmask_width(330), -1, np.int32)
    c.fill(row)
    assert set(np.flatnonzero(unpack_bitmask(row, 330)).tolist()) == {2}


def test_cache_lru_and_threads(tok):
    b = GrammarBackend(tok, V, [EOS], cache_size=2)
    specs = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, 4)]
    first = b.compile(specs[0])
    b.compile(specs[1])
    b.compile(specs[2])  # evicts specs[0]
    assert b.cache_info() == {"entries": 2, "capacity": 2}
    assert b.compile(specs[0]) is not first and b.stats.compiled == 4
    errors: list[BaseException] = []

    def work(i):
        try:
            for j in range(20):
                spec = StructuredOutputsParams(choice=[f"c{(i + j) % 5}", "z"])
                m = b.matcher(b.compile(spec))
                assert all(m.advance(t) for t in tok.encode(f"c{(i + j) % 5}",
                                                            add_special_tokens=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert b.stats.fills == 0 and b.stats.compile_seconds > 0


def test_fill_counters(tok):
    b = GrammarBackend(tok, V, [EOS])
    m = b.matcher(b.compile(StructuredOutputsParams(regex="ab")))
    row = np.full(bitmask_width(V), -1, np.int32)
    m.fill(row)
    m.fill(row)
    assert b.stats.fills == 2 and b.stats.fill_seconds > 0


def real_walks(path, eos_ids, seed):
    """Random walks under SCHEMA and a phone regex with a real tokenizer."""
    tok = Tokenizer.from_gguf(path)
    vocab = tok.vocab_size
    b = GrammarBackend(tok, vocab, eos_ids)
    rng = np.random.default_rng(seed)
    for spec, check in ((StructuredOutputsParams(json=SCHEMA),
                         lambda s: jsonschema.validate(json.loads(s), SCHEMA)),
                        (StructuredOutputsParams(regex=PHONE),
                         lambda s: re.fullmatch(PHONE, s) or pytest.fail(s))):
        compiled = b.compile(spec)
        for _ in range(4):
            m = b.matcher(compiled)
            out = []
            for _ in range(300):
                row = np.full(bitmask_width(vocab), -1, np.int32)
                m.fill(row)
                ids = np.flatnonzero(unpack_bitmask(row, vocab))
                eos = [i for i in ids if i in eos_ids]
                t = eos[0] if eos else int(rng.choice(ids))
                assert m.advance(t)
                if eos:
                    break
                out.append(t)
            check(tok.decode(out))
    assert b.stats.compiled == 2 and b.stats.fills > 40


@pytest.mark.real_model
def test_smollm2_walks(smollm2_path):
    real_walks(smollm2_path, [2], seed=6)  # <|im_end|>


@pytest.mark.real_model
def test_gemma3_sentencepiece_walks(gemma3_path):
    real_walks(gemma3_path, [1, 106], seed=7)  # <eos>, <end_of_turn>
