"""The scanned layer body and the two step programs (``jaxserve.models.stack``,
``ModelRunner.decode_step`` / ``prefill_step``).

* A step program's size does not grow with depth: ``prefill_step`` and
  ``decode_step`` of a 2-layer and a 16-layer tiny Llama, MoE and Gemma 3
  lower to HLO whose instruction counts differ by under 10%; unrolled, the
  16-layer program is several times the 2-layer one (so the count can fail).
* A step whose rows are all decodes runs ``decode_step``'s program; a step
  with a prompt chunk runs ``prefill_step``'s.
* Scanned and unrolled forms give the same logits and greedy tokens, for
  runs split by real differences (an MoE model's dense layers, Gemma 3's
  windows through the Pallas path's static window).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.runner import ModelRunner
from jaxserve.models import MODEL_CLASSES

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
            head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=False, eos_token_ids=(1,))
FAMILIES = {
    "llama": dict(),
    "moe": dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, norm_topk_prob=True, qk_norm=True),
    "gemma3": dict(architecture="gemma3", qk_norm=True, tie_word_embeddings=True,
                   hidden_act="gelu_pytorch_tanh", sliding_window=16, rope_local_theta=1e4,
                   query_pre_attn_scalar=8.0),
}


def _config(family: str, num_layers: int) -> ModelConfig:
    extra = dict(FAMILIES[family])
    if family == "gemma3":  # five local layers, then a global one
        extra["layer_types"] = tuple("full_attention" if i % 6 == 5 else "sliding_attention"
                                     for i in range(num_layers))
    return ModelConfig(num_layers=num_layers, **{**BASE, **extra})


def _runner(cfg: ModelConfig, scan: bool = True, seed: int = 0, **kw) -> ModelRunner:
    from flax import nnx
    model = MODEL_CLASSES[cfg.architecture](cfg, rngs=nnx.Rngs(seed), **kw)
    return ModelRunner(model, num_pages=32, page_size=8, max_model_len=128,
                       kv_dtype="float32", max_num_seqs=8, max_num_tokens=64, scan_layers=scan)


def _hlo_instructions(runner: ModelRunner, decode: bool, T: int) -> int:
    plan = runner.empty_plan(T, 0, decode)
    fn = runner.decode_step if decode else runner.prefill_step
    hlo = fn.lower(runner.state, runner.k_stack, runner.v_stack, plan.md, plan.prev_rows,
                   runner._no_prev).as_text(dialect="hlo")
    return sum(1 for line in hlo.splitlines() if " = " in line)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_programs_do_not_grow_with_depth(family):
    counts = {}
    for layers in (2, 16):
        runner = _runner(_config(family, layers))
        counts[layers] = [_hlo_instructions(runner, True, 4),
                          _hlo_instructions(runner, False, 32)]
    for (shallow, deep), what in zip(zip(counts[2], counts[16]), ("decode_step",
                                                                    "prefill_step")):
        assert abs(deep - shallow) < 0.1 * shallow, (family, what, shallow, deep)
    # Unrolled, depth shows (the measure can fail): 16 layers >> 2 layers.
    unrolled = [_hlo_instructions(_runner(_config(family, n), scan=False), True, 4)
                for n in (2, 16)]
    assert unrolled[1] > 3 * unrolled[0], unrolled


def test_layer_runs_split_only_where_layers_differ():
    """One run for Llama and Gemma 3 on XLA (the window is a scanned input);
    an MoE model's dense layers make runs of their own; the Pallas path's
    static windows split Gemma 3 at each change of window."""
    assert _runner(_config("llama", 5)).layer_segments == ((0, 5),)
    assert _runner(_config("gemma3", 8)).layer_segments == ((0, 8),)
    moe = _config("moe", 5)
    moe = dataclasses.replace(moe, mlp_only_layers=(2,))
    assert _runner(moe).layer_segments == ((0, 2), (2, 3), (3, 5))
    pallas = _runner(_config("gemma3", 8), attention_impl="pallas", interpret=True)
    assert pallas.layer_segments == ((0, 5), (5, 6), (6, 8))
    assert _runner(_config("llama", 5), scan=False).layer_segments is None


def _logits(runner: ModelRunner, prompts):
    """Last-token logits of each prompt (one prefill step), then one decode
    step's logits after appending token 7 to each."""
    from jaxserve.engine.request import Request
    from jaxserve.engine.sampling_params import SamplingParams
    from jaxserve.engine.scheduler import ScheduledBatch
    reqs, page = [], 0
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", None, list(p), SamplingParams(max_tokens=4, temperature=0), 0,
                    frozenset())
        n = -(-(len(p) + 1) // 8)
        r.page_ids = list(range(page, page + n))
        page += n
        reqs.append(r)
    first = runner.execute(ScheduledBatch(reqs, [len(p) for p in prompts], num_decode=0),
                           return_logits=True).logits
    for r in reqs:
        r.num_computed_tokens = len(r.prompt_token_ids)
        r.output_token_ids.append(7)
    second = runner.execute(ScheduledBatch(reqs, [1] * len(reqs), num_decode=len(reqs)),
                            return_logits=True).logits
    return first, second


@pytest.mark.parametrize("family,kw", [
    ("llama", {}), ("moe", dict(mlp_only_layers=(1,))), ("gemma3", {}),
    pytest.param("gemma3", "pallas", marks=pytest.mark.slow)])
def test_scanned_equals_unrolled(family, kw):
    impl = {}
    if kw == "pallas":
        kw, impl = {}, dict(attention_impl="pallas", interpret=True)
    cfg = dataclasses.replace(_config(family, 7), **kw)
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(10, 30))]
    scanned = _logits(_runner(cfg, scan=True, **impl), prompts)
    unrolled = _logits(_runner(cfg, scan=False, **impl), prompts)
    for a, b in zip(scanned, unrolled):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert np.isfinite(a).all() and np.abs(a).max() > 1e-3


