"""GPU benchmark: ``python -m jaxserve.bench device [--output device.json]``.

On one accelerator, a Llama-3-8B-shaped model (32 layers, D 4096, 32 query /
8 kv heads of 128, SwiGLU 14336, vocab 128256) with random bf16 weights:

1. ceilings: a large bf16 matmul and a large copy (``roofline.measure_ceilings``);
2. decode steps at batch 1, 8, 64 and 256, each sequence with ``--decode_ctx``
   tokens in its cache: the median of ``--iters`` steps, its bytes moved
   (weights + KV read + KV written) and MBU, FLOPs and MFU;
3. prefill of one 1,024- and one 4,096-token prompt: median step, MFU, MBU;
4. weight formats and KV cache dtypes: one projection ``W x`` of ``--quant_shape``
   (F x D, default 6144 x 2304) at M = ``--quant_ms`` columns (1, 8, 128):
   dense f32 and bf16 against ``quant.quantized_matmul`` of int8, w8a8 and
   int4 (group 32) weights (``lowering="auto"``, the engine's own form;
   activations bf16 on the accelerator, f32 on CPU), with the weight bytes as
   stored and their bytes/s; and one layer's decode attention over bf16 vs
   int8 K/V pages (f32 scales beside them) at ``--kv_attention`` (rows x
   context, default 8x4096 and 64x4096; N 32, K 8, H 128), the engine's
   attention (Pallas on GPU/TPU, XLA on CPU), KV bytes read and bytes/s;
5. the ``chat`` and ``rag`` workloads (``jaxserve.bench.workloads``, random
   token ids of the same lengths since the model has no tokenizer) through
   the engine's scheduler, closed loop at ``--concurrency``, vLLM-style
   figures and the per-phase roofline of their steps.

Steps 2 and 3 drive ``Engine.shaped_step`` with hand-built batches
(``steps.time_step``), so each point is exactly one shape: one XLA
compilation per batch bucket / prompt length, then timed calls. The K/V they
read are whatever the cache holds (zeros): timing does not depend on the
values. Step 5 goes through ``Engine.step()`` like any request. The run is sized to finish within ``--budget_s`` (default 450 s,
for an 8-minute slot on one H200); a workload that would start with less
than ``--workload_min_s`` left is skipped and the JSON says so. The JSON is
rewritten after every section, so a run cut short keeps what it measured.

``--smoke`` runs a tiny f32 config with small shapes on any backend (CPU
included), to check the script; its figures mean nothing. Without it the
script refuses to run on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM
from jaxserve.bench import machine, roofline, serving, stats
from jaxserve.bench.steps import time_step
from jaxserve.bench.workloads import make_requests
from jaxserve.config import ModelConfig
from jaxserve.models import quant
from pallas_kernels.bench import _case, median_time
from pallas_kernels.ragged_paged_attention import kernel, kernel_xla
from pallas_kernels.ragged_paged_attention import quant as kvq

LLAMA3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False)
SMOKE = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
    tie_word_embeddings=False)


def _figures(point: dict, cfg: ModelConfig, ceil, param_bytes: int, kv_bytes: int) -> dict:
    q = [point["q_len"]] * point["num_seqs"]
    kv = [point["ctx"]] * point["num_seqs"]
    f = roofline.step_flops(cfg, q, kv)
    b = roofline.step_bytes(cfg, q, kv, param_bytes, kv_bytes)
    s = point["median_s"]
    return dict(point, flops=f, bytes=b, ms=1e3 * s, flops_per_s=f / s,
                bytes_per_s=b["total"] / s, mfu=f / s / ceil.flops_per_s,
                mbu=b["total"] / s / ceil.bytes_per_s, tokens_per_s=sum(q) / s,
                bound="compute" if f / ceil.flops_per_s >= b["total"] / ceil.bytes_per_s
                else "bandwidth")


QUANT_FORMS = ("float32", "bfloat16", "int8", "w8a8", "int4")


def quant_matmuls(F: int, D: int, ms, iters: int, act_dtype) -> list[dict]:
    """Median ms of ``W x`` (W [F, D], x [D, M]) per form and M; see step 4."""
    rng = np.random.default_rng(0)
    w = (0.02 * rng.standard_normal((F, D))).astype(np.float32)
    dense = jax.jit(lambda w, x: jnp.einsum("fd,dt->ft", w, x,
                                            preferred_element_type=jnp.float32))
    fmts = {"int8": quant.INT8, "w8a8": quant.W8A8, "int4": quant.method_format("int4", 32)}
    rows = []
    for form in QUANT_FORMS:
        if form in fmts:
            qt = quant.quantize_np(w, fmts[form])
            parts = [None if a is None else jnp.asarray(a) for a in (qt.q, qt.scale, qt.zero)]
            fn, xdt = jax.jit(functools.partial(quant.quantized_matmul, fmts[form])), act_dtype
        else:
            parts, fn, xdt = [jnp.asarray(w, form)], dense, jnp.dtype(form)
        nbytes = sum(a.nbytes for a in parts if a is not None)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((D, m)), xdt)
            t = median_time(fn, *parts, x, iters=iters, warmup=1)
            rows.append({"form": form, "F": F, "D": D, "M": m, "ms": 1e3 * t,
                         "weight_bytes": nbytes, "bytes_per_s": nbytes / t,
                         "act_dtype": str(jnp.dtype(xdt))})
    for r in rows:  # speed-ups against the dense forms at the same M
        for ref in ("float32", "bfloat16"):
            base = next(b for b in rows if b["form"] == ref and b["M"] == r["M"])
            r[f"speedup_vs_{ref}"] = base["ms"] / r["ms"]
    return rows


def kv_attention(cases, iters: int, dense_dtype, rng) -> list[dict]:
    """Median ms of one layer's decode attention over ``dense_dtype`` vs
    int8 pages (N 32, K 8, H 128, L 16) per (rows, ctx); see step 4."""
    N, K, H, L = 32, 8, 128, 16
    accel = jax.default_backend() in ("gpu", "tpu")
    rows = []
    for b, ctx in cases:
        q, kp, vp, kv_lens, pidx, cu, ns = _case(rng, b, 1, ctx, N=N, K=K, H=H, L=L,
                                                 dtype=dense_dtype)
        for kv in (str(jnp.dtype(dense_dtype)), "int8"):
            if kv == "int8":
                P = kp.shape[0]
                (kq, ks), (vq, vs) = (kvq.quantize(p.reshape(P * L, K, H), jnp.int8)
                                      for p in (kp, vp))
                pages = (kq.reshape(P, L, K, H), vq.reshape(P, L, K, H), ks.reshape(P, L, K),
                         vs.reshape(P, L, K))
            else:
                pages = (kp, vp, None, None)
            def attend(q, k, v, ks, vs, kv_lens, pidx, cu, ns, num_decode):
                if accel:
                    return kernel.ragged_paged_attention(
                        q, k, v, kv_lens, pidx, cu, ns, sm_scale=H ** -0.5, k_scales_PLK=ks,
                        v_scales_PLK=vs)
                return kernel_xla.ragged_paged_attention(
                    q, k, v, kv_lens, pidx, cu, ns, num_decode, sm_scale=H ** -0.5,
                    k_scales_PLK=ks, v_scales_PLK=vs)
            fn = jax.jit(attend, static_argnums=(9,))
            t = median_time(fn, q, *pages, kv_lens, pidx, cu, ns, b, iters=iters, warmup=1)
            per_tok = 2 * K * (H * jnp.dtype(pages[0].dtype).itemsize + (4 if kv == "int8" else 0))
            nbytes = b * ctx * per_tok
            rows.append({"rows": b, "ctx": ctx, "kv_dtype": kv, "ms": 1e3 * t,
                         "kv_bytes_read": nbytes, "bytes_per_s": nbytes / t,
                         "impl": "pallas" if accel else "xla"})
        rows[-1]["speedup_vs_dense"] = rows[-2]["ms"] / rows[-1]["ms"]
    return rows


def add_arguments(ap) -> None:
    """The ``device`` subcommand's options."""
    ap.add_argument("--smoke", action="store_true", help="tiny f32 config, any backend")
    ap.add_argument("--output", default="device_bench.json", help="JSON file to write")
    ap.add_argument("--decode_batches", default=None, help="default 1,8,64,256 (smoke 1,2,4)")
    ap.add_argument("--decode_ctx", type=int, default=None,
                    help="tokens in each decoding sequence's cache (default 512; smoke 32)")
    ap.add_argument("--prefill_lens", default=None, help="default 1024,4096 (smoke 64,128)")
    ap.add_argument("--workloads", default="chat,rag", help="serving workloads, or none")
    ap.add_argument("--concurrency", type=int, default=None, help="default 32 (smoke 2)")
    ap.add_argument("--num_prompts", type=int, default=None, help="default 64 (smoke 2)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per step shape "
                    "(default 10; smoke 2)")
    ap.add_argument("--quant_shape", default=None, help="FxD of the quantized matmul "
                    "(default 6144x2304; smoke 256x128)")
    ap.add_argument("--quant_ms", default=None, help="columns M (default 1,8,128; smoke 1,8)")
    ap.add_argument("--kv_attention", default=None, help="rowsxctx decode attention cases, "
                    "bf16 vs int8 KV (default 8x4096,64x4096; smoke 2x64), or none")
    ap.add_argument("--budget_s", type=float, default=450.0, help="whole-run time budget, s")
    ap.add_argument("--workload_min_s", type=float, default=120.0,
                    help="skip a workload that would start with less than this left, s")


