"""Shared fixtures and the test tiers.

Tiers (``tiers.py``, README "Tests"): ``pytest -m "not slow and not real_model"``
is the fast tier: it imports neither torch nor transformers (``test_fast_tier.py``
checks) and needs no real checkpoint.

Torch-free tiny models (``tiny_models.py``; numpy weights, the real model code):

- ``tiny_parts`` / ``make_tiny_llm``: the tiny random Llama (vocab 256, 3
  layers, EOS id 1, no tokenizer: prompts are token ids).
- ``mock_parts`` / ``make_mock_llm``: the mock model for engine, engine-loop
  and server tests that need text: a tiny Llama (vocab 320) with the tiny
  GGUF's byte-level tokenizer and ChatML template, built without a file.
- ``tiny_gguf``: a tiny random Llama GGUF file (``tiny_gguf.py``), for CLI and
  server subprocesses.

References (slow or real_model tests only): ``tiny_hf`` (transformers' model on
``tiny_parts``' very weights), ``mixtral_folders`` (a tiny HF Mixtral and its
Orbax conversion), and the real SmolLM2-135M / Gemma 3 270M GGUFs (fetched once
into the cache). A test taking one of them gets its mark from the fixture
(``tiers.FIXTURE_MARKS``), so it cannot leak into the fast tier.

The CPU backend is given 8 devices (before jax is imported) so sharding tests
can build meshes; everything else runs on the first device as before. XLA:CPU
compiles with LLVM at -O0 (``--xla_backend_optimization_level=0``; below). The CPU
kernel's column limits are the built-in table (``JAXSERVE_KERNEL_WIDTHS=builtin``).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's LLVM passes at -O0: the suite is mostly compiling (tiny models, many
# shapes), and O0 compiles a third faster while XLA's own HLO passes (fusion, layout,
# the numerics) are the same. test_spec_decode.py + test_backpressure.py, fresh caches,
# 2-core EPYC: 281 -> 231 s, 372 -> 270 CPU s; the real-model files 197 -> 192 s (their
# slower steps take back most of it). An XLA_FLAGS that sets a level keeps its own.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# The CPU kernel's built-in column limits, not this machine's measurement
# (jaxserve.engine.kernel_widths): the same programs on every run and worker, and
# no 3-19 s measurement per kernel kind in a fresh cache. test_kernel_widths.py
# measures on purpose, and CLI subprocesses inherit this.
os.environ.setdefault("JAXSERVE_KERNEL_WIDTHS", "builtin")

import gc
import time

import pytest
# The tier hooks (tiers.py's docstring): pytest finds them in this module's namespace.
from tiers import (pytest_collection_finish, pytest_collection_modifyitems,  # noqa: F401
                   pytest_ignore_collect, pytest_runtest_protocol)  # noqa: F401
from tiny_models import TINY_SEED, hf_llama, mock_tokenizer, tiny_config, tiny_llama_params

XLA_CACHE = os.path.join(os.environ.get("JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve")),
                         "xla-tests")
MOCK_VOCAB = 320  # the tiny GGUF tokenizer's 269 tokens, padded


def _factory(parts):
    """``make(**engine_args) -> LLM`` over ``parts`` (small KV cache, shared XLA cache)."""
    from jaxserve import LLM

    def make(**kw):
        kw.setdefault("num_pages", 128)
        kw.setdefault("page_size", 8)
        kw.setdefault("compilation_cache_dir", XLA_CACHE)
        return LLM(**kw, **parts)
    return make


@pytest.fixture(scope="session")
def tiny_parts():
    """Keyword arguments that build a jaxserve engine on the tiny random Llama
    (``model_config``, HF-named numpy ``params``; no torch)."""
    cfg = tiny_config()
    return dict(model_config=cfg, params=tiny_llama_params(cfg, seed=TINY_SEED))


@pytest.fixture
def make_tiny_llm(tiny_parts):
    """Factory: ``make_tiny_llm(**engine_args) -> LLM`` over the tiny model."""
    return _factory(tiny_parts)


@pytest.fixture(scope="session")
def mock_parts():
    """The mock model: keyword arguments of an engine over a tiny random Llama
    (``tiny_models.TINY`` with vocab 320, EOS ``<|im_end|>`` = 2) with the tiny GGUF's
    tokenizer and ChatML template. Deterministic: same ids, same logits."""
    cfg = tiny_config(vocab_size=MOCK_VOCAB, eos_token_ids=(2,))
    tok = mock_tokenizer(MOCK_VOCAB)
    return dict(model_config=cfg, params=tiny_llama_params(cfg, seed=1), tokenizer=tok,
                chat_template=tok.chat_template)


@pytest.fixture
def make_mock_llm(mock_parts):
    """Factory: ``make_mock_llm(**engine_args) -> LLM`` over the mock model (text in, text out)."""
    return _factory(mock_parts)


@pytest.fixture(scope="session")
def tiny_hf(tiny_parts):
    """transformers' f32 ``LlamaForCausalLM`` (eval) holding ``tiny_parts``'
    weights: the HF reference. Imports torch: tests using it are slow."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return hf_llama(tiny_parts["model_config"], tiny_parts["params"])


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
def untied_gguf(tmp_path_factory):
    """A tiny random Llama Q8_0 GGUF with an untied LM head (vocab 320, D 64,
    F 128, 4 heads, 2 kv heads), the source of the Orbax conversion tests; a Path."""
    from tiny_gguf import write_tiny_gguf
    from jaxserve.config import ModelConfig
    path = tmp_path_factory.mktemp("untied-gguf") / "tiny.gguf"
    write_tiny_gguf(path, ModelConfig(vocab_size=320, tie_word_embeddings=False))
    return path


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


