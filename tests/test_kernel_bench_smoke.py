"""``python -m pallas_kernels.bench --smoke`` runs on CPU (interpret mode) and
its decode outputs agree with JAX's own paged attention kernel."""

import re

from pallas_kernels import bench


def test_bench_smoke_runs_and_agrees_with_jax_kernel(capsys):
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    diffs = [float(m) for m in re.findall(r"(\d\.\d\de[-+]\d\d)\s*$", out, re.M)]
    assert len(diffs) == 5, out  # 4 decode rows vs JAX's kernel, 1 prefill vs the reference
    assert max(diffs) < 1e-5, out


def test_bench_without_gpu_says_so(capsys):
    import jax
    import pytest
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert bench.main([]) == 1
    assert "no GPU" in capsys.readouterr().out
