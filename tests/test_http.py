"""The OpenAI-compatible HTTP API (``jaxserve.server.http``) through the
official ``openai`` client and raw ``httpx``: a real ``python -m
jaxserve.main --mode serve --http_port 0`` process on 127.0.0.1 serving a
tiny random GGUF.

Expected outputs come from an in-process ``LLM`` over the same file: greedy
and seeded sampling do not depend on batch-mates, so every choice must equal
its ``LLM.generate`` / ``LLM.chat`` result (text, token count, finish reason,
logprobs within 1e-6). Bad requests get OpenAI's error object with the field
at fault, and the server serves the next request correctly.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_util import ServerProcess
from test_server import ENGINE_FLAGS

pytestmark = pytest.mark.slow

CONTEXT = 512  # the tiny GGUF's max_position_embeddings
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_gguf):
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", *ENGINE_FLAGS])
    assert s.http_port and s.http_url == f"http://127.0.0.1:{s.http_port}"
    yield s
    assert s.terminate() == 0


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    from jaxserve import LLM
    from conftest import XLA_CACHE
    return LLM(tiny_gguf, num_pages=1024, page_size=8, compilation_cache_dir=XLA_CACHE)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0,
                      timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


def _sp(**kw):
    from jaxserve import SamplingParams
    return SamplingParams(**kw)


def _prompt_list(prompt) -> list:
    """The prompts of a completions ``prompt`` field, one per engine request."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _extra(choice, name):
    """A field the openai models do not declare (``stop_reason``, ...)."""
    return choice.model_dump().get(name)


def _choices_of(exp: list) -> list:
    """Engine choices in the API's order: prompt_index * n + choice_index."""
    return [o for r in exp for o in sorted(r.outputs, key=lambda o: o.index)]


def _read_completion_stream(stream, chat: bool = False):
    """Concatenate a stream's chunks per choice index.

    Returns:
      (texts {index: str}, finish reasons {index: str}, usage or None,
      logprob chunks {index: [chunk logprobs]}, the chunks).
    """
    texts, finish, lps, chunks = {}, {}, {}, list(stream)
    usage = None
    for j, chunk in enumerate(chunks):
        assert chunk.object == ("chat.completion.chunk" if chat else "text_completion")
        if not chunk.choices:
            assert j == len(chunks) - 1, "the usage chunk must be the last"
            usage = chunk.usage
            continue
        assert chunk.usage is None
        assert len(chunk.choices) == 1, chunk  # new text for one index per chunk
        c = chunk.choices[0]
        assert c.index not in finish, f"index {c.index} has a chunk after its finish_reason"
        if chat:
            if c.index not in texts:
                assert c.delta.role == "assistant", chunk  # each index opens with the role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        else:
            texts[c.index] = texts.get(c.index, "") + c.text
        if c.logprobs is not None:
            lps.setdefault(c.index, []).append(c.logprobs)
        if c.finish_reason is not None:
            finish[c.index] = c.finish_reason
    return texts, finish, usage, lps, chunks


