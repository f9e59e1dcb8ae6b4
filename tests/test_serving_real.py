"""Serving semantics on SmolLM2-135M (issue 3): prefix caching and chunked
prefill on real weights, and streamed text (stop strings, UTF-8) through the
whole engine with the real tokenizer. Greedy, f32.
"""

from __future__ import annotations

import pytest
import torch

from jaxserve import LLM, SamplingParams
from conftest import XLA_CACHE

pytestmark = pytest.mark.real_model

L = 16  # the shared engine's page size


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.fixture
def llm(smollm2_llm):
    yield smollm2_llm
    engine = smollm2_llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_pages == engine.num_pages


@pytest.fixture(scope="module")
def system_prefix(smollm2_ckpt):
    """Exactly 500 token ids of a chat system turn."""
    tok = smollm2_ckpt.tokenizer
    text = ("You are a museum guide. Here is the exhibit catalogue. " +
            " ".join(f"Item {i}: a bronze tool from site {i % 7}, used for weaving and trade."
                     for i in range(80)))
    ids = tok.apply_chat_template([{"role": "system", "content": text}],
                                  add_generation_prompt=False, tokenize=True)
    assert len(ids) > 500
    return ids[:500]


def user_turn(tok, question):
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                      "<|im_start|>assistant\n")


def test_shared_prefix_cold_warm_exact(llm, smollm2_ckpt, smollm2_hf, system_prefix):
    tok = smollm2_ckpt.tokenizer
    engine = llm.engine
    engine.reset_prefix_cache()
    qs = ["Which item is number 3?", "What were the tools used for?", "Say hello."]
    prompts = [system_prefix + user_turn(tok, q) for q in qs]
    cold = llm.generate(prompts, greedy(12))
    assert [o.metrics.num_cached_tokens for o in cold] == [0, 0, 0]  # one batch, cache empty
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long))
    assert cold[0].outputs[0].token_ids == ref[0, len(prompts[0]):].tolist()[:len(
        cold[0].outputs[0].token_ids)]
    warm = llm.generate(prompts, greedy(12))
    for p, c, w in zip(prompts, cold, warm):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        assert w.metrics.num_cached_tokens == (len(p) - 1) // L * L
    # New questions after the same 500-token system prefix: 31 full pages hit.
    more = [system_prefix + user_turn(tok, q) for q in ("Where is site 4?", "List two items.")]
    hits = llm.generate(more, greedy(12))
    engine.reset_prefix_cache()
    fresh = llm.generate(more, greedy(12))
    for h, f in zip(hits, fresh):
        assert h.metrics.num_cached_tokens == 496 and f.metrics.num_cached_tokens == 0
        assert h.outputs[0].token_ids == f.outputs[0].token_ids


def test_chunked_prefill_real_weights(llm, smollm2_ckpt, system_prefix):
    parts = dict(model_config=smollm2_ckpt.config, params=smollm2_ckpt.params,
                 tokenizer=smollm2_ckpt.tokenizer, chat_template=smollm2_ckpt.chat_template)
    prompt = system_prefix[:300] + user_turn(smollm2_ckpt.tokenizer, "Which item is number 3?")
    whole = llm.generate(prompt, greedy(12, ignore_eos=True))[0]
    chunked = LLM(max_num_batched_tokens=128, num_pages=64, enable_prefix_caching=False,
                  compilation_cache_dir=XLA_CACHE, **parts)
    out = chunked.generate(prompt, greedy(12, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == whole.outputs[0].token_ids
    assert chunked.engine.stats().num_steps == 11 + -(-len(prompt) // 128)


def _stream(engine, rid, prompt, params):
    """Run one request alone; every delta must extend a prefix of the final text."""
    engine.add_request(rid, prompt, params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.outputs[0].delta_text)
            final = o
    text = final.outputs[0].text
    acc = ""
    for d in deltas:
        acc += d
        assert text.startswith(acc), (acc, text)
    assert acc == text
    return final.outputs[0], deltas


def test_stop_strings_streamed_through_engine(llm, smollm2_ckpt):
    tok = smollm2_ckpt.tokenizer
    engine = llm.engine
    prompt = llm.apply_chat_template([{"role": "user", "content":
                                       "Write two sentences about the sea."}])
    full, _ = _stream(engine, "full", prompt, greedy(48, ignore_eos=True))
    ids = full.token_ids
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    # A stop string spanning three tokens: from inside token 10 to inside token 12.
    k = next(k for k in range(8, 40) if all(len(pieces[j + 1]) - len(pieces[j]) >= 3
                                            for j in (k, k + 2)))
    start, end = len(pieces[k]) + 1, len(pieces[k + 2]) + 2
    cases = {
        "spans three tokens": full.text[start:end],
        "ends inside a token": full.text[len(pieces[k]) - 2:len(pieces[k]) + 1],
        "prefix of a longer word": next(w[:3] for w in full.text.split() if len(w) >= 6
                                        and w.isalpha()),
    }
    for name, stop in cases.items():
        out, deltas = _stream(engine, name, prompt, greedy(48, ignore_eos=True, stop=[stop]))
        cut = full.text.find(stop)
        assert cut >= 0 and out.text == full.text[:cut], name
        assert (out.finish_reason, out.stop_reason) == ("stop", stop), name
        # (_stream checked that no delta ever went past the cut text.)


def test_streamed_utf8_and_prompt_cut_inside_a_character(llm, smollm2_ckpt):
    tok = smollm2_ckpt.tokenizer
    engine = llm.engine
    prompt = llm.apply_chat_template([{"role": "user", "content":
                                       "Reply with emoji only: 🎉🌊🐟 and the word 日本"}])
    out, deltas = _stream(engine, "emoji", prompt, greedy(24, ignore_eos=True))
    assert out.text == tok.decode(out.token_ids)
    # Greedy SmolLM2 echoes emoji and CJK here, split across byte-level tokens.
    assert any(c in out.text for c in "🎉🌊🐟日本"), out.text
    assert any("\ufffd" in tok.decode([t]) for t in out.token_ids), \
        "no token holds a partial character"
    assert not any("\ufffd" in d for d in deltas)
    # A prompt given as ids that ends inside the 3-byte character 日.
    ids = tok.encode("Translate: 日本")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    out, deltas = _stream(engine, "cut", ids[:cut], greedy(16, ignore_eos=True))
    assert out.text == tok.decode(out.token_ids)
    first = next(d for d in deltas if d)
    assert out.text.startswith(first) and "Translate" not in first