def test_decode_rows_run_decode_step_and_prompts_prefill_step(make_tiny_llm):
    """Count the calls of each program while an engine serves: a step with a
    prompt chunk is a ``prefill_step``, a step of decode rows a ``decode_step``."""
    from jaxserve import SamplingParams
    llm = make_tiny_llm()
    runner = llm.engine.runner
    calls = []
    for name in ("decode_step", "prefill_step"):
        fn = getattr(runner, name)

        def spy(*args, _fn=fn, _name=name):
            calls.append((_name, args[3].decode_only, args[3].input_ids.shape[0]))
            return _fn(*args)
        setattr(runner, name, spy)
    llm.generate([[3, 4, 5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert calls[0] == ("prefill_step", False, 16)  # the 5-token prompt, T = 16
    assert [c[0] for c in calls[1:]] == ["decode_step"] * 3, calls
    assert all(c[1] and c[2] == 1 for c in calls[1:]), calls
    with pytest.raises(ValueError, match="decode_step runs decode-only plans"):
        plan = runner.empty_plan(16, 0, decode=False)
        runner._decode_step(runner.state, runner.k_stack, runner.v_stack, plan.md,
                            plan.prev_rows, runner._no_prev)


def test_kv_cache_is_stacked_and_updated_in_place(make_tiny_llm):
    """One [layers, P, L, K, H] buffer per K and V, donated: after a step the
    runner holds new buffers of the same shape and the old ones are deleted."""
    from jaxserve import SamplingParams
    llm = make_tiny_llm()
    runner = llm.engine.runner
    cfg = llm.engine.model_config
    before = runner.k_stack.pages_PLKH
    assert before.shape == (cfg.num_layers, 128, 8, cfg.num_kv_heads, cfg.head_dim)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0))
    assert before.is_deleted()
    assert runner.k_stack.pages_PLKH.shape == before.shape
    assert len(runner.k_cache) == cfg.num_layers  # per-layer views for inspection
    assert float(np.abs(np.asarray(runner.k_cache[0].pages_PLKH)).max()) > 0
