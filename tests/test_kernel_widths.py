"""The CPU kernel's column limits per machine (``jaxserve.engine.kernel_widths``):
the rule that turns timings into a limit, the process table and its checks, when
the built-in table is kept, a real measurement and its cache, the kinds a model's
weights use, and the engine build installing them."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import executables, format_choice, kernel_widths
from jaxserve.models import quant, quant_cpu
from pallas_kernels import quant_matmul_cpu as qmc

SMALL = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_heads=4,
                    num_kv_heads=2, num_layers=2)
needs_library = pytest.mark.skipif(not qmc.available(), reason="CPU kernel library not built")


@pytest.fixture(autouse=True)
def fresh_table(monkeypatch, tmp_path):
    """The built-in table and nothing resolved, before and after each test; a
    private cache folder; measurement allowed."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv(kernel_widths.ENV, "measure")
    before = qmc.set_max_columns(dict(qmc.BUILTIN_MAX_COLUMNS))
    wide = quant_cpu.set_int8_wide_form("int8_dot")
    monkeypatch.setattr(kernel_widths, "_resolved", {})
    yield tmp_path
    qmc.set_max_columns(before)
    quant_cpu.set_int8_wide_form(wide)


def test_limit_is_the_last_width_of_the_kernels_unbroken_lead():
    assert kernel_widths.limit_from({1: (10, 5), 8: (10, 6), 32: (10, 9.9)}) == 32
    # The first loss ends it, whatever a wider width measured after.
    assert kernel_widths.limit_from({1: (10, 5), 8: (10, 6), 32: (10, 11), 128: (9, 5)}) == 8
    assert kernel_widths.limit_from({1: (4, 5)}) == 0
    assert kernel_widths.limit_from({1: (4, 4)}) == 0  # a tie keeps XLA's form
    assert kernel_widths.limit_from({}) == 0


def test_wide_passes_run_over_a_share_of_the_layers():
    # every layer while a step streams its weights, then about the same work
    assert [kernel_widths.layers_at(M, 30) for M in (1, 8, 32, 128, 512, 2048)] == \
        [30, 30, 30, 8, 2, 1]
    assert kernel_widths.layers_at(2048, 2) == 1 and kernel_widths.layers_at(64, 3) == 2


def test_the_process_table_is_checked_and_read_by_use_kernel():
    previous = qmc.set_max_columns({"int8": 64})
    assert previous == qmc.BUILTIN_MAX_COLUMNS
    assert qmc.use_kernel("int8", 576, 576, 64) and not qmc.use_kernel("int8", 576, 576, 65)
    assert qmc.max_columns()["int8"] == 64 and qmc.BUILTIN_MAX_COLUMNS["int8"] == 1
    qmc.set_max_columns({"int8": 0})
    assert not qmc.use_kernel("int8", 576, 576, 1)
    with pytest.raises(ValueError, match="unknown kernel kind 'int3'"):
        qmc.set_max_columns({"int3": 4})
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="int8"):
            qmc.set_max_columns({"int8": bad})
    assert qmc.max_columns()["int8"] == 0  # a refused call changes nothing


@needs_library
def test_the_limits_are_part_of_the_program_fingerprint():
    a, fa = executables.kernel_digest(), executables.fingerprint("x")
    qmc.set_max_columns({"q4g": 256})
    assert executables.kernel_digest() != a
    qmc.set_max_columns({"q4g": qmc.BUILTIN_MAX_COLUMNS["q4g"]})
    assert executables.kernel_digest() == a and executables.fingerprint("x") == fa
    quant_cpu.set_int8_wide_form("dequantize")
    assert executables.fingerprint("x") != fa


