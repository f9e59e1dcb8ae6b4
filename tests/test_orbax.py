"""Orbax checkpoints (``checkpoints.orbax_ckpt``): convert, restore into a sharding.

Layers: a tiny random GGUF converted to an Orbax folder round-trips config,
params, tokenizer and chat template exactly; the engine on that folder gives
the same last-token logits as on the GGUF (1 device, ``tp=4`` and
``tp=2,ep=2`` meshes), and the arrays Orbax restores already carry the
shardings the model's logical axes give them; a tiny random Mixtral HF folder
the same on ``tp=2,ep=2``; a deleted or truncated file under ``params/`` and a
missing folder are ``ValueError``s naming the file; ``--mode convert`` on the
command line; and the real SmolLM2-135M (``real_model``, ``slow``).

``tests/conftest.py`` gives the CPU backend 8 devices.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import XLA_CACHE
from flax import nnx
from jax.sharding import PartitionSpec as P

from checkpoints import orbax_ckpt
from checkpoints.loader import convert_to_orbax, load_checkpoint, load_model_config
from jaxserve import LLM
from jaxserve.models import MODEL_CLASSES, llama, moe
from sharding.mesh import parse_mesh_spec
from sharding.rules import hf_shardings

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], list(range(10, 40)), [42] * 19, [200]]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_llm(model, mesh: str | None = None, **kw) -> LLM:
    n = 1 if mesh is None else math.prod(parse_mesh_spec(mesh).values())
    return LLM(str(model), num_pages=64, page_size=8, compilation_cache_dir=XLA_CACHE,
               mesh=mesh, devices=jax.devices()[:n], **kw)


@pytest.fixture(scope="module")
def gguf_path(untied_gguf):
    return untied_gguf


@pytest.fixture(scope="module")
def gguf_orbax(gguf_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "tiny"
    written = convert_to_orbax(gguf_path, out, show_progress=False)
    assert written[0] == out.absolute() / "params"
    return out


def test_roundtrip_config_params_tokenizer(gguf_path, gguf_orbax):
    assert orbax_ckpt.is_orbax_checkpoint(gguf_orbax)
    assert not orbax_ckpt.is_orbax_checkpoint(gguf_path)
    src = load_checkpoint(gguf_path, show_progress=False)
    ours = load_checkpoint(gguf_orbax, show_progress=False)
    assert isinstance(ours, orbax_ckpt.OrbaxCheckpoint)
    assert ours.config == src.config == load_model_config(gguf_orbax)
    assert sorted(ours.params) == sorted(src.params)
    for name, a in src.params.items():
        assert isinstance(ours.params[name], np.ndarray), name
        np.testing.assert_array_equal(ours.params[name], a, err_msg=name)
        assert ours.params[name].dtype == np.float32
    assert ours.chat_template == src.chat_template and ours.chat_template
    text = "<|im_start|>user\nhello world, 123!<|im_end|>"
    assert ours.tokenizer.encode(text) == src.tokenizer.encode(text)
    ids = src.tokenizer.encode(text)
    assert ours.tokenizer.decode(ids) == src.tokenizer.decode(ids)
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id",
                 "special_token_ids"):
        assert getattr(ours.tokenizer, attr) == getattr(src.tokenizer, attr), attr
    assert ours.metadata["source"] == str(gguf_path)


def test_convert_refuses_non_empty_output(gguf_path, gguf_orbax):
    with pytest.raises(ValueError, match="exists and is not empty"):
        convert_to_orbax(gguf_path, gguf_orbax, show_progress=False)


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


def _check_shardings(llm, params, family):
    """Every restored array is a jax.Array already in the sharding its param's
    logical axes give it on the engine's mesh."""
    engine = llm.engine
    cfg = engine.runner.model_config  # the engine's layers are stacked: name an unstacked twin's
    unstacked = nnx.eval_shape(lambda: MODEL_CLASSES[cfg.architecture](cfg, rngs=nnx.Rngs(0)))
    want = hf_shardings(family.hf_params(unstacked), engine.mesh, engine.runner.rules)
    assert sorted(params) == sorted(want)
    for name, arr in params.items():
        assert isinstance(arr, jax.Array), name
        assert arr.sharding.mesh == engine.mesh, name
        assert arr.sharding.spec == want[name].spec, (name, arr.sharding.spec, want[name].spec)
    return want


