"""``python -m jaxserve.bench lora``: what serving many LoRA adapters costs.

One engine (``LLM(enable_lora=True)``, ``--max_loras`` slots of rank
``--rank``) over the base model; ``--adapters`` random adapters of rank
``--rank`` on all seven projections, written as PEFT writes them
(``write_random_adapter``; no torch needed), registered at start.

- **Batch** (the issue's target: >= 0.85x): ``--batch`` prompts, greedy,
  ``--max_tokens`` each, generated at once by the base alone and spread
  round-robin over the adapters (every slot in use), the two passes
  alternated ``--repeats`` times after the engine's warm-up; output tokens
  per second of each, the median of the pairs' ratios, and the XLA programs
  built while measuring (0: the adapters are array values of the same
  programs).
- **Swap** (target: < 50 ms): the time to write one adapter into a slot
  (``SlotWriter.write``: host -> device copy and the in-place slot update,
  finished), the median over ``--repeats`` x adapters writes.

The machine is named with every figure (``machine.describe``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from jaxserve.bench import machine, report

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf or HF folder")
    p.add_argument("--output", required=True, help="folder for result.json and report.md")
    p.add_argument("--batch", type=int, default=32, help="requests of each pass")
    p.add_argument("--max_tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--adapters", type=int, default=8, help="adapters the batch is spread over")
    p.add_argument("--max_loras", type=int, default=8, help="adapter slots on device")
    p.add_argument("--rank", type=int, default=16, help="rank of every adapter (and the slots)")
    p.add_argument("--repeats", type=int, default=5, help="alternated pass pairs (median)")


def write_random_adapter(folder: str, model_config, rank: int, seed: int,
                         alpha: float | None = None) -> str:
    """Write a PEFT LoRA adapter of ``rank`` on all seven projections of every
    layer of ``model_config`` into ``folder`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, the names ``peft`` saves): A ~ N(0, 1/in),
    B ~ N(0, 1/rank) / 4, so it moves the logits without drowning the base.
    Returns ``folder``."""
    from safetensors.numpy import save_file
    cfg = model_config
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    shapes = {"q_proj": (N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D),
              "o_proj": (D, N * H), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for proj, (out_dim, in_dim) in shapes.items():
            sub = "self_attn" if proj in TARGETS[:4] else "mlp"
            pre = f"base_model.model.model.layers.{i}.{sub}.{proj}"
            tensors[f"{pre}.lora_A.weight"] = (rng.standard_normal((rank, in_dim))
                                               / np.sqrt(in_dim)).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = (rng.standard_normal((out_dim, rank))
                                               / np.sqrt(rank) / 4).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                   "lora_alpha": alpha or rank, "target_modules": list(TARGETS),
                   "bias": "none", "use_rslora": False, "use_dora": False,
                   "lora_dropout": 0.0}, f, indent=1)
    return folder


def _pass(llm, prompts, params, loras) -> dict:
    e = llm.engine
    s0 = e.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, loras)
    dt = time.perf_counter() - t0
    s1 = e.stats()
    toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return dict(seconds=dt, output_tokens=toks, tok_s=toks / dt, steps=s1.num_steps - s0.num_steps,
                compilations=s1.num_compilations - s0.num_compilations,
                first_tokens=[o.outputs[0].token_ids[:4] for o in outs[:2]])


def run(a) -> int:
    import tempfile

    from jaxserve import LLM, SamplingParams
    if a.adapters < 1 or a.max_loras < 1 or a.rank < 1:
        raise ValueError("--adapters, --max_loras and --rank must be >= 1")
    llm = LLM(a.model, max_num_seqs=max(64, a.batch), enable_lora=True, max_loras=a.max_loras,
              max_lora_rank=a.rank)
    e = llm.engine
    tmp = tempfile.mkdtemp(prefix="jaxserve-lora-bench-")
    names = [f"lora{i}" for i in range(a.adapters)]
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        e.add_lora(name, write_random_adapter(os.path.join(tmp, name), e.model_config, a.rank,
                                              seed=i))
    register_s = (time.perf_counter() - t0) / a.adapters
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Write a short story about the number {i} and a lighthouse.")
               for i in range(a.batch)]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    mix = [names[i % a.adapters] for i in range(a.batch)]
    res = {"machine": machine.describe(), "model": a.model, "batch": a.batch,
           "max_tokens": a.max_tokens, "adapters": a.adapters, "max_loras": a.max_loras,
           "rank": a.rank, "register_seconds_per_adapter": register_s}
    e.warmup()  # every step program, so no measured pass compiles one
    _pass(llm, prompts, params, None)
    _pass(llm, prompts, params, mix)
    runs = [(_pass(llm, prompts, params, None), _pass(llm, prompts, params, mix))
            for _ in range(a.repeats)]
    for k, name in ((0, "base"), (1, "lora_mix")):
        side = [r[k] for r in runs]
        best = sorted(side, key=lambda r: r["tok_s"])[len(side) // 2]
        res[name] = best | dict(tok_s_runs=[round(r["tok_s"], 1) for r in side],
                                compilations=sum(r["compilations"] for r in side))
    ratios = [m["tok_s"] / b["tok_s"] for b, m in runs]
    res["ratio_runs"] = [round(x, 3) for x in ratios]
    res["ratio"] = statistics.median(ratios)
    # Swaps: each adapter written into slot 1 in turn (the slot is then stale
    # for the registry: reset it so later requests swap their adapter back).
    slots = e.adapters
    times = []
    for _ in range(a.repeats):
        for name in names:
            times.append(slots.writer.write(1, slots.get(name).values))
    slots.in_slot[1] = None
    slots.slot_of = {n: s for n, s in slots.slot_of.items() if s != 1}
    res["swap_ms_median"] = 1e3 * statistics.median(times)
    res["swap_ms_max"] = 1e3 * max(times)
    res["slot_bytes"] = int(sum(v.nbytes for v in slots.get(names[0]).values.values()))
    paths = report.write(a.output, res, markdown)
    print(markdown(res))
    print("wrote " + ", ".join(paths))
    return 0


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# Multi-LoRA: {res['model']}", "",
             f"Machine: {m.get('cpu_model')} ({m.get('cpu_count')} CPUs; "
             f"{' '.join(m.get('avx_flags', [])) or 'no AVX'}).", "",
             f"Batch of {res['batch']} (greedy, {res['max_tokens']} tokens each); "
             f"{res['adapters']} adapters of rank {res['rank']} on all seven projections, "
             f"{res['max_loras']} slots.", "",
             "| rows | output tok/s (median; runs) | steps | output tokens | programs built |",
             "|---|---|---|---|---|"]
    for name, label in (("base", "base alone"),
                        ("lora_mix", f"spread over {res['adapters']} adapters")):
        r = res[name]
        lines.append(f"| {label} | {r['tok_s']:.1f} ({r['tok_s_runs']}) | {r['steps']} | "
                     f"{r['output_tokens']} | {r['compilations']} |")
    lines += ["", f"With adapters: **{res['ratio']:.2f}x** the base's output tok/s (target >= "
              f"0.85x; the median of {len(res['ratio_runs'])} alternated pairs, "
              f"{res['ratio_runs']}).", "",
              f"Swapping an adapter into a slot ({res['slot_bytes'] / 2**20:.1f} MiB): median "
              f"**{res['swap_ms_median']:.1f} ms**, max {res['swap_ms_max']:.1f} ms (target "
              f"< 50 ms); registering one (parse + check): "
              f"{res['register_seconds_per_adapter'] * 1e3:.0f} ms.", ""]
    return "\n".join(lines)


__all__ = ["add_arguments", "markdown", "run", "write_random_adapter"]
