"""Hostile input on both doors (issue 33): one real ``python -m jaxserve.main
--mode serve --http_port 0`` process with a bearer token, serving a tiny
random GGUF, gets values that once gave a 500, a silently-off filter, a
retryable status for what can never run, or a different answer on each API:

  * lone surrogates in every field a message may echo: the proper 404/400,
    the value backslash-escaped, never a 500;
  * JSON nested 100,000 deep (arrays, objects, in any field): 400 naming
    ``MAX_JSON_DEPTH``;
  * sampling floats that overflow or underflow in float32, and a temperature
    above ``MAX_TEMPERATURE`` (where ``top_k`` 3 would stop holding): 400 /
    INVALID_ARGUMENT naming the field; at ``MAX_TEMPERATURE`` ``top_k`` 3
    holds;
  * the bearer scheme in any case and two ``authorization`` values: the same
    answer on both APIs; gRPC ``max_tokens`` 2^31-1: INVALID_ARGUMENT naming
    the context limit, as HTTP's 400;
  * more sequences than an idle server can hold: 400 naming ``prompt`` / ``n``.

After the cases the server still serves, every page is free and the log
holds no traceback.
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest

from jaxserve.engine.sampling_params import MAX_TEMPERATURE, SamplingParams
from jaxserve.server import jaxserve_pb2 as pb
from jaxserve.server import jaxserve_pb2_grpc as pb_grpc
from jaxserve.server.client import make_request
from jaxserve.server.json_body import MAX_JSON_DEPTH
from server_util import ServerProcess
from test_server import ENGINE_FLAGS, _wait_idle

pytestmark = pytest.mark.slow

TOKEN = "hostile-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HI = [{"role": "user", "content": "hi"}]
S = "\ud800"  # a lone surrogate: valid in JSON text ("\ud800"), not encodable in UTF-8


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", *ENGINE_FLAGS,
                       "--auth_token_file", str(token_file)])
    yield s
    log = "".join(s.lines)
    assert s.terminate() == 0
    assert "Traceback" not in log, log[-4000:]
    assert "Logging error" not in log, log[-4000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield pb_grpc.GenerationStub(ch)


def _post(http: httpx.Client, route: str, body) -> httpx.Response:
    """POST ``body`` as ASCII JSON (lone surrogates as ``\\ud800`` escapes,
    which httpx's own UTF-8 encoding cannot write)."""
    return http.post(route, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    """The error message of an OpenAI error response of ``status``/``param``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"]) == (status, param), err
    return err["message"]


def _grpc_error(stub, req: pb.GenerateRequest, metadata=AUTH) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, metadata=tuple(metadata.items()), timeout=60))
    return e.value


def _serves(server, http, stub) -> None:
    """A normal request on each API still gets its 4 tokens; then every page is free."""
    r = _post(http, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                               ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    out = list(stub.Generate(make_request(token_ids=[5, 6, 7], max_tokens=4, temperature=0,
                                          ignore_eos=True, output_kind=pb.OUTPUT_KIND_FINAL_ONLY),
                             metadata=tuple(AUTH.items()), timeout=60))
    assert len(out[-1].completions[0].token_ids) == 4
    m = _wait_idle(server)
    assert m["jaxserve_kv_cache_pages_used"] == 0
    assert m["jaxserve_kv_cache_pages_free"] == m["jaxserve_kv_cache_pages_total"]


# ---- 1. lone surrogates in every echoed field ---------------------------------------

SURROGATE_CASES = [  # (route, body, status, param)
    ("/v1/completions", dict(model=S, prompt="hi"), 404, "model"),
    ("/v1/completions", dict(model="a" + S, prompt="hi", stream=True), 404, "model"),
    ("/v1/chat/completions", dict(model=S, messages=HI), 404, "model"),
    ("/v1/completions", dict(prompt=S), 400, "prompt"),
    ("/v1/completions", dict(prompt=["hi", S]), 400, "prompt.1"),
    ("/v1/completions", dict(prompt="hi", stop=[S]), 400, "stop"),
    ("/v1/completions", dict(prompt="hi", stop=S), 400, "stop"),
    ("/v1/completions", dict(prompt="hi", logit_bias={S: 1.0}), 400, "logit_bias"),
    ("/v1/completions", dict(prompt="hi", temperature=S), 400, "temperature"),
    ("/v1/completions", dict(prompt="hi", seed={S: 1}), 400, "seed"),
    ("/v1/chat/completions", dict(messages=[{"role": S, "content": "hi"}]), 400,
     "messages.0.role"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": S}]), 400,
     "messages.0.content"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [
        {"type": S, "text": "hi"}]}]), 400, "messages.0.content.0"),
    ("/v1/chat/completions", dict(messages=HI, tools=[{"type": "function", "function": {
        "name": S}}]), 400, "tools.0.function.name"),
    ("/v1/chat/completions", dict(messages=HI, response_format={"type": S}), 400,
     "response_format.type"),
    ("/v1/chat/completions", dict(messages=HI, logit_bias={S: 1}), 400, "logit_bias"),
    ("/tokenize", dict(prompt=S), 400, "prompt"),
    ("/tokenize", dict(messages=[{"role": S, "content": "x"}]), 400, "messages.0.role"),
]


@pytest.mark.parametrize("route, body, status, param", SURROGATE_CASES,
                         ids=[f"{r.split('/')[-1]}-{p}-{i}" for i, (r, _, _, p) in
                              enumerate(SURROGATE_CASES)])
def test_lone_surrogates_get_their_status_escaped(server, http, route, body, status, param):
    msg = _error(_post(http, route, body), status, param)
    assert S not in msg
    if param == "model":
        assert "\\ud800" in msg  # backslash-escaped, as the client sent it


def test_surrogates_that_are_ignored_or_in_keys_still_serve(server, http, stub):
    """``user`` is ignored; a key that is no valid string (an unknown field
    named by a surrogate) is a 400 whose message shows it escaped; a
    surrogate key inside ``logit_bias`` is a 400 naming ``logit_bias.<key>``."""
    r = _post(http, "/v1/completions", dict(prompt=[5, 6], max_tokens=2, user=S))
    assert r.status_code == 200, r.text
    for extra in ({S: 1}, {"x" + S: {S: S}}):
        msg = _error(_post(http, "/v1/completions", dict(prompt=[5, 6], max_tokens=2, **extra)),
                     400, None)
        assert "\\ud800" in msg and S not in msg, msg
    r = _post(http, "/v1/completions", dict(prompt="hi", logit_bias={S: "x"}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]  # pydantic names the key with U+FFFD in place of the surrogate
    assert err["param"].startswith("logit_bias.") and S not in err["param"] + err["message"]
    _serves(server, http, stub)


def test_surrogate_in_route_and_bytes_that_are_not_utf8(server, http, stub):
    msg = _error(http.get("/v1/models/%ED%A0%80"), 404, "model")
    assert "does not exist" in msg
    # a body that is not UTF-8 at all, and raw surrogate bytes in a JSON string
    # (json.loads takes a surrogate's UTF-8 bytes: the prompt check refuses it)
    for raw, param, start in ((b'{"prompt": "\xff"}', None, "the body is not valid JSON"),
                              (b'{"prompt": "\xed\xa0\x80"}', "prompt",
                               "prompt: is not valid Unicode: lone surrogate U+D800")):
        msg = _error(http.post("/v1/completions", content=raw,
                               headers={"content-type": "application/json"}), 400, param)
        assert msg.startswith(start), msg
    # gRPC: proto strings must be UTF-8; bytes that are not are INVALID_ARGUMENT
    raw = make_request("hi", max_tokens=2).SerializeToString().replace(b"hi", b"\xed\xa0")
    ch = grpc.insecure_channel(server.target)
    try:
        raw_generate = ch.unary_stream("/jaxserve.v1.Generation/Generate",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(raw_generate(raw, metadata=tuple(AUTH.items()), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    finally:
        ch.close()
    _serves(server, http, stub)


# ---- 2. deep JSON -------------------------------------------------------------------

DEEP = 100_000


def _deep_array(n: int) -> bytes:
    return b"[" * n + b"]" * n


def _deep_object(n: int) -> bytes:
    return b'{"a":' * n + b"1" + b"}" * n


DEEP_BODIES = {
    "top-array": _deep_array(DEEP),
    "top-object": _deep_object(DEEP),
    "prompt": b'{"prompt": ' + _deep_array(DEEP) + b', "max_tokens": 2}',
    "logit_bias": b'{"prompt": "hi", "logit_bias": ' + _deep_object(DEEP) + b"}",
    "unknown-field": b'{"prompt": "hi", "extra": [' + _deep_object(DEEP) + b"]}",
    "unclosed": b'{"prompt": "hi", "x": ' + b"[" * DEEP,
    "just-over": b'{"prompt": "hi", "x": ' + _deep_array(MAX_JSON_DEPTH) + b"}",
}


@pytest.mark.parametrize("body, start", [
    (b'{"prompt": "hi", "n": ' + b"1" * 5000 + b"}", "the body is not valid JSON: Exceeds the "
     "limit (4300 digits)"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature must be a number in [0, 10000]"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature must be a number in [0, 10000]"),
    (b'{"prompt": "hi", "top_p": -Infinity}', "top_p must be in (0, 1]"),
    (b'{"prompt": [5, 6], "max_tokens": ' + b"9" * 4000 + b"}", "max_tokens: this model's"),
], ids=["int-5000-digits", "1e999", "NaN", "-Infinity", "int-4000-digits"])
def test_numbers_json_cannot_hold_are_400(server, http, body, start):
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(start), r.text


@pytest.mark.parametrize("name", list(DEEP_BODIES))
def test_deep_json_is_400_naming_the_limit(server, http, name):
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = http.post(route, content=DEEP_BODIES[name],
                      headers={"content-type": "application/json"})
        msg = _error(r, 400, None)
        assert f"at most {MAX_JSON_DEPTH} is allowed" in msg, msg


def test_depth_within_the_limit_and_brackets_in_strings_pass(server, http, stub):
    inside = _deep_array(MAX_JSON_DEPTH - 2)  # the body's object + "x" make it 64 deep
    r = http.post("/v1/completions", content=b'{"prompt": [5, 6], "max_tokens": 2, "x": ' +
                  inside + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = _post(http, "/v1/completions", dict(prompt="[{" * 100 + '\\"[', max_tokens=2))
    assert r.status_code == 200, r.text
    _serves(server, http, stub)


# ---- 3. sampling floats as the device's float32 ----------------------------------

FLOATS = [  # (field, value): each refused on both APIs
    ("temperature", 3e38), ("temperature", 1e308), ("temperature", MAX_TEMPERATURE * 1.01),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e39),
    ("presence_penalty", 1e39), ("frequency_penalty", -1e39), ("top_p", 1e-50),
]


def test_sampling_params_check_the_float32_value():
    """The one check (``SamplingParams``), as ``LLM.generate`` meets it."""
    for field, value in FLOATS:
        got = re.escape(repr(value))
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*got {got}$"):
            SamplingParams(**{field: value})
    for field, value in (("temperature", MAX_TEMPERATURE), ("repetition_penalty", 1e-30),
                         ("min_p", 1e-50), ("temperature", 1e-300)):
        assert getattr(SamplingParams(**{field: value}), field) == value


@pytest.mark.parametrize("field, value", FLOATS, ids=[f"{f}={v:g}" for f, v in FLOATS])
def test_float32_overflows_are_refused_on_both_apis(server, http, stub, field, value):
    msg = _error(_post(http, "/v1/completions", {"prompt": "hi", field: value}), 400, field)
    assert msg.startswith(f"{field} must be") and "float32" in msg, msg
    _error(_post(http, "/v1/chat/completions", {"messages": HI, field: value}), 400, field)
    err = _grpc_error(stub, make_request("hi", max_tokens=2, **{field: value}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"SamplingParams.{field} must be" in err.details(), err.details()


def test_top_k_holds_at_the_maximum_temperature(server, http, stub):
    """At ``MAX_TEMPERATURE`` the 3 kept tokens are near uniform, yet every
    sampled token is one of the raw top 3 (rank <= 3), over both APIs."""
    resp = list(stub.Generate(make_request(
        token_ids=[5, 6, 7], max_tokens=8, temperature=MAX_TEMPERATURE, top_k=3, n=8, seed=1,
        logprobs=0, ignore_eos=True, output_kind=pb.OUTPUT_KIND_FINAL_ONLY),
        metadata=tuple(AUTH.items()), timeout=60))
    ranks = [lp.chosen.rank for c in resp[-1].completions for lp in c.logprobs]
    assert len(ranks) == 64 and max(ranks) <= 3 and len(set(ranks)) == 3, ranks
    r = _post(http, "/v1/chat/completions", dict(
        messages=HI, max_tokens=8, temperature=MAX_TEMPERATURE, top_k=3, n=4, seed=2,
        logprobs=True, top_logprobs=5, ignore_eos=True))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        for tok in choice["logprobs"]["content"]:
            third = sorted((t["logprob"] for t in tok["top_logprobs"]), reverse=True)[2]
            assert tok["logprob"] >= third, tok
    _serves(server, http, stub)


# ---- 4. one admission rule ----------------------------------------------------------

def test_bearer_rule_is_the_same_on_both_apis(server, stub):
    with httpx.Client(base_url=server.http_url, timeout=60) as h:
        def http_status(headers):
            r = h.post("/tokenize", json=dict(prompt="hi"), headers=headers)
            return r.status_code, (r.json()["error"]["message"] if r.status_code != 200 else "")

        def grpc_status(metadata):
            try:
                list(stub.Generate(make_request(token_ids=[5, 6], max_tokens=1),
                                   metadata=metadata, timeout=60))
                return 200, ""
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
                return 401, e.details()

        cases = [  # (authorization values, status, reason)
            ([f"bearer {TOKEN}"], 200, ""), ([f"BEARER {TOKEN}"], 200, ""),
            ([f"Bearer {TOKEN}"], 200, ""),
            ([], 401, "missing bearer token"), ([f"Bearer {TOKEN}x"], 401, "wrong bearer token"),
            ([TOKEN], 401, "scheme is not Bearer"), ([f"Basic {TOKEN}"], 401, "not Bearer"),
            ([f"Bearer {TOKEN}", f"Bearer {TOKEN}"], 401, "2 authorization values"),
            ([f"Bearer {TOKEN}", "Bearer wrong"], 401, "2 authorization values"),
            (["Bearer wrong", f"Bearer {TOKEN}"], 401, "2 authorization values"),
        ]
        for values, status, reason in cases:
            pairs = [("authorization", v) for v in values]
            for got in (http_status(pairs), grpc_status(pairs)):
                assert got[0] == status and reason in got[1], (values, got)


def test_max_tokens_beyond_the_context_is_refused_on_both_apis(server, http, stub):
    for max_tokens in (2**31 - 1, 510):
        msg = _error(_post(http, "/v1/completions", dict(prompt=[5, 6, 7],
                                                            max_tokens=max_tokens)),
                     400, "max_tokens")
        assert "maximum context length is 512" in msg
        err = _grpc_error(stub, make_request(token_ids=[5, 6, 7], max_tokens=max_tokens))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("sampling.max_tokens: this model's maximum context "
                                         "length is 512 tokens"), err.details()
    # exactly the room left is fine on both
    r = _post(http, "/v1/completions", dict(prompt=[5, 6, 7], max_tokens=2, temperature=0))
    assert r.status_code == 200
    _serves(server, http, stub)


# ---- 5. more than an idle server can ever hold ------------------------------------

def test_requests_no_idle_server_can_hold_are_400_not_429(server, http, stub):
    """64 running + 256 waiting = 320 sequences at most (ENGINE_FLAGS and the
    default ``--max_waiting_requests``)."""
    msg = _error(_post(http, "/v1/completions", dict(prompt=[[5, 6]] * 1000, max_tokens=2)),
                 400, "prompt")
    assert "1000 prompt(s) x n=1 is 1000 sequences" in msg and "= 320" in msg, msg
    msg = _error(_post(http, "/v1/completions", dict(prompt=[[5, 6]] * 100, n=64,
                                                        max_tokens=2)), 400, "prompt")
    assert "6400 sequences" in msg
    for route, body in (("/v1/completions", dict(prompt="hi", n=129)),
                        ("/v1/chat/completions", dict(messages=HI, n=129))):
        msg = _error(_post(http, route, body), 400, "n")
        assert msg.startswith("n: 129 is more than max_num_seqs=64"), msg
    err = _grpc_error(stub, make_request("hi", n=129, max_tokens=2))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("sampling.n: 129 is more than max_num_seqs=64")
    # 320 sequences fit an idle server: 5 prompts x n 64 run
    r = _post(http, "/v1/completions", dict(prompt=[[5, 6]] * 5, n=64, max_tokens=1))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 320
    _serves(server, http, stub)
