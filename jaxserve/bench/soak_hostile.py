"""The soak's hostile requests, for both APIs, each with the
statuses it must end with: what a bad value deserves by the admission rule
("bad input -> 400 / INVALID_ARGUMENT, never 500; a request larger than the
server can ever hold -> 400 naming the limit, not 429; one auth rule for both
doors"), not what today's server answers. A case answered otherwise is
counted as an unexpected status in the soak's report, never hidden.

* ``HTTP_HOSTILE``: name -> (expected HTTP statuses, builder). A builder
  takes (rng, cfg) and returns (path, body bytes, auth) where auth is
  ``"ok"`` (the right bearer token, if the server has one) or the list of
  ``(name, value)`` authorization headers to send instead.
* ``GRPC_HOSTILE``: name -> (expected gRPC code names, builder). A builder
  takes cfg and returns (serialized ``GenerateRequest`` bytes, metadata or
  None for the right token): bytes, so that what protobuf's Python API
  refuses to build (invalid UTF-8, nested groups) can still be sent.

The ``auth_*`` cases need a server with a token (``cfg["token"]``); the soak
draws them only then. Kinds covered: lone surrogates in several fields (JSON
``\\ud800`` escapes over HTTP; the CESU bytes ``ED A0 80`` over gRPC),
nesting 100,000 deep (JSON arrays and objects; protobuf groups), floats that
overflow or underflow float32 (temperature 3e38 / 1e308 / 1e999, penalties
1e-300 and 3e38, top_p 1e-50), integers past int32/int64 (max_tokens,
seed, logprobs), requests too large to ever hold (1,000 prompts, 100 prompts
x n 64, n 129), and authorization headers (missing, wrong, lower-case
scheme, two values, non-ASCII bytes).
"""

from __future__ import annotations

import json

from jaxserve.server.client import make_request

DEPTH = 100_000  # nesting of the deep-structure cases
BAD = {"400"}
INVALID = {"INVALID_ARGUMENT"}
UNAUTH_HTTP, UNAUTH_GRPC = {"401"}, {"UNAUTHENTICATED"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _j(path: str, body: dict, auth="ok"):
    return lambda rng, cfg: (path, json.dumps(body).encode(), auth)


def _raw(path: str, text: str, auth="ok"):
    return lambda rng, cfg: (path, text.encode(), auth)


def _small(**kw) -> dict:
    return {"prompt": "Hello there", "max_tokens": 2, "temperature": 0.0, **kw}


def _chat(content: str = "Hello", role: str = "user", **kw) -> dict:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 2, **kw}


def _auth(values):
    """An authorization case: ``values(token)`` -> the header values sent."""
    return lambda rng, cfg: (CMPL, json.dumps(_small()).encode(),
                             [("authorization", v) for v in values(cfg["token"])])


HTTP_HOSTILE = {
    # Lone surrogates (a 500 today where the model name holds one: finding 1).
    "model_surrogate": ({"400", "404"}, _j(CMPL, _small(model="\ud800"))),
    "prompt_surrogate": (BAD, _j(CMPL, _small(prompt="Hi \ud800 there"))),
    "stop_surrogate": (BAD, _j(CMPL, _small(stop=["\udfff"]))),
    "chat_content_surrogate": (BAD, _j(CHAT, _chat("Hi \ud800"))),
    "chat_role_surrogate": (BAD, _j(CHAT, _chat(role="\ud800"))),
    # Nesting 100,000 deep (RecursionError, a 500 today: finding 1).
    "deep_array": (BAD, _raw(CMPL, "[" * DEPTH + "]" * DEPTH)),
    "deep_object_prompt": (BAD, _raw(CMPL, '{"prompt": ' + '{"a": ' * DEPTH + "1"
                                     + "}" * DEPTH + ', "max_tokens": 2}')),
    # Floats past float32 (finding 2).
    "temperature_3e38": (BAD, _j(CMPL, _small(temperature=3e38, top_k=3))),
    "temperature_1e308": (BAD, _j(CMPL, _small(temperature=1e308, top_k=3))),
    "temperature_1e999": (BAD, _raw(CMPL, '{"prompt": "Hi", "max_tokens": 2, '
                                          '"temperature": 1e999}')),
    "repetition_penalty_1e-300": (BAD, _j(CMPL, _small(repetition_penalty=1e-300))),
    "presence_penalty_3e38": (BAD, _j(CMPL, _small(presence_penalty=3e38))),
    "chat_top_p_1e-50": (BAD, _j(CHAT, _chat(top_p=1e-50, temperature=1.0))),
    # Integers past int32 / int64 (finding 4).
    "max_tokens_2^31-1": (BAD, _j(CMPL, _small(max_tokens=2**31 - 1))),
    "max_tokens_2^63": (BAD, _j(CMPL, _small(max_tokens=2**63))),
    "seed_2^64": (BAD, _j(CMPL, _small(seed=2**64))),
    "logprobs_2^40": (BAD, _j(CMPL, _small(logprobs=2**40))),
    # More than the server can ever hold: 400, not a retryable 429 (finding 5).
    "prompts_1000": (BAD, _j(CMPL, _small(prompt=["Hi"] * 1000))),
    "prompts_100_x_n_64": (BAD, _j(CMPL, _small(prompt=["Hi"] * 100, n=64))),
    "n_129": (BAD, _j(CMPL, _small(n=129))),
    # Plain bad bodies.
    "not_json": (BAD, _raw(CMPL, '{"prompt": "Hi", ')),
    "negative_temperature": (BAD, _j(CMPL, _small(temperature=-1.0))),
    "unknown_role": (BAD, _j(CHAT, _chat(role="wizard"))),
    "empty_messages": (BAD, _j(CHAT, {"messages": []})),
    # One auth rule for both doors (finding 4).
    "auth_missing": (UNAUTH_HTTP, _auth(lambda t: [])),
    "auth_wrong": (UNAUTH_HTTP, _auth(lambda t: [f"Bearer {t}x"])),
    "auth_lowercase_scheme": ({"200"}, _auth(lambda t: [f"bearer {t}"])),
    "auth_two_values": (UNAUTH_HTTP, _auth(lambda t: [f"Bearer {t}x", f"Bearer {t}"])),
    "auth_non_ascii": (UNAUTH_HTTP, _auth(lambda t: [b"Bearer \xff\xfe"])),
}


