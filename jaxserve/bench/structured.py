"""``python -m jaxserve.bench structured``: what structured outputs cost.

Two measurements on one engine (``LLM``), each pass the median of
``--repeats`` runs after a warm-up pass (which also compiles the grammar):

- **Batch** (the issue's target: <= 1.10x): ``--batch`` chat prompts asking
  for a person as JSON, greedy, ``--max_tokens``, generated at once,
  unconstrained and constrained by a JSON Schema
  (``StructuredOutputsParams(json=...)``), the two passes alternated after
  the engine's warm-up; output tokens per second of each, the median of
  the pairs' ratios, and the XLA programs built during the measured passes
  (0: constrained and plain rows share one program per bucket).
- **Forced drafting** (target: >= 1.3x): one request at a time under a
  schema whose keys are fixed strings (a JSON object of ``--fields`` string
  fields), with the grammar's forced tokens riding as drafts
  (``max_forced_drafts`` 8, the default) against plain constrained decoding
  (``max_forced_drafts`` 0): output tokens per second and engine steps.

The machine is named with every figure (``machine.describe``). Host-side
mask time comes from the engine's counters (``EngineStats.mask_fills`` /
``mask_fill_seconds``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from jaxserve.bench import machine, report

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "city", "role"],
}
TOPICS = ["a doctor", "a pilot", "a chef", "a student", "a farmer", "a painter", "a nurse",
          "a teacher"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="alias, .gguf or HF folder")
    p.add_argument("--output", required=True, help="folder for result.json and report.md")
    p.add_argument("--batch", type=int, default=32, help="requests of the batch pass")
    p.add_argument("--max_tokens", type=int, default=96, help="output tokens per request")
    p.add_argument("--fields", type=int, default=8, help="string fields of the forced-key "
                   "schema")
    p.add_argument("--single", type=int, default=4, help="requests of the forced-drafting pass "
                   "(one at a time)")
    p.add_argument("--repeats", type=int, default=5, help="measured runs per pass (median)")
    p.add_argument("--max_num_seqs", type=int, default=None, help="the engine's sequence "
                   "slots, every decode width of which is compiled before measuring "
                   "(default: max(64, --batch); at least --batch)")


def forced_key_schema(fields: int) -> dict:
    """A JSON object of ``fields`` short string fields with long fixed keys:
    most of its tokens are forced by the grammar."""
    props = {f"field_number_{i}_of_the_record": {"type": "string", "maxLength": 8}
             for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def _pass(llm, prompts, params) -> dict:
    e = llm.engine
    s0 = e.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    s1 = e.stats()
    toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return dict(seconds=dt, output_tokens=toks, tok_s=toks / dt, steps=s1.num_steps - s0.num_steps,
                compilations=s1.num_compilations - s0.num_compilations,
                mask_fills=s1.mask_fills - s0.mask_fills,
                mask_fill_ms=1e3 * (s1.mask_fill_seconds - s0.mask_fill_seconds),
                forced_tokens=s1.num_forced_tokens - s0.num_forced_tokens,
                finish=sorted({c.finish_reason for o in outs for c in o.outputs}),
                texts=[o.outputs[0].text for o in outs[:2]])


def _median(llm, prompts, params, repeats: int) -> dict:
    _pass(llm, prompts, params)  # warm-up: programs, grammar compile
    runs = [_pass(llm, prompts, params) for _ in range(repeats)]
    best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return best | dict(tok_s_runs=[round(r["tok_s"], 1) for r in runs],
                       compilations=sum(r["compilations"] for r in runs))


def _paired(llm, prompts, plain, constrained, repeats: int) -> tuple[dict, dict, list[float]]:
    """Both batch passes, alternated (plain, constrained) ``repeats`` times
    after a warm-up pass of each, so a machine whose speed drifts moves both
    alike: (median plain run, median constrained run, the per-pair time
    ratios constrained / plain per output token)."""
    _pass(llm, prompts, plain)
    _pass(llm, prompts, constrained)
    runs = [(_pass(llm, prompts, plain), _pass(llm, prompts, constrained))
            for _ in range(repeats)]
    out = []
    for k in (0, 1):
        side = [r[k] for r in runs]
        best = sorted(side, key=lambda r: r["tok_s"])[len(side) // 2]
        out.append(best | dict(tok_s_runs=[round(r["tok_s"], 1) for r in side],
                               compilations=sum(r["compilations"] for r in side)))
    return out[0], out[1], [p["tok_s"] / c["tok_s"] for p, c in runs]


def run(a) -> int:
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.sampling_params import StructuredOutputsParams
    slots = max(64, a.batch) if a.max_num_seqs is None else a.max_num_seqs
    if slots < a.batch:
        raise ValueError(f"--max_num_seqs {slots} is less than --batch {a.batch}: the batch "
                         f"pass runs all its requests at once")
    llm = LLM(a.model, max_num_seqs=slots)
    prompts = [llm.apply_chat_template(
        [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} number {i} as a JSON "
          "object with name, age, city and role."}]) for i in range(a.batch)]
    plain = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    schema = dataclasses.replace(plain, structured_outputs=StructuredOutputsParams(json=PERSON))
    res = {"machine": machine.describe(), "model": a.model, "batch": a.batch,
           "max_tokens": a.max_tokens}
    llm.engine.warmup()  # every step program, so no measured pass compiles one
    res["batch_plain"], res["batch_constrained"], ratios = _paired(llm, prompts, plain, schema,
                                                                    a.repeats)
    res["batch_ratio_runs"] = [round(x, 3) for x in ratios]
    res["batch_ratio"] = statistics.median(ratios)
    # The prompts' prefill (and first token) is the same in both passes but
    # is spread over fewer tokens when the grammar closes the output early:
    # the time after it, per token after the first, compares the decoding.
    first = _median(llm, prompts, dataclasses.replace(plain, max_tokens=1), a.repeats)
    res["prefill_seconds"] = first["seconds"]
    for name in ("batch_plain", "batch_constrained"):
        r = res[name]
        r["decode_tok_s"] = (r["output_tokens"] - a.batch) / max(1e-9, r["seconds"] -
                                                                first["seconds"])
    res["decode_ratio"] = res["batch_plain"]["decode_tok_s"] / \
        res["batch_constrained"]["decode_tok_s"]

    keyed = dataclasses.replace(plain, max_tokens=4 * a.fields + 24 * a.fields, structured_outputs=
                                StructuredOutputsParams(json=forced_key_schema(a.fields)))
    single = prompts[:a.single]
    e = llm.engine
    base = e.config.scheduler.max_forced_drafts
    out = {}
    for name, k in (("forced_drafts", base or 8), ("plain_constrained", 0)):
        e.set_max_forced_drafts(k)
        runs = [_median(llm, [p], keyed, a.repeats) for p in single]
        out[name] = dict(max_forced_drafts=k, tok_s=statistics.median(r["tok_s"] for r in runs),
                         steps=sum(r["steps"] for r in runs),
                         output_tokens=sum(r["output_tokens"] for r in runs),
                         forced_tokens=sum(r["forced_tokens"] for r in runs),
                         compilations=sum(r["compilations"] for r in runs),
                         texts=[r["texts"][0] for r in runs[:2]])
    e.set_max_forced_drafts(base)
    res["single"] = out
    res["forced_speedup"] = out["forced_drafts"]["tok_s"] / out["plain_constrained"]["tok_s"]
    paths = report.write(a.output, res, markdown)
    print(markdown(res))
    print("wrote " + ", ".join(paths))
    return 0


def markdown(res: dict) -> str:
    b, c, s = res["batch_plain"], res["batch_constrained"], res["single"]
    m = res["machine"]
    lines = [f"# Structured outputs: {res['model']}", "",
             f"Machine: {m.get('cpu_model')} ({m.get('cpu_count')} CPUs; "
             f"{' '.join(m.get('avx_flags', [])) or 'no AVX'}).", "",
             f"## Batch of {res['batch']} (greedy, max_tokens {res['max_tokens']})", "",
             "| rows | output tok/s (median; runs) | decode tok/s after the first token | "
             "steps | output tokens | host mask fills | mask fill ms | programs built | "
             "finish |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in (("unconstrained", b), ("JSON schema", c)):
        lines.append(f"| {name} | {r['tok_s']:.1f} ({r['tok_s_runs']}) | "
                     f"{r.get('decode_tok_s', 0):.1f} | {r['steps']} | "
                     f"{r['output_tokens']} | {r['mask_fills']} | {r['mask_fill_ms']:.1f} | "
                     f"{r['compilations']} | {', '.join(r['finish'])} |")
    lines += ["", f"Constrained costs **{res['batch_ratio']:.2f}x** the unconstrained time per "
              f"output token (target <= 1.10x; the median of the ratios of "
              f"{len(res.get('batch_ratio_runs', []))} alternated pairs, "
              f"{res.get('batch_ratio_runs')}); after the prompts' prefill and first token "
              f"({res.get('prefill_seconds', 0):.2f} s, the same in both, spread over fewer "
              f"tokens when the grammar closes the output early) **"
              f"{res.get('decode_ratio', 0):.2f}x**.", "",
              "## Forced-key schema, one request at a time", "",
              "| decoding | output tok/s (median) | steps | output tokens | forced tokens as "
              "drafts | programs built |", "|---|---|---|---|---|---|"]
    for name, r in s.items():
        lines.append(f"| {name} (max_forced_drafts {r['max_forced_drafts']}) | "
                     f"{r['tok_s']:.1f} | {r['steps']} | {r['output_tokens']} | "
                     f"{r['forced_tokens']} | {r['compilations']} |")
    lines += ["", f"Forced drafting: **{res['forced_speedup']:.2f}x** the tokens/s of plain "
              "constrained decoding (target >= 1.3x).", ""]
    return "\n".join(lines)


__all__ = ["add_arguments", "forced_key_schema", "markdown", "run"]
