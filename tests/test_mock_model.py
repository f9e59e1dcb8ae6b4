"""The mock model (``conftest.mock_parts`` / ``make_mock_llm``) through the real
engine: text in, text out, chat, stop strings; deterministic from token ids;
no torch, no file (``tiny_models.py``)."""

from __future__ import annotations

import numpy as np

from jaxserve import SamplingParams

PROMPTS = ["hello world", "the world, hello"]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_same_ids_same_logits_and_tokens_in_two_engines(make_mock_llm, mock_parts):
    a, b = make_mock_llm(), make_mock_llm()
    tok = mock_parts["tokenizer"]
    ids = [tok.encode(p) for p in PROMPTS]
    np.testing.assert_array_equal(a.engine.last_token_logits(ids),
                                  b.engine.last_token_logits(ids))
    outs = a.generate(PROMPTS, greedy(12))
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in b.generate(PROMPTS, greedy(12))]
    for prompt, o in zip(PROMPTS, outs):
        assert o.prompt == prompt and o.prompt_token_ids == tok.encode(prompt)
        assert len(set(o.outputs[0].token_ids)) > 1  # greedy moves from token to token
        assert isinstance(o.outputs[0].text, str)


def test_chat_renders_chatml(make_mock_llm, mock_parts):
    tok = mock_parts["tokenizer"]
    out = make_mock_llm().chat([{"role": "user", "content": "hi"}], greedy(4))[0]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4


def test_stop_string_ends_the_text(make_mock_llm):
    llm = make_mock_llm()
    full = llm.generate(PROMPTS[0], greedy(24))[0].outputs[0]
    # The first stretch of two printable ASCII characters in the greedy text.
    k = next(i for i in range(1, len(full.text) - 1)
             if full.text[i:i + 2].isascii() and full.text[i:i + 2].isprintable())
    stop = full.text[k:k + 2]
    out = llm.generate(PROMPTS[0], greedy(24, stop=[stop]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full.text[:full.text.index(stop)]