def run(a) -> int:
    """The whole script (see the module docstring); 1 without a GPU unless
    ``--smoke``."""
    t_start = time.monotonic()
    on_accel = jax.default_backend() in ("gpu", "tpu")
    if not on_accel and not a.smoke:
        print(f"no GPU (backend {jax.default_backend()!r}); run on a GPU, or --smoke for a "
              "tiny check of this script")
        return 1
    smoke = a.smoke
    cfg = SMOKE if smoke else LLAMA3_8B
    dtype = "float32" if smoke else "bfloat16"
    batches = [int(x) for x in (a.decode_batches or ("1,2,4" if smoke else "1,8,64,256"))
               .split(",")]
    ctx = a.decode_ctx or (32 if smoke else 512)
    prefill_lens = [int(x) for x in (a.prefill_lens or ("64,128" if smoke else "1024,4096"))
                    .split(",")]
    iters = a.iters or (2 if smoke else 10)
    conc = a.concurrency or (2 if smoke else 32)
    num_prompts = a.num_prompts or (2 if smoke else 64)
    wl_names = [w for w in a.workloads.split(",") if w and w != "none"]
    longest = max(prefill_lens + [ctx + 1, 256 if smoke else 1600])  # rag: ~1,320 + 50
    page_size = 16
    pages_needed = max(batches) * -(-ctx // page_size) + 2 * conc * -(-1400 // page_size) + 64
    out: dict = {"benchmark": "jaxserve device benchmark (python -m jaxserve.bench device)",
                 "smoke": smoke, "model_config": dataclasses.asdict(cfg),
                 "dtype": dtype, "env": machine.environment(), "flags": vars(a), "sections": {}}

    def save():
        out["wall_s"] = time.monotonic() - t_start
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)

    def log(msg):
        print(f"[{time.monotonic() - t_start:6.1f} s] {msg}", flush=True)

    t = time.monotonic()
    llm = LLM("random-" + ("smoke" if smoke else "llama3-8b"), model_config=cfg, params=None,
              dtype=dtype, page_size=page_size, num_pages=pages_needed, max_num_seqs=max(
                  max(batches), conc), max_num_batched_tokens=max(prefill_lens + [2048]),
              max_model_len=longest + 8, enable_prefix_caching=False)
    engine = llm.engine
    out["sections"]["init_s"] = time.monotonic() - t
    log(f"random {cfg.num_layers}-layer model and {pages_needed} KV pages ready")

    t = time.monotonic()
    ceil = roofline.measure_ceilings(dtype, matmul_n=256 if smoke else None,
                                     copy_mib=8 if smoke else None)
    out["ceilings"] = {"flops_per_s": ceil.flops_per_s, "bytes_per_s": ceil.bytes_per_s,
                       "source": ceil.source, "seconds": time.monotonic() - t}
    log(f"ceilings {ceil.flops_per_s / 1e12:.3g} TFLOP/s, {ceil.bytes_per_s / 1e9:.0f} GB/s")
    save()

    rng = np.random.default_rng(0)
    kw = dict(param_bytes=np.dtype(jax.numpy.dtype(dtype)).itemsize,
              kv_bytes=engine.kv_dtype.itemsize)
    out["decode"] = []
    for b in batches:
        p = _figures(time_step(engine, b, 1, ctx, iters, rng), cfg, ceil, **kw)
        out["decode"].append(p)
        log(f"decode batch {b:>4} ctx {ctx}: {p['ms']:.2f} ms/step, {p['tokens_per_s']:.0f} "
            f"tok/s, MBU {p['mbu']:.1%}, MFU {p['mfu']:.1%} (compile+first {p['first_call_s']:.0f} s)")
        save()
    out["prefill"] = []
    for n in prefill_lens:
        p = _figures(time_step(engine, 1, n, n, iters, rng), cfg, ceil, **kw)
        out["prefill"].append(p)
        log(f"prefill {n:>5} tokens: {p['ms']:.1f} ms, MFU {p['mfu']:.1%}, MBU {p['mbu']:.1%} "
            f"(compile+first {p['first_call_s']:.0f} s)")
        save()

    F, D = (int(v) for v in (a.quant_shape or ("256x128" if smoke else "6144x2304")).split("x"))
    ms = [int(x) for x in (a.quant_ms or ("1,8" if smoke else "1,8,128")).split(",")]
    spec = a.kv_attention or ("2x64" if smoke else "8x4096,64x4096")
    cases = [] if spec == "none" else [tuple(int(v) for v in c.split("x"))
                                       for c in spec.split(",")]
    act = jax.numpy.dtype(dtype)  # bf16 on the accelerator, f32 in smoke
    out["quant_matmul"] = quant_matmuls(F, D, ms, iters, act)
    for r in out["quant_matmul"]:
        log(f"matmul {r['form']:>8} {F}x{D} M={r['M']:>3}: {r['ms']:.3f} ms, "
            f"{r['bytes_per_s'] / 1e9:.0f} GB/s of weights, {r['speedup_vs_bfloat16']:.2f}x bf16")
    save()
    out["kv_attention"] = kv_attention(cases, iters, act, rng)
    for r in out["kv_attention"]:
        log(f"attention {r['rows']}x{r['ctx']} KV {r['kv_dtype']:>8}: {r['ms']:.3f} ms, "
            f"{r['bytes_per_s'] / 1e9:.0f} GB/s")
    save()

    out["workloads"] = {}
    for w in wl_names:
        left = a.budget_s - (time.monotonic() - t_start)
        if left < a.workload_min_s and not smoke:
            out["workloads"][w] = {"skipped": f"{left:.0f} s of the {a.budget_s:.0f} s budget "
                                              f"left (< --workload_min_s {a.workload_min_s:.0f})"}
            log(f"workload {w} skipped: {left:.0f} s left")
            save()
            continue
        reqs = make_requests(None, cfg.vocab_size, w, num_prompts, seed=0,
                             scale=0.05 if smoke else 1.0)
        t = time.monotonic()
        run = serving.run_inprocess(engine, reqs, conc)
        summary = stats.summarize(run.records)
        out["workloads"][w] = {
            "concurrency": conc, "num_prompts": num_prompts, "seconds": time.monotonic() - t,
            "compilations": run.compilations, "preemptions": run.preemptions,
            "peak_kv_pages": max((s[1] for s in run.kv_series), default=0),
            "summary": summary,
            "roofline": roofline.analyze(run.steps, cfg, ceil, **kw)}
        log(f"workload {w}: {num_prompts} requests at C={conc} in {summary['duration_s']:.1f} s, "
            f"{summary['output_throughput']:.0f} out tok/s, TTFT p50 "
            f"{summary['ttft_ms']['p50']:.0f} ms, TPOT p50 {summary['tpot_ms']['p50']:.1f} ms, "
            f"{run.compilations} compilations")
        save()
    save()
    log(f"wrote {a.output}")
    return 0

