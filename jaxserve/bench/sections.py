"""Benchmark sections that cannot hang the run: each runs under its own time
limit in a worker process, and a section that overruns is cut.

A hung XLA or Triton call blocks in C++ and no Python signal reaches it, so
the limit is enforced from outside: the supervisor (``supervise``, the parent
process, which never touches the accelerator) starts a worker process
(``run_worker`` in the child) that runs the pending sections in order and
rewrites the JSON document after each one, marking the section it is about
to run ``{"status": "running", "started_at": <epoch s>, "limit_s": ...}``.
The supervisor polls that file; when a running section passes its limit it
kills the worker's process group (SIGKILL), marks the section
``"timeout"``, and starts a fresh worker for the sections after it. A worker
that dies (a crash, a signal) gets its running section marked ``"error"``,
and the run goes on the same way.

Section statuses in ``doc["sections"][name]["status"]``: ``pending`` (not
reached yet; never in a finished document), ``running``, ``ok``,
``failed`` (the section ran and its check did not pass), ``error`` (it
raised, or its worker died: ``"error"`` says why), ``timeout`` (cut at
``limit_s``), ``skipped`` (``"reason"``: not enough of the budget left,
or not wanted).

Hang injection (tests): the environment variable
``JAXSERVE_BENCH_HANG=NAME`` makes section NAME block forever in the worker
with every catchable signal masked, as a hung device call would, so only
the supervisor's kill ends it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
import traceback

HANG_ENV = "JAXSERVE_BENCH_HANG"
POLL_S = 0.25
DONE = ("ok", "failed", "error", "timeout", "skipped")


def clean(x):
    """``x`` with non-finite floats as None (JSON has no NaN or inf)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def save(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(clean(doc), f, indent=1)
    os.replace(tmp, path)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _hang_if_asked(name: str) -> None:
    if os.environ.get(HANG_ENV) == name:
        print(f"[{name}] {HANG_ENV}={name}: hanging with signals masked", flush=True)
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL,
                                                                              signal.SIGSTOP})
        except (OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT,
                                                      signal.SIGTERM})
        while True:
            time.sleep(3600)


def run_worker(path: str, sections: dict, limits: dict, min_s: dict, budget_s: float) -> int:
    """Run the ``pending`` sections of the document at ``path`` in order (the
    worker side of ``supervise``).

    Args:
      path: the JSON document; ``doc["started_at"]`` (epoch s) starts the budget.
      sections: {name: fn(doc, progress) -> dict}, in run order; the dict
        returned is merged into the section's entry, and a ``"status"`` in it
        (e.g. ``"failed"``) replaces ``"ok"``; ``progress(**fields)`` merges
        fields into the entry and writes the file at once (what a section
        measured before it is cut is kept).
      limits: {name: seconds} each section's own limit.
      min_s: {name: seconds} a section is skipped when less than this is left.
      budget_s: the whole run's budget, s.

    Returns:
      0 (statuses are in the document).
    """
    doc = load(path)
    for name, fn in sections.items():
        entry = doc["sections"][name]
        if entry["status"] != "pending":
            continue
        left = budget_s - (time.time() - doc["started_at"])
        if left < min_s.get(name, 0.0) or left <= 0:
            entry.update(status="skipped", reason=f"{max(left, 0):.0f} s of the {budget_s:.0f} "
                         f"s budget left (< {min_s.get(name, 0.0):.0f} s for this section)")
            save(path, doc)
            continue
        t = time.time()
        entry.update(status="running", started_at=t, limit_s=min(limits[name], left))
        save(path, doc)
        print(f"[{t - doc['started_at']:6.1f} s] section {name} (limit "
              f"{entry['limit_s']:.0f} s)", flush=True)
        _hang_if_asked(name)

        def progress(**fields):
            entry.update(fields)
            save(path, doc)
        try:
            result = fn(doc, progress) or {}
            status = result.pop("status", "ok")
        except Exception as e:  # a section's failure is recorded, and the run goes on
            result = {"error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
            status = "error"
        entry.update(result, status=status, seconds=time.time() - t)
        save(path, doc)
        print(f"[{time.time() - doc['started_at']:6.1f} s] section {name}: {status} "
              f"({entry['seconds']:.1f} s)", flush=True)
    return 0


def _kill(proc: subprocess.Popen, path: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait()
    try:  # a save it was killed in the middle of
        os.remove(f"{path}.tmp{proc.pid}")
    except FileNotFoundError:
        pass


def _watch(path: str, proc: subprocess.Popen, started_at: float, deadline_s: float) -> None:
    """Poll one worker until it exits or is cut; record what happened."""
    while True:
        rc = proc.poll()
        doc = load(path)
        secs = doc["sections"]
        running = [n for n, s in secs.items() if s["status"] == "running"]
        now = time.time()
        if rc is not None:
            for n in running:  # the worker died inside a section
                secs[n].update(status="error", seconds=now - secs[n]["started_at"],
                               error=f"worker exited with status {rc} inside it")
            nxt = [n for n, s in secs.items() if s["status"] == "pending"]
            if not running and rc != 0 and nxt and not doc.get("refused"):
                secs[nxt[0]].update(status="error",  # died between sections: blame the next
                                    error=f"worker exited with status {rc} before it")
            break
        over = [n for n in running if now - secs[n]["started_at"] > secs[n]["limit_s"]]
        if over or now - started_at > deadline_s:
            _kill(proc, path)
            doc = load(path)  # with what it wrote before it died
            for n, s in doc["sections"].items():
                if s["status"] == "running":
                    s.update(status="timeout", seconds=now - s["started_at"],
                             error=f"cut at its {s['limit_s']:.0f} s limit" if n in over
                             else "cut at the end of the run's budget")
            print(f"[{now - started_at:6.1f} s] cut: {', '.join(over) or 'budget spent'}",
                  flush=True)
            break
        time.sleep(POLL_S)
    save(path, doc)


def supervise(path: str, spawn, budget_s: float, *, grace_s: float = 15.0,
              max_workers: int = 20) -> dict:
    """Run the document's pending sections in workers, cutting any that
    overrun (see the module docstring).

    Args:
      path: the JSON document (already written, every section to run
        ``pending``, ``doc["started_at"]`` set).
      spawn: ``spawn() -> subprocess.Popen`` starting one worker in a new
        session (``start_new_session=True``) so its group can be killed.
      budget_s: the whole run's budget, s; a worker still alive at
        ``budget_s + grace_s`` is killed whatever it is doing.
      max_workers: most workers started (a worker that keeps dying between
        sections cannot loop forever).

    Returns:
      The final document, also written to ``path``: every section has a
      finished status (pending ones become ``skipped``); ``workers`` counts
      the workers started, ``wall_s`` the seconds since ``started_at``.
    """
    doc = load(path)
    started_at = doc["started_at"]
    workers = 0
    while workers < max_workers:
        pending = [n for n, s in doc["sections"].items() if s["status"] == "pending"]
        if not pending or time.time() - started_at > budget_s or doc.get("refused"):
            break
        proc = spawn()
        workers += 1
        try:
            _watch(path, proc, started_at, budget_s + grace_s)
        except BaseException:  # Ctrl-C: the worker is in its own session, end it too
            _kill(proc, path)
            raise
        doc = load(path)
    for s in doc["sections"].values():
        if s["status"] in ("pending", "running"):
            s.update(status="skipped", reason=doc.get("refused")
                     or "not reached: the budget ran out")
    doc["workers"] = workers
    doc["wall_s"] = time.time() - started_at
    save(path, doc)
    return doc