# ---- executables freed between modules -----------------------------------------

_peak_mappings = [0]  # the most memory mappings this process held after a test


def num_mappings() -> int:
    """This process's memory mappings (lines of ``/proc/self/maps``; 0 where
    there is none)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(scope="module", autouse=True)
def collect_dead_engines():
    """After each test module (its module fixtures torn down first), free the
    XLA executables its tests left behind (``_free_executables``).

    Why: a live XLA:CPU executable holds memory mappings (code, read-only and
    data sections of its kernels; ~930 for a tiny-model engine), and a dropped
    engine sits in reference cycles (a runner and its jitted bound methods)
    that only a full collection frees. In a process this large (torch,
    transformers) Python runs full collections rarely, so engines piled up:
    ~20,000 mappings after the first tenth of the suite, and Linux refuses a
    process more than ``vm.max_map_count`` (65,530) mappings; XLA then died
    with SIGSEGV loading the next executable (CI, 80% of the suite in).
    Kernel tests leave as many in ``jit``'s caches of module-level
    functions (one executable per shape tried).
    """
    yield
    _free_executables(16_000)


def _free_executables(limit: int) -> None:
    """Note the mappings; past ``limit``, a full collection, then, if they
    are still past it, JAX's in-memory caches dropped too (``jit``'s
    executables of module-level functions: a kernel test's hundreds of
    shapes stay mapped otherwise; a later call finds them in the persistent
    cache)."""
    n = num_mappings()
    _peak_mappings[0] = max(_peak_mappings[0], n)
    if n > limit:
        gc.collect()
        if num_mappings() > limit:
            import jax
            jax.clear_caches()
            gc.collect()


def pytest_runtest_teardown(item, nextitem):
    """The same inside a module whose tests build many engines or shapes,
    at half the kernel's limit."""
    _free_executables(32_000)


# ---- the suite's compile bill ------------------------------------------------

def pytest_sessionstart(session):
    """Count this process's XLA programs from the start (``compile_cache``)."""
    from jaxserve.engine import compile_cache
    compile_cache.install()
    session.config._jaxserve_start = (time.monotonic(), compile_cache.counts())


# Under pytest-xdist: each worker's ([ProgramCounts' numeric fields], peak mappings).
_worker_figures: list = []


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its compile bill to the controller
    (``workeroutput``), which builds no program itself."""
    out, start = getattr(session.config, "workeroutput", None), \
        getattr(session.config, "_jaxserve_start", None)
    if out is not None and start is not None:
        from jaxserve.engine import compile_cache
        c = compile_cache.counts() - start[1]
        out["jaxserve_compile"] = [c.programs, c.loaded, c.written, c.compile_s, c.load_s,
                                   c.trace_s, c.lower_s]
        out["jaxserve_mappings"] = _peak_mappings[0]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: keep a finished worker's compile bill."""
    got = getattr(node, "workeroutput", {}).get("jaxserve_compile")
    if got is not None:
        _worker_figures.append((got, node.workeroutput.get("jaxserve_mappings", 0)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's wall time and the XLA programs its in-process engines built
    (compiled, or loaded from the persistent cache; subprocess servers are
    not counted), with the seconds XLA spent compiling them; under
    pytest-xdist, summed over the workers (the peak mappings: the most of any
    one worker)."""
    start = getattr(config, "_jaxserve_start", None)
    if start is None:
        return
    from jaxserve.engine import compile_cache
    t0, c0 = start
    if _worker_figures:
        c = compile_cache.ProgramCounts(*map(sum, zip(*(w for w, _ in _worker_figures))))
        peak = max(m for _, m in _worker_figures)
        where = f"in {len(_worker_figures)} pytest-xdist workers"
    else:
        c, peak, where = compile_cache.counts() - c0, _peak_mappings[0], "in this process"
    terminalreporter.write_line(
        f"jaxserve suite: {time.monotonic() - t0:.0f} s wall; XLA programs built {where}: "
        f"{c.programs} ({c.loaded} loaded from the persistent cache, {c.compiled} "
        f"compiled in {c.compile_s:.0f} s; tracing {c.trace_s:.0f} s, lowering "
        f"{c.lower_s:.0f} s); at most {peak:,} memory mappings after a test"
        f" (the kernel's limit: vm.max_map_count)")