# ---- gRPC ---------------------------------------------------------------------------------

_SURROGATE = b"\xed\xa0\x80"  # U+D800 as CESU-8: not UTF-8, protobuf must refuse it


def _g(**sampling):
    """A small Generate request with ``sampling`` set (floats pass as given:
    a proto float field rounds 3e38 to float32, 1e39 to inf, 1e-300 to 0)."""
    def build(cfg):
        req = make_request(token_ids=[1, 2, 3], max_tokens=2, temperature=0.0)
        for k, v in sampling.items():
            setattr(req.sampling, k, v)
        return req.SerializeToString(), None
    return build


def _surrogate_in(field: str):
    """A request whose ``field`` holds the placeholder "@@@", then replaced
    on the wire by the 3 bytes of a lone surrogate (same length)."""
    def build(cfg):
        if field == "chat":
            req = make_request(messages=[{"role": "user", "content": "Hi @@@"}], max_tokens=2)
        elif field == "stop":
            req = make_request("Hello there", max_tokens=2, stop=["@@@"])
        elif field == "request_id":
            req = make_request("Hello there", max_tokens=2, request_id="id-@@@")
        else:
            req = make_request("Hi @@@ there", max_tokens=2)
        return req.SerializeToString().replace(b"@@@", _SURROGATE), None
    return build


def _deep_groups(cfg):
    """Unknown field 1000 as start-group tags nested DEPTH deep, then their
    end-group tags (protobuf parses unknown groups recursively)."""
    def varint(n):
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)
    return varint(1000 << 3 | 3) * DEPTH + varint(1000 << 3 | 4) * DEPTH, None


def _g_auth(values):
    def build(cfg):
        req = make_request(token_ids=[1, 2, 3], max_tokens=2, temperature=0.0)
        return req.SerializeToString(), tuple(("authorization", v) for v in values(cfg["token"]))
    return build


GRPC_HOSTILE = {
    "text_surrogate": (INVALID, _surrogate_in("text")),
    "chat_surrogate": (INVALID, _surrogate_in("chat")),
    "stop_surrogate": (INVALID, _surrogate_in("stop")),
    "request_id_surrogate": (INVALID, _surrogate_in("request_id")),
    "deep_groups": (INVALID, _deep_groups),
    "temperature_3e38": (INVALID, _g(temperature=3e38, top_k=3)),
    "temperature_inf": (INVALID, _g(temperature=float("inf"))),
    "temperature_nan": (INVALID, _g(temperature=float("nan"))),
    "repetition_penalty_1e-300": (INVALID, _g(repetition_penalty=1e-300)),
    "presence_penalty_3e38": (INVALID, _g(presence_penalty=3e38)),
    "top_p_1e-50": (INVALID, _g(top_p=1e-50, temperature=1.0)),
    "max_tokens_2^31-1": (INVALID, _g(max_tokens=2**31 - 1)),
    "n_129": (INVALID, _g(n=129)),
    "auth_missing": (UNAUTH_GRPC, _g_auth(lambda t: [])),
    "auth_wrong": (UNAUTH_GRPC, _g_auth(lambda t: [f"Bearer {t}x"])),
    "auth_lowercase_scheme": ({"OK"}, _g_auth(lambda t: [f"bearer {t}"])),
    "auth_two_values": (UNAUTH_GRPC, _g_auth(lambda t: [f"Bearer {t}x", f"Bearer {t}"])),
}


def unread_shape(rng, cfg: dict) -> dict:
    """The sampling of an ``unread`` stream (both APIs): n 1-4, logprobs 0 or
    5, up to 300 tokens; one in four the issue's shape (n 16, logprobs 20, up
    to 1,500 tokens). max_tokens stays within the context and within half the
    KV cache for all n choices (``cfg["kv_tokens"]``), so the server can hold
    it: the stream is refused for nothing but its reader."""
    if rng.random() < 0.25:
        n, logprobs, want = 16, 20, 1500
    else:
        n, logprobs, want = int(rng.integers(1, 5)), int(rng.choice([0, 5])), 300
    room = cfg.get("kv_tokens", 1 << 30) // (2 * n) - 40
    return {"n": n, "logprobs": logprobs, "ignore_eos": True, "temperature": 0.0,
            "max_tokens": max(8, min(want, cfg["max_model_len"] - 40, room))}


def names(table: dict, cfg: dict) -> list[str]:
    """The cases of ``table`` a run draws from: the ``auth_*`` ones only when
    the server has a token."""
    return [k for k in table if cfg.get("token") or not k.startswith("auth_")]


__all__ = ["GRPC_HOSTILE", "HTTP_HOSTILE", "names", "unread_shape"]
