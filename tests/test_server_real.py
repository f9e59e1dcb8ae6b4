"""``python -m jaxserve.main --mode serve`` on the real SmolLM2-135M: a
streamed greedy ``Generate`` returns exactly ``LLM.generate``'s tokens and
text, with usage and timing on its last message; the command-line client
prints the same text."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from jaxserve import SamplingParams
from jaxserve.server.client import Client
from server_util import ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def server(smollm2_path):
    # The default model (smollm2-135m). While its weights load, health says
    # NOT_SERVING and Generate UNAVAILABLE; reflection already answers.
    s = ServerProcess(["--max_num_seqs", "8"], wait_serving=False)
    try:
        with Client(s.target) as c:
            assert c.health() == "NOT_SERVING"
            assert c.health("jaxserve.v1.Generation") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                c.complete("hi", max_tokens=1)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "jaxserve.v1.Generation" in _reflected_services(s.target)
        s.wait_serving()
        with Client(s.target) as c:
            assert c.health() == "SERVING"
    except BaseException:
        s.kill()
        raise
    yield s
    assert s.terminate() == 0


def _reflected_services(target: str) -> list[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    return [s.name for s in resp.list_services_response.service]


def test_streamed_generate_equals_llm_generate(server, smollm2_llm):
    chat = [{"role": "user", "content": QUESTION}]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want_chat = smollm2_llm.chat(chat, params)[0]
    want_text = smollm2_llm.generate("The three primary colors are", params)[0]
    with Client(server.target) as c:
        info = c.model_info()
        assert (info.name, info.architecture, info.vocab_size) == ("smollm2-135m", "llama",
                                                                 49152)
        stream = list(c.generate(messages=chat, max_tokens=24, temperature=0.0))
        text = c.complete("The three primary colors are", max_tokens=24, temperature=0.0)
    assert len(stream) > 1  # streamed, not one message
    assert "".join(r.completions[0].text for r in stream if r.completions) \
        == want_chat.outputs[0].text
    assert [t for r in stream for c in r.completions for t in c.token_ids] \
        == want_chat.outputs[0].token_ids
    last = stream[-1]
    assert last.finished and all(not r.finished for r in stream[:-1])
    assert last.completions[-1].finish_reason == want_chat.outputs[0].finish_reason
    assert last.usage.prompt_tokens == len(want_chat.prompt_token_ids)
    assert last.usage.completion_tokens == len(want_chat.outputs[0].token_ids)
    t = last.timing
    assert 0 <= t.queue_ms <= t.ttft_ms <= t.e2e_ms and t.tpot_ms > 0
    assert text.token_ids == want_text.outputs[0].token_ids
    assert text.text == want_text.outputs[0].text

    out = subprocess.run([sys.executable, "-m", "jaxserve.server.client", QUESTION, "--chat",
                          "--max_tokens", "24", "--target", server.target],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == want_chat.outputs[0].text
    assert "TTFT" in out.stderr
