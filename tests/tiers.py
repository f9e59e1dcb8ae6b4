"""The test tiers, as pytest hooks (``conftest.py`` imports them).

Markers (``pyproject.toml``): ``slow`` (more than a few seconds: subprocess
servers, benchmarks, big sweeps, and every test that needs torch or
transformers as a reference) and ``real_model`` (a real checkpoint fetched
into the cache). The fast tier, ``pytest -m "not slow and not real_model"``
(``FAST``), imports neither torch nor transformers and runs in minutes.

Four hooks hold that:

- marks from fixtures: a test that takes (directly or through other fixtures)
  one of ``FIXTURE_MARKS``' fixtures gets its mark, before ``-m`` selects: an
  HF reference (``tiny_hf``, ...) makes it slow, a real checkpoint
  (``smollm2_path``, ...) real_model, whether or not its file says so.
- ``pytest_ignore_collect``: a test module whose ``pytestmark`` puts every one
  of its tests outside ``-m`` is not imported at all. Its marks are read from
  its source (``ast``), so an HF-only module with ``import torch`` at the top
  costs the fast tier nothing. It is skipped only if no combination of the
  other marks its source names (or fixtures add) could bring a test back
  into ``-m``.
- the watch: after collection and after each test, the first moment a module
  of ``HEAVY`` shows up in ``sys.modules`` is kept in ``config.stash[HEAVY_SINCE]``
  (a node id, or "collection"), for ``test_fast_tier.py`` to report.
- tests marked ``last`` run after every other test of the session.
"""

from __future__ import annotations

import ast
import functools
import itertools
import sys

import pytest

FAST = "not slow and not real_model"
HEAVY = ("torch", "transformers")
HEAVY_SINCE = pytest.StashKey[str]()
# conftest fixtures -> the mark every test that uses them carries
FIXTURE_MARKS = {
    "tiny_hf": "slow", "mixtral_folders": "slow",  # torch + transformers
    "smollm2_hf": "slow", "smollm2_hf_tokenizer": "slow", "gemma3_hf_tokenizer": "slow",
    "smollm2_path": "real_model", "smollm2_llm": "real_model", "gemma3_path": "real_model",
}


def heavy_modules() -> list[str]:
    """The modules of ``HEAVY`` this process has imported."""
    return [m for m in HEAVY if m in sys.modules]


def _selects(markexpr: str, marks: set[str]) -> bool | None:
    """Whether ``-m markexpr`` selects a test with exactly ``marks`` (None:
    this pytest's expression API is unknown)."""
    try:
        from _pytest.mark.expression import Expression
        return bool(Expression.compile(markexpr).evaluate(lambda name, /, **kw: name in marks))
    except Exception:  # noqa: BLE001 - a private API: collect everything rather than guess
        return None


def is_fast_tier(config: pytest.Config) -> bool:
    """``-m`` deselects ``slow`` and ``real_model`` tests and keeps plain ones."""
    expr = config.getoption("markexpr", "")
    return bool(expr) and _selects(expr, set()) is True and not any(
        _selects(expr, {m}) is not False for m in ("slow", "real_model"))


@functools.cache
def _source_marks(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """(marks of the module-level ``pytestmark``, every ``*.mark.NAME`` the
    source names), read without importing the module."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return frozenset(), frozenset()

    def names(node) -> set[str]:
        return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    module: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            module |= names(node.value)
    return frozenset(module), frozenset(names(tree))


def pytest_ignore_collect(collection_path, config):
    """Do not import a test module ``-m`` deselects whole (module docstring)."""
    expr = config.getoption("markexpr", "")
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    module, named = _source_marks(str(collection_path))
    if not module:
        return None
    others = sorted((named | set(FIXTURE_MARKS.values())) - module)
    if len(others) > 10:
        return None
    for r in range(len(others) + 1):
        for extra in itertools.combinations(others, r):
            if _selects(expr, set(module | set(extra))) is not False:
                return None
    return True


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    """Marks from fixtures (``FIXTURE_MARKS``); tests marked ``last`` run after all others."""
    for item in items:
        for name in sorted({FIXTURE_MARKS[f] for f in getattr(item, "fixturenames", ())
                            if f in FIXTURE_MARKS}):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    if heavy_modules() and HEAVY_SINCE not in session.config.stash:
        session.config.stash[HEAVY_SINCE] = "collection (a test module, conftest or plugin)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    try:
        return (yield)
    finally:
        if heavy_modules() and HEAVY_SINCE not in item.config.stash:
            item.config.stash[HEAVY_SINCE] = item.nodeid
