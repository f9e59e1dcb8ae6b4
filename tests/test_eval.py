"""``--mode eval`` (``jaxserve.bench.eval``) and ``Engine.prompt_logits``, on
tiny random models: the figures against an independent numpy computation
from ``prompt_logits``, KL 0 for identical configs and > 0 for different
models, ``prompt_logits`` against ``last_token_logits`` and shorter prefixes,
and the CLI on a tiny GGUF (JSON fields; a bad ``--eval_context``)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxserve.bench import eval as ev

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=256)
C, MAX = 64, 192  # 3 windows of 64 tokens, positions 32..62 scored in each
IDS = [int(i) for i in np.random.default_rng(0).integers(0, TINY["vocab_size"], 200)]


def _engine(seed: int):
    from conftest import XLA_CACHE

    from jaxserve import LLM
    from jaxserve.config import ModelConfig
    cfg = ModelConfig(tie_word_embeddings=False, eos_token_ids=(1,), **TINY)
    return LLM(model_config=cfg, seed=seed, num_pages=16, page_size=8,
               compilation_cache_dir=XLA_CACHE).engine


@pytest.fixture(scope="module")
def engines():
    """Two engines of one random model (seed 0) and one of another (seed 1)."""
    return _engine(0), _engine(0), _engine(1)


def _logsoftmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _numpy_figures(cand, ref):
    """(ppl, ref_ppl, per-position KL) from each window's ``prompt_logits``."""
    nll, nll_ref, kld = [], [], []
    for i in range(MAX // C):
        w = IDS[i * C:(i + 1) * C]
        lq = _logsoftmax(cand.prompt_logits(w))[C // 2:C - 1]
        lp = _logsoftmax(ref.prompt_logits(w))[C // 2:C - 1]
        y = np.array(w[C // 2 + 1:])
        nll += list(-lq[np.arange(len(y)), y])
        nll_ref += list(-lp[np.arange(len(y)), y])
        kld += list((np.exp(lp) * (lp - lq)).sum(-1))
    return np.exp(np.mean(nll)), np.exp(np.mean(nll_ref)), np.array(kld)


def test_prompt_logits_is_causal_and_matches_last_token_logits(engines):
    e = engines[0]
    free = e.num_free_pages
    full = e.prompt_logits(IDS[:40])
    assert full.shape == (40, TINY["vocab_size"]) and full.dtype == np.float32
    np.testing.assert_allclose(full[-1], e.last_token_logits([IDS[:40]])[0], atol=1e-5)
    np.testing.assert_allclose(full[:13], e.prompt_logits(IDS[:13]), atol=1e-5)
    np.testing.assert_allclose(full[:1], e.prompt_logits(IDS[:1]), atol=1e-5)
    assert e.num_free_pages == free
    with pytest.raises(ValueError, match="max_model_len"):
        e.prompt_logits(IDS[:1] * (TINY["max_position_embeddings"] + 1))


def test_ppl_and_kl_match_numpy_for_two_models(engines):
    a, _, b = engines
    r = ev.evaluate(a, IDS, reference=b, context=C, max_tokens=MAX, progress=False)
    ppl, ref_ppl, kld = _numpy_figures(a, b)
    assert r["num_windows"] == 3 and r["tokens_scored"] == 3 * (C - 1 - C // 2)
    assert np.isfinite(r["ppl"]) and r["ppl"] == pytest.approx(ppl, rel=1e-6)
    assert r["ref_ppl"] == pytest.approx(ref_ppl, rel=1e-6)
    assert r["kld"]["mean"] > 1e-4
    assert r["kld"]["mean"] == pytest.approx(kld.mean(), rel=1e-6)
    assert r["kld"]["max"] == pytest.approx(kld.max(), rel=1e-6)
    assert r["kld"]["p99"] == pytest.approx(np.quantile(kld, 0.99), rel=1e-6)
    assert r["ln_ppl_ratio"] == pytest.approx(np.log(ppl / ref_ppl), abs=1e-9)
    assert r["ppl_diff_pct"] == pytest.approx(100 * (ppl / ref_ppl - 1), abs=1e-6)
    assert r["reference_run"] is True


def test_identical_configs_give_zero_kl(engines):
    a, a2, _ = engines
    r = ev.evaluate(a, IDS, reference=a2, context=C, max_tokens=MAX, progress=False)
    assert abs(r["kld"]["mean"]) < 1e-6 and abs(r["kld"]["max"]) < 1e-6
    assert r["same_top_pct"] == 100.0 and r["ppl"] == pytest.approx(r["ref_ppl"], rel=1e-6)
    own = ev.evaluate(a, IDS, context=C, max_tokens=MAX, progress=False)  # no second run
    assert own["reference_run"] is False and own["kld"]["max"] == 0.0
    assert own["ppl"] == pytest.approx(r["ppl"], rel=1e-6)
    assert "KL 0 by construction" in ev.format_summary(own)


def test_result_fields_and_json(engines):
    a, _, b = engines
    r = ev.evaluate(a, IDS, reference=b, context=C, max_tokens=MAX, progress=False)
    for key in ("context", "num_windows", "tokens_scored", "candidate", "reference",
                "reference_run", "ppl", "ppl_stderr", "ref_ppl", "ln_ppl_ratio", "ppl_ratio",
                "ppl_diff", "ppl_diff_pct", "ppl_correlation", "same_top_pct", "seconds",
                "tokens_per_second"):
        assert key in r, key
    assert {"mean", "max", "p99", "p99_9", "median", "min"} <= set(r["kld"])
    assert {"mean", "rms"} <= set(r["delta_p"])
    assert r["candidate"]["quantization"] == "none"
    assert r["candidate"]["quantize_lm_head"] is True  # the EngineConfig default
    assert r["candidate"]["weight_bytes"] == sum(  # every array of the state, as stored
        x.nbytes for x in jax.tree.leaves(a.weights))
    json.dumps(r)
    assert "Same top p" in ev.format_summary(r)


def test_windows_and_options():
    w = ev.make_windows(list(range(10)), 4, 100, bos=99)
    assert w == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert ev.make_windows(list(range(10)), 4, 5) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="fewer than eval_context"):
        ev.make_windows(list(range(3)), 4, 100)
    with pytest.raises(ValueError, match="eval_context must be >= 4"):
        ev.check_options(3, 100)
    with pytest.raises(ValueError, match="eval_max_tokens"):
        ev.check_options(8, 4)
    text, path = ev.load_text()
    assert path == ev.DEFAULT_TEXT and len(text) > 50_000
    with pytest.raises(ValueError, match="cannot read"):
        ev.load_text("/nonexistent/eval.txt")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxserve.main", "--mode", "eval", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_rejects_bad_eval_context():
    proc = _cli("--eval_context", "2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: eval_context must be >= 4 tokens, got 2"], proc.stderr[-2000:]


@pytest.mark.slow
def test_cli_writes_json_on_a_tiny_gguf(tiny_gguf, tmp_path):
    out = tmp_path / "eval.json"
    proc = _cli("--model", tiny_gguf, "--eval_context", "32", "--eval_max_tokens", "96",
                "--kv_cache_dtype", "float32", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["num_windows"] == 3 and r["context"] == 32 and np.isfinite(r["ppl"])
    assert r["text"]["path"] == ev.DEFAULT_TEXT and r["text"]["tokens"] > 96
    assert r["candidate"]["kv_cache_dtype"] == "float32" and r["reference_run"] is True
    assert abs(r["kld"]["max"]) < 1e-6  # an f32 cache is the f32 model's "auto" cache
    assert "Mean PPL(Q)" in proc.stdout and "wrote" in proc.stdout
