"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE; no model).

The tests that take ``tok`` read the SmolLM2 GGUF (fetched once): ``real_model``.

Every stream is checked step by step: after each ``add`` the deltas so far
concatenate to ``output_text`` and are a prefix of the independently computed
final text, so a delta that is later cut (an unheld stop-string prefix) or a
broken character fails.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.engine.detokenizer import IncrementalDetokenizer

ATOMS = (list("abcdefghijklmnopqrstuvwxyzTHE0123456789 .,!?'\n") + [" the", "there", "  "]
         + list("日本語中文한국어") + ["👍🏽", "🇯🇵", "👨\u200d👩\u200d👧", "😀"]
         + list("éàüñçøß") + ["e\u0301", "n\u0303"])
texts = st.lists(st.sampled_from(ATOMS), max_size=30).map("".join)


@pytest.fixture(scope="module")
def tok(smollm2_ckpt):
    return smollm2_ckpt.tokenizer


def encode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE round-trips
    return ids


def stream(tok, ids, stop, expected, min_tokens=0, valid_utf8=True):
    """Feed ``ids`` one by one (stopping like the engine); check every step.

    Returns the detokenizer after ``finish`` and the index of the token after
    which it stopped (None if it never did)."""
    d = IncrementalDetokenizer(tok, list(stop))
    acc, stopped_at = "", None
    for n, i in enumerate(ids, 1):
        delta = d.add(i, check_stop=n >= min_tokens)
        assert not (valid_utf8 and "\ufffd" in delta), (delta, n)
        acc += delta
        assert acc == d.output_text and expected.startswith(acc), (acc, expected, n)
        if d.stopped_on is not None:
            stopped_at = n - 1
            break
    acc += d.finish()
    assert acc == d.output_text == expected
    return d, stopped_at


def char_offsets(tok, ids):
    """offsets[k] = len(decode(ids[:k])) (ASCII texts only: every cut is clean)."""
    return [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]


@pytest.mark.parametrize("text,stop,tokens,expected", [
    # "uic" lies strictly inside the token " quick".
    (" the quick brown fox jumps", "uic", (1, 1), " the q"),
    # "e qu" starts at the end of " the" and ends inside " quick".
    (" the quick brown fox jumps", "e qu", (0, 1), " th"),
    # "world, t" spans " world", "," and " this".
    ("Hello world, this is a test", "world, t", (1, 3), "Hello "),
    # Raw substring match, as vLLM: "the" inside the word "there" stops.
    ("Look over there now", "the", (2, 2), "Look over "),
])
@pytest.mark.real_model
def test_stop_string_positions(tok, text, stop, tokens, expected):
    ids = encode(tok, text)
    off = char_offsets(tok, ids)
    start, end = text.index(stop), text.index(stop) + len(stop)
    first = max(k for k in range(len(ids)) if off[k] <= start)
    last = min(k for k in range(len(ids)) if off[k + 1] >= end)
    assert (first, last) == tokens  # the case is what its comment says
    d, stopped_at = stream(tok, ids, [stop], expected)
    assert d.stopped_on == stop and stopped_at == last


@pytest.mark.real_model
def test_earliest_of_several_stop_strings_wins(tok):
    # Both complete with " world"; "lo w" starts first though listed second.
    d, stopped_at = stream(tok, encode(tok, "Hello world"), ["world", "lo w"], "Hel")
    assert d.stopped_on == "lo w" and stopped_at == 1


@pytest.mark.real_model
def test_stop_string_far_into_a_long_output(tok):
    text = "a b c. " * 400 + "the end"
    d, _ = stream(tok, encode(tok, text), ["c. the"], "a b c. " * 399 + "a b ")
    assert d.stopped_on == "c. the"


def test_no_tokenizer():
    d = IncrementalDetokenizer(None, ["x"])
    assert d.add(5) == "" and d.finish() == "" and d.output_text == ""


@pytest.mark.real_model
def test_prompt_ending_inside_a_character_does_not_leak(tok):
    ids = encode(tok, "The answer is 日本語")
    # The first token boundary inside "日" (its UTF-8 bytes span several tokens).
    k = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert tok.decode(ids[:k]) == "The answer is \ufffd"
    out = ids[k:]  # the output starts with 日's orphan continuation bytes
    # The honest decode of orphan continuation bytes is U+FFFD; the
    # detokenizer sees no prompt, so it neither completes nor drops them.
    expected = tok.decode(out)
    assert expected.startswith("\ufffd") and expected.endswith("本語")
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.add(i) for i in out] + [d.finish()]
    first = next(x for x in deltas if x)
    assert "日" not in first and "answer" not in first
    assert "".join(deltas) == d.output_text == expected


