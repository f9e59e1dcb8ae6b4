"""The attention self-check at start-up and its fallback to the XLA path
(``jaxserve.engine.attention_check``), on CPU through the Pallas interpreter
(``attention_impl="auto"`` with ``attention_interpret=True`` runs the check).

The check passes on the real (interpreted) kernel for the tiny model, and
for a windowed, soft-capped, int8-KV variant; it catches a kernel that
ignores the window or the soft cap. An injected compile error and an
injected mismatch (``attention_check.pallas_attention`` monkeypatched) make
an ``"auto"`` engine serve through the XLA path with the same greedy tokens
as an ``attention_impl="xla"`` engine, log one line, and count the fallback
in the ``/metrics`` text; an explicit ``"pallas"`` raises.
"""

import dataclasses
import logging

import jax.numpy as jnp
import pytest

from jaxserve import SamplingParams
from jaxserve.engine import attention_check
from jaxserve.engine.attention_check import AttentionCheckError, check_attention
from jaxserve.metrics import ServingMetrics
from tiny_models import tiny_config

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], [200], list(range(10, 90))]
REAL_PALLAS = attention_check.pallas_attention


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def serve(engine):
    """Mixed steps: "a" decodes while "c" prefills in chunks beside it."""
    engine.add_request("a", PROMPTS[0], greedy(8))
    engine.step()
    engine.add_request("b", PROMPTS[1], greedy(4))
    engine.add_request("c", PROMPTS[2], greedy(4))
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o.outputs[0].token_ids) for o in engine.step()
                     if o.finished)
    return final


def metrics_text(engine) -> str:
    m = ServingMetrics()
    m.observe_stats(engine.stats())
    return m.render().decode()


def compile_error(*args, **kw):
    raise RuntimeError("Mosaic failed to compile TPU kernel: injected by the test")


def wrong_by_10_percent(*args, **kw):
    return REAL_PALLAS(*args, **kw) * 1.1


@pytest.fixture(scope="module")
def xla_tokens(tiny_parts):
    from conftest import _factory
    llm = _factory(tiny_parts)(attention_impl="xla", max_num_batched_tokens=32)
    assert llm.engine.attention_check is None  # "xla" runs no check
    return serve(llm.engine)


def test_check_passes_on_the_real_kernel():
    r = check_attention(tiny_config(), jnp.float32, jnp.float32, 8, interpret=True)
    assert (r.impl, r.reason) == ("pallas", None), r.detail
    assert r.max_error < 1e-4


def test_check_covers_windows_soft_cap_and_int8_kv(monkeypatch):
    cfg = tiny_config(sliding_window=24, layer_types=("sliding_attention", "full_attention",
                                                       "sliding_attention"),
                      attn_logit_softcapping=30.0)
    seen = []

    def spy(*args, **kw):
        seen.append((kw["sliding_window"], kw["soft_cap"], kw["k_scales_PLK"] is not None))
        return REAL_PALLAS(*args, **kw)

    monkeypatch.setattr(attention_check, "pallas_attention", spy)
    r = check_attention(cfg, jnp.float32, jnp.int8, 8, interpret=True)
    assert r.reason is None, r.detail
    assert r.max_error < 1e-4  # both paths dequantize the same int8 pages
    assert seen == [(None, 30.0, True), (24, 30.0, True)]  # every window of the layers


@pytest.mark.parametrize("drop", ["sliding_window", "soft_cap"])
def test_check_catches_a_kernel_ignoring_window_or_cap(monkeypatch, drop):
    cfg = tiny_config(sliding_window=24, attn_logit_softcapping=5.0)
    monkeypatch.setattr(attention_check, "pallas_attention",
                        lambda *a, **kw: REAL_PALLAS(*a, **{**kw, drop: None}))
    r = check_attention(cfg, jnp.float32, jnp.float32, 8, interpret=True)
    assert (r.impl, r.reason) == ("xla", "mismatch")
    assert r.max_error > 1e-2, r.detail


@pytest.mark.parametrize("inject, reason", [(compile_error, "compile_error"),
                                            (wrong_by_10_percent, "mismatch")])
def test_injected_failure_falls_back_to_xla(make_tiny_llm, xla_tokens, monkeypatch, caplog,
                                            inject, reason):
    monkeypatch.setattr(attention_check, "pallas_attention", inject)
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.attention_check"):
        llm = make_tiny_llm(attention_impl="auto", attention_interpret=True,
                            max_num_batched_tokens=32)
    engine = llm.engine
    lines = [r.getMessage() for r in caplog.records
             if r.name == "jaxserve.engine.attention_check"]
    assert len(lines) == 1 and f"failed ({reason})" in lines[0] \
        and "XLA path" in lines[0], lines
    print(lines[0])
    assert engine.attention_impl == "xla"
    assert engine.attention_check.reason == reason
    assert serve(engine) == xla_tokens
    text = metrics_text(engine)
    print("\n".join(line for line in text.splitlines() if "jaxserve_attention" in line))
    assert f'jaxserve_attention_fallback_total{{reason="{reason}"}} 1.0' in text
    assert 'jaxserve_attention_impl{impl="xla"} 1.0' in text
    assert 'jaxserve_attention_impl{impl="pallas"} 0.0' in text


