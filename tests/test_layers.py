"""DESIGN.md's package layers, held by import-linter.

``[tool.importlinter]`` in ``pyproject.toml`` has three contracts over
``jaxserve``, ``checkpoints``, ``sharding`` and ``pallas_kernels``:

- layers, highest first: ``jaxserve.main`` (+ ``flags``, ``demo`` once they
  exist) > ``jaxserve.bench`` | ``jaxserve.disagg`` > ``jaxserve.server`` >
  ``jaxserve.engine`` > ``checkpoints`` > ``jaxserve.models`` >
  ``jaxserve.config`` | ``jaxserve.metrics`` | ``sharding`` | ``pallas_kernels``
  (``|``: siblings that must not import each other);
- no import cycles between sibling modules or packages, at any depth;
- the serving core imports neither torch nor transformers.

``lint-imports`` runs on this checkout (``import-linter`` is in the ``test``
extra, so CI has it), and on copies with one import added on purpose, to
show each contract fails on what it forbids.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "checkpoints", "sharding", "pallas_kernels")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("importlinter") is None,
    reason="import-linter is not installed (it is in the test extra: pip install -e .[test])")


def lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with this Python, in ``cwd`` (its packages come first on
    sys.path); wide lines, so no contract name or import chain is wrapped."""
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "250"})


def test_contracts_hold():
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout, res.stdout


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory) -> pathlib.Path:
    """The packages and pyproject.toml, copied (no caches)."""
    root = tmp_path_factory.mktemp("layers")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns(
            "__pycache__", "*.pyc", "data"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize("module, line, contract, culprit", [
    # a model reaching up into the engine
    ("jaxserve/models/llama.py", "from jaxserve.engine import engine as _up",
     "Packages import only the layers below them", "jaxserve.models.llama -> jaxserve.engine"),
    # two siblings of one layer
    ("sharding/rules.py", "from pallas_kernels.ragged_paged_attention import reference as _up",
     "Packages import only the layers below them", "sharding.rules -> pallas_kernels"),
    # the tokenizer <-> GGUF loader cycle issue 31 removed
    ("checkpoints/tokenizer.py", "from checkpoints import gguf_loader as _up",
     "No import cycles", ".tokenizer -> .gguf_loader"),
    ("jaxserve/engine/runner.py", "import torch as _up",
     "imports neither torch nor transformers", "jaxserve.engine.runner -> torch"),
], ids=["upward", "sibling", "cycle", "torch"])
def test_an_added_import_breaks_its_contract(copy_root, module, line, contract, culprit):
    path = copy_root / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{line}  # added by tests/test_layers.py\n")
        res = lint_imports(copy_root)
    finally:
        path.write_text(original)
    assert res.returncode != 0, res.stdout
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and culprit in broken, res.stdout
