"""GPU script: ``python -m jaxserve.bench device --output x.json`` (or
``python -m jaxserve.bench.device ...``).

On one accelerator, in this order, each section under its own time limit
(``SECTIONS``; ``--section_limits name=s,...`` overrides), within
``--budget_s`` (default 450 s, for an 8-minute slot on one H200):

1. ``selfcheck`` (60 s): the device's Pallas attention kernel against
   ``ref_ragged_paged_attention`` on random mixed decode + prefill batches,
   Llama-3-8B's heads (32/8/128) and SmolLM2's (9/3/64), bf16 and int8 KV,
   with and without a sliding window and soft cap: max abs error per case,
   pass/fail (``device_kernels.selfcheck``);
2. ``ceilings`` (45 s): a large matmul (FLOP/s) and an in-place copy
   (bytes/s) (``roofline.measure_ceilings``);
   ``kernel_decode`` (120 s): the kernel alone against JAX's
   ``pallas.ops.gpu.paged_attention`` at ``--kernel_decode`` (batch x
   context, default 1x4096, 8x4096, 64x4096, 1x32768): ms per call, KV
   bytes read, fraction of the copy ceiling, our time / theirs;
   ``kernel_prefill`` (60 s): against ``jax.nn.dot_product_attention(...,
   implementation="cudnn")`` on a causal prompt of each ``--kernel_prefill``
   length (default 1024, 4096): ms, FLOPs, fraction of the matmul ceiling,
   our time / theirs (``device_kernels``);
3. with the time left, a Llama-3-8B-shaped model (32 layers, D 4096, 32 query
   / 8 kv heads of 128, SwiGLU 14336, vocab 128256, random bf16 weights;
   ``device_model``): ``model_decode`` (120 s): decode steps at batch 1, 8,
   64 and 256 on ``--decode_ctx`` (512) tokens each (median of ``--iters``,
   bytes moved, MBU, MFU); ``model_prefill`` (60 s): one 1,024- and one
   4,096-token prompt; ``quant_matmul`` (45 s): one ``--quant_shape``
   projection (6144 x 2304) at M = 1, 8, 128, dense f32 / bf16 against
   int8, w8a8 and int4 weights; ``kv_attention`` (45 s): one layer's decode
   attention over bf16 vs int8 pages at ``--kv_attention`` (8x4096,
   64x4096); ``workload_chat`` and ``workload_rag`` (150 s each): the
   workloads (``jaxserve.bench.workloads``, random token ids) through the
   engine's scheduler at ``--concurrency`` 32, vLLM-style figures and the
   roofline of their steps; a workload that would start with less than
   ``--workload_min_s`` (120 s) left is skipped.

A section that raises is recorded (``"error"``) and the next one runs; a
section that overruns its limit, even hung inside a device call, is cut: the
sections run in a worker process that the parent kills, and a fresh worker
goes on with the next section (``sections``); whatever happens, a worker
still alive 15 s past the budget is killed, so the run ends by then. The JSON at ``--output`` is
rewritten after every section (and as a section's cases finish), so a run cut
short keeps what it measured: ``sections`` maps each name to its figures and
``"status"`` (``ok``, ``failed``: a check did not pass, ``error``,
``timeout``, ``skipped`` with its ``reason``).

Exit status: 0 when every section is ``ok`` or ``skipped``; 3 when any is
``failed``, ``error`` or ``timeout`` (the JSON is written either way); 1
without an accelerator and without ``--smoke``; 2 for a bad option.

``--smoke`` runs everything with tiny shapes on any backend (CPU included;
the kernel in Pallas interpret mode, a tiny f32 model), to check the script;
its figures mean nothing. ``--sections a,b`` runs only those (the others are
``skipped``). ``JAXSERVE_BENCH_HANG=NAME`` in the environment makes section
NAME hang with its signals masked (the tests' way to see a section cut).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

from jaxserve.bench import sections as sec

# name: (time limit s, least time left to start it s); workload_<name> per --workloads.
SECTIONS = {"selfcheck": (60.0, 0.0), "ceilings": (45.0, 0.0), "kernel_decode": (120.0, 20.0),
            "kernel_prefill": (60.0, 15.0), "model_decode": (120.0, 30.0),
            "model_prefill": (60.0, 20.0), "quant_matmul": (45.0, 10.0),
            "kv_attention": (45.0, 10.0)}
WORKLOAD_LIMIT_S = 150.0


def __getattr__(name):  # the model's names, without importing JAX's users in the parent
    if name in ("LLAMA3_8B", "SMOKE", "QUANT_FORMS"):
        from jaxserve.bench import device_model
        return getattr(device_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(ap) -> None:
    """The ``device`` subcommand's options."""
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any backend")
    ap.add_argument("--output", default="device_bench.json", help="JSON file to write")
    ap.add_argument("--sections", default="all", help="comma list of sections to run "
                    "(default all; the others are recorded as skipped)")
    ap.add_argument("--section_limits", default="", help="name=seconds,... per-section time "
                    "limits replacing the defaults")
    ap.add_argument("--kernel_decode", default=None, help="BxCTX kernel decode cases "
                    "(default 1x4096,8x4096,64x4096,1x32768; smoke 1x64,2x128)")
    ap.add_argument("--kernel_prefill", default=None, help="kernel prefill prompt lengths "
                    "(default 1024,4096; smoke 64)")
    ap.add_argument("--decode_batches", default=None, help="default 1,8,64,256 (smoke 1,2,4)")
    ap.add_argument("--decode_ctx", type=int, default=None,
                    help="tokens in each decoding sequence's cache (default 512; smoke 32)")
    ap.add_argument("--prefill_lens", default=None, help="default 1024,4096 (smoke 64,128)")
    ap.add_argument("--workloads", default="chat,rag", help="serving workloads, or none")
    ap.add_argument("--concurrency", type=int, default=None, help="default 32 (smoke 2)")
    ap.add_argument("--num_prompts", type=int, default=None, help="default 64 (smoke 2)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per shape "
                    "(default 10; smoke 2)")
    ap.add_argument("--quant_shape", default=None, help="FxD of the quantized matmul "
                    "(default 6144x2304; smoke 256x128)")
    ap.add_argument("--quant_ms", default=None, help="columns M (default 1,8,128; smoke 1,8)")
    ap.add_argument("--kv_attention", default=None, help="rowsxctx decode attention cases, "
                    "bf16 vs int8 KV (default 8x4096,64x4096; smoke 2x64), or none")
    ap.add_argument("--budget_s", type=float, default=450.0, help="whole-run time budget, s")
    ap.add_argument("--workload_min_s", type=float, default=120.0,
                    help="skip a workload that would start with less than this left, s")


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} {text!r}: expected positive integers")
    return vals