def _assert_usage(usage, exp: list) -> None:
    prompt = sum(len(r.prompt_token_ids) for r in exp)
    completion = sum(len(o.token_ids) for r in exp for o in r.outputs)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt, completion, prompt + completion)
    assert usage.prompt_tokens_details.cached_tokens >= 0


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """``r`` is OpenAI's error object with ``status`` (and ``param`` naming the
    field, or a path inside it such as ``messages.0.role``)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    if status in (400, 413):
        assert err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param or str(err["param"]).startswith(
            (param + ".", param + "[")), err
    return err


def _assert_serves(http, model: str, reference) -> None:
    """/health is 200 and a greedy request equals ``LLM.generate``'s."""
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=dict(model=model, prompt=[5, 6, 7], max_tokens=4,
                                                temperature=0))
    assert r.status_code == 200, r.text
    want = reference.generate([[5, 6, 7]], _sp(max_tokens=4, temperature=0.0))[0]
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    assert r.json()["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)


# ---- completions and chat equal the engine ------------------------------------

COMPLETIONS = {
    "text": dict(prompt="hello world", max_tokens=12),
    "texts": dict(prompt=["the tea", "well well", "hi there"], max_tokens=8),
    "ids": dict(prompt=[5, 6, 7, 8], max_tokens=10, ignore_eos=True),
    "id_lists": dict(prompt=[[5, 6, 7], [40, 41], [300, 12, 13, 14]], max_tokens=6),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_completions_match_llm_generate(server, client, reference, tiny_gguf, case, stream):
    kw = dict(COMPLETIONS[case])
    ignore_eos = kw.pop("ignore_eos", False)
    prompts = _prompt_list(kw["prompt"])
    exp = reference.generate(prompts, _sp(max_tokens=kw["max_tokens"], temperature=0.0,
                                          ignore_eos=ignore_eos))
    want = _choices_of(exp)
    extra = dict(extra_body={"ignore_eos": True}) if ignore_eos else {}
    if not stream:
        resp = client.completions.create(model=tiny_gguf, temperature=0, **kw, **extra)
        assert resp.object == "text_completion" and resp.model == tiny_gguf
        assert resp.id and isinstance(resp.created, int)
        assert [c.index for c in resp.choices] == list(range(len(want)))
        for c, w in zip(resp.choices, want):
            assert c.text == w.text, (case, c.index)
            assert c.finish_reason == w.finish_reason
            assert _extra(c, "stop_reason") == w.stop_reason
        _assert_usage(resp.usage, exp)
    else:
        texts, finish, usage, _, chunks = _read_completion_stream(client.completions.create(
            model=tiny_gguf, temperature=0, stream=True, stream_options={"include_usage": True},
            **kw, **extra))
        assert all(ch.model == tiny_gguf and ch.id == chunks[0].id for ch in chunks)
        assert texts == {i: w.text for i, w in enumerate(want)}
        assert finish == {i: w.finish_reason for i, w in enumerate(want)}
        _assert_usage(usage, exp)
    if ignore_eos:
        assert all(len(w.token_ids) == kw["max_tokens"] and w.finish_reason == "length"
                   for w in want)


def _chats():
    """(openai messages, the same as plain strings for ``LLM.chat``, API kw, max_tokens)."""
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "the tea"}]
    tool = [{"role": "user", "content": "what is six times seven"},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    return {
        "one": (CHAT, CHAT, dict(max_tokens=10), 10),
        "conversation": (conv, conv, dict(max_completion_tokens=8), 8),
        "tool": (tool, [{"role": "tool", "content": "42"} if m["role"] == "tool" else m
                        for m in tool], dict(max_tokens=5), 5),
        "text_parts": (parts, [{"role": "user", "content": "hello world"}], dict(max_tokens=6),
                       6),
        "no_max_tokens": (CHAT, CHAT, {}, None),  # up to the context length
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", ["one", "conversation", "tool", "text_parts", "no_max_tokens"])
def test_chat_matches_llm_chat(server, client, reference, tiny_gguf, case, stream):
    messages, plain, kw, max_tokens = _chats()[case]
    prompt = reference.apply_chat_template(plain)
    if max_tokens is None:
        max_tokens = CONTEXT - len(prompt)
    exp = reference.chat(plain, _sp(max_tokens=max_tokens, temperature=0.0))
    want = exp[0].outputs[0]
    if not stream:
        resp = client.chat.completions.create(model=tiny_gguf, messages=messages, temperature=0,
                                              **kw)
        assert resp.object == "chat.completion" and resp.model == tiny_gguf
        assert len(resp.choices) == 1 and resp.choices[0].index == 0
        c = resp.choices[0]
        assert c.message.role == "assistant"
        assert c.message.content == want.text
        assert c.finish_reason == want.finish_reason
        usage = resp.usage
    else:
        texts, finish, usage, _, _ = _read_completion_stream(client.chat.completions.create(
            model=tiny_gguf, messages=messages, temperature=0, stream=True,
            stream_options={"include_usage": True}, **kw), chat=True)
        assert texts == {0: want.text}
        assert finish == {0: want.finish_reason}
    assert usage.prompt_tokens == len(prompt) == len(exp[0].prompt_token_ids)
    _assert_usage(usage, exp)
    if case == "no_max_tokens":  # the random model rarely ends a reply itself
        assert len(want.token_ids) == max_tokens and want.finish_reason == "length"


def _stop_string(text: str) -> str:
    """Two characters of a greedy output past its start (no U+FFFD, which
    stands for bytes the detokenizer may still join): a stop string it meets."""
    return next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])


