"""The fast tier, ``pytest -m "not slow and not real_model"``, imports neither
torch nor transformers (README "Tests"; the hooks are in ``tiers.py``).

- Collection: a fresh ``pytest --collect-only`` of the fast tier, in a
  subprocess, must leave both out of ``sys.modules``. A test module that
  imports torch at its top and is not marked slow fails here, even when this
  file runs alone.
- The session: the last test of a fast-tier run checks that no test of it
  imported them, and names the first one that did (a fast test taking
  ``tiny_hf``, say). It skips in any other session.
- The checks have teeth: the collection check sees a module that leaks, and
  the collection hook leaves unimported only what ``-m`` deselects whole.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import tiers
from tiers import FAST, HEAVY, HEAVY_SINCE, heavy_modules, is_fast_tier

ROOT = pathlib.Path(__file__).resolve().parents[1]


def collect(*args: str, watch=HEAVY, cwd=ROOT, env=None):
    """``pytest --collect-only -m FAST *args`` in a fresh interpreter; returns
    (the completed process, the modules of ``watch`` it had imported)."""
    code = ("import sys, pytest\n"
            "rc = pytest.main(sys.argv[1:])\n"
            f"print('imported:', *[m for m in {tuple(watch)!r} if m in sys.modules])\n"
            "sys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code, "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", FAST, *args],
                         cwd=cwd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **(env or {})})
    lines = [line for line in res.stdout.splitlines() if line.startswith("imported:")]
    assert lines, res.stdout[-3000:] + res.stderr[-3000:]
    return res, set(lines[-1].split()[1:])


def test_collecting_the_fast_tier_imports_neither_torch_nor_transformers():
    res, imported = collect("tests")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "tests collected" in res.stdout, res.stdout[-3000:]
    assert not imported, (f"collecting the fast tier imported {sorted(imported)}: a test module "
                          "imports it at its top; mark the module slow (pytestmark) or import "
                          "it inside the tests that need it")


def test_the_collection_check_sees_a_leak_and_skips_deselected_modules(tmp_path):
    """``leaky_dep`` stands for torch: imported by a fast module, it is seen;
    imported by a module marked slow, that module is never imported; a test
    taking ``tiny_hf`` is deselected (its fixture marks it slow)."""
    (tmp_path / "leaky_dep.py").write_text("")
    (tmp_path / "slow_dep.py").write_text("")
    (tmp_path / "test_fast_leak.py").write_text("import leaky_dep\n\n\ndef test_a():\n    pass\n")
    (tmp_path / "test_slow_only.py").write_text(textwrap.dedent("""\
        import pytest
        import slow_dep

        pytestmark = pytest.mark.slow


        def test_b():
            pass
        """))
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""\
        import pytest


        @pytest.fixture
        def tiny_hf():
            import torch
            return torch
        """))
    (tmp_path / "test_hf_fixture.py").write_text("def test_d(tiny_hf):\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: s\n    real_model: r\n")
    res, imported = collect(str(tmp_path), "-p", "tiers", "--rootdir", str(tmp_path),
                            "-c", str(tmp_path / "pytest.ini"),
                            watch=("leaky_dep", "slow_dep"), cwd=tmp_path,
                            env={"PYTHONPATH": os.pathsep.join(
                                [str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert imported == {"leaky_dep"}
    assert "test_fast_leak.py::test_a" in res.stdout and "test_b" not in res.stdout
    assert "test_d" not in res.stdout  # tiny_hf made it slow (tiers.FIXTURE_MARKS)


@pytest.mark.parametrize("expr, ignored", [
    (FAST, True), ("not slow", True),
    ("slow", False), ("real_model", False),  # test_c is slow and real_model: selected
    ("not real_model", False), ("", False),
])
def test_a_module_is_left_unimported_only_if_no_test_of_it_can_run(tmp_path, expr, ignored):
    path = tmp_path / "test_mod.py"
    path.write_text(textwrap.dedent("""\
        import pytest

        pytestmark = pytest.mark.slow


        @pytest.mark.real_model
        def test_c():
            pass
        """))
    config = types.SimpleNamespace(getoption=lambda name, default=None: expr)
    assert (tiers.pytest_ignore_collect(path, config) is True) == ignored


@pytest.mark.parametrize("expr, fast", [
    (FAST, True), ("not real_model and not slow", True), ("not slow", False),
    ("", False), ("slow", False), ("not slow and not real_model and not gpu", True),
])
def test_is_fast_tier(expr, fast):
    assert is_fast_tier(types.SimpleNamespace(getoption=lambda name, default=None: expr)) == fast


@pytest.mark.last
def test_this_fast_tier_session_imported_neither_torch_nor_transformers(request):
    if not is_fast_tier(request.config):
        pytest.skip(f"not a fast-tier session (-m {FAST!r} deselects slow and real_model tests)")
    since = request.config.stash.get(HEAVY_SINCE, None)
    assert since is None and not heavy_modules(), (
        f"{heavy_modules()} imported during {since}: a fast test needs torch or transformers; "
        "mark it slow, or give it the torch-free fixtures (tiny_parts, make_mock_llm)")
