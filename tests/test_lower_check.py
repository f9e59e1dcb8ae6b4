"""Both ragged paged attention kernels lower for TPU (Mosaic) and CUDA
(Triton) on this CPU for every model shape the project claims
(``pallas_kernels.lower_check``), and the check can fail: a block shape
broken on purpose makes the CLI exit 1 naming the failing lowering.

``KNOWN_FAILURES``: the lowerings today's kernels fail (issue 32), each
``xfail(strict=True)``, so a kernel that starts lowering one turns its test
red until the entry is deleted.
"""

import io
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels import lower_check

CASES = lower_check.claimed_cases()


def case_id(c: lower_check.Case) -> str:
    win = "-" if c.sliding_window is None else c.sliding_window
    cap = "-" if c.soft_cap is None else f"{c.soft_cap:g}"
    return (f"{c.platform}-N{c.q_heads}K{c.kv_heads}H{c.head_dim}-w{win}-c{cap}-"
            f"{c.kv_dtype}-{c.batch}")


# id -> the first line of the lowering error today. Empty: with jax 0.10.2 every
# claimed lowering of both kernels passes (lowering does not run Mosaic's layout
# passes or the Triton compiler, where the issue's findings would show).
KNOWN_FAILURES: dict[str, str] = {}


def _param(c):
    cid = case_id(c)
    marks = ([pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[cid])]
             if cid in KNOWN_FAILURES else [])
    return pytest.param(c, id=cid, marks=marks)


def test_known_failures_name_real_cases():
    assert set(KNOWN_FAILURES) <= {case_id(c) for c in CASES}


def test_claimed_shapes_cover_the_issue():
    groups = {c.q_heads // c.kv_heads for c in CASES}
    assert {1, 3, 4, 5, 7, 8} <= groups
    assert {c.head_dim for c in CASES} == {64, 128, 256}
    assert {c.kv_dtype for c in CASES} == {"bfloat16", "int8", "float8_e4m3fn"}
    assert {c.platform for c in CASES} == {"tpu", "cuda"}
    assert {512, 1024, None} <= {c.sliding_window for c in CASES}
    assert any(c.soft_cap for c in CASES) and {c.batch for c in CASES} == {"decode", "prefill"}


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_claimed_shape_lowers(case):
    lower_check.lower(case)


def _main(*argv):
    out = io.StringIO()
    rc = lower_check.main(list(argv), out=out)
    return rc, out.getvalue().splitlines()


SMOLLM2 = ("--q_heads", "9", "--kv_heads", "3", "--head_dim", "64")


def test_cli_one_shape():
    rc, lines = _main("--platforms", "cuda", *SMOLLM2, "--kv_dtype", "bfloat16",
                      "--page_size", "16")
    assert rc == 0 and len(lines) == len(lower_check.BATCHES) + 1, lines
    assert all(line.startswith("cuda") and line.split("  ")[-2] == "ok"
               for line in lines[:-1]), lines
    assert lines[-1].startswith(f"all {len(lower_check.BATCHES)} lowerings ok")


def test_cli_window_cap_fp8_both_platforms():
    rc, lines = _main("--platforms", "tpu,cuda", "--q_heads", "28", "--kv_heads", "4",
                      "--head_dim", "128", "--kv_dtype", "fp8_e4m3", "--page_size", "32",
                      "--sliding_window", "256", "--soft_cap", "30")
    assert rc == 0, lines
    assert len(lines) == 2 * len(lower_check.BATCHES) + 1
    assert all("N28/K4/H128 L32 window=256 cap=30 float8_e4m3fn" in line
               for line in lines[:-1]), lines


@pytest.mark.parametrize("argv", [
    ("--q_heads", "8"),                                 # partial shape
    ("--platforms", "rocm", *SMOLLM2),                  # unknown platform
    ("--kv_dtype", "fp16", *SMOLLM2),                   # unknown dtype
    ("--q_heads", "8", "--kv_heads", "3", "--head_dim", "64"),  # 8 % 3
    ("--page_size", "0", *SMOLLM2),
    ("--frobnicate",),                                  # argparse's own error
    ("--all", *SMOLLM2),
])
def test_cli_bad_flags_exit_2_with_one_error_line(argv):
    rc, lines = _main(*argv)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines


@pytest.mark.parametrize("check_tiling", [True, False])
def test_a_tile_unaligned_block_fails_and_is_named(monkeypatch, check_tiling):
    """One kv head per grid step makes the q block [bq, G = 2, H] of an
    [T, N = 8, H] array: neither a multiple of the sublane tile nor the whole
    dimension. The kernel's own tiling check refuses it; with that check off,
    Mosaic's lowering does."""
    import functools
    real = lower_check.kernel_for("tpu")
    monkeypatch.setattr(lower_check, "kernel_for", lambda platform: functools.partial(
        real, num_kv_heads_per_block=1, check_tiling=check_tiling))
    rc, lines = _main("--platforms", "tpu", "--q_heads", "8", "--kv_heads", "4",
                      "--head_dim", "256", "--kv_dtype", "bfloat16", "--page_size", "16")
    assert rc == 1, lines
    assert sum("FAILED" in line for line in lines[:-1]) == len(lower_check.BATCHES), lines
    last = lines[-1]
    assert last.startswith("2 of 2 lowerings FAILED") and "tpu  custom" in last \
        and "N8/K4/H256" in last and "decode T64/S64" in last, last
    assert ("Mosaic cannot tile that block" if check_tiling else "divisible by 8 and 128") \
        in last, last


def test_a_broken_blockspec_fails_and_is_named(monkeypatch):
    """Every blocked BlockSpec of the TPU kernel loses a column: the lowering
    fails (at trace, where the kernel reshapes the block) and is named."""
    import jax
    from jax.experimental import pallas as pl
    real = pl.BlockSpec

    def broken(block_shape=None, *args, **kw):
        if block_shape is not None and len(block_shape) >= 2:
            block_shape = (*block_shape[:-1], block_shape[-1] - 1)
        return real(block_shape, *args, **kw)

    jax.clear_caches()  # the kernels are jitted: a shape traced before would not re-trace
    monkeypatch.setattr(pl, "BlockSpec", broken)
    try:
        rc, lines = _main("--platforms", "tpu", "--q_heads", "8", "--kv_heads", "4",
                          "--head_dim", "256", "--kv_dtype", "bfloat16", "--page_size", "16")
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # drop the broken traces
    assert rc == 1, lines
    assert "FAILED" in lines[-1] and "tpu  custom" in lines[-1], lines[-1]


def test_cli_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "pallas_kernels.lower_check", "--platforms",
                        "tpu", "--q_heads", "8"], capture_output=True, text=True, timeout=120,
                       cwd=pathlib.Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and r.stdout.startswith("error: "), (r.stdout, r.stderr)