def _eos_seed(reference, prompt, max_tokens=60) -> int:
    """A seed whose sampled output (temperature 0.9) ends with EOS before max_tokens."""
    for seed in range(200):
        out = reference.generate([prompt], _sp(max_tokens=max_tokens, temperature=0.9,
                                               seed=seed))[0].outputs[0]
        if out.finish_reason == "stop" and len(out.token_ids) < max_tokens:
            return seed
    raise AssertionError("no seed in 0..199 reaches EOS")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_finish_reasons_match_the_engine(server, client, reference, tiny_gguf, stream):
    """"stop" by a stop string, a stop token id and EOS; "length" otherwise;
    ``stop_reason`` is the engine's."""
    greedy = reference.generate(["hello world"], _sp(max_tokens=30, temperature=0.0))[0]
    text, ids = greedy.outputs[0].text, greedy.outputs[0].token_ids
    stop = _stop_string(text)
    seed = _eos_seed(reference, [5, 7, 9])
    cases = [  # (API kwargs, engine params)
        (dict(prompt="hello world", max_tokens=30, temperature=0, stop=[stop]),
         dict(max_tokens=30, temperature=0.0, stop=[stop])),
        (dict(prompt="hello world", max_tokens=30, temperature=0, stop=stop,
              extra_body={"include_stop_str_in_output": True}),
         dict(max_tokens=30, temperature=0.0, stop=[stop], include_stop_str_in_output=True)),
        (dict(prompt="hello world", max_tokens=30, temperature=0,
              extra_body={"stop_token_ids": [ids[4]]}),
         dict(max_tokens=30, temperature=0.0, stop_token_ids=[ids[4]])),
        (dict(prompt=[5, 7, 9], max_tokens=60, temperature=0.9, seed=seed),
         dict(max_tokens=60, temperature=0.9, seed=seed)),
        (dict(prompt=[5, 7, 9], max_tokens=60, temperature=0.9, seed=seed,
              extra_body={"ignore_eos": True}),
         dict(max_tokens=60, temperature=0.9, seed=seed, ignore_eos=True)),
    ]
    for kw, params in cases:
        want = reference.generate([kw["prompt"]], _sp(**params))[0].outputs[0]
        if stream:
            texts, finish, usage, _, _ = _read_completion_stream(client.completions.create(
                model=tiny_gguf, stream=True, stream_options={"include_usage": True}, **kw))
            assert (texts[0], finish[0]) == (want.text, want.finish_reason), kw
        else:
            resp = client.completions.create(model=tiny_gguf, **kw)
            c, usage = resp.choices[0], resp.usage
            assert (c.text, c.finish_reason) == (want.text, want.finish_reason), kw
            assert _extra(c, "stop_reason") == want.stop_reason, kw
        assert usage.completion_tokens == len(want.token_ids), kw
    # The cases reach what they are named for.
    got = [reference.generate([kw["prompt"]], _sp(**p))[0].outputs[0] for kw, p in cases]
    assert [o.finish_reason for o in got] == ["stop", "stop", "stop", "stop", "length"]
    assert got[0].stop_reason == stop and got[1].text.endswith(stop)
    assert got[2].stop_reason == ids[4]
    # A chat reply cut by a stop string.
    chat_text = reference.chat(CHAT, _sp(max_tokens=20, temperature=0.0))[0].outputs[0].text
    cstop = _stop_string(chat_text)
    want = reference.chat(CHAT, _sp(max_tokens=20, temperature=0.0, stop=[cstop]))[0].outputs[0]
    resp = client.chat.completions.create(model=tiny_gguf, messages=CHAT, max_tokens=20,
                                          temperature=0, stop=[cstop])
    assert want.finish_reason == "stop"
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == (
        want.text, "stop")


