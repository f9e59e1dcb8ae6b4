"""Text that is not valid Unicode (a lone surrogate, as ``surrogateescape``
makes of undecodable bytes) is a ValueError naming where, in every Python
entry point, and the engine stays usable."""

from __future__ import annotations

import re

import pytest

from jaxserve import LLM, SamplingParams
from conftest import XLA_CACHE


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf, num_pages=64, page_size=8, compilation_cache_dir=XLA_CACHE)


@pytest.mark.parametrize("text, where", [
    ("a\ud800", "U+D800 at character 1"),
    ("\udcff", "U+DCFF at character 0"),
    ("hello \udfff world", "U+DFFF at character 6"),
])
def test_prompt_with_lone_surrogate(llm, text, where):
    with pytest.raises(ValueError, match=re.escape(f"prompt: is not valid Unicode: lone surrogate {where}")):
        llm.generate(text, SamplingParams(max_tokens=1))
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_pages == engine.num_pages
    out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_stop_string_and_chat_with_lone_surrogate(llm):
    with pytest.raises(ValueError, match=r"SamplingParams.stop\[1\]: is not valid Unicode: "
                                         r"lone surrogate U\+D801 at character 2"):
        SamplingParams(stop=["ok", "ab\ud801"])
    with pytest.raises(ValueError, match=r"messages\[1\].content: is not valid Unicode: "
                                         r"lone surrogate U\+DC80 at character 0"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "\udc80"}],
                 SamplingParams(max_tokens=1))
