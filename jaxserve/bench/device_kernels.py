"""The device script's kernel sections: the attention kernel checked against
the reference, and timed alone against JAX's own kernels.

* ``selfcheck``: ``pallas_kernels.ragged_paged_attention.kernel.
  ragged_paged_attention`` (the device's Pallas kernel: Triton on GPU, Mosaic
  on TPU; the GPU kernel under the Pallas interpreter with ``interpret``) on
  random ragged batches mixing decode rows and prefill chunks (some on top
  of cached tokens), padding tokens and unused sequence slots, against
  ``reference.ref_ragged_paged_attention`` on the same pages in f32; for the
  head shapes in ``HEAD_SHAPES``, bf16 and int8 KV (``quant.quantize``, f32
  scales), with and without a sliding window and soft cap. Max abs error
  per case, and pass when it is at most ``TOLERANCE``.
* ``kernel_decode``: one query token per sequence, B sequences x C tokens of
  context, bf16; ours vs ``jax.experimental.pallas.ops.gpu.paged_attention.
  paged_attention`` (pages transposed to its [K, P, L, H] outside the timing;
  it takes no softmax scale, so q is pre-scaled; ``k_splits`` 16 and 8 pages
  per compute block, its defaults, capped by the pages a sequence has).
  Bytes moved: the K and V pages read, ``2 * B * C * K * H * 2``; bytes/s as
  a fraction of the copy ceiling.
* ``kernel_prefill``: one prompt of n tokens, causal, no cached tokens, bf16;
  ours vs ``jax.nn.dot_product_attention(..., is_causal=True,
  implementation="cudnn")`` on dense [1, n, K, H] K/V (``"xla"`` on a
  backend without cuDNN, and said so). FLOPs: ``4 * N * H * n (n + 1) / 2``
  (visible (query, key) pairs); FLOP/s as a fraction of the matmul ceiling.

Each comparison is guarded: an upstream API that is missing or fails on a
shape records its error in the row, not a crash. Times are the median of
``iters`` calls after one warm-up (``pallas_kernels.bench.median_time``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bench import median_time
from pallas_kernels.ragged_paged_attention import kernel, reference
from pallas_kernels.ragged_paged_attention import quant as kvq

# name: (query heads N, kv heads K, head dim H)
HEAD_SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
# Max abs error allowed against the f32 reference, by query dtype: a bf16
# output carries 2^-8 relative rounding of values up to ~4 (normal inputs),
# and the kernels feed bf16 probabilities to the P @ V matmul.
TOLERANCE = {"bfloat16": 5e-2, "float32": 2e-3}
WINDOW, SOFT_CAP = 24, 5.0  # small enough to change the result at these lengths
PAGE_SIZE = 16


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:1000]


def _pages(x_PLKH, kv_dtype: str, dtype):
    """(pages, scales or None) of f32 ``x_PLKH`` stored as ``kv_dtype``."""
    if kv_dtype == "bfloat16" or kv_dtype == jnp.dtype(dtype).name:
        return x_PLKH.astype(dtype), None
    P, L, K, H = x_PLKH.shape
    q, s = kvq.quantize(x_PLKH.reshape(P * L, K, H), jnp.dtype(kv_dtype))
    return q.reshape(P, L, K, H), s.reshape(P, L, K)


def mixed_batch(rng, *, N: int, K: int, H: int, num_decode: int, num_prefill: int,
                max_ctx: int, max_q: int, dtype, kv_dtype: str, L: int = PAGE_SIZE,
                pad_tokens: int = 3, spare_seqs: int = 2) -> dict:
    """A random ragged batch: ``num_decode`` decode rows (one token on
    1..max_ctx - 1 cached) first, then ``num_prefill`` chunks of 2..max_q
    tokens (every other one on top of cached tokens), ``pad_tokens`` tokens
    owned by no sequence, ``spare_seqs`` unused sequence slots, and pages in a
    random order with random values beyond each sequence's length.

    Returns:
      {"args": (q_TNH, k_pages, v_pages, kv_lens_S, page_indices_SP,
      cu_q_lens_S1, num_seqs), "k_scales", "v_scales" (None for bf16),
      "q_lens", "kv_lens"}.
    """
    q_lens = [1] * num_decode + [int(x) for x in rng.integers(2, max_q + 1, num_prefill)]
    kv_lens = [int(rng.integers(2, max_ctx + 1)) for _ in range(num_decode)]
    kv_lens += [q + (int(rng.integers(1, max_ctx)) if i % 2 else 0)
                for i, q in enumerate(q_lens[num_decode:])]
    n = len(q_lens)
    S = n + spare_seqs
    pps = -(-max(kv_lens) // L)
    P = sum(-(-kv // L) for kv in kv_lens) + 4
    ids = rng.permutation(P)
    page_indices = np.zeros((S, pps), np.int32)
    at = 0
    for i, kv in enumerate(kv_lens):
        m = -(-kv // L)
        page_indices[i, :m] = ids[at:at + m]
        at += m
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(spare_seqs, sum(q_lens))])
    T = sum(q_lens) + pad_tokens
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv_ = jax.random.split(key, 3)
    q = jax.random.normal(kq, (T, N, H), jnp.float32).astype(dtype)
    k, ks = _pages(jax.random.normal(kk, (P, L, K, H), jnp.float32), kv_dtype, dtype)
    v, vs = _pages(jax.random.normal(kv_, (P, L, K, H), jnp.float32), kv_dtype, dtype)
    args = (q, k, v, jnp.asarray(kv_lens + [0] * spare_seqs, jnp.int32),
            jnp.asarray(page_indices), jnp.asarray(cu, jnp.int32), jnp.array([n], jnp.int32))
    return {"args": args, "k_scales": ks, "v_scales": vs, "q_lens": q_lens, "kv_lens": kv_lens}


def selfcheck_cases(smoke: bool) -> list[dict]:
    """The self-check's cases: KV dtype x (plain, window + soft cap) x every
    head shape, the plain bf16 ones first (a section cut at its limit keeps
    the cases done); in smoke, SmolLM2's heads with bf16 plain and int8
    windowed (smaller batches: 2 decode rows, 2 prefill chunks)."""
    if smoke:
        return [dict(heads="smollm2", kv_dtype="bfloat16", window=None, soft_cap=None),
                dict(heads="smollm2", kv_dtype="int8", window=WINDOW, soft_cap=SOFT_CAP)]
    return [dict(heads=h, kv_dtype=kv, window=w, soft_cap=c) for kv in ("bfloat16", "int8")
            for w, c in ((None, None), (WINDOW, SOFT_CAP)) for h in HEAD_SHAPES]


def selfcheck(smoke: bool, interpret: bool, progress, seed: int = 0) -> dict:
    """Section 1 (see the module docstring): {"cases": [{"heads", "N", "K",
    "H", "kv_dtype", "window", "soft_cap", "q_lens", "kv_lens",
    "max_abs_err", "max_abs_ref", "tolerance", "pass"} or {..., "error"}],
    "status": "ok" when every case passed, else "failed"}. ``progress(**kw)``
    records the cases done so far (a cut section keeps them)."""
    dtype = jnp.bfloat16
    tol = TOLERANCE[jnp.dtype(dtype).name]
    rows = []
    for i, case in enumerate(selfcheck_cases(smoke)):
        N, K, H = HEAD_SHAPES[case["heads"]]
        row = dict(case, N=N, K=K, H=H, seed=seed + i, tolerance=tol)
        rng = np.random.default_rng(seed + i)
        try:
            b = mixed_batch(rng, N=N, K=K, H=H, dtype=dtype, kv_dtype=case["kv_dtype"],
                            num_decode=2 if smoke else int(rng.integers(1, 9)),
                            num_prefill=2 if smoke else int(rng.integers(1, 4)),
                            max_ctx=40 if smoke else 600, max_q=20 if smoke else 200)
            row.update(q_lens=b["q_lens"], kv_lens=b["kv_lens"])
            kw = dict(sm_scale=H ** -0.5, sliding_window=case["window"],
                      soft_cap=case["soft_cap"])
            ours = jax.jit(functools.partial(kernel.ragged_paged_attention, interpret=interpret,
                                             **kw))
            ref = jax.jit(functools.partial(reference.ref_ragged_paged_attention, **kw))
            q, k, v, *meta = b["args"]
            got = ours(q, k, v, *meta, k_scales_PLK=b["k_scales"], v_scales_PLK=b["v_scales"])
            f32 = (lambda x: x) if b["k_scales"] is not None else (
                lambda x: x.astype(jnp.float32))
            want = ref(q.astype(jnp.float32), f32(k), f32(v), *meta,
                       k_scales_PLK=b["k_scales"], v_scales_PLK=b["v_scales"])
            d = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
            err = float(d.max()) if np.isfinite(d).all() else float("inf")
            row.update(max_abs_err=err, max_abs_ref=float(np.abs(np.asarray(want)).max()),
                       ok=bool(err <= tol))
        except Exception as e:  # one case's lowering error must not hide the others
            row.update(error=_err(e), ok=False)
        row["pass"] = row.pop("ok")
        rows.append(row)
        print(f"  selfcheck {case['heads']} {case['kv_dtype']} window={case['window']} "
              f"cap={case['soft_cap']}: max|err| {row.get('max_abs_err', '-')} "
              f"{'pass' if row['pass'] else 'FAIL ' + row.get('error', '')}", flush=True)
        progress(cases=rows)
    return {"cases": rows, "status": "ok" if all(r["pass"] for r in rows) else "failed"}


def _fraction(x, ceiling):
    return None if not ceiling else x / ceiling


def _decode_case(rng, B: int, ctx: int, N: int, K: int, H: int, dtype):
    pps = -(-ctx // PAGE_SIZE)
    P = B * pps
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (B, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (P, PAGE_SIZE, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (P, PAGE_SIZE, K, H), jnp.float32).astype(dtype)
    pi = jnp.asarray(rng.permutation(P).reshape(B, pps), jnp.int32)
    return (q, k, v, jnp.full((B,), ctx, jnp.int32), pi,
            jnp.arange(B + 1, dtype=jnp.int32), jnp.array([B], jnp.int32))


def _jax_paged_attention(interpret: bool, sm_scale: float):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    def theirs(q, k_KPLH, v_KPLH, kv_lens, page_indices):
        pps = page_indices.shape[1]
        splits = min(16, pps)
        q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)  # it applies no scale
        return paged_attention(q, k_KPLH, v_KPLH, page_indices, kv_lens, interpret=interpret,
                               k_splits=splits,
                               pages_per_compute_block=max(1, min(8, pps // splits)))
    return jax.jit(theirs)


def kernel_decode(cases, ceilings: dict | None, iters: int, interpret: bool, progress,
                  heads=(32, 8, 128)) -> dict:
    """Section 2a: {"rows": [{"batch", "ctx", "kv_bytes", "ours_ms",
    "ours_bytes_per_s", "ours_of_copy", "jax_ms", "jax_bytes_per_s",
    "jax_of_copy", "ours_over_jax" (time ratio), "max_abs_diff", "jax_error" /
    "ours_error"}], "against": ...}."""
    N, K, H = heads
    dtype = jnp.bfloat16
    bw = (ceilings or {}).get("bytes_per_s")
    ours = jax.jit(functools.partial(kernel.ragged_paged_attention, sm_scale=H ** -0.5,
                                     interpret=interpret))
    try:
        theirs, theirs_error = _jax_paged_attention(interpret, H ** -0.5), None
    except Exception as e:  # the upstream module moved or is missing
        theirs, theirs_error = None, _err(e)
    rng = np.random.default_rng(1)
    rows = []
    for B, ctx in cases:
        row = {"batch": B, "ctx": ctx, "N": N, "K": K, "H": H, "dtype": "bfloat16",
               "kv_bytes": 2 * B * ctx * K * H * jnp.dtype(dtype).itemsize}
        args = _decode_case(rng, B, ctx, N, K, H, dtype)
        got = None
        try:
            t = median_time(ours, *args, iters=iters, warmup=1)
            got = ours(*args)
            row.update(ours_ms=1e3 * t, ours_bytes_per_s=row["kv_bytes"] / t,
                       ours_of_copy=_fraction(row["kv_bytes"] / t, bw))
        except Exception as e:
            row["ours_error"] = _err(e)
        if theirs is None:
            row["jax_error"] = theirs_error
        else:
            try:
                kT, vT = (jnp.transpose(p, (2, 0, 1, 3)) for p in args[1:3])
                targs = (args[0], kT, vT, args[3], args[4])
                t = median_time(theirs, *targs, iters=iters, warmup=1)
                row.update(jax_ms=1e3 * t, jax_bytes_per_s=row["kv_bytes"] / t,
                           jax_of_copy=_fraction(row["kv_bytes"] / t, bw))
                if got is not None:
                    row["max_abs_diff"] = float(jnp.max(jnp.abs(
                        got.astype(jnp.float32) - theirs(*targs).astype(jnp.float32))))
                del kT, vT
            except Exception as e:  # JAX's kernel rejects some shapes
                row["jax_error"] = _err(e)
        if "ours_ms" in row and "jax_ms" in row:
            row["ours_over_jax"] = row["ours_ms"] / row["jax_ms"]
        rows.append(row)
        print(f"  decode {B}x{ctx}: ours {row.get('ours_ms', float('nan')):.3f} ms "
              f"({row.get('ours_of_copy') or 0:.0%} of copy), jax "
              f"{row.get('jax_ms', float('nan')):.3f} ms", flush=True)
        progress(rows=rows)
        del args, got
    return {"rows": rows, "against": "jax.experimental.pallas.ops.gpu.paged_attention",
            "ceiling_bytes_per_s": bw}


def _cudnn_or_xla() -> str:
    return "cudnn" if jax.default_backend() == "gpu" else "xla"


def kernel_prefill(lens, ceilings: dict | None, iters: int, interpret: bool, progress,
                   heads=(32, 8, 128)) -> dict:
    """Section 2b: {"rows": [{"tokens", "flops", "ours_ms", "ours_flops_per_s",
    "ours_of_matmul", "theirs_ms", ..., "ours_over_theirs", "max_abs_diff"}],
    "against": "jax.nn.dot_product_attention(implementation=...)"}."""
    N, K, H = heads
    dtype = jnp.bfloat16
    mm = (ceilings or {}).get("flops_per_s")
    impl = _cudnn_or_xla()
    ours = jax.jit(functools.partial(kernel.ragged_paged_attention, sm_scale=H ** -0.5,
                                     interpret=interpret))

    def theirs_fn(q_TNH, k_TKH, v_TKH):
        return jax.nn.dot_product_attention(q_TNH[None], k_TKH[None], v_TKH[None],
                                            scale=H ** -0.5, is_causal=True,
                                            implementation=impl)[0]
    theirs = jax.jit(theirs_fn)
    rng = np.random.default_rng(2)
    rows = []
    for n in lens:
        row = {"tokens": n, "N": N, "K": K, "H": H, "dtype": "bfloat16",
               "flops": 4 * N * H * n * (n + 1) // 2}
        args = list(_decode_case(rng, 1, n, N, K, H, dtype))
        key = jax.random.key(int(rng.integers(1 << 30)))
        args[0] = jax.random.normal(key, (n, N, H), jnp.float32).astype(dtype)
        args[5] = jnp.array([0, n], jnp.int32)
        got = None
        try:
            t = median_time(ours, *args, iters=iters, warmup=1)
            got = ours(*args)
            row.update(ours_ms=1e3 * t, ours_flops_per_s=row["flops"] / t,
                       ours_of_matmul=_fraction(row["flops"] / t, mm))
        except Exception as e:
            row["ours_error"] = _err(e)
        try:
            # The same K/V, dense: page j of the row holds positions j*L..j*L+L-1.
            k_TKH, v_TKH = (p[args[4][0]].reshape(-1, K, H)[:n] for p in args[1:3])
            t = median_time(theirs, args[0], k_TKH, v_TKH, iters=iters, warmup=1)
            row.update(theirs_ms=1e3 * t, theirs_flops_per_s=row["flops"] / t,
                       theirs_of_matmul=_fraction(row["flops"] / t, mm))
            if got is not None:
                row["max_abs_diff"] = float(jnp.max(jnp.abs(
                    got.astype(jnp.float32)
                    - theirs(args[0], k_TKH, v_TKH).astype(jnp.float32))))
        except Exception as e:  # no cuDNN, or a shape it refuses
            row["theirs_error"] = _err(e)
        if "ours_ms" in row and "theirs_ms" in row:
            row["ours_over_theirs"] = row["ours_ms"] / row["theirs_ms"]
        rows.append(row)
        print(f"  prefill {n}: ours {row.get('ours_ms', float('nan')):.3f} ms "
              f"({row.get('ours_of_matmul') or 0:.0%} of matmul), {impl} "
              f"{row.get('theirs_ms', float('nan')):.3f} ms", flush=True)
        progress(rows=rows)
    return {"rows": rows, "against": f"jax.nn.dot_product_attention(implementation={impl!r})",
            "ceiling_flops_per_s": mm}
