"""The GPU script (``python -m jaxserve.bench device``) on CPU: its ``--smoke``
run writes every section with a status and real figures (the kernel
self-check holds the interpret-mode kernel to the reference); a section made
to hang is cut at its limit, later sections still run, the JSON is written
and the exit status says so; the self-check fails a kernel off by 10% and
one that cannot lower; the section supervisor records raising, crashing, hung
and skipped sections without JAX."""

import json
import os
import subprocess
import sys
import time

import pytest

from jaxserve.bench import sections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _device(*args, env=None, timeout=600, module=False):
    """``python -m jaxserve.bench device ARGS`` (``module``: ``python -m
    jaxserve.bench.device ARGS``, the same script); (result, wall s)."""
    t = time.monotonic()
    cmd = ["-m", "jaxserve.bench.device"] if module else ["-m", "jaxserve.bench", "device"]
    r = subprocess.run([sys.executable, *cmd, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return r, time.monotonic() - t


@pytest.mark.slow
def test_device_smoke_writes_every_section(tmp_path):
    from jaxserve.bench import device, device_kernels
    out = tmp_path / "x.json"
    r, wall = _device("--smoke", "--decode_batches", "1,4", "--prefill_lens", "64",
                      "--workloads", "chat", "--output", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    s = doc["sections"]
    assert list(s) == [*device.SECTIONS, "workload_chat"]
    assert {n: v["status"] for n, v in s.items()} == {n: "ok" for n in s}, s
    assert doc["exit_status"] == 0 and doc["workers"] == 1 and doc["wall_s"] < wall
    # Self-check: every case ran the kernel against the reference, within tolerance.
    cases = s["selfcheck"]["cases"]
    assert [(c["kv_dtype"], c["window"]) for c in cases] == [
        (c["kv_dtype"], c["window"]) for c in device_kernels.selfcheck_cases(True)]
    for c in cases:
        assert c["pass"] and 0 <= c["max_abs_err"] <= c["tolerance"] and c["max_abs_ref"] > 0.5
        assert c["q_lens"][0] == 1 and max(c["q_lens"]) > 1  # decode and prefill mixed
    assert s["ceilings"]["flops_per_s"] > 0 and s["ceilings"]["bytes_per_s"] > 0
    # The kernel alone: ours timed at every case; JAX's figures or its error recorded.
    dec = s["kernel_decode"]["rows"]
    assert [(x["batch"], x["ctx"]) for x in dec] == [(1, 64), (2, 128)]
    for x in dec:
        assert x["ours_ms"] > 0 and x["kv_bytes"] == 2 * x["batch"] * x["ctx"] * 2 * 64 * 2
        assert x["ours_of_copy"] > 0 and ("jax_ms" in x or x["jax_error"])
        if "jax_ms" in x:  # same attention, two kernels
            assert x["max_abs_diff"] < 5e-2 and x["ours_over_jax"] > 0
    pre = s["kernel_prefill"]["rows"][0]
    assert pre["tokens"] == 64 and pre["flops"] == 4 * 4 * 64 * 64 * 65 // 2
    assert pre["ours_ms"] > 0 and pre["theirs_ms"] > 0 and pre["max_abs_diff"] < 5e-2
    assert "implementation='xla'" in s["kernel_prefill"]["against"]  # no cuDNN on CPU
    # The model's steps, formats, KV dtypes and workload (as before the sections).
    assert [p["num_seqs"] for p in s["model_decode"]["points"]] == [1, 4]
    for p in s["model_decode"]["points"] + s["model_prefill"]["points"]:
        assert p["ms"] > 0 and 0 < p["mbu"] and 0 < p["mfu"] and p["bound"]
    assert s["model_decode"]["model_init_s"] > 0 and "model_init_s" not in s["model_prefill"]
    mm = s["quant_matmul"]["rows"]
    assert [(p["form"], p["M"]) for p in mm] == [(f, m) for f in device.QUANT_FORMS
                                                 for m in (1, 8)]
    by = {p["form"]: p for p in mm if p["M"] == 1}
    assert by["float32"]["weight_bytes"] == 256 * 128 * 4
    assert by["int8"]["weight_bytes"] == 256 * 128 + 256 * 4  # + one f32 scale per row
    assert by["int4"]["weight_bytes"] == 256 * 64 + 2 * 256 * 4 * 2  # + f16 scale, zero per 32
    att = s["kv_attention"]["rows"]
    assert [(p["rows"], p["ctx"], p["kv_dtype"]) for p in att] == [(2, 64, "float32"),
                                                                   (2, 64, "int8")]
    assert att[1]["kv_bytes_read"] == 2 * 64 * 2 * 8 * (128 + 4)
    wl = s["workload_chat"]
    assert wl["summary"]["completed"] == 2 and "decode" in wl["roofline"]


def test_device_hung_section_is_cut_and_later_sections_run(tmp_path):
    out = tmp_path / "x.json"
    r, wall = _device("--smoke", "--sections", "ceilings,quant_matmul", "--section_limits",
                      "ceilings=3", "--quant_ms", "1", "--output", str(out),
                      env={sections.HANG_ENV: "ceilings"}, timeout=300, module=True)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    s = doc["sections"]
    assert s["ceilings"]["status"] == "timeout" and s["ceilings"]["limit_s"] == 3
    assert 3 <= s["ceilings"]["seconds"] < 10 and "cut at its 3 s limit" in s["ceilings"]["error"]
    assert s["quant_matmul"]["status"] == "ok" and len(s["quant_matmul"]["rows"]) == 5
    assert s["selfcheck"] == {"status": "skipped", "reason": "not in --sections"}
    assert doc["workers"] == 2 and doc["exit_status"] == 3  # a fresh worker after the cut
    assert "not ok: ceilings" in r.stdout and wall < 200


def test_device_bad_options_exit_2_before_any_work(tmp_path, capsys):
    from jaxserve.bench.__main__ import main
    for argv, msg in ((["--sections", "selfcheck,nope"], "unknown section(s) nope"),
                      (["--section_limits", "selfcheck=0"], "must be > 0"),
                      (["--kernel_decode", "8by4096"], "--kernel_decode '8by4096'")):
        with pytest.raises(SystemExit) as e:
            main(["device", "--smoke", "--output", str(tmp_path / "x.json"), *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


WORKER = """
import os, sys, time
from jaxserve.bench import sections
def crash(d, p):
    p(partial=1)
    os._exit(7)
def boom(d, p):
    raise RuntimeError("kernel said no")
fns = {"a": lambda d, p: {"x": 1}, "hang": lambda d, p: None, "boom": boom,
       "failed": lambda d, p: {"status": "failed", "why": "mismatch"}, "crash": crash,
       "e": lambda d, p: {"x": 2}, "late": lambda d, p: {"x": 3}}
sys.exit(sections.run_worker(sys.argv[1], fns, {n: 2.0 for n in fns}, {"late": 1e9}, 60.0))
"""


def test_supervisor_records_every_kind_of_end(tmp_path, monkeypatch):
    path = str(tmp_path / "doc.json")
    names = ("a", "hang", "boom", "failed", "crash", "e", "late")
    sections.save(path, {"started_at": time.time(),
                         "sections": {n: {"status": "pending"} for n in names}})
    monkeypatch.setenv(sections.HANG_ENV, "hang")
    doc = sections.supervise(path, lambda: subprocess.Popen(
        [sys.executable, "-c", WORKER, path], cwd=REPO, start_new_session=True), 60.0)
    s = doc["sections"]
    assert {n: v["status"] for n, v in s.items()} == {
        "a": "ok", "hang": "timeout", "boom": "error", "failed": "failed", "crash": "error",
        "e": "ok", "late": "skipped"}
    assert s["a"]["x"] == 1 and s["e"]["x"] == 2 and s["failed"]["why"] == "mismatch"
    assert 2 <= s["hang"]["seconds"] < 6
    assert "RuntimeError: kernel said no" in s["boom"]["error"] and s["boom"]["traceback"]
    assert s["crash"]["partial"] == 1 and "status 7 inside it" in s["crash"]["error"]
    assert "budget" in s["late"]["reason"]
    assert doc["workers"] == 3 and json.loads(open(path).read()) == doc


def test_supervisor_kills_a_worker_hung_before_any_section(tmp_path):
    path = str(tmp_path / "doc.json")
    sections.save(path, {"started_at": time.time(), "sections": {"a": {"status": "pending"}}})
    t = time.monotonic()
    doc = sections.supervise(path, lambda: subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True),
        budget_s=1.0, grace_s=1.0)
    assert time.monotonic() - t < 10
    assert doc["sections"]["a"]["status"] == "skipped" and doc["workers"] == 1


def test_selfcheck_catches_a_wrong_kernel_and_a_lowering_error(monkeypatch):
    from jaxserve.bench import device_kernels as dk
    from pallas_kernels.ragged_paged_attention import reference

    def off(*args, interpret, **kw):  # the definition with a 10% error
        return reference.ref_ragged_paged_attention(*args, **kw) * 1.1

    def broken(*args, interpret, **kw):
        raise NotImplementedError("Mosaic cannot lower this block shape")
    seen = []  # (the real kernel passing: test_device_smoke_writes_every_section)
    monkeypatch.setattr(dk.kernel, "ragged_paged_attention", off)
    bad = dk.selfcheck(True, True, lambda **kw: seen.append(len(kw["cases"])))
    assert seen == [1, 2]  # each case recorded as it finished
    assert bad["status"] == "failed" and not any(c["pass"] for c in bad["cases"])
    assert all(c["max_abs_err"] > c["tolerance"] for c in bad["cases"])
    monkeypatch.setattr(dk.kernel, "ragged_paged_attention", broken)
    err = dk.selfcheck(True, True, lambda **kw: None)
    assert err["status"] == "failed"
    assert all("NotImplementedError: Mosaic" in c["error"] for c in err["cases"])
