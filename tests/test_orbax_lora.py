"""LoRA adapters shipped in an Orbax checkpoint (``checkpoints.orbax_lora``, issue 35).

The tiny random GGUF (``tiny_gguf``) is converted on the command line with
``--lora_modules a=...,b=...`` (two random PEFT adapters of ranks 4 and 8,
``jaxserve.bench.lora.write_random_adapter``; no torch). Checked: the
adapter files are copied byte for byte and listed in
``jaxserve_orbax.json``; ``LLM(model=<folder>, enable_lora=True)`` registers
both, and its last-token logits with each adapter equal those of the GGUF
with the original folders registered (and differ from the base); ``--mode
serve`` on the folder turns LoRA on by itself, lists the adapters on
``/v1/models`` and lets an explicit ``--lora_modules`` entry of the same name
replace one; a bad adapter entry exits 2 naming it before anything is
written; a truncated adapter file is a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import XLA_CACHE

from checkpoints.loader import load_model_config
from checkpoints.orbax_lora import checkpoint_adapters
from jaxserve import LLM
from jaxserve.bench.lora import write_random_adapter

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 31], list(range(10, 40)), [200]]
ROOT = pathlib.Path(__file__).resolve().parents[1]
RANKS = {"a": 4, "b": 8}


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.main", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def adapters(tiny_gguf, tmp_path_factory) -> dict[str, str]:
    """name -> a random PEFT adapter folder for the tiny GGUF."""
    cfg = load_model_config(tiny_gguf)
    return {name: write_random_adapter(str(tmp_path_factory.mktemp(f"adapter-{name}")), cfg,
                                       rank, seed=30 + i)
            for i, (name, rank) in enumerate(RANKS.items())}


@pytest.fixture(scope="module")
def converted(tiny_gguf, adapters, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("orbax-lora") / "ckpt"
    res = _main("--mode", "convert", "--model", tiny_gguf, "--output", str(out),
                "--lora_modules", ",".join(f"{n}={p}" for n, p in adapters.items()))
    assert res.returncode == 0, res.stderr[-3000:]
    for name in adapters:
        assert str(out.absolute() / "lora" / name) in res.stdout, res.stdout
    return out


def test_files_copied_and_listed(converted, adapters):
    assert checkpoint_adapters(converted) == [(n, str(converted / "lora" / n)) for n in RANKS]
    info = json.loads((converted / "jaxserve_orbax.json").read_text())["lora_adapters"]
    assert list(info) == ["a", "b"]
    for name, folder in adapters.items():
        assert info[name]["rank"] == RANKS[name] and info[name]["source"] == folder
        assert len(info[name]["target_modules"]) == 7
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            copied = (converted / "lora" / name / f).read_bytes()
            assert copied == (pathlib.Path(folder) / f).read_bytes(), f
            assert info[name]["files"][f] == len(copied)


def test_llm_registers_shipped_adapters_with_the_same_logits(tiny_gguf, converted, adapters):
    kw = dict(num_pages=64, page_size=8, compilation_cache_dir=XLA_CACHE, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    ref = LLM(tiny_gguf, **kw)
    for name, folder in adapters.items():
        ref.engine.add_lora(name, folder)
    want = {n: ref.engine.last_token_logits(PROMPTS, lora=n) for n in (None, "a", "b")}
    del ref
    llm = LLM(str(converted), **kw)
    assert llm.engine.list_loras() == ["a", "b"]
    for name in (None, "a", "b"):
        got = llm.engine.last_token_logits(PROMPTS, lora=name)
        np.testing.assert_allclose(got, want[name], atol=1e-6, rtol=0, err_msg=str(name))
    for name in ("a", "b"):  # the adapters do move the logits
        assert np.abs(want[name] - want[None]).max() > 1e-2, name
    # Without enable_lora the folder serves its base model only (vLLM's LLM).
    assert LLM(str(converted), num_pages=64, page_size=8,
               compilation_cache_dir=XLA_CACHE).engine.list_loras() == []


@pytest.mark.slow  # a server subprocess
def test_serve_turns_lora_on_and_lists_adapters(converted, adapters, tiny_gguf, tmp_path):
    import httpx
    from server_util import ServerProcess
    from test_server import ENGINE_FLAGS
    override = write_random_adapter(str(tmp_path / "b2"), load_model_config(tiny_gguf), 8, 99)
    s = ServerProcess(["--model", str(converted), "--http_port", "0", *ENGINE_FLAGS,
                       "--max_lora_rank", "8", "--lora_modules", f"b={override}"])
    try:
        with httpx.Client(base_url=s.http_url, timeout=120) as http:
            data = http.get("/v1/models").json()["data"]
            assert [(c["id"], c["root"]) for c in data] == [
                (str(converted), str(converted)), ("a", str(converted / "lora" / "a")),
                ("b", override)]
            r = http.post("/v1/completions", json=dict(model="a", prompt=PROMPTS[0],
                                                       max_tokens=4, temperature=0.0))
            assert r.status_code == 200 and r.json()["model"] == "a", r.text
    finally:
        assert s.terminate() == 0


def test_bad_adapter_fails_convert_before_writing(tiny_gguf, adapters, tmp_path):
    other = load_model_config(tiny_gguf)
    wrong = write_random_adapter(str(tmp_path / "wrong"), dataclasses.replace(
        other, intermediate_size=other.intermediate_size * 2), 4, seed=5)
    out = tmp_path / "never"
    res = _main("--mode", "convert", "--model", tiny_gguf, "--output", str(out),
                "--lora_modules", f"a={adapters['a']},bad={wrong}")
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"'bad={wrong}'" in errors[0] and "do not fit the base weight" in errors[0], errors
    assert not out.exists()


def test_truncated_adapter_file_named(converted, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(converted, copy)
    weights = copy / "lora" / "b" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match="adapter_model.safetensors.*truncated"):
        checkpoint_adapters(copy)
    assert checkpoint_adapters(ROOT) == []  # not an Orbax checkpoint
