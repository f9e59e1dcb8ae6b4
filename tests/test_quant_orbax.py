"""Quantized Orbax checkpoints (``convert_to_orbax(..., quantization=...)``).

Layers: a tiny random llama GGUF converted with int8, int4 and gguf stores
every projection as its parts (``:q`` int8 / packed uint8, ``:scale`` f32,
``:zero`` only where the format has one) and the rest as f32, with the
formats in ``jaxserve_orbax.json``, and restores to exactly the
``quantize_np`` of the source weights; an engine on the folder takes the
checkpoint's quantization and gives the same greedy tokens as one built with
that quantization straight from the GGUF; on ``tp=2`` (fake CPU devices) the
parts are restored already split like their logical axes, and the tokens
stay the same; a different explicit ``quantization`` is an error before any
weight is read; ``--mode convert --quantization int8`` on the command line.

A tiny Mixtral's experts are stored quantized too (its router is not).

``tests/conftest.py`` gives the CPU backend 8 devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import XLA_CACHE
from jax.sharding import PartitionSpec as P

from checkpoints import orbax_ckpt
from checkpoints.loader import convert_to_orbax, load_checkpoint
from jaxserve import LLM, SamplingParams
from jaxserve.models import quant

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], list(range(10, 40)), [200]]
ROOT = pathlib.Path(__file__).resolve().parents[1]
Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


def make_llm(model, tp: int = 1, **kw) -> LLM:
    return LLM(str(model), num_pages=64, page_size=8, compilation_cache_dir=XLA_CACHE,
               mesh=None if tp == 1 else f"tp={tp}", devices=jax.devices()[:tp], **kw)


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def source(untied_gguf):
    """A tiny Q8_0 GGUF (D 64, F 128, 4 heads, 2 kv heads, untied LM head)."""
    return untied_gguf


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """method -> Orbax folder converted from ``source`` with it."""
    root = tmp_path_factory.mktemp("qorbax")
    out = {}
    for method in ("int8", "int4", "gguf"):
        out[method] = root / method
        convert_to_orbax(source, out[method], show_progress=False, quantization=method)
    return out


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_layout_and_exact_restore(source, converted, method):
    folder = converted[method]
    tree = orbax_ckpt._metadata_tree(folder)
    src = load_checkpoint(source, show_progress=False).params
    saved = json.loads((folder / "jaxserve_orbax.json").read_text())["quantization"]
    assert saved["method"] == method and saved["group_size"] == 32
    projections = [n for n in src if quant.is_projection(n) or n == "lm_head.weight"]
    assert sorted(saved["formats"]) == sorted(projections) and len(projections) == 15
    fmt = quant.method_format(method) if method != "gguf" else quant.Q8_0  # a Q8_0 file
    head_fmt = quant.head_format(fmt) if method != "gguf" else fmt  # int8/int4: Q8_0 groups
    for name in src:
        if name not in projections:
            assert tree[name].dtype == np.float32, name
            continue
        assert name not in tree
        fmt_ = head_fmt if name == "lm_head.weight" else fmt
        assert tree[f"{name}:q"].dtype == (np.uint8 if fmt_.bits == 4 else np.int8), name
        assert tree[f"{name}:scale"].dtype == (np.float32 if fmt_.group_size is None
                                               else np.float16), name  # grouped: f16
        assert (f"{name}:zero" in tree) == fmt_.zero_point, name
    assert tree[f"{Q}:q"].shape == ((64, 32) if fmt.bits == 4 else (64, 64))
    ckpt = load_checkpoint(folder, show_progress=False)
    assert ckpt.quantization.method == method
    for name, w in src.items():
        got = ckpt.params[name]
        if name not in projections:
            assert isinstance(got, np.ndarray) and np.array_equal(got, w), name
            continue
        assert isinstance(got, quant.QuantizedTensor) and got.fmt == (
            head_fmt if name == "lm_head.weight" else fmt), name
        if method == "gguf":  # the file's own blocks
            assert np.array_equal(got.dequantize(), w), name
        else:
            want = quant.quantize_np(w, head_fmt if name == "lm_head.weight" else fmt)
            for part in ("q", "scale", "zero"):
                a, b = getattr(got, part), getattr(want, part)
                assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), name


@pytest.fixture
def restored(monkeypatch):
    """Records what ``restore_orbax`` returns to the engine."""
    seen = []
    real = orbax_ckpt.restore_orbax

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]
    monkeypatch.setattr(orbax_ckpt, "restore_orbax", spy)
    return seen


@pytest.mark.parametrize("method", ["int8", "int4", "gguf"])
def test_engine_tokens_match_direct_quantization(source, converted, restored, method):
    want = greedy(make_llm(source, quantization=method))
    llm = make_llm(converted[method])  # quantization "none": the checkpoint's is taken
    assert llm.engine.config.quantization == method
    assert greedy(llm) == want
    assert len(restored) == 1
    qt = restored[0][Q]
    assert isinstance(qt, quant.QuantizedTensor) and isinstance(qt.q, jax.Array)
    q_state = llm.engine.runner.layer_params(0)["self_attn"]["q_proj"]["q"].value
    assert q_state.dtype == qt.q.dtype
    assert greedy(make_llm(converted[method], quantization=method)) == want  # equal is fine


@pytest.mark.parametrize("method", ["int8", "gguf"])
def test_quantized_head_round_trip(source, converted, method):
    """The untied head restores as the stored format (gguf: the file's Q8_0
    blocks of ``output.weight``), the engine's tokens those of one built
    from the GGUF; ``quantize_lm_head=False`` on the same folder holds it
    dense (the stored values, dequantized) and gives the same tokens."""
    from flax import nnx
    want = greedy(make_llm(source, quantization=method))
    llm = make_llm(converted[method])
    model = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state)
    fmt = quant.Q8_0  # int8's head: Q8_0 groups (quant.head_format); gguf: the file's Q8_0
    assert isinstance(model.lm_head, quant.QuantizedWeight) and model.lm_head.fmt == fmt
    stored = load_checkpoint(converted[method], show_progress=False).params["lm_head.weight"]
    assert np.array_equal(np.asarray(model.lm_head.q[...]), stored.q)
    assert greedy(llm) == want
    dense = make_llm(converted[method], quantize_lm_head=False)
    head = nnx.merge(dense.engine.runner.graphdef, dense.engine.runner.state).lm_head
    assert isinstance(head, nnx.Param) and np.array_equal(np.asarray(head[...]),
                                                          stored.dequantize())
    assert greedy(dense) == want


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tp2_restores_parts_split(source, converted, restored, method):
    llm = make_llm(converted[method], tp=2)
    q, down = restored[0][Q], restored[0][DOWN]
    # q_proj [N*H, D] ("q_heads", "embed"): rows over tp, its scales too.
    assert q.q.sharding.spec == P("tp", None) and q.scale.sharding.spec == P("tp", None)
    # down_proj [D, F] ("embed", "mlp"): columns over tp; per-channel scales
    # have one column (replicated), int4's [D, F/32] groups split like F.
    assert down.q.sharding.spec == P(None, "tp")
    assert down.scale.sharding.spec == (P(None, "tp") if method == "int4" else P(None, None))
    if method == "int4":
        assert down.zero.sharding.spec == P(None, "tp")
        assert down.q.addressable_shards[0].data.shape == (64, 32)  # 128 / 2 / 2 bytes
    placed = llm.engine.runner.layer_params(1)["mlp"]["down_proj"]["q"].value
    assert placed.sharding.spec == P(None, "tp")
    assert greedy(llm) == greedy(make_llm(source, quantization=method))


def test_mismatching_quantization_fails_before_weights(converted, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("weights read before the quantization was checked")
    monkeypatch.setattr(orbax_ckpt, "restore_orbax", fail)
    with pytest.raises(ValueError, match="int8.*int4|int4.*int8"):
        make_llm(converted["int8"], quantization="int4")
    with pytest.raises(ValueError, match="w8a8.*int8|int8.*w8a8"):
        make_llm(converted["int8"], quantization="w8a8")


def test_convert_errors(source, converted, tmp_path):
    with pytest.raises(ValueError, match="gguf.*folder"):
        convert_to_orbax(converted["int8"], tmp_path / "a", quantization="gguf",
                         show_progress=False)
    with pytest.raises(ValueError, match="group_size=48"):
        convert_to_orbax(source, tmp_path / "b", quantization="int4", group_size=48,
                         show_progress=False)
    with pytest.raises(ValueError, match="quantization must be one of"):
        convert_to_orbax(source, tmp_path / "c", quantization="fp4", show_progress=False)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_cli_convert_int8(source, tmp_path):
    out = tmp_path / "cli"
    res = subprocess.run([sys.executable, "-m", "jaxserve.main", "--mode", "convert",
                          "--model", str(source), "--output", str(out),
                          "--quantization", "int8"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr
    assert "projections int8" in res.stdout
    saved = orbax_ckpt.saved_quantization(out)
    assert saved.method == "int8" and saved.formats[Q] == quant.INT8
    assert orbax_ckpt._metadata_tree(out)[f"{DOWN}:q"].dtype == np.int8


@pytest.mark.slow
def test_mixtral_int8_experts_stored_quantized(mixtral_folders, tmp_path):
    hf, _ = mixtral_folders
    out = tmp_path / "mixtral-int8"
    convert_to_orbax(hf, out, quantization="int8", show_progress=False)
    tree = orbax_ckpt._metadata_tree(out)
    assert tree["model.layers.0.block_sparse_moe.experts.3.w2.weight:q"].dtype == np.int8
    assert tree["model.layers.0.block_sparse_moe.gate.weight"].dtype == np.float32  # router
    assert greedy(make_llm(out)) == greedy(make_llm(hf, quantization="int8"))


def test_unquantized_orbax_quantized_on_load(source, tmp_path):
    out = tmp_path / "f32"
    convert_to_orbax(source, out, show_progress=False)
    assert greedy(make_llm(out, quantization="int8")) == greedy(make_llm(source,
                                                                          quantization="int8"))
    with pytest.raises(ValueError, match="unquantized"):
        make_llm(out, quantization="gguf")