@pytest.mark.parametrize("mesh", [None, "tp=4", "tp=2,ep=2"])
def test_engine_logits_match_gguf(gguf_path, gguf_orbax, restored, mesh):
    ref = make_llm(gguf_path, mesh).engine.last_token_logits(PROMPTS)
    llm = make_llm(gguf_orbax, mesh)
    ours = llm.engine.last_token_logits(PROMPTS)
    np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
    assert len(restored) == 1
    want = _check_shardings(llm, restored[0], llama)
    tp = 1 if mesh is None else parse_mesh_spec(mesh)["tp"]
    if tp > 1:  # vocab 320, 4 heads, MLP 128 split; 2 kv heads split only at tp=2
        assert want["model.embed_tokens.weight"].spec == P("tp", None)
        assert want["lm_head.weight"].spec == P("tp", None)
        assert want["model.layers.0.self_attn.q_proj.weight"].spec == P("tp", None)
        assert want["model.layers.1.mlp.down_proj.weight"].spec == P(None, "tp")
        kv = P("tp", None) if tp == 2 else P(None, None)
        assert want["model.layers.0.self_attn.k_proj.weight"].spec == kv
    # The runner keeps the restored layout.
    placed = jax.tree_util.tree_leaves(llm.engine.runner.state)
    for arr, sharding in zip(placed, jax.tree_util.tree_leaves(llm.engine.runner.param_shardings)):
        assert arr.sharding.spec == sharding.spec
    assert llm.get_tokenizer() is not None


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, "tp=2,ep=2"])
def test_mixtral_logits_match_hf_folder(mixtral_folders, restored, mesh):
    hf, orbax_dir = mixtral_folders
    ref = make_llm(hf, mesh).engine.last_token_logits(PROMPTS)
    llm = make_llm(orbax_dir, mesh)
    np.testing.assert_allclose(llm.engine.last_token_logits(PROMPTS), ref, atol=1e-6, rtol=0)
    want = _check_shardings(llm, restored[0], moe)
    if mesh is not None:  # one expert's tensor: split over tp, replicated over ep
        assert want["model.layers.0.block_sparse_moe.experts.3.w1.weight"].spec == P("tp", None)
        assert want["model.layers.0.block_sparse_moe.experts.3.w2.weight"].spec == P(None, "tp")
        stacked = llm.engine.runner.layer_params(0)["mlp"]["gate_proj"].value
        assert stacked.sharding.spec == P("ep", "tp", None)


# ---- errors -----------------------------------------------------------------

def _data_files(folder: pathlib.Path) -> list[pathlib.Path]:
    files = [p for p in (folder / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, list((folder / "params").rglob("*"))
    return sorted(files, key=lambda p: -p.stat().st_size)


@pytest.mark.parametrize("damage", ["delete", "truncate", "flip"])
def test_damaged_params_file_is_named(gguf_orbax, tmp_path, damage):
    bad = tmp_path / "bad"
    shutil.copytree(gguf_orbax, bad)
    victim = _data_files(bad)[0]
    size = victim.stat().st_size
    if damage == "delete":
        victim.unlink()
    elif damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(size // 2)
    else:  # 64 bytes changed in place, same size: zstd may still decode it
        with open(victim, "r+b") as f:
            f.seek(size // 2)
            data = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0x5A for b in data))
        assert victim.stat().st_size == size
    with pytest.raises(ValueError, match=victim.name):
        orbax_ckpt.restore_orbax(bad, show_progress=False)
    with pytest.raises(ValueError, match=victim.name):
        make_llm(bad)


def test_missing_checkpoint_is_named(gguf_orbax, tmp_path):
    with pytest.raises(ValueError, match="model_config.json"):
        orbax_ckpt.load_orbax_config(tmp_path / "nothing")
    with pytest.raises(ValueError, match="params"):
        orbax_ckpt.restore_orbax(tmp_path / "nothing", show_progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(gguf_orbax, bad)
    (bad / "model_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="model_config.json"):
        load_model_config(bad)


def test_restore_only_the_named_tensors(gguf_orbax):
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    one = {"model.embed_tokens.weight": jax.sharding.NamedSharding(mesh, P("tp", None))}
    out = orbax_ckpt.restore_orbax(gguf_orbax, one, show_progress=False)
    assert list(out) == list(one) and out["model.embed_tokens.weight"].sharding == one[
        "model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="lacks tensor 'model.nothing.weight'"):
        orbax_ckpt.restore_orbax(gguf_orbax, {"model.nothing.weight": one[
            "model.embed_tokens.weight"]}, show_progress=False)


def test_cli_convert(gguf_path, tmp_path):
    out = tmp_path / "cli"
    res = subprocess.run([sys.executable, "-m", "jaxserve.main", "--mode", "convert",
                          "--model", str(gguf_path), "--output", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr
    assert str(out.absolute() / "params") in res.stdout
    assert "model_config.json" in res.stdout and "tokenizer.json" in res.stdout
    assert orbax_ckpt.load_orbax_config(out) == load_model_config(gguf_path)


# ---- the real SmolLM2-135M --------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_orbax_logits_match_gguf(smollm2_path, tmp_path):
    out = tmp_path / "smollm2"
    convert_to_orbax(smollm2_path, out, show_progress=False)
    kw = dict(num_pages=32, page_size=16, max_model_len=256, compilation_cache_dir=XLA_CACHE)
    ref = LLM(str(smollm2_path), **kw)
    ids = [ref.engine.encode(p) for p in ("The capital of France is", "1, 2, 3,")]
    ref_logits = ref.engine.last_token_logits(ids)
    del ref
    for mesh, n in ((None, 1), ("tp=3", 3)):
        llm = LLM(str(out), mesh=mesh, devices=jax.devices()[:n], **kw)
        assert [llm.engine.encode(p) for p in ("The capital of France is", "1, 2, 3,")] == ids
        np.testing.assert_allclose(llm.engine.last_token_logits(ids), ref_logits,
                                   atol=1e-6 if n == 1 else 1e-4, rtol=0)
