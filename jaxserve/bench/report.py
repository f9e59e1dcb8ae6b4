"""The one report writer of every benchmark: a JSON file of every figure, a
Markdown report and PNG plots, into one folder.

``write(folder, result, markdown, plots)`` creates ``folder`` and writes

* ``result.json`` (``json_name``; the soak run calls it ``soak.json``):
  ``result`` as indented JSON (``default=str`` for what JSON cannot hold);
* each PNG of ``plots`` ({file name: ``fn(result, path, plt)``}) with
  matplotlib's Agg backend (no display needed); without matplotlib none is
  drawn and ``report.md`` ends with a line saying so;
* ``report.md``: ``markdown(result)``, called after the plots (a plot may
  add notes to ``result``);

and returns the paths written (JSON, report, then the PNGs). The shared
pieces of the reports live here too: ``fmt`` (a number or "-"), ``ratio``,
``targets_table`` (the target / value / limit / met table every benchmark
with targets prints) and ``machine_lines`` (the machine table).
"""

from __future__ import annotations

import json
import os

NO_PLOTS = "matplotlib is not installed (pip install -e '.[bench]')"


def fmt(v, spec: str = "{:.1f}", none: str = "-") -> str:
    """``spec.format(v)``, or ``none`` for None."""
    return none if v is None else spec.format(v)


def ratio(a, b):
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def targets_table(rows: list[dict], title: str = "Targets") -> list[str]:
    """``## title`` and the table of {"target", "value", "limit", "met"} rows
    (met: True, False, or None when a figure is missing)."""
    lines = [f"## {title}", "", "| target | value | limit | met |", "|---|---:|---:|---|"]
    for t in rows:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {fmt(t['value'], '{:.3g}')} | {t['limit']} | {met} |")
    return lines


def machine_lines(m: dict) -> list[str]:
    """The first rows of a machine table (``machine.describe()``)."""
    return ["| | |", "|---|---|", f"| CPU | {m['cpu_model']}, {m['cpu_count']} cores |",
            f"| AVX flags | {' '.join(m['avx_flags']) or '-'} |", f"| jax | {m['jax']} |"]


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None. Imported here, lazily:
    matplotlib is an optional extra (``.[bench]``) and slow to import."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write(folder: str, result: dict, markdown, plots: dict | None = None,
          json_name: str = "result.json") -> list[str]:
    """Write the JSON, the PNGs and ``report.md`` into ``folder`` (created);
    see the module docstring. Returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    pngs = []
    plt = _pyplot() if plots else None
    if plots and plt is None:
        result["plots_note"] = NO_PLOTS
    for name, fn in (plots or {}).items() if plt is not None else ():
        path = os.path.join(folder, name)
        if fn(result, path, plt) is not False:  # a plot with nothing to draw returns False
            pngs.append(path)
    paths = [os.path.join(folder, json_name), os.path.join(folder, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = markdown(result)
    if result.get("plots_note"):
        text += f"\nNo plots: {result['plots_note']}.\n"
    with open(paths[1], "w") as f:
        f.write(text)
    return paths + pngs


def read_report(paths: list[str]) -> str:
    """The text of the ``report.md`` that ``write`` wrote."""
    with open(paths[1]) as f:
        return f.read()
