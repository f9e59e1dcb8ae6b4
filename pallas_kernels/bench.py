"""Kernel benchmark: ``python -m pallas_kernels.bench``.

On a GPU it times our ragged paged attention kernel (``kernel.py``)

* decode: one query token per sequence, batch 1, 8, 64 x context 1k, 8k, 32k,
  against JAX's own ``jax.experimental.pallas.ops.gpu.paged_attention``;
* prefill: 4 sequences each with a chunk of 512 or 2,048 new tokens on top of
  as many cached ones;

and prints the achieved bandwidth (decode: K and V bytes read / time) against
the device's copy ceiling (a large on-device copy), and the achieved TFLOP/s
(prefill: 4 * heads * head_dim * visible (q, kv) pairs / time) against its
matmul ceiling (a large bf16 matmul). Shapes are Llama-3-8B-like: 32 query
heads, 8 kv heads, head dim 128, page size 16, bf16. Each figure is the median
of ``--iters`` timed calls after two warm-up calls. It takes a few minutes on
one H200.

On CPU, ``--smoke`` runs tiny shapes with ``interpret=True`` (to check the
script, not to measure anything); without it the script says there is no GPU
and exits.

``--decode-cpu`` (any backend, meant for XLA:CPU) times the XLA lowering
(``kernel_xla``, ``decode_only``: the engine's ``decode_step`` program;
pages both with its XLA decode path and with the C++ ``kernel_cpu``,
alternated) on
decode rows with SmolLM2-135M's heads (N 9, K 3, H 64, page size 16), f32 and
int8 KV (int8 with f32 per-token scales, which it counts as bytes read), batch
rows 1, 8, 32 x context 256, 1,024, 4,096: ms per layer call (median of
``--iters``), K/V bytes read, GB/s, and the same process's limit, the
bandwidth of a large f32 matvec ([8192, 8192] @ [8192], 268 MB of matrix,
timed before and after the cases; the table uses the first), each also per
process CPU second (all threads), which moves less than wall time when
other jobs load the machine.
Pages are drawn in random order, as a long-running cache holds them.

``--prefill-cpu`` times the same way one sequence's prefill (128, 512, 940,
2,048 tokens, the whole prompt: every row a prefill row) through
``kernel_xla.ragged_paged_attention``, f32 and int8 KV, XLA path
(``_prefill_seqs``) against the C++ kernel: ms per layer call and GFLOP/s
(4 * N * H * visible (q, kv) pairs per second), wall and per CPU second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import kernel, reference


def median_time(fn, *args, iters: int, warmup: int = 2, **kwargs) -> float:
    """Median wall time of ``fn(*args, **kwargs)`` over ``iters`` calls after
    ``warmup`` untimed ones, in seconds (each call waited for with
    ``block_until_ready``)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_ceiling_gbs(nbytes: int, iters: int) -> float:
    """Read + write bandwidth of a plain on-device copy, GB/s."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1 + 0)
    return 2 * nbytes / median_time(f, x, iters=iters) / 1e9


def matmul_ceiling_tflops(n: int, iters: int) -> float:
    """bf16 matmul throughput (f32 accumulation), TFLOP/s."""
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / median_time(f, a, a, iters=iters) / 1e12


def median_cpu_time(fn, *args, iters: int, **kwargs) -> float:
    """Median process CPU time (all threads) of ``fn(*args, **kwargs)`` over
    ``iters`` calls after one untimed one, in seconds: steadier than wall
    time on a machine other jobs load."""
    jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(iters):
        t0 = time.process_time()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.process_time() - t0)
    return statistics.median(times)


def matvec_gbs(n: int, iters: int) -> tuple[float, float]:
    """Bandwidth of an f32 [n, n] @ [n] matvec (the matrix's bytes / time),
    GB/s per wall second and per process CPU second."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.matmul)
    return (4 * n * n / median_time(f, a, x, iters=iters) / 1e9,
            4 * n * n / median_cpu_time(f, a, x, iters=iters) / 1e9)


def _traced_with(kernels: bool, f, *args, **kwargs):
    """Trace and run ``f`` once with ``JAXSERVE_CPU_KERNELS`` on or off (read at
    trace time), so that later calls keep that path."""
    import os
    old = os.environ.get("JAXSERVE_CPU_KERNELS")
    os.environ["JAXSERVE_CPU_KERNELS"] = "1" if kernels else "0"
    try:
        jax.block_until_ready(f(*args, **kwargs))
    finally:
        if old is None:
            del os.environ["JAXSERVE_CPU_KERNELS"]
        else:
            os.environ["JAXSERVE_CPU_KERNELS"] = old


def _alternated(fns, *args, iters: int, **kwargs):
    """Median wall and process CPU seconds of each of ``fns``, calls alternated
    (one of each per round) so that load from other jobs hits them alike."""
    wall = [[] for _ in fns]
    cpu = [[] for _ in fns]
    for _ in range(iters):
        for i, f in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(*args, **kwargs))
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def decode_cpu(iters: int, batches=(1, 8, 32), contexts=(256, 1024, 4096),
               dtypes=("f32", "int8")) -> list[dict]:
    """The ``--decode-cpu`` table (module docstring); returns its rows as dicts
    (dtype, path, batch, ctx, ms, cpu_ms, bytes, gbs, cpu_gbs) after printing
    them. Pages are timed twice, alternated: the XLA decode path
    (``JAXSERVE_CPU_KERNELS=0`` at trace time) and the C++ kernel
    (``kernel_cpu``, where it is built)."""
    from pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_xla

    N, K, H, L = 9, 3, 64, 16
    rng = np.random.default_rng(0)
    limit, cpu_limit = matvec_gbs(8192, iters)
    print(f"device: {jax.devices()[0].device_kind}; f32 matvec [8192, 8192] @ [8192]: "
          f"{limit:.1f} GB/s, {cpu_limit:.1f} GB/s per CPU second; heads {N}/{K}, head dim "
          f"{H}, page {L}")
    print(f"{'kv':<5} {'path':<6} {'batch':>5} {'ctx':>6} {'ms':>8} {'MB read':>8} {'GB/s':>6} "
          f"{'of matvec':>9} {'CPU ms':>8} {'GB/s CPU':>8} {'of matvec':>9}")
    rows = []
    for dt in dtypes:
        for batch in batches:
            for ctx in contexts:
                q, kp, vp, kv_lens, pi, cu, ns = _case(rng, batch, 1, ctx, N=N, K=K, H=H, L=L,
                                                       dtype=jnp.float32)
                kw, nbytes = {}, 2 * batch * ctx * K * H * 4
                if dt == "int8":
                    kp, vp, kw = _int8_pages(kp, vp)
                    nbytes = 2 * batch * ctx * K * (H + 4)
                args = (q, kp, vp, kv_lens, pi, cu, ns, ns)
                paths = ["xla"] + (["kernel"] if kernel_cpu.available() else [])
                fns = []
                for path in paths:
                    f = jax.jit(lambda *a, **k: kernel_xla.ragged_paged_attention(
                        *a, sm_scale=H ** -0.5, decode_only=True, **k))
                    _traced_with(path == "kernel", f, *args, **kw)
                    fns.append(f)
                for path, (t, c) in zip(paths, _alternated(fns, *args, iters=iters, **kw)):
                    gbs, cpu_gbs = nbytes / t / 1e9, nbytes / c / 1e9
                    rows.append(dict(dtype=dt, path=path, batch=batch, ctx=ctx, ms=t * 1e3,
                                     cpu_ms=c * 1e3, bytes=nbytes, gbs=gbs, cpu_gbs=cpu_gbs))
                    print(f"{dt:<5} {path:<6} {batch:>5} {ctx:>6} {t * 1e3:>8.3f} "
                          f"{nbytes / 1e6:>8.2f} {gbs:>6.1f} {gbs / limit:>9.0%} {c * 1e3:>8.3f} "
                          f"{cpu_gbs:>8.1f} {cpu_gbs / cpu_limit:>9.0%}", flush=True)
    limit2, cpu_limit2 = matvec_gbs(8192, iters)
    print(f"f32 matvec after the cases: {limit2:.1f} GB/s, {cpu_limit2:.1f} GB/s per CPU second")
    return rows