def test_max_tokens_default_and_null(server, http, reference, tiny_gguf):
    """Completions: absent max_tokens is 16, null is up to the context length."""
    ids = reference.get_tokenizer().encode("hi there")
    for body, max_tokens in ((dict(prompt="hi there"), 16),
                             (dict(prompt="hi there", max_tokens=None), CONTEXT - len(ids))):
        want = reference.generate(["hi there"], _sp(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True))[0].outputs[0]
        r = http.post("/v1/completions", json=dict(model=tiny_gguf, temperature=0,
                                                   ignore_eos=True, **body))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens == len(want.token_ids)
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_echo_and_vllm_extras(server, client, reference, tiny_gguf):
    want = reference.generate(["hello world"], _sp(max_tokens=5, temperature=0.0))[0]
    resp = client.completions.create(model=tiny_gguf, prompt="hello world", max_tokens=5,
                                     temperature=0, echo=True, user="tester")
    assert resp.choices[0].text == "hello world" + want.outputs[0].text
    assert resp.usage.completion_tokens == 5
    # Every sampling knob at once, seeded: the engine's tokens under the same params.
    params = dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5,
                  frequency_penalty=0.3, top_k=20, min_p=0.02, repetition_penalty=1.3,
                  min_tokens=4)
    vllm = ("top_k", "min_p", "repetition_penalty", "min_tokens")
    api = {k: v for k, v in params.items() if k not in vllm}
    extra = {k: params[k] for k in vllm}
    for prompt in ("the tea", [5, 6, 7, 8, 9]):
        want = reference.generate([prompt], _sp(**params))[0].outputs[0]
        resp = client.completions.create(model=tiny_gguf, prompt=prompt, extra_body=extra, **api)
        assert resp.choices[0].text == want.text
        assert resp.usage.completion_tokens == len(want.token_ids) >= 4
        chat = reference.chat(CHAT, _sp(**params))[0].outputs[0]
        resp = client.chat.completions.create(model=tiny_gguf, messages=CHAT, extra_body=extra,
                                              **api)
        assert resp.choices[0].message.content == chat.text
        assert resp.usage.completion_tokens == len(chat.token_ids)


# ---- streaming: usage chunk, n choices ------------------------------------------

def test_raw_sse_stream(server, http, reference, tiny_gguf):
    """The wire format: ``data: {json}`` events, ``data: [DONE]`` last."""
    body = dict(model=tiny_gguf, prompt="hello world", max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True})
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.strip()]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    want = reference.generate(["hello world"], _sp(max_tokens=8, temperature=0.0))[0]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == want.outputs[0].text
    assert all(c["object"] == "text_completion" for c in chunks)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_n3_seeded_streams_equal_whole_and_engine(server, client, reference, tiny_gguf, api):
    """n = 3 at temperature 0.9 with a seed over two prompts (completions: 6
    choices, index = prompt * 3 + choice): every index streams, and each
    index's text equals its non-streamed twin and the engine's choice."""
    params = _sp(n=3, seed=1234, temperature=0.9, max_tokens=12)
    kw = dict(model=tiny_gguf, n=3, seed=1234, temperature=0.9, max_tokens=12)
    if api == "completions":
        prompts = ["the tea", "hello"]
        exp = reference.generate(prompts, params)
        create = lambda **more: client.completions.create(prompt=prompts, **kw, **more)
        text_of = lambda c: c.text
    else:
        exp = reference.chat(CHAT, params)
        create = lambda **more: client.chat.completions.create(messages=CHAT, **kw, **more)
        text_of = lambda c: c.message.content
    want = _choices_of(exp)
    assert len({w.text for w in want}) > 1  # the seeds differ per choice
    whole = create()
    texts, finish, usage, _, _ = _read_completion_stream(
        create(stream=True, stream_options={"include_usage": True}), chat=api == "chat")
    assert sorted(texts) == sorted(finish) == list(range(len(want)))
    assert [c.index for c in whole.choices] == list(range(len(want)))
    for i, w in enumerate(want):
        assert texts[i] == text_of(whole.choices[i]) == w.text, i
        assert finish[i] == whole.choices[i].finish_reason == w.finish_reason, i
    _assert_usage(usage, exp)
    _assert_usage(whole.usage, exp)


