"""``--quantization auto`` (``jaxserve.engine.format_choice``): the candidates
each kind of checkpoint gets, a real measurement and its per-machine cache,
and the engine serving the resolved format."""

import json

import gguf
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import format_choice
from jaxserve.models import quant

SMALL = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_heads=4,
                    num_kv_heads=2, num_layers=2)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    return tmp_path


def test_block_gguf_candidates_and_the_overhead_bound_floor(tmp_path, cache_dir):
    from tiny_gguf import write_tiny_gguf
    q41, f16 = tmp_path / "q41.gguf", tmp_path / "f16.gguf"
    write_tiny_gguf(q41, SMALL, qtype=gguf.GGMLQuantizationType.Q4_1)
    write_tiny_gguf(f16, SMALL, qtype=gguf.GGMLQuantizationType.F16)
    assert format_choice.gguf_block_format(q41) == quant.Q4
    assert format_choice.gguf_block_format(f16) is None
    cands, fmt, _ = format_choice._candidates(EngineConfig(model=str(q41)))
    assert cands == ("none", "gguf", "gguf_a16") and fmt == quant.Q4
    cands, _, why = format_choice._candidates(EngineConfig(model=str(f16)))
    assert cands == ("none",) and "Q8_0/Q4_0/Q4_1" in why
    # A tiny model is overhead-bound: f32 kept without measuring, nothing cached.
    c = format_choice.choose(EngineConfig(model=str(q41)), SMALL)
    assert (c.quantization, c.score, c.cached) == ("none", {}, False)
    assert "overhead-bound" in c.reason and not (cache_dir / format_choice.CACHE_FILE).exists()


def test_a_real_measurement_is_cached_per_machine(tmp_path, cache_dir, monkeypatch):
    from tiny_gguf import write_tiny_gguf
    path = tmp_path / "q41.gguf"
    write_tiny_gguf(path, SMALL, qtype=gguf.GGMLQuantizationType.Q4_1)
    monkeypatch.setattr(format_choice, "MIN_WEIGHT_BYTES", 0)
    config = EngineConfig(model=str(path), quantization="auto")
    c = format_choice.choose(config, SMALL)
    cands = ("none", "gguf", "gguf_a16")
    assert not c.cached and c.candidates == cands
    assert c.score["none"] == 1.0 and all(c.score[m] > 0 for m in ("gguf", "gguf_a16", "gguf_a8"))
    assert all(c.ms[m][M] > 0 for m in (*cands, "gguf_a8") for M in format_choice.COLUMNS)
    assert c.quantization == format_choice.pick(c.score, cands)  # gguf_a8 timed, not chosen
    assert f"opt-in gguf_a8 (int8 activations, llama.cpp's arithmetic) " \
           f"{c.score['gguf_a8']:.2f}x" in c.reason
    saved = json.loads((cache_dir / format_choice.CACHE_FILE).read_text())
    (key, entry), = saved.items()
    assert format_choice.machine_key() in key and entry["quantization"] == c.quantization
    again = format_choice.choose(config, SMALL)
    assert again.cached and again.quantization == c.quantization and again.score == c.score
    # An entry whose choice is no longer a candidate (written when gguf_a8 was one) is
    # measured again, not served.
    stale = json.loads((cache_dir / format_choice.CACHE_FILE).read_text())
    stale[key]["quantization"] = "gguf_a8"
    (cache_dir / format_choice.CACHE_FILE).write_text(json.dumps(stale))
    fresh = format_choice.choose(config, SMALL)
    assert not fresh.cached and fresh.quantization in cands
    # Another machine (or jax, or kernel build) measures again.
    monkeypatch.setattr(format_choice, "machine_key", lambda: "another cpu [avx2]")
    assert not format_choice.choose(config, SMALL).cached
    assert len(json.loads((cache_dir / format_choice.CACHE_FILE).read_text())) == 2
    # resolve() replaces only "auto".
    assert format_choice.resolve(config, SMALL).quantization in cands
    fixed = EngineConfig(model=str(path), quantization="int8")
    assert format_choice.resolve(fixed, SMALL) is fixed


def test_pick_prefers_exact_numerics_on_ties():
    cands = ("none", "gguf", "gguf_a16")
    pick = format_choice.pick
    assert pick({"none": 1.0, "gguf": 0.98, "gguf_a16": 0.975}, cands) == "none"  # all ties
    assert pick({"none": 1.0, "gguf": 0.5, "gguf_a16": 0.49}, cands) == "gguf"  # within 3%
    assert pick({"none": 1.0, "gguf": 0.5, "gguf_a16": 0.48}, cands) == "gguf_a16"
    assert pick({"none": 1.0, "gguf": 1.2, "gguf_a16": 0.9}, cands) == "gguf_a16"
    assert pick({"none": 1.0, "gguf": 0.9, "gguf_a16": 1.5}, cands) == "gguf"


def test_engine_serves_the_resolved_format(tiny_gguf, cache_dir):
    from jaxserve import LLM
    llm = LLM(tiny_gguf, quantization="auto", num_pages=16)
    assert llm.engine.config.quantization == "none"
    ref = LLM(tiny_gguf, num_pages=16)
    from jaxserve import SamplingParams
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert ([o.outputs[0].token_ids for o in llm.generate(["hello"], params)]
            == [o.outputs[0].token_ids for o in ref.generate(["hello"], params)])


def test_unknown_quantization_names_the_choices():
    with pytest.raises(ValueError, match="auto"):
        EngineConfig(quantization="fp4")