def _int8_pages(kp_PLKH, vp_PLKH):
    """f32 pages as int8 pages with their [P, L, K] scales (``quant.quantize`` per
    token and kv head): (k pages, v pages, the scale keywords of the attention)."""
    from pallas_kernels.ragged_paged_attention import quant
    P, L, K, H = kp_PLKH.shape
    (kp, ks), (vp, vs) = (quant.quantize(x.reshape(P * L, K, H), jnp.int8)
                          for x in (kp_PLKH, vp_PLKH))
    return (kp.reshape(P, L, K, H), vp.reshape(P, L, K, H),
            dict(k_scales_PLK=ks.reshape(P, L, K), v_scales_PLK=vs.reshape(P, L, K)))


def prefill_cpu(iters: int, lengths=(128, 512, 940, 2048), dtypes=("f32", "int8")) -> list[dict]:
    """The ``--prefill-cpu`` table (module docstring); returns its rows as dicts
    (dtype, path, n, ms, cpu_ms, gflops, cpu_gflops) after printing them."""
    from pallas_kernels.ragged_paged_attention import kernel_cpu, kernel_xla

    N, K, H, L = 9, 3, 64, 16
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}; heads {N}/{K}, head dim {H}, page {L}")
    print(f"{'kv':<5} {'path':<6} {'tokens':>6} {'ms':>8} {'GFLOP/s':>8} {'CPU ms':>8} "
          f"{'GFLOP/s CPU':>11}")
    rows = []
    for dt in dtypes:
        for n in lengths:
            q, kp, vp, kv_lens, pi, cu, ns = _case(rng, 1, n, n, N=N, K=K, H=H, L=L,
                                                   dtype=jnp.float32)
            kw = {}
            if dt == "int8":
                kp, vp, kw = _int8_pages(kp, vp)
            flop = 4 * N * H * n * (n + 1) / 2
            args = (q, kp, vp, kv_lens, pi, cu, ns, 0)
            paths = ["xla"] + (["kernel"] if kernel_cpu.available() else [])
            fns = []
            for path in paths:
                f = jax.jit(lambda *a, **k: kernel_xla.ragged_paged_attention(
                    *a, sm_scale=H ** -0.5, **k))
                _traced_with(path == "kernel", f, *args, **kw)
                fns.append(f)
            for path, (t, c) in zip(paths, _alternated(fns, *args, iters=iters, **kw)):
                rows.append(dict(dtype=dt, path=path, n=n, ms=t * 1e3, cpu_ms=c * 1e3,
                                 gflops=flop / t / 1e9, cpu_gflops=flop / c / 1e9))
                print(f"{dt:<5} {path:<6} {n:>6} {t * 1e3:>8.2f} {flop / t / 1e9:>8.1f} "
                      f"{c * 1e3:>8.2f} {flop / c / 1e9:>11.1f}", flush=True)
    return rows