# ---- logprobs -------------------------------------------------------------------

def _assert_top(got: dict, entry: dict, k: int) -> None:
    """``got`` ({token text: logprob}) holds the engine's ``k`` best candidates;
    texts of several candidates may coincide (partial UTF-8 bytes)."""
    best = [lp for lp in entry.values() if lp.rank is not None and lp.rank <= k]
    assert len(got) <= k
    assert set(got) == {lp.decoded_token for lp in best}
    for text, value in got.items():
        assert any(abs(value - lp.logprob) <= 1e-6 for lp in best if lp.decoded_token == text)


def _assert_completion_logprobs(lp, out, k: int) -> None:
    n = len(out.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == n
    assert lp.text_offset[0] == 0
    assert all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.tokens[i] == entry[tok].decoded_token
        assert lp.token_logprobs[i] == pytest.approx(entry[tok].logprob, abs=1e-6)
        _assert_top(lp.top_logprobs[i], entry, k)


def test_completion_logprobs_equal_the_engine(server, client, reference, tiny_gguf):
    prompts = ["hello world", "the tea"]
    exp = reference.generate(prompts, _sp(max_tokens=8, temperature=0.0, logprobs=5))
    resp = client.completions.create(model=tiny_gguf, prompt=prompts, max_tokens=8,
                                     temperature=0, logprobs=5)
    for c, r in zip(resp.choices, exp):
        assert c.text == r.outputs[0].text
        _assert_completion_logprobs(c.logprobs, r.outputs[0], 5)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    # Streamed, the chunks' logprobs add up to the same lists.
    _, _, _, lps, _ = _read_completion_stream(client.completions.create(
        model=tiny_gguf, prompt=prompts, max_tokens=8, temperature=0, logprobs=5, stream=True))
    for i, c in enumerate(resp.choices):
        assert [t for p in lps[i] for t in p.tokens] == c.logprobs.tokens
        assert [t for p in lps[i] for t in p.token_logprobs] == pytest.approx(
            c.logprobs.token_logprobs, abs=1e-6)
        streamed = [t for p in lps[i] for t in p.top_logprobs]
        assert [sorted(t) for t in streamed] == [sorted(t) for t in c.logprobs.top_logprobs]
        for a, b in zip(streamed, c.logprobs.top_logprobs):  # other batch-mates: rounding
            assert [a[t] for t in sorted(a)] == pytest.approx([b[t] for t in sorted(b)],
                                                              abs=1e-6)
    # logprobs=0: the sampled token's logprob only.
    resp = client.completions.create(model=tiny_gguf, prompt="hello world", max_tokens=4,
                                     temperature=0, logprobs=0)
    out = reference.generate(["hello world"], _sp(max_tokens=4, temperature=0.0,
                                                  logprobs=0))[0].outputs[0]
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in
                                               zip(out.token_ids, out.logprobs)], abs=1e-6)
    assert all(not top for top in lp.top_logprobs)


def _assert_chat_logprobs(content, out, k: int) -> None:
    assert len(content) == len(out.token_ids)
    for item, tok, entry in zip(content, out.token_ids, out.logprobs):
        assert item.token == entry[tok].decoded_token
        assert item.logprob == pytest.approx(entry[tok].logprob, abs=1e-6)
        assert item.bytes == list(item.token.encode("utf-8"))
        best = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                      key=lambda lp: lp.rank)
        assert len(item.top_logprobs) == len(best) == k
        for t, lp in zip(item.top_logprobs, best):
            assert t.token == lp.decoded_token
            assert t.logprob == pytest.approx(lp.logprob, abs=1e-6)
            assert t.bytes == list(t.token.encode("utf-8"))


