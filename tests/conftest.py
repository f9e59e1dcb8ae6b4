"""Shared fixtures: a tiny random Llama (HF reference + jaxserve copy) and the
real SmolLM2-135M GGUF (fetched once into the cache).

The CPU backend is given 8 devices (before jax is imported) so sharding tests
can build meshes; everything else runs on the first device as before.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import time

import numpy as np
import pytest

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3,
            num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=512)
XLA_CACHE = os.path.join(os.environ.get("JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve")),
                         "xla-tests")


@pytest.fixture(scope="session")
def tiny_hf():
    """A random HF ``LlamaForCausalLM`` (f32, eval) with untied embeddings.

    ``initializer_range`` is large so greedy outputs vary from token to token.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=TINY["vocab_size"], hidden_size=TINY["hidden_size"],
        intermediate_size=TINY["intermediate_size"], num_hidden_layers=TINY["num_layers"],
        num_attention_heads=TINY["num_heads"], num_key_value_heads=TINY["num_kv_heads"],
        head_dim=TINY["head_dim"], rope_theta=TINY["rope_theta"],
        rms_norm_eps=TINY["rms_norm_eps"], max_position_embeddings=TINY["max_position_embeddings"],
        tie_word_embeddings=False, initializer_range=0.15, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(torch.float32)
    return model


@pytest.fixture(scope="session")
def tiny_parts(tiny_hf):
    """Keyword arguments that build a jaxserve engine with ``tiny_hf``'s weights."""
    from jaxserve.config import ModelConfig
    cfg = ModelConfig(tie_word_embeddings=False, eos_token_ids=(1,), **TINY)
    params = {k: v.detach().numpy().astype(np.float32) for k, v in tiny_hf.state_dict().items()}
    return dict(model_config=cfg, params=params)


@pytest.fixture
def make_tiny_llm(tiny_parts):
    """Factory: ``make_tiny_llm(**engine_args) -> LLM`` over the tiny model."""
    from jaxserve import LLM

    def make(**kw):
        kw.setdefault("num_pages", 128)
        kw.setdefault("page_size", 8)
        kw.setdefault("compilation_cache_dir", XLA_CACHE)
        return LLM(**kw, **tiny_parts)
    return make


@pytest.fixture(scope="session")
def smollm2_path():
    from checkpoints.fetch import resolve_model
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_ckpt(smollm2_path):
    """jaxserve's own load of the SmolLM2 GGUF (config, params, tokenizer, template)."""
    from checkpoints.gguf_loader import load_gguf
    return load_gguf(smollm2_path, show_progress=False)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
    """transformers' tokenizer read from the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent),
                                                      gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' f32 model dequantized from the same GGUF file (~30 s; load once)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_llm():
    """The one jaxserve ``LLM`` over SmolLM2 shared by the session (default engine args).

    Tests must leave it idle: no unfinished requests, every page free.
    """
    from jaxserve import LLM
    return LLM("smollm2-135m", compilation_cache_dir=XLA_CACHE)


@pytest.fixture(scope="session")
def gemma3_path():
    """The real Gemma 3 270M Q4_K_M GGUF (alias ``gemma3-270m``, ~253 MB, fetched once)."""
    from checkpoints.fetch import resolve_model
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_path):
    """transformers' tokenizer read from the Gemma 3 GGUF (~20 s: 262,144 pieces)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_path.parent),
                                                      gguf_file=gemma3_path.name)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama GGUF (vocab 320, 2 layers, 512 positions, with a
    tokenizer) for CLI and server tests; path as str."""
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=320, max_position_embeddings=512,
                                      num_layers=2))
    return str(path)


@pytest.fixture(scope="session")
def mixtral_folders(tmp_path_factory):
    """A tiny random Mixtral saved as an HF folder and converted to Orbax:
    (hf folder, orbax folder)."""
    pytest.importorskip("transformers")
    from test_hf_checkpoints import make_tokenizer
    from test_moe import make_hf

    from checkpoints.loader import convert_to_orbax
    hf = tmp_path_factory.mktemp("mixtral")
    make_hf("mixtral").save_pretrained(hf, safe_serialization=True)
    make_tokenizer().save_pretrained(hf)
    out = tmp_path_factory.mktemp("mixtral-orbax") / "ckpt"
    convert_to_orbax(hf, out, show_progress=False)
    return hf, out


# ---- the suite's compile bill ------------------------------------------------

def pytest_sessionstart(session):
    """Count this process's XLA programs from the start (``compile_cache``)."""
    from jaxserve.engine import compile_cache
    compile_cache.install()
    session.config._jaxserve_start = (time.monotonic(), compile_cache.counts())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's wall time and the XLA programs its in-process engines built
    (compiled, or loaded from the persistent cache; subprocess servers are
    not counted), with the seconds XLA spent compiling them."""
    start = getattr(config, "_jaxserve_start", None)
    if start is None:
        return
    from jaxserve.engine import compile_cache
    t0, c0 = start
    c = compile_cache.counts() - c0
    terminalreporter.write_line(
        f"jaxserve suite: {time.monotonic() - t0:.0f} s wall; XLA programs built in this "
        f"process: {c.programs} ({c.loaded} loaded from the persistent cache, {c.compiled} "
        f"compiled in {c.compile_s:.0f} s; tracing {c.trace_s:.0f} s, lowering "
        f"{c.lower_s:.0f} s)")