@pytest.mark.real_model
def test_output_ending_inside_a_character(tok):
    # Cut by max_tokens inside "語": finish() releases the orphan bytes as the
    # U+FFFD that decode gives them; until then they are held back.
    ids = encode(tok, "日本語")[:-1]
    expected = tok.decode(ids)
    assert expected.startswith("日本") and expected.endswith("\ufffd")
    d = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.add(i) for i in ids)
    assert streamed == "日本"
    assert streamed + d.finish() == d.output_text == expected


@pytest.mark.real_model
def test_min_tokens_ignores_a_held_back_stop_string(tok):
    # " quick" (check_stop False) completes "quick", also a prefix of
    # "quick brown fox", so it is held back; it must still be ignored later.
    stop = ["quick", "quick brown fox"]
    d, stopped_at = stream(tok, encode(tok, " the quick brown fox jumps"), stop, " the ",
                           min_tokens=3)
    assert d.stopped_on == "quick brown fox" and stopped_at == 3


@pytest.mark.parametrize("text,stop,min_tokens,expected,stopped", [
    # "quick brown" begins in " quick" (check_stop False: held back, not
    # emitted) and completes in " brown" (check_stop True): it stops.
    (" the quick brown fox jumps", "quick brown", 3, " the ", "quick brown"),
    # A stop string completed while check_stop is False is ignored for good...
    (" the quick brown fox jumps", "quick", 3, " the quick brown fox jumps", None),
    # ...but a later occurrence stops.
    (" quick brown quick fox", "quick", 2, " quick brown ", "quick"),
    # min_tokens == number of tokens to the stop: the stop token is checked.
    (" the quick brown fox jumps", "quick", 2, " the ", "quick"),
])
@pytest.mark.real_model
def test_min_tokens(tok, text, stop, min_tokens, expected, stopped):
    d, _ = stream(tok, encode(tok, text), [stop], expected, min_tokens=min_tokens)
    assert d.stopped_on == stopped


@pytest.mark.real_model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_stream_equals_decode(tok, text):
    ids = encode(tok, text)
    stream(tok, ids, [], tok.decode(ids))


def reference(tok, ids, stop, min_tokens):
    """Final text and stop string from whole-prefix decodes: after token k, the
    decodable text ``decode(ids[:k])`` (less an unfinished character) is
    searched, if ``k >= min_tokens``, for matches ending in its new part; the
    earliest match (then the first listed) cuts it."""
    prev = ""
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k]).rstrip("\ufffd")
        if k >= min_tokens:
            hits = [(i, j) for j, s in enumerate(stop)
                    if (i := cur.find(s, max(0, len(prev) - len(s) + 1))) != -1]
            if hits:
                i, j = min(hits)
                return cur[:i], stop[j]
        prev = cur
    return tok.decode(ids), None


@pytest.mark.real_model
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=texts.filter(bool))
def test_stream_with_stop_strings(tok, data, text):
    ids = encode(tok, text)
    substring = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 8)).map(
        lambda t: text[t[0]:t[0] + t[1]])
    other = st.lists(st.sampled_from(ATOMS), min_size=1, max_size=3).map("".join)
    stop = data.draw(st.lists(st.one_of(substring, other), min_size=1, max_size=3))
    min_tokens = data.draw(st.integers(0, len(ids) + 1))
    expected, expected_stop = reference(tok, ids, stop, min_tokens)
    d, _ = stream(tok, ids, stop, expected, min_tokens=min_tokens)
    assert d.stopped_on == expected_stop
    if expected_stop is not None:
        assert text.startswith(expected + expected_stop)
    if min_tokens <= 1:  # every token checked: stop at the first stop string
        assert (expected_stop is None) == (not any(s in text for s in stop))
        assert not any(s in expected for s in stop)


@pytest.mark.parametrize("text,stop,expected", [
    # the stop string stays at the end of the text; nothing after it
    (" the quick brown fox jumps", ["brown"], " the quick brown"),
    # it lies inside one token (" quick"): the cut is mid-token, after it
    (" the quick brown fox jumps", ["uic"], " the quic"),
    # the earliest match wins, as without include_stop_str
    (" the quick brown fox jumps", ["fox", "quick"], " the quick"),
])
@pytest.mark.real_model
def test_include_stop_str_keeps_the_stop_string(tok, text, stop, expected):
    d = IncrementalDetokenizer(tok, stop, include_stop_str=True)
    acc = ""
    for i in encode(tok, text):
        acc += d.add(i)
        assert expected.startswith(acc), (acc, expected)
        if d.stopped_on is not None:
            break
    acc += d.finish()
    assert acc == d.output_text == expected


@pytest.mark.real_model
def test_skip_special_tokens_false_keeps_them(tok):
    eos = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(eos) == 1  # SmolLM2's chat end marker is one special token
    ids = encode(tok, "Hi there") + eos + encode(tok, " again")
    kept, dropped = (IncrementalDetokenizer(tok, [], skip_special_tokens=s) for s in (False, True))
    texts = ["".join(d.add(i) for i in ids) + d.finish() for d in (kept, dropped)]
    assert texts == ["Hi there<|im_end|> again", "Hi there again"]
