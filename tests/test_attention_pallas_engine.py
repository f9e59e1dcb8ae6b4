"""The engine with ``attention_impl="pallas"`` (Pallas interpreter on CPU)
gives the same greedy tokens as the XLA path: on the tiny model through mixed
chunked-prefill + decode steps, and on SmolLM2 for three prompts batched.
Interpret mode is slow, so both are small."""

import dataclasses

import pytest

from jaxserve import LLM, SamplingParams
from conftest import XLA_CACHE

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], [200], list(range(10, 90))]


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_tiny_pallas_interpret_equals_xla_mixed_steps(tiny_parts):
    cfg = dataclasses.replace(tiny_parts["model_config"], max_position_embeddings=1024)
    parts = dict(tiny_parts, model_config=cfg)
    outs = {}
    for impl in ("xla", "pallas"):
        llm = LLM(attention_impl=impl, attention_interpret=impl == "pallas", page_size=8,
                  num_pages=128, max_num_batched_tokens=32, compilation_cache_dir=XLA_CACHE,
                  **parts)
        engine = llm.engine
        assert engine.attention_impl == impl
        engine.add_request("a", PROMPTS[0], greedy(12))
        engine.step()  # "a" decodes while "c" prefills in chunks of <= 31 beside it
        engine.add_request("b", PROMPTS[1], greedy(6))
        engine.add_request("c", PROMPTS[2], greedy(6))
        final = {}
        while engine.has_unfinished_requests():
            final.update((o.request_id, o.outputs[0].token_ids) for o in engine.step()
                         if o.finished)
        outs[impl] = final
    assert outs["pallas"] == outs["xla"]


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_pallas_interpret_equals_xla(smollm2_llm, smollm2_ckpt):
    parts = dict(model_config=smollm2_ckpt.config, params=smollm2_ckpt.params,
                 tokenizer=smollm2_ckpt.tokenizer, chat_template=smollm2_ckpt.chat_template)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, greedy(6))]
    llm = LLM(attention_impl="pallas", attention_interpret=True, num_pages=64,
              compilation_cache_dir=XLA_CACHE, **parts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6))]
    assert got == want


def test_pallas_without_lowering_is_a_clear_error(tiny_parts):
    import jax
    if jax.default_backend() in ("gpu", "tpu"):
        pytest.skip("this backend has a Pallas lowering")
    with pytest.raises(ValueError, match="attention_interpret"):
        LLM(attention_impl="pallas", num_pages=16, **tiny_parts)
    with pytest.raises(ValueError, match="attention_impl"):
        LLM(attention_impl="flash", num_pages=16, **tiny_parts)
