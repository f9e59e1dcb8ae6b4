"""The admission rules both APIs share, without a server (issue 33; the
real-server cases are in ``test_hostile_inputs.py``): JSON nesting measured
without recursion, the one bearer-token rule, escaping of what UTF-8 cannot
encode, and sampling floats checked as float32."""

from __future__ import annotations

import json

import pytest

from jaxserve.engine.sampling_params import MAX_TEMPERATURE, SamplingParams, escape_text, float32_of
from jaxserve.server.auth import bearer_refusal
from jaxserve.server.json_body import MAX_JSON_DEPTH, json_depth, loads
from jaxserve.server.openai_protocol import APIError


@pytest.mark.parametrize("text, depth", [
    ("[" * 70 + "]" * 70, 70),
    ('{"a": ' * 65 + "1" + "}" * 65, 65),
    ('{"s": "' + "[" * 100 + '"}', 1),                   # brackets in a string
    ('{"s": "\\"' + "[" * 100 + '", "t": [[1]]}', 3),   # after an escaped quote
    ('["\\\\", ' + "[" * 66 + "]" * 66 + "]", 67),       # an escaped backslash ends the string
    ("[" + "[1]," * 200 + "[1]]", 2),                    # many brackets, shallow
])
def test_json_depth_counts_nesting_outside_strings(text, depth):
    raw = text.encode()
    assert json_depth(raw) == depth
    if depth <= MAX_JSON_DEPTH:
        assert loads(raw) == json.loads(raw)
    else:
        with pytest.raises(APIError, match=f"{depth} deep; at most {MAX_JSON_DEPTH} is allowed"):
            loads(raw)


@pytest.mark.parametrize("values, why", [
    (["Bearer t0k"], None), (["bearer t0k"], None), (["BEARER  t0k "], None),
    ([b"Bearer t0k"], None),
    ([], "missing bearer token"), (["Bearer t0kx"], "wrong bearer token"),
    (["t0k"], "the authorization scheme is not Bearer"),
    (["Basic t0k"], "the authorization scheme is not Bearer"),
    (["Bearer t0k", "Bearer t0k"], "2 authorization values; exactly one is allowed"),
    (["Bearer \udcff"], "wrong bearer token"),
])
def test_one_bearer_rule(values, why):
    got = bearer_refusal(values, "t0k")
    assert (got if got is None else got.split(" (")[0]) == why
    assert bearer_refusal(values, None) is None and bearer_refusal(values, "") is None


def test_errors_escape_what_utf8_cannot_encode():
    assert escape_text("model \ud800!") == "model \\ud800!"
    assert escape_text("é ok") == "é ok"
    body = APIError(404, "The model `\ud800` does not exist", "m\udcff").body()
    json.dumps(body, ensure_ascii=False).encode("utf-8")  # renders
    assert body["error"]["message"] == "The model `\\ud800` does not exist"
    assert body["error"]["param"] == "m\\udcff"


def test_sampling_floats_are_checked_as_float32():
    assert float32_of(1e-300) == 0.0 and float32_of(1e39) == float("inf")
    assert float32_of(10**400) == float("inf") and float32_of(-(10**400)) == float("-inf")
    assert float32_of(True) != float32_of(True)  # NaN: a bool is no number here
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE
    for kw, field in ((dict(temperature=3e38), "temperature"),
                      (dict(temperature=float("inf")), "temperature"),
                      (dict(repetition_penalty=1e-300), "repetition_penalty"),
                      (dict(repetition_penalty=float("inf")), "repetition_penalty"),
                      (dict(presence_penalty=float("nan")), "presence_penalty"),
                      (dict(top_p=1e-46), "top_p"), (dict(min_p=float("nan")), "min_p")):
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} .* \(as float32\)"):
            SamplingParams(**kw)
    long = 10**400
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=long)
    assert str(e.value).endswith("...") and len(str(e.value)) < 200


def test_json_depth_carries_across_chunks(monkeypatch):
    from jaxserve.server import json_body
    monkeypatch.setattr(json_body, "_CHUNK", 7)
    assert json_depth(b"[" * 100 + b"]" * 100) == 100
    assert json_depth(b"[" + b"[1]," * 80 + b"[[[" * 30 + b"]]]" * 30 + b"]") == 91