def _case(rng, num_seqs, q_len, kv_len, *, N, K, H, L, dtype):
    """Random q, pages and metadata for ``num_seqs`` sequences of the same shape."""
    pages_per_seq = -(-kv_len // L)
    P = num_seqs * pages_per_seq
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    T = num_seqs * q_len
    q = jax.random.normal(kq, (T, N, H), jnp.float32).astype(dtype)
    k_pages = jax.random.normal(kk, (P, L, K, H), jnp.float32).astype(dtype)
    v_pages = jax.random.normal(kv, (P, L, K, H), jnp.float32).astype(dtype)
    page_indices = jnp.asarray(rng.permutation(P).reshape(num_seqs, pages_per_seq), jnp.int32)
    kv_lens = jnp.full((num_seqs,), kv_len, jnp.int32)
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len
    num_seqs_1 = jnp.array([num_seqs], jnp.int32)
    return q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs_1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--decode-cpu", action="store_true",
                    help="time the XLA lowering's decode rows against a large matvec")
    ap.add_argument("--prefill-cpu", action="store_true",
                    help="time the XLA lowering's prefill rows: XLA path against kernel_cpu")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if args.decode_cpu:
        decode_cpu(args.iters)
        return 0
    if args.prefill_cpu:
        prefill_cpu(args.iters)
        return 0
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        print(f"no GPU (backend {jax.default_backend()!r}); run on a GPU, or --smoke for a "
              "tiny interpret-mode check of this script")
        return 1
    rng = np.random.default_rng(0)
    interpret = not on_gpu
    if args.smoke:
        N, K, H, L, dtype = 4, 2, 64, 16, jnp.float32
        decode_cases = [(b, c) for b in (1, 4) for c in (64, 256)]
        prefill_cases = [(2, 32)]
        iters = 1
    else:
        N, K, H, L, dtype = 32, 8, 128, 16, jnp.bfloat16
        decode_cases = [(b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)]
        prefill_cases = [(4, 512), (4, 2048)]
        iters = args.iters
    sm_scale = H ** -0.5
    itemsize = jnp.dtype(dtype).itemsize
    if on_gpu:
        bw = copy_ceiling_gbs(4 << 30, iters)
        mm = matmul_ceiling_tflops(8192, iters)
    else:
        bw, mm = float("nan"), float("nan")
    print(f"device: {jax.devices()[0].device_kind}; copy ceiling {bw:.0f} GB/s, "
          f"bf16 matmul ceiling {mm:.0f} TFLOP/s; heads {N}/{K}, head dim {H}, page {L}, "
          f"{jnp.dtype(dtype).name}")

    ours = jax.jit(lambda *a: kernel.ragged_paged_attention(*a, sm_scale=sm_scale,
                                                            interpret=interpret))
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    def theirs_fn(q, k_pages, v_pages, kv_lens, page_indices):
        # JAX's kernel wants [K, P, L, H] pages (transposed once, outside the
        # timing) and pages per sequence divisible by k_splits (its defaults:
        # 16 splits, 8 pages per compute block).
        pages = page_indices.shape[1]
        k_splits = min(16, pages)
        q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)  # it applies no softmax scale
        return jax_pa.paged_attention(q, k_pages, v_pages, page_indices, kv_lens,
                                      interpret=interpret, k_splits=k_splits,
                                      pages_per_compute_block=min(8, pages // k_splits))
    theirs = jax.jit(theirs_fn)

    print(f"\n{'decode':<10} {'batch':>5} {'ctx':>6} {'ours ms':>9} {'GB/s':>7} {'of copy':>8} "
          f"{'jax ms':>9} {'ours/jax':>8} {'max|diff|':>10}")
    for batch, ctx in decode_cases:
        q, kp, vp, kv_lens, pi, cu, ns = _case(rng, batch, 1, ctx, N=N, K=K, H=H, L=L,
                                               dtype=dtype)
        t_ours = median_time(ours, q, kp, vp, kv_lens, pi, cu, ns, iters=iters)
        kp_t, vp_t = jnp.transpose(kp, (2, 0, 1, 3)), jnp.transpose(vp, (2, 0, 1, 3))
        try:
            t_jax = median_time(theirs, q, kp_t, vp_t, kv_lens, pi, iters=iters)
            diff = float(jnp.max(jnp.abs(ours(q, kp, vp, kv_lens, pi, cu, ns).astype(jnp.float32)
                                         - theirs(q, kp_t, vp_t, kv_lens, pi).astype(jnp.float32))))
        except Exception as e:  # JAX's kernel rejects some shapes (e.g. in interpret mode)
            print(f"  (jax paged_attention failed: {type(e).__name__}: {str(e)[:80]})")
            t_jax, diff = float("nan"), float("nan")
        nbytes = 2 * batch * ctx * K * H * itemsize
        gbs = nbytes / t_ours / 1e9
        print(f"{'':<10} {batch:>5} {ctx:>6} {t_ours * 1e3:>9.3f} {gbs:>7.0f} {gbs / bw:>8.1%} "
              f"{t_jax * 1e3:>9.3f} {t_ours / t_jax:>8.2f} {diff:>10.2e}")

    print(f"\n{'prefill':<10} {'seqs':>5} {'chunk':>6} {'ours ms':>9} {'TFLOP/s':>8} "
          f"{'of mm':>7} {'max|diff| vs ref':>17}")
    for seqs, chunk in prefill_cases:
        kv_len = 2 * chunk
        q, kp, vp, kv_lens, pi, cu, ns = _case(rng, seqs, chunk, kv_len, N=N, K=K, H=H, L=L,
                                               dtype=dtype)
        t_ours = median_time(ours, q, kp, vp, kv_lens, pi, cu, ns, iters=iters)
        pairs = seqs * (chunk * (kv_len - chunk) + chunk * (chunk + 1) // 2)
        tflops = 4 * N * H * pairs / t_ours / 1e12
        # The dense reference on the last 32 query rows of sequence 0 (as a
        # 32-token chunk with the same kv_len, so positions are unchanged).
        tail = min(32, chunk)
        ref = reference.ref_ragged_paged_attention(
            q[chunk - tail:chunk], kp, vp, kv_lens[:1], pi[:1], jnp.array([0, tail], jnp.int32),
            jnp.array([1], jnp.int32), sm_scale=sm_scale)
        diff = float(jnp.max(jnp.abs(ours(q, kp, vp, kv_lens, pi, cu, ns)[chunk - tail:chunk]
                                     .astype(jnp.float32) - ref.astype(jnp.float32))))
        print(f"{'':<10} {seqs:>5} {chunk:>6} {t_ours * 1e3:>9.3f} {tflops:>8.1f} "
              f"{tflops / mm:>7.1%} {diff:>17.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