def _pairs(text: str, flag: str) -> list[list[int]]:
    if text == "none":
        return []
    try:
        out = [[int(v) for v in c.split("x")] for c in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected AxB,AxB,...") from None
    if any(len(p) != 2 or min(p) < 1 for p in out):
        raise ValueError(f"{flag} {text!r}: expected AxB,AxB,... of positive integers")
    return out


def options(a) -> dict:
    """The run's sizes, defaults filled in (smoke or not); ValueError naming a
    bad flag."""
    s = a.smoke
    o = {"batches": _ints(a.decode_batches or ("1,2,4" if s else "1,8,64,256"),
                          "--decode_batches"),
         "ctx": a.decode_ctx or (32 if s else 512),
         "prefill_lens": _ints(a.prefill_lens or ("64,128" if s else "1024,4096"),
                               "--prefill_lens"),
         "iters": a.iters or (2 if s else 10), "concurrency": a.concurrency or (2 if s else 32),
         "num_prompts": a.num_prompts or (2 if s else 64),
         "workloads": [w for w in a.workloads.split(",") if w and w != "none"],
         "kernel_decode": _pairs(a.kernel_decode or ("1x64,2x128" if s else
                                                     "1x4096,8x4096,64x4096,1x32768"),
                                 "--kernel_decode"),
         "kernel_prefill": _ints(a.kernel_prefill or ("64" if s else "1024,4096"),
                                 "--kernel_prefill"),
         "quant_shape": _pairs(a.quant_shape or ("256x128" if s else "6144x2304"),
                               "--quant_shape")[0],
         "quant_ms": _ints(a.quant_ms or ("1,8" if s else "1,8,128"), "--quant_ms"),
         "kv_attention": _pairs(a.kv_attention or ("2x64" if s else "8x4096,64x4096"),
                                "--kv_attention")}
    if a.budget_s <= 0:
        raise ValueError(f"--budget_s {a.budget_s}: must be > 0")
    return o


def section_table(a, o) -> tuple[dict, dict, list[str]]:
    """({name: limit_s}, {name: min_s}, names to run) in run order, from
    ``SECTIONS``, ``--workloads``, ``--section_limits`` and ``--sections``."""
    limits = {n: v[0] for n, v in SECTIONS.items()}
    min_s = {n: v[1] for n, v in SECTIONS.items()}
    for w in o["workloads"]:
        limits[f"workload_{w}"] = WORKLOAD_LIMIT_S
        min_s[f"workload_{w}"] = 0.0 if a.smoke else a.workload_min_s
    for item in (x for x in a.section_limits.split(",") if x):
        name, _, val = item.partition("=")
        if name not in limits:
            raise ValueError(f"--section_limits: unknown section {name!r} (one of "
                             f"{', '.join(limits)})")
        try:
            limits[name] = float(val)
        except ValueError:
            raise ValueError(f"--section_limits {item!r}: expected name=seconds") from None
        if limits[name] <= 0:
            raise ValueError(f"--section_limits {item!r}: must be > 0")
    wanted = list(limits) if a.sections == "all" else [x for x in a.sections.split(",") if x]
    unknown = [n for n in wanted if n not in limits]
    if unknown:
        raise ValueError(f"--sections: unknown section(s) {', '.join(unknown)} (one of "
                         f"{', '.join(limits)})")
    return limits, min_s, wanted


def run(a) -> int:
    """The whole script (see the module docstring): the parent, which never
    touches the accelerator; workers (``worker``) run the sections. Its exit
    status as documented there."""
    o = options(a)
    limits, min_s, wanted = section_table(a, o)
    doc = {"benchmark": "jaxserve device benchmark (python -m jaxserve.bench device)",
           "smoke": a.smoke, "flags": vars(a), "options": o,
           "budget_s": a.budget_s, "started_at": time.time(), "limits": limits, "min_s": min_s,
           "sections": {n: {"status": "pending"} if n in wanted else
                        {"status": "skipped", "reason": "not in --sections"} for n in limits}}
    out = os.path.abspath(a.output)
    sec.save(out, doc)

    def spawn():
        return subprocess.Popen([sys.executable, "-c", "import sys; from jaxserve.bench import "
                                 "device; sys.exit(device.worker(sys.argv[1]))", out],
                                start_new_session=True)
    doc = sec.supervise(out, spawn, a.budget_s)
    if doc.get("refused"):
        print(doc["refused"])
        return 1
    bad = [n for n, s in doc["sections"].items() if s["status"] in ("failed", "error", "timeout")]
    doc["exit_status"] = 3 if bad else 0
    sec.save(out, doc)
    for n, s in doc["sections"].items():
        why = s.get("error") or s.get("reason") or ""
        print(f"{n:>16}: {s['status']:<8} {s.get('seconds', 0):6.1f} s  {why[:100]}")
    print(f"wrote {a.output} in {doc['wall_s']:.0f} s ({doc['workers']} worker(s))"
          + (f"; not ok: {', '.join(bad)}" if bad else ""))
    return doc["exit_status"]


def worker(path: str) -> int:
    """One worker: run the pending sections of the document at ``path``
    (``sections.run_worker``); 1 when it refuses (no accelerator, no smoke)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.bench import device_kernels as dk
    from jaxserve.bench import device_model as dm
    from jaxserve.bench import machine, roofline

    doc = sec.load(path)
    a, o = argparse.Namespace(**doc["flags"]), doc["options"]
    backend = jax.default_backend()
    accel = backend in ("gpu", "tpu")
    if not accel and not a.smoke:
        doc["refused"] = (f"no GPU (backend {backend!r}); run on a GPU, or --smoke for a tiny "
                          "check of this script")
        sec.save(path, doc)
        return 1
    model = dm.Model(a, o)
    if "env" not in doc:
        doc.update(env=machine.environment(), model_config=dataclasses.asdict(model.cfg),
                   dtype=model.dtype)
        sec.save(path, doc)
    interpret = not accel
    heads = (4, 2, 64) if a.smoke else (32, 8, 128)
    act = jnp.dtype(model.dtype)  # bf16 on the accelerator, f32 in smoke

    def ceil(d):
        c = d["sections"]["ceilings"]
        return c if c["status"] == "ok" else None

    def ceilings(d, progress):
        c = roofline.measure_ceilings(model.dtype, matmul_n=256 if a.smoke else None,
                                      copy_mib=8 if a.smoke else None)
        print(f"  ceilings {c.flops_per_s / 1e12:.3g} TFLOP/s, {c.bytes_per_s / 1e9:.0f} GB/s",
              flush=True)
        return {"flops_per_s": c.flops_per_s, "bytes_per_s": c.bytes_per_s, "source": c.source}

    fns = {
        "selfcheck": lambda d, p: dk.selfcheck(a.smoke, interpret, p),
        "ceilings": ceilings,
        "kernel_decode": lambda d, p: dk.kernel_decode(o["kernel_decode"], ceil(d), o["iters"],
                                                       interpret, p, heads),
        "kernel_prefill": lambda d, p: dk.kernel_prefill(o["kernel_prefill"], ceil(d),
                                                         o["iters"], interpret, p, heads),
        "model_decode": lambda d, p: dm.steps(model, d, [(b, 1, o["ctx"]) for b in o["batches"]],
                                              p),
        "model_prefill": lambda d, p: dm.steps(model, d, [(1, n, n) for n in o["prefill_lens"]],
                                               p),
        "quant_matmul": lambda d, p: {"rows": dm.quant_matmuls(*o["quant_shape"], o["quant_ms"],
                                                               o["iters"], act)},
        "kv_attention": lambda d, p: {"rows": dm.kv_attention(
            o["kv_attention"], o["iters"], act, np.random.default_rng(0))},
    }
    for w in o["workloads"]:
        fns[f"workload_{w}"] = lambda d, p, w=w: dm.workload(model, d, w)
    return sec.run_worker(path, {n: fns[n] for n in doc["limits"]}, doc["limits"],
                          doc["min_s"], a.budget_s)


def main(argv=None) -> int:
    """``python -m jaxserve.bench.device ...``: the same as ``python -m
    jaxserve.bench device ...``."""
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.device",
                                 description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    try:
        return run(a)
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
