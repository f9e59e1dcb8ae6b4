"""Structured outputs end to end through the engine with the real grammar
backend (``jaxserve.engine.structured``, llguidance) on the tiny random GGUF
Llama and its tokenizer: JSON Schema outputs parse and validate, choices and
regexes match, forced tokens ride as drafts, plain rows beside structured
ones get their own tokens, and nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import pytest
from conftest import XLA_CACHE


from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.sampling_params import StructuredOutputsParams  # noqa: E402
from jaxserve.engine.spec_policy import ForcedDraftPolicy  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "pet"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
            and obj["pet"] in ("cat", "dog"))


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    llm = LLM(tiny_gguf, num_pages=256, page_size=8, max_num_seqs=8,
              max_num_batched_tokens=64, compilation_cache_dir=XLA_CACHE)
    llm.engine.warmup()
    # Forced drafts always pay here, whatever this machine's step times.
    llm.engine.set_forced_draft_policy(ForcedDraftPolicy(cost_fn=lambda t: 1.0))
    return llm


def test_json_schema_outputs_validate_and_compile_nothing(llm):
    e = llm.engine
    before, forced = e.num_compilations, e.stats().num_forced_tokens
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for s in range(6)]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["hello world"], plain)[0].outputs[0].token_ids
    outs = llm.generate(["a person:"] * 6 + ["hello world"], params + [plain])
    assert e.num_compilations == before, "structured rows compiled a program"
    for o in outs[:6]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        assert _valid(json.loads(c.text)), c.text
    assert outs[6].outputs[0].token_ids == alone
    assert e.stats().num_forced_tokens > forced  # the keys rode as drafts
    assert e.num_free_pages == e.num_pages


def test_choice_and_regex_match(llm):
    choices = ["yes", "no", "maybe later"]
    outs = llm.generate(
        ["answer:"] * 6,
        [SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                        structured_outputs=StructuredOutputsParams(choice=choices))
         for s in range(3)]
        + [SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                          structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}"))
           for s in range(3)])
    for o in outs[:3]:
        assert o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop"
    for o in outs[3:]:
        assert re.fullmatch(r"\d{3}-\d{4}", o.outputs[0].text), o.outputs[0].text


def test_async_on_and_off_agree(llm):
    import dataclasses
    e = llm.engine
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for s in range(3)] + [SamplingParams(max_tokens=10, temperature=0.8, seed=7)]
    runs = []
    for on in (False, True):
        e.config = dataclasses.replace(e.config, async_scheduling=on)
        runs.append([o.outputs[0].token_ids for o in llm.generate(["x:"] * 4, params)])
    assert runs[0] == runs[1]


def test_bad_schema_is_a_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match="json"):
        llm.engine.add_request(None, "x", SamplingParams(
            structured_outputs=StructuredOutputsParams(json={"type": "no-such-type"})))
    assert not llm.engine.has_unfinished_requests()