def test_chat_logprobs_equal_the_engine(server, client, reference, tiny_gguf):
    out = reference.chat(CHAT, _sp(max_tokens=8, temperature=0.0, logprobs=5))[0].outputs[0]
    resp = client.chat.completions.create(model=tiny_gguf, messages=CHAT, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=5)
    c = resp.choices[0]
    assert c.message.content == out.text
    assert resp.usage.completion_tokens == len(c.logprobs.content) == 8
    _assert_chat_logprobs(c.logprobs.content, out, 5)
    _, _, _, lps, _ = _read_completion_stream(client.chat.completions.create(
        model=tiny_gguf, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=5, stream=True), chat=True)
    streamed = [item for p in lps[0] for item in p.content]
    assert [i.token for i in streamed] == [i.token for i in c.logprobs.content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in c.logprobs.content],
                                                          abs=1e-6)
    assert [[t.token for t in i.top_logprobs] for i in streamed] == [
        [t.token for t in i.top_logprobs] for i in c.logprobs.content]
    # Without logprobs there are none.
    resp = client.chat.completions.create(model=tiny_gguf, messages=CHAT, max_tokens=3,
                                          temperature=0)
    assert resp.choices[0].logprobs is None


# ---- the other routes -----------------------------------------------------------

def test_models_health_metrics(server, client, http, tiny_gguf):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_gguf]
    m = models.data[0]
    assert m.object == "model" and m.owned_by == "jaxserve"
    assert m.model_dump()["max_model_len"] == CONTEXT
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["id"] == tiny_gguf
    assert client.models.retrieve(tiny_gguf).id == tiny_gguf  # GET /v1/models/{id}
    assert raw["data"][0]["parent"] is None and len(raw["data"]) == 1  # no LoRA adapters
    _assert_error(http.get("/v1/models/other"), 404, "model")
    # vLLM's LoRA routes answer 400 on a server started without LoRA
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                        ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        err = _assert_error(http.post(route, json=body), 400)
        assert "LoRA is not enabled" in err["message"], err
    assert http.get("/health").status_code == 200
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = lambda text: {line.rpartition(" ")[0].split("{")[0] for line in text.splitlines()
                          if line and not line.startswith("#")}
    got = names(r.text)
    for name in ("jaxserve_num_requests_running", "jaxserve_kv_cache_pages_used",
                 "jaxserve_abort_delay_steps_count", "jaxserve_request_received_total",
                 "jaxserve_time_to_first_token_seconds_count"):
        assert name in got, name
    assert got == {k.split("{")[0] for k in server.metrics()}  # the metrics port's page


def test_tokenize_detokenize_round_trip(server, http, reference, tiny_gguf):
    tok = reference.get_tokenizer()
    for text in ("hello world", "the tea<|im_end|> well", "héllo ☕"):
        for special in (False, True):
            r = http.post("/tokenize", json=dict(model=tiny_gguf, prompt=text,
                                                 add_special_tokens=special))
            assert r.status_code == 200, r.text
            want = tok.encode(text, add_special_tokens=special)
            got = r.json()
            assert (got["tokens"], got["count"], got["max_model_len"]) == (
                want, len(want), CONTEXT), (text, special)
        r = http.post("/detokenize", json=dict(model=tiny_gguf, tokens=tok.encode(text)))
        assert r.status_code == 200 and r.json()["prompt"] == text
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = http.post("/tokenize", json=dict(model=tiny_gguf, messages=conv))
    assert r.json()["tokens"] == reference.apply_chat_template(conv)
    assert r.json()["count"] == len(reference.apply_chat_template(conv))


def test_unknown_model_is_404(server, client, http, reference, tiny_gguf):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=tiny_gguf + "x", messages=CHAT, max_tokens=2)
    _assert_error(http.post("/v1/completions", json=dict(model="nope", prompt="hi")), 404)
    _assert_error(http.get("/v1/no-such-route"), 404)
    _assert_serves(http, tiny_gguf, reference)