@pytest.mark.parametrize("M", [5, 33])
def test_int8_wide_forms_against_the_f64_reference(M):
    """Past the kernel (its limit 0 here), int8's "dequantize" form is the
    format's exact product (f32 rounding only), "int8_dot" its two-int8-term
    approximation of x (~16 bits); both near the f64 reference."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 160)).astype(np.float32) * 0.05
    x = rng.standard_normal((160, M)).astype(np.float32)
    t = quant.quantize_np(w, quant.INT8)
    ref = (t.q.astype(np.float64) * t.scale.astype(np.float64)) @ x.astype(np.float64)
    qmc.set_max_columns({"int8": 0})
    q, scale = jnp.asarray(t.q), jnp.asarray(t.scale)
    err = {}
    for form in quant_cpu.INT8_WIDE_FORMS:
        quant_cpu.set_int8_wide_form(form)
        y = np.asarray(quant.quantized_matmul(quant.INT8, q, scale, None, jnp.asarray(x)))
        err[form] = np.abs(y - ref).max() / np.abs(ref).max()
    exact = np.asarray(quant.quantized_matmul(quant.INT8, q, scale, None, jnp.asarray(x),
                                              "exact"))
    quant_cpu.set_int8_wide_form("dequantize")
    again = np.asarray(quant.quantized_matmul(quant.INT8, q, scale, None, jnp.asarray(x)))
    assert err["dequantize"] < 1e-6 and np.allclose(again, exact, rtol=0, atol=1e-5)
    assert 1e-7 < err["int8_dot"] < 1e-4  # the two-term form: visibly not f32's rounding
    with pytest.raises(ValueError, match="'int4_dot'"):
        quant_cpu.set_int8_wide_form("int4_dot")
    assert quant_cpu.int8_wide_form() == "dequantize"


def test_builtin_where_measuring_cannot_help_or_is_not_wanted(monkeypatch, fresh_table):
    big = ModelConfig(vocab_size=320, hidden_size=1024, intermediate_size=4096, num_heads=8,
                      num_kv_heads=8, num_layers=4)
    w = kernel_widths.choose("int8", SMALL)
    assert (w.max_columns, w.source, w.ms) == (qmc.BUILTIN_MAX_COLUMNS["int8"], "builtin", {})
    assert ("overhead-bound" if qmc.available() else "not built") in w.reason
    monkeypatch.setenv(kernel_widths.ENV, "builtin")
    w = kernel_widths.choose("q4g", big)
    assert w.source == "builtin" and (f"{kernel_widths.ENV}=builtin" in w.reason
                                      or not qmc.available())
    monkeypatch.setattr(qmc, "available", lambda: False)
    monkeypatch.setenv(kernel_widths.ENV, "measure")
    assert "not built" in kernel_widths.choose("q4g", big).reason
    monkeypatch.setenv(kernel_widths.ENV, "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        kernel_widths.choose("q4g", big)
    assert not (fresh_table / kernel_widths.CACHE_FILE).exists()


@needs_library
def test_a_measurement_sets_the_limit_it_timed_and_is_cached(monkeypatch, fresh_table):
    monkeypatch.setattr(format_choice, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(kernel_widths, "COLUMNS", (1, 8, 32))
    table = qmc.max_columns()
    w = kernel_widths.choose("int8", SMALL)
    assert w.source == "measured" and qmc.max_columns() == table  # measuring restores it
    assert list(w.ms) == [1, 8, 32][:len(w.ms)] and w.ms
    assert all(x > 0 and k > 0 for x, k in w.ms.values())
    assert w.max_columns == kernel_widths.limit_from(w.ms)
    # Measuring stopped at the kernel's first loss, or ran every width.
    last_x, last_k = w.ms[max(w.ms)]
    assert last_k >= last_x or len(w.ms) == 3
    saved = json.loads((fresh_table / kernel_widths.CACHE_FILE).read_text())
    ((key, entry),) = saved.items()
    # Keyed on the library's bytes: a rebuilt library measures again.
    assert executables.library_digest() in key and executables.library_digest() != "xla"
    assert entry["max_columns"] == w.max_columns and "int8 kernel / XLA form" in entry["reason"]
    # int8 also times XLA's two forms past the kernel, and keeps the faster.
    assert set(w.wide_ms) == set(quant_cpu.INT8_WIDE_FORMS)
    assert w.wide_form == min(w.wide_ms, key=w.wide_ms.get) and quant_cpu.int8_wide_form() == (
        "int8_dot")  # measuring restores the process's form
    again = kernel_widths.choose("int8", SMALL)
    assert (again.source, again.max_columns, again.ms, again.wide_form) == (
        "cached", w.max_columns, w.ms, w.wide_form)
    assert kernel_widths.choose("q8g", SMALL, use_cache=False).wide_form is None


def test_kinds_of_a_model_and_the_build_installs_them(monkeypatch, make_tiny_llm):
    from jaxserve.engine import build
    chosen = []

    def choose(kind, model_config, **kw):
        chosen.append(kind)
        return kernel_widths.KindWidth(kind, 7, {1: (2.0, 1.0)}, "measured", "test",
                                       "dequantize" if kind == "int8" else None)
    monkeypatch.setattr(kernel_widths, "choose", choose)
    kinds = {}
    real_resolve = kernel_widths.resolve

    def resolve(model, model_config, quantization, dtype):
        kinds[quantization] = kernel_widths.kinds_of(model, quantization, dtype)
        return real_resolve(model, model_config, quantization, dtype)
    monkeypatch.setattr(build.kernel_widths, "resolve", resolve)
    make_tiny_llm(quantization="int8")
    # int8 projections, and the head in Q8_0-style groups (quant.head_format).
    assert kinds["int8"] == ["int8", "q8g"] == sorted(chosen)
    assert qmc.max_columns()["int8"] == 7 and qmc.max_columns()["q8g"] == 7
    assert quant_cpu.int8_wide_form() == "dequantize"
    assert set(kernel_widths.resolved()) == {"int8", "q8g"}
    make_tiny_llm(quantization="int4")
    assert kinds["int4"] == ["q4g", "q8g"] and sorted(chosen) == ["int8", "q4g", "q8g"]
    make_tiny_llm()
    assert kinds["none"] == ["f32"] and "f32" in chosen  # each kind once per process
    assert chosen.count("q8g") == 1
    assert qmc.max_columns() == {**qmc.BUILTIN_MAX_COLUMNS, "int8": 7, "q8g": 7, "q4g": 7,
                                 "f32": 7}
