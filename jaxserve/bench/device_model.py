"""The device script's whole-model sections (section 3 of ``device``): a
Llama-3-8B-shaped model's decode and prefill steps, weight formats and KV
dtypes, and serving workloads. See ``jaxserve.bench.device`` for what each
measures; this module holds the code."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench import roofline, serving, stats
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
PAGE_SIZE = 16


def ceilings_from(doc: dict) -> roofline.Ceilings:
    """The ceilings section's figures (NaN when it did not finish: the
    fractions become null in the JSON)."""
    c = doc["sections"].get("ceilings", {})
    if c.get("status") != "ok":
        return roofline.Ceilings(float("nan"), float("nan"), "the ceilings section did not "
                                 "finish")
    return roofline.Ceilings(c["flops_per_s"], c["bytes_per_s"], c["source"])


class Model:
    """The random model and its engine, built on first use in a worker (a
    worker started after a cut builds it again)."""

    def __init__(self, a, o):
        self.a, self.o, self._llm, self.init_s = a, o, None, None
        self.cfg = SMOKE if a.smoke else LLAMA3_8B
        self.dtype = "float32" if a.smoke else "bfloat16"

    @property
    def engine(self):
        if self._llm is None:
            from jaxserve import LLM
            o, t = self.o, time.monotonic()
            longest = max(o["prefill_lens"] + [o["ctx"] + 1, 256 if self.a.smoke else 1600])
            pages = (max(o["batches"]) * -(-o["ctx"] // PAGE_SIZE)
                     + 2 * o["concurrency"] * -(-1400 // PAGE_SIZE) + 64)
            self._llm = LLM("random-" + ("smoke" if self.a.smoke else "llama3-8b"),
                            model_config=self.cfg, params=None, dtype=self.dtype,
                            page_size=PAGE_SIZE, num_pages=pages,
                            max_num_seqs=max(max(o["batches"]), o["concurrency"]),
                            max_num_batched_tokens=max(o["prefill_lens"] + [2048]),
                            max_model_len=longest + 8, enable_prefix_caching=False)
            self.init_s = time.monotonic() - t
            print(f"  random {self.cfg.num_layers}-layer model, {pages} KV pages: "
                  f"{self.init_s:.1f} s", flush=True)
        return self._llm.engine

    def built_here(self) -> dict:
        """{"model_init_s": s} once, for the section that built the model."""
        s, self.init_s = self.init_s, None
        return {} if s is None else {"model_init_s": s}

    def byte_sizes(self) -> dict:
        return dict(param_bytes=jnp.dtype(self.dtype).itemsize,
                    kv_bytes=self.engine.kv_dtype.itemsize)


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


def steps(model: Model, doc: dict, shapes, progress) -> dict:
    """Decode or prefill steps: ``shapes`` [(num_seqs, q_len, ctx)], each
    ``steps.time_step`` (median of ``iters``) with its roofline figures."""
    ceil, kw, points = ceilings_from(doc), model.byte_sizes(), []
    rng = np.random.default_rng(0)
    for b, q_len, ctx in shapes:
        p = _figures(time_step(model.engine, b, q_len, ctx, model.o["iters"], rng), model.cfg,
                     ceil, **kw)
        points.append(p)
        print(f"  {b} x {q_len} new on {ctx}: {p['ms']:.2f} ms/step, {p['tokens_per_s']:.0f} "
              f"tok/s, MBU {p['mbu']:.1%}, MFU {p['mfu']:.1%} (compile+first "
              f"{p['first_call_s']:.0f} s)", flush=True)
        progress(points=points)
    return {"points": points, **model.built_here()}


QUANT_FORMS = ("float32", "bfloat16", "int8", "w8a8", "int4")


def quant_matmuls(F: int, D: int, ms, iters: int, act_dtype) -> list[dict]:
    """Median ms of ``W x`` (W [F, D], x [D, M]) per form and M: dense f32 and
    bf16 against ``quant.quantized_matmul`` of int8, w8a8 and int4 (group 32)
    weights; the weight bytes as stored and their bytes/s."""
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
    int8 pages (N 32, K 8, H 128, L 16) per (rows, ctx): the engine's
    attention (Pallas on GPU/TPU, XLA on CPU), KV bytes read and bytes/s."""
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


def workload(model: Model, doc: dict, name: str) -> dict:
    """One serving workload (``workloads.make_requests``, random token ids)
    through ``serving.run_inprocess``, closed loop: vLLM-style summary and the
    per-phase roofline of its steps."""
    o, cfg = model.o, model.cfg
    engine = model.engine
    reqs = make_requests(None, cfg.vocab_size, name, o["num_prompts"], seed=0,
                         scale=0.05 if model.a.smoke else 1.0)
    t = time.monotonic()
    run = serving.run_inprocess(engine, reqs, o["concurrency"])
    summary = stats.summarize(run.records)
    print(f"  {name}: {o['num_prompts']} requests at C={o['concurrency']} in "
          f"{summary['duration_s']:.1f} s, {summary['output_throughput']:.0f} out tok/s, "
          f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, TPOT p50 "
          f"{summary['tpot_ms']['p50']:.1f} ms, {run.compilations} compilations", flush=True)
    return {**model.built_here(), "concurrency": o["concurrency"],
            "num_prompts": o["num_prompts"], "run_s": time.monotonic() - t,
            "compilations": run.compilations, "preemptions": run.preemptions,
            "peak_kv_pages": max((s[1] for s in run.kv_series), default=0),
            "summary": summary,
            "roofline": roofline.analyze(run.steps, cfg, ceilings_from(doc),
                                         **model.byte_sizes())}
