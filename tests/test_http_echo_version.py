"""Completions with ``echo`` and ``logprobs`` as evaluation harnesses score
prompts: the first prompt token is in ``tokens`` (its text, null logprobs)
and ``text_offset`` is each token's character offset in the returned text
(OpenAI's and vLLM's: the previous offset plus the previous token's length).
A unit check of ``openai_protocol.completion_logprobs`` and the same through
a real server (whole and streamed). And vLLM's ``GET /version``."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from jaxserve.engine.request import Logprob
from jaxserve.server.openai_protocol import completion_logprobs


def test_first_echoed_token_has_its_text_and_offsets_accumulate():
    entries = [None, {7: Logprob(-0.5, 1, "lo")}, {9: Logprob(-1.0, 2, " w"),
                                                   8: Logprob(-0.1, 1, "!")}]
    out = completion_logprobs([5, 7, 9], entries, 1, 0, {5: "hel"}.get)
    assert out == {"tokens": ["hel", "lo", " w"], "token_logprobs": [None, -0.5, -1.0],
                   "top_logprobs": [None, {"lo": -0.5}, {"!": -0.1}],
                   "text_offset": [0, 3, 5]}
    assert completion_logprobs([5], [None], 1, 4)["tokens"] == [""]  # no tokenizer


@pytest.fixture(scope="module")
def server(tiny_gguf):
    from server_util import ServerProcess
    from test_server import ENGINE_FLAGS
    s = ServerProcess(["--model", tiny_gguf, "--http_port", "0", *ENGINE_FLAGS])
    yield s
    assert s.terminate() == 0


@pytest.mark.slow
def test_echo_logprobs_through_the_server(server, tiny_gguf):
    prompt = "hello world"
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        first = http.post("/detokenize", json={"tokens": ids[:1]}).json()["prompt"]
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=tiny_gguf, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
              temperature=0)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert first and lp.tokens[0] == first and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(ids) + 3
    assert "".join(lp.tokens[:len(ids)]) == prompt and whole.text.startswith(prompt)
    assert lp.text_offset == list(itertools.accumulate([0] + [len(t) for t in lp.tokens[:-1]]))
    streamed = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.slow
def test_version_route(server):
    import importlib.metadata
    r = httpx.get(server.http_url + "/version", timeout=30)
    assert r.status_code == 200 and r.json() == {
        "version": importlib.metadata.version("jaxserve")}