@pytest.mark.parametrize("inject, reason", [(compile_error, "compile_error"),
                                            (wrong_by_10_percent, "mismatch")])
def test_explicit_pallas_with_a_failed_check_raises(make_tiny_llm, monkeypatch, inject,
                                                    reason):
    monkeypatch.setattr(attention_check, "pallas_attention", inject)
    with pytest.raises(AttentionCheckError, match=f"failed \\({reason}\\).*not falling back"):
        make_tiny_llm(attention_impl="pallas", attention_interpret=True)


def test_auto_with_a_passing_check_serves_pallas(make_tiny_llm):
    engine = make_tiny_llm(attention_impl="auto", attention_interpret=True).engine
    assert engine.attention_impl == "pallas"
    assert engine.attention_check.reason is None
    text = metrics_text(engine)
    assert 'jaxserve_attention_impl{impl="pallas"} 1.0' in text
    assert 'jaxserve_attention_fallback_total{reason=' not in text


def test_auto_on_cpu_runs_no_check(make_tiny_llm, monkeypatch):
    import jax
    if jax.default_backend() != "cpu":
        pytest.skip("CPU behaviour")
    monkeypatch.setattr(attention_check, "pallas_attention", compile_error)
    engine = make_tiny_llm().engine
    assert (engine.attention_impl, engine.attention_check) == ("xla", None)
    assert dataclasses.asdict(engine.stats())["attention_fallback"] == ""


def test_every_model_is_checked_and_the_first_failure_decides(monkeypatch):
    """A draft model's heads are checked beside the target's: a kernel that
    fails only on the draft's shape sends both to XLA."""
    from jaxserve.config import EngineConfig
    target, draft = tiny_config(), tiny_config(num_heads=6, num_kv_heads=2, head_dim=32)

    def fails_on_draft(q_TNH, *args, **kw):
        if q_TNH.shape[1:] == (6, 32):
            raise ValueError("injected: no lowering for the draft's heads")
        return REAL_PALLAS(q_TNH, *args, **kw)

    monkeypatch.setattr(attention_check, "pallas_attention", fails_on_draft)
    config = EngineConfig(attention_impl="auto", attention_interpret=True)
    impl, check = attention_check.choose_attention_impl(config, [target])
    assert (impl, check.reason) == ("pallas", None)
    impl, check = attention_check.choose_attention_impl(config, [target, draft])
    assert (impl, check.reason) == ("xla", "compile_error") and "N6/K2/H32" in check.detail


def test_cache_refusal_names_the_stacked_cache_the_gpu_kernel_cannot_address():
    """The engine's own cache shape, [layers * pages, L, K, H], is checked
    against the GPU kernel's 32-bit addressing before any step: an int8
    cache just over 2^31 elements is refused, the same pages in bf16 (i64
    offsets past 2^32 bytes) and one page fewer in int8 are not."""
    cfg = dataclasses.replace(tiny_config(), num_layers=4, num_kv_heads=2, head_dim=64)
    per_page = 4 * 16 * 2 * 64                       # elements of one page, all layers
    pages = 2**31 // per_page + 1                    # just over 2^31 elements
    why = attention_check.cache_refusal([cfg], pages, 16, jnp.int8)
    assert why is not None and "32-bit offsets" in why and str(4 * pages) in why, why
    assert attention_check.cache_refusal([cfg], pages, 16, jnp.bfloat16) is None
    assert attention_check.cache_refusal([cfg], pages - 1, 16, jnp.int8) is None


def test_a_cache_the_kernel_refuses_falls_back_to_xla(make_tiny_llm, xla_tokens, monkeypatch):
    """A refused cache shape (the check forced, a real one needs GBs) sends
    "auto" to XLA without running the kernel, counted as unsupported_cache;
    explicit "pallas" raises."""
    def refuse(pages_PLKH):
        raise ValueError(f"refused {tuple(pages_PLKH.shape)}")
    monkeypatch.setattr(attention_check, "check_addressing", refuse)
    monkeypatch.setattr(attention_check, "pallas_attention", compile_error)  # must not run
    engine = make_tiny_llm(attention_impl="auto", attention_interpret=True,
                           max_num_batched_tokens=32).engine
    assert engine.attention_impl == "xla"
    assert engine.attention_check.reason == "unsupported_cache"
    assert "refused" in engine.attention_check.detail
    assert serve(engine) == xla_tokens
    assert 'jaxserve_attention_fallback_total{reason="unsupported_cache"} 1.0' in \
        metrics_text(engine)
    with pytest.raises(AttentionCheckError, match="unsupported_cache"):
        make_tiny_llm(attention_impl="pallas", attention_interpret=True)
