"""Speculative decoding, off against on, on three workloads in one run:
``python -m jaxserve.bench.spec_bench --output benchmarks/spec``.

Every (workload, configuration) pair gets a fresh engine (so each adaptive
policy starts from its prior and learns only that workload), built from one
load of the checkpoint (``LLM(model, **parts)``; f32 on CPU, the ``LLM``
defaults otherwise), warmed up, run, measured and freed (``del``,
``gc.collect``, ``jax.clear_caches``) before the next loads. The first
configuration of each workload is ``off`` (no ``speculative_config``); every
ratio is a configuration's figure over ``off``'s in the same run.

Workloads (greedy unless said; one request at a time unless said):

* **W_copy** (copy-heavy): a user turn, through the model's chat template,
  asks to *repeat*, *edit* (British to American spelling: the passage spells
  "harbour", "colour", "organised") or *summarise* a ~``--passage_tokens``
  passage: sentences of ``workloads.CORPUS`` in a seeded random order, a new
  order per request, so no two prompts share more than the template's
  prefix. The tasks cycle over the requests. ``max_tokens`` =
  ``--max_tokens``, EOS honoured (the two engines write the same greedy
  tokens, so the same lengths). ``jaxserve/bench/data/python_reference.txt``
  is not used: its README keeps it held out from every prompt, for
  ``--mode eval``. Configurations: off, ``ngram`` k = 3 and k = 5 (adaptive,
  prompt lookup n in [2, 5]). Figure: TPOT, the median over requests of
  ``RequestMetrics.tpot_ms`` (first token to finish / (tokens - 1)).
* **W_chat**: short questions (``CHAT_QUESTIONS``) through the chat template,
  ``--max_tokens``, EOS honoured. Configurations: off, ``ngram`` k = 3 (for
  reference), and a draft model ``{"method": "draft", "model": "self",
  "quantization": q}`` for each q of ``--chat_drafts`` (int8, int4, w8a8),
  k = 3, adaptive and forced (``adaptive=False``: k = 3 every step, what
  speculation costs when the policy cannot turn it off). Figure: TPOT.
* **W_rare** (drafts rarely right): ``--rare_requests`` (32) requests of
  ``workloads``' ``chat`` shape (~118 tokens of shuffled corpus text and a
  question, as the writer's W1), all added at once and drained with
  ``engine.step``; temperature 1.0, one seed per request, EOS ignored,
  ``--rare_max_tokens``. Why temperature 1: greedy decoding of a 135M model
  falls into loops that prompt lookup predicts well, and random-token
  prompts give it nothing to look up at all (no drafts, nothing verified);
  sampling keeps the text varied, so n-gram drafts are proposed (common
  bigrams recur) and mostly wrong, which is the cost this workload is for.
  With seeds, speculation is exact for sampled requests too (the Gumbel
  coupling in ``speculation``'s docstring): both engines write the same
  tokens, so they do the same work. Configurations: off, ``ngram`` k = 3
  adaptive, and k = 3 forced (what the policy saves). Figure: output tokens /
  (first add to last finish), tok/s.

Warm-up (``--warmup``): ``full`` compiles every step shape the workload can
reach (``reachable_counts``: all of ``Engine.step_token_counts`` for W_rare,
those up to the longest prompt + k + 2 one request at a time) on the target
and on the draft model's runner, then runs one untimed
request of the workload (a different prompt; for W_rare its concurrent run
at 8 tokens each), which also gives the policy its first cost and acceptance
samples, as a serving engine's first requests would; ``request`` runs only
the untimed request(s) (quick runs); ``none`` nothing. The prefix cache is
emptied before the timed pass. XLA compilations in the timed pass (target
and draft runners) are counted and reported; they must be 0 for the figures
to mean anything.

Figures per configuration: the timed pass's speculation counters (drafts,
draft and accepted tokens, acceptance rate, mean acceptance length = 1 +
accepted / drafts, per-position acceptance = drafts accepted at position j /
drafts reaching j), the policy's k at the end (``EngineStats.spec_k``) and
how often each k was in force after a step, its conditional acceptance
estimates, the draft model's share of the wall time, the median device ms
of the target's steps per token count T (``Engine.last_step``: what verifying
k + 1 tokens costs against a 1-token decode), and whether each request's
tokens equal ``off``'s (speculation is exact, so they should).

Targets (printed, not tests): W_copy ngram TPOT <= 0.55x off; W_chat draft
TPOT <= 0.7x off (adaptive configurations); W_rare ngram adaptive tok/s >=
0.95x off. ``--quick`` shrinks every size (and warms up by request) to check
the script in a minute or two; its figures mean nothing. Times are
``time.monotonic`` seconds, shown in ms.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

from jaxserve.bench import workloads, writer
from jaxserve.engine.shapes import bucket

COPY_TASKS = (
    ("repeat", "Repeat the following text exactly, word for word, without adding anything."),
    ("edit", "Rewrite the following text with British spellings changed to American ones "
             "(harbour -> harbor, colour -> color, organised -> organized). Change nothing "
             "else."),
    ("summarise", "Summarise the following text in a few sentences."),
)
CHAT_QUESTIONS = (
    "What causes the seasons on Earth?", "How do I boil an egg?",
    "Give me three tips for learning a new language.", "Why is the sky blue?",
    "What is the difference between weather and climate?", "How does a bicycle stay upright?",
    "Write a haiku about autumn.", "What should I pack for a weekend camping trip?",
    "Explain what a prime number is.", "How can I sleep better at night?",
    "What is photosynthesis?", "Suggest a name for a small bakery.",
    "How do vaccines work?", "What are the planets of the solar system?",
    "Why do cats purr?", "How do I make a good cup of tea?",
)
TARGETS = {"copy": ("ngram", "tpot", 0.55), "chat": ("draft", "tpot", 0.7),
           "rare": ("ngram", "tok_per_s", 0.95)}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The workloads' sizes (``--quick`` shrinks them)."""

    num_requests: int = 8  # W_copy and W_chat, each
    max_tokens: int = 160
    passage_tokens: int = 500
    rare_requests: int = 32
    rare_max_tokens: int = 128


QUICK = Sizes(num_requests=2, max_tokens=12, passage_tokens=80, rare_requests=4,
              rare_max_tokens=8)


@dataclasses.dataclass
class Req:
    """One request: its kind (copy task, ``chat`` or ``rare``), prompt ids, params."""

    kind: str
    prompt_ids: list[int]
    params: object


def _log(t0: float, msg: str) -> None:
    print(f"spec_bench [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ---- configurations and requests -------------------------------------------------------

def configs(workload: str, drafts: list[str]) -> list[tuple[str, dict | None]]:
    """(label, ``speculative_config``) of each configuration; ``off`` first."""
    ng = lambda k, adaptive=True: {"method": "ngram", "num_speculative_tokens": k,
                                   "adaptive": adaptive}
    if workload == "copy":
        return [("off", None), ("ngram-k3", ng(3)), ("ngram-k5", ng(5))]
    if workload == "rare":
        return [("off", None), ("ngram-k3", ng(3)), ("ngram-k3-forced", ng(3, False))]
    out = [("off", None), ("ngram-k3", ng(3))]
    for adaptive in (True, False):
        out += [(f"draft-{q}" + ("" if adaptive else "-forced"),
                 {"method": "draft", "model": "self", "quantization": q,
                  "num_speculative_tokens": 3, "adaptive": adaptive}) for q in drafts]
    return out


def _chat_ids(llm, rng, vocab: int, text: str) -> list[int]:
    """``text`` as one user turn through the chat template (random ids of
    about its length, ~4 characters a token, without a tokenizer)."""
    try:
        return list(llm.apply_chat_template([{"role": "user", "content": text}]))
    except ValueError:  # no tokenizer / template: a tiny random model
        return rng.integers(0, vocab, size=max(4, len(text) // 4)).tolist()


def _passage(tok, rng, n: int) -> str:
    """Corpus sentences in a random order until the text has >= ``n`` tokens."""
    order, text = rng.permutation(len(workloads.SENTENCES)), ""
    for i in np.concatenate([order, order]):
        text += workloads.SENTENCES[i] + " "
        if (len(tok.encode(text, add_special_tokens=False)) if tok else len(text) // 4) >= n:
            break
    return text.strip()


def make_requests(llm, workload: str, sizes: Sizes, n: int, seed: int) -> list[Req]:
    """``n`` requests of ``workload`` (see the module docstring), seeded."""
    from jaxserve.engine.request import SamplingParams
    tok, vocab = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0)
    if workload == "copy":
        out = []
        for i in range(n):
            kind, ask = COPY_TASKS[i % len(COPY_TASKS)]
            text = f"{ask}\n\n{_passage(tok, rng, sizes.passage_tokens)}"
            out.append(Req(kind, _chat_ids(llm, rng, vocab, text), greedy))
        return out
    if workload == "chat":
        qs = rng.permutation(len(CHAT_QUESTIONS))
        return [Req("chat", _chat_ids(llm, rng, vocab, CHAT_QUESTIONS[qs[i % len(qs)]]), greedy)
                for i in range(n)]
    scale = 118 / workloads.SHAPES["chat"].input_len
    return [Req("rare", r.prompt_ids, SamplingParams(
        max_tokens=sizes.rare_max_tokens, temperature=1.0, seed=seed * 1000 + i,
        ignore_eos=True)) for i, r in enumerate(workloads.make_requests(
            tok, vocab, "chat", n, seed=seed, scale=scale))]


# ---- running -------------------------------------------------------------------------

def _compilations(engine) -> int:
    sp = engine.speculator
    draft = sp.draft.runner.num_compilations if sp is not None and sp.draft else 0
    return engine.runner.num_compilations + draft


def _drain(engine, ids: set[str], ks: collections.Counter, steps: dict) -> dict:
    """Step until every request of ``ids`` finished; their final outputs.
    ``ks`` counts the policy's k after each step; ``steps[T]`` gets
    (device ms, host ms) of each step of T tokens that did not compile."""
    final = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.request_id in ids and out.finished:
                final[out.request_id] = out
        if engine.speculator is not None:
            ks[engine.speculator.k] += 1
        info = engine.last_step
        if info is not None and not info.compiled:
            steps.setdefault(sum(info.q_lens), []).append((info.device_ms, info.host_ms))
    return final


def step_figures(steps: dict) -> dict:
    """T -> {"steps", "device_ms_median", "host_ms_median"}, ascending T."""
    return {T: {"steps": len(v), "device_ms_median": statistics.median(d for d, _ in v),
                "host_ms_median": statistics.median(h for _, h in v)}
            for T, v in sorted(steps.items())}


def _record(req: Req, out) -> dict:
    m = out.metrics
    return {"kind": req.kind, "prompt_tokens": len(req.prompt_ids),
            "output_tokens": len(out.outputs[0].token_ids), "ttft_ms": m.ttft_ms,
            "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms, "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_tokens": m.num_accepted_tokens,
            "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text}


def run_pass(engine, reqs: list[Req], concurrent: bool) -> tuple[list[dict], float, dict, dict]:
    """Every request of ``reqs``: one at a time, or all added at once
    (``concurrent``) and drained. Returns (records in request order, wall s
    from the first add to the last finish, policy k -> steps, ``step_figures``)."""
    ks: collections.Counter = collections.Counter()
    steps: dict = {}
    t = time.monotonic()
    if concurrent:
        ids = [engine.add_request(None, r.prompt_ids, r.params) for r in reqs]
        final = _drain(engine, set(ids), ks, steps)
        recs = [_record(r, final[i]) for r, i in zip(reqs, ids)]
    else:
        recs = []
        for r in reqs:
            rid = engine.add_request(None, r.prompt_ids, r.params)
            recs.append(_record(r, _drain(engine, {rid}, ks, steps)[rid]))
    return recs, time.monotonic() - t, dict(sorted(ks.items())), step_figures(steps)


def _spec_snapshot(engine) -> dict | None:
    sp = engine.speculator
    if sp is None:
        return None
    st = sp.stats
    return {"drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens,
            "accepted_tokens": st.num_accepted_tokens,
            "accepted": list(st.accepted_per_position), "reached": list(st.drafted_per_position),
            "draft_s": sp.draft.seconds if sp.draft else 0.0,
            "draft_steps": sp.draft.num_steps if sp.draft else 0}


def spec_figures(engine, before: dict | None, wall_s: float) -> dict | None:
    """The timed pass's speculation figures (counters after - ``before``)."""
    after = _spec_snapshot(engine)
    if after is None:
        return None
    d = {k: (after[k] - before[k]) if not isinstance(after[k], list)
         else [a - b for a, b in zip(after[k], before[k])] for k in after}
    policy = engine.speculator.policy
    return {"num_drafts": d["drafts"], "num_draft_tokens": d["draft_tokens"],
            "num_accepted_tokens": d["accepted_tokens"],
            "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"]
            if d["draft_tokens"] else None,
            "mean_acceptance_length": 1 + d["accepted_tokens"] / d["drafts"]
            if d["drafts"] else None,
            "accepted_per_position": d["accepted"], "drafts_per_position": d["reached"],
            "per_position_acceptance": [a / r if r else None
                                        for a, r in zip(d["accepted"], d["reached"])],
            "final_k": engine.stats().spec_k, "policy_speculating": policy.speculating,
            "policy_acceptance": [round(a, 4) for a in policy.acceptance],
            "draft_model_s": d["draft_s"], "draft_model_steps": d["draft_steps"],
            "draft_model_share": d["draft_s"] / wall_s if wall_s > 0 else None}


def reachable_counts(engine, reqs: list[Req], concurrent: bool) -> list[int]:
    """Step token counts T the workload can reach: every one of the engine's
    when requests run together; one at a time, those up to the longest
    prompt + k + 2 (a prefill, or the draft's catch-up on the prompt and the
    first tokens, is the largest step; decodes verify k + 1)."""
    counts = engine.step_token_counts()
    if concurrent:
        return counts
    k = engine.speculator.max_k if engine.speculator is not None else 0
    hi = bucket(max(len(r.prompt_ids) for r in reqs) + k + 2)
    return [T for T in counts if T <= hi] or counts[:1]


def warm_up(engine, warm: list[Req], counts: list[int], how: str, concurrent: bool) -> dict:
    """``how`` = full / request / none (module docstring); returns what it cost."""
    t, comp = time.monotonic(), _compilations(engine)
    if how == "full":
        engine.runner.warmup(counts)
        if engine.speculator is not None and engine.speculator.draft is not None:
            engine.speculator.draft.runner.warmup(counts)
    if how != "none":
        run_pass(engine, warm, concurrent)
    return {"how": how, "step_token_counts": len(counts) if how == "full" else 0,
            "seconds": time.monotonic() - t, "compilations": _compilations(engine) - comp}


def run_config(llm, reqs: list[Req], warm: list[Req], how: str, concurrent: bool) -> dict:
    """Warm-up, then the timed pass of one configuration; its figures."""
    engine = llm.engine
    counts = reachable_counts(engine, reqs + warm, concurrent)
    entry = {"warmup": warm_up(engine, warm, counts, how, concurrent)}
    engine.allocator.reset_prefix_cache()
    before, comp = _spec_snapshot(engine), _compilations(engine)
    recs, wall, ks, steps = run_pass(engine, reqs, concurrent)
    tpots = [r["tpot_ms"] for r in recs if r["tpot_ms"] is not None]
    out_tokens = sum(r["output_tokens"] for r in recs)
    entry.update(
        wall_s=wall, output_tokens=out_tokens,
        tok_per_s=out_tokens / wall if wall > 0 else None,
        tpot_ms_median=statistics.median(tpots) if tpots else None,
        tpot_ms_mean=statistics.fmean(tpots) if tpots else None,
        ttft_ms_median=statistics.median(r["ttft_ms"] for r in recs),
        compilations_timed=_compilations(engine) - comp, policy_k_steps=ks,
        steps_by_tokens=steps,
        spec=spec_figures(engine, before, wall), requests=recs)
    return entry


def run_workload(build, workload: str, sizes: Sizes, drafts: list[str], how: str, seed: int,
                 t0: float) -> dict:
    """Every configuration of ``workload``, one engine at a time."""
    import jax
    concurrent = workload == "rare"
    n = sizes.rare_requests if concurrent else sizes.num_requests
    result: dict = {"configs": {}}
    reqs = warm = None
    for label, spec in configs(workload, drafts):
        t = time.monotonic()
        llm = build(spec)
        if reqs is None:
            reqs = make_requests(llm, workload, sizes, n, seed)
            warm = make_requests(llm, workload, sizes, n if concurrent else 1, seed + 99)
            if concurrent:  # the untimed concurrent pass: same rows, 8 tokens each
                warm = [dataclasses.replace(r, params=dataclasses.replace(
                    r.params, max_tokens=min(8, r.params.max_tokens))) for r in warm]
            result["prompt_tokens"] = [len(r.prompt_ids) for r in reqs]
            result["kinds"] = [r.kind for r in reqs]
        load_s = time.monotonic() - t
        e = run_config(llm, reqs, warm, how, concurrent)
        e.update(speculative_config=spec, load_s=load_s,
                 kv_pages=llm.engine.allocator.num_pages)
        result["configs"][label] = e
        sp = e["spec"] or {}
        _log(t0, f"{workload} {label}: " + (f"tok/s {e['tok_per_s']:.1f}" if concurrent else
                                            f"TPOT median {_f(e['tpot_ms_median'])} ms")
             + (f", acceptance {_f(sp.get('acceptance_rate'), '{:.2f}')}, mean length "
                f"{_f(sp.get('mean_acceptance_length'), '{:.2f}')}, final k {sp['final_k']}"
                if sp else "") + f"; warm-up {e['warmup']['seconds']:.0f} s, "
             f"{e['compilations_timed']} compilations timed")
        del llm
        gc.collect()
        jax.clear_caches()
    summarize_workload(result)
    for e in result["configs"].values():  # token ids only for the comparison
        for r in e["requests"]:
            del r["token_ids"]
            if e is not result["configs"]["off"]:
                del r["text"]
            else:
                r["text"] = r["text"][:300]
    return result


# ---- figures ---------------------------------------------------------------------------

def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize_workload(result: dict) -> None:
    """Ratios to ``off``, per-kind TPOT and token agreement, in place."""
    off = result["configs"]["off"]
    for e in result["configs"].values():
        e["tpot_ratio"] = _ratio(e["tpot_ms_median"], off["tpot_ms_median"])
        e["tok_per_s_ratio"] = _ratio(e["tok_per_s"], off["tok_per_s"])
        same = [a["token_ids"] == b["token_ids"] for a, b in zip(e["requests"], off["requests"])]
        e["outputs_equal_off"] = sum(same)
        by_kind = collections.defaultdict(list)
        for r in e["requests"]:
            if r["tpot_ms"] is not None:
                by_kind[r["kind"]].append(r["tpot_ms"])
        e["tpot_ms_median_by_kind"] = {k: statistics.median(v) for k, v in by_kind.items()}


def targets(result: dict) -> list[dict]:
    """The issue's targets over the configurations that ran:
    {"target", "value", "limit", "met"}."""
    rows = []
    for w, (method, fig, lim) in TARGETS.items():
        for label, e in result["workloads"].get(w, {}).get("configs", {}).items():
            if not label.startswith(method) or label.endswith("-forced"):
                continue
            if fig == "tpot":
                rows.append({"target": f"W_{w} TPOT {label} / off", "limit": f"<= {lim}",
                             "value": e["tpot_ratio"]})
            else:
                rows.append({"target": f"W_{w} tok/s {label} / off", "limit": f">= {lim}",
                             "value": e["tok_per_s_ratio"]})
            v = rows[-1]["value"]
            rows[-1]["met"] = None if v is None else bool(v <= lim if fig == "tpot" else v >= lim)
    return rows


def _f(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    """The report (see the module docstring)."""
    m = result["machine"]
    sz = result["sizes"]
    quick = " (quick: sizes too small to mean anything)" if result["quick"] else ""
    lines = [f"# jaxserve speculative decoding benchmark on {m['cpu_model']} "
             f"({m['cpu_count']} cores)", "",
             f"Model `{result['model']}`, f32{quick}; jax {m['jax']} ({m['jax_backend']}); "
             f"commit {result.get('git_commit')}; load average at start "
             f"{_f((m['load_average_start'] or [None])[0], '{:.2f}')}, at end "
             f"{_f((result.get('load_average_end') or [None])[0], '{:.2f}')}; run took "
             f"{result['wall_s']:.0f} s.", "",
             "| | |", "|---|---|", f"| CPU | {m['cpu_model']}, {m['cpu_count']} cores |",
             f"| AVX flags | {' '.join(m['avx_flags']) or '-'} |", f"| jax | {m['jax']} |",
             f"| sizes | W_copy / W_chat {sz['num_requests']} requests each, max_tokens "
             f"{sz['max_tokens']}, passage ~{sz['passage_tokens']} tokens; W_rare "
             f"{sz['rare_requests']} concurrent x {sz['rare_max_tokens']} tokens |",
             f"| warm-up | {result['warmup']} |", "",
             "Each configuration is a fresh engine, warmed up, then timed; ratios are over "
             "`off` in the same run (TPOT: < 1 is faster; tok/s: > 1 is faster). accept = "
             "accepted / draft tokens; length = 1 + accepted / drafts (tokens per verified "
             "row); per position j = drafts accepted at j / drafts reaching j; k: the policy's "
             "k at the end, and steps per k in the timed pass; draft share = the draft model's "
             "share of the wall time; step ms by T = the median device ms of the timed pass's "
             "steps of T tokens (the 4 most frequent T), which is what a verification of k + "
             "1 tokens costs against a plain decode step of 1; equal = requests whose tokens "
             "equal off's; compiles = XLA compilations in the timed pass (must be 0).", ""]
    titles = {"copy": "W_copy: repeat / edit / summarise a passage, batch 1, greedy",
              "chat": "W_chat: short questions, batch 1, greedy",
              "rare": "W_rare: drafts rarely right, concurrent, temperature 1"}
    for w, wr in result["workloads"].items():
        rare = w == "rare"
        n = len(wr["prompt_tokens"])
        lines += [f"## {titles[w]}", "",
                  f"{n} requests, prompts of {min(wr['prompt_tokens'])}-"
                  f"{max(wr['prompt_tokens'])} tokens" + (", all added at once." if rare
                                                         else ", one at a time."), "",
                  ("| config | tok/s | x off | TTFT p50 ms | " if rare else
                   "| config | TPOT p50 ms | x off | TPOT mean ms | by kind (p50 ms) | ")
                  + "accept | length | per position | k (steps per k) | step ms by T (steps) "
                  "| draft share | equal | compiles |", "|---|" + "---:|" * 3
                  + ("" if rare else "---|") + "---:|---:|---|---|---|---:|---:|---:|"]
        for label, e in wr["configs"].items():
            sp = e["spec"] or {}
            pp = ", ".join(_f(v, "{:.2f}") for v in sp.get("per_position_acceptance", []))
            k = (f"{sp['final_k']} ({', '.join(f'{a}: {b}' for a, b in e['policy_k_steps'].items())})"
                 if sp else "-")
            head = (f"{_f(e['tok_per_s'])} | {_f(e['tok_per_s_ratio'], '{:.2f}x')} | "
                    f"{_f(e['ttft_ms_median'], '{:.0f}')}" if rare else
                    f"{_f(e['tpot_ms_median'])} | {_f(e['tpot_ratio'], '{:.2f}x')} | "
                    f"{_f(e['tpot_ms_mean'])} | " + ", ".join(
                        f"{a} {b:.1f}" for a, b in e["tpot_ms_median_by_kind"].items()))
            top = sorted(sorted(e["steps_by_tokens"].items(), key=lambda x: -x[1]["steps"])[:4])
            st = ", ".join(f"{T}: {v['device_ms_median']:.1f} ({v['steps']})" for T, v in top)
            lines.append(f"| {label} | {head} | {_f(sp.get('acceptance_rate'), '{:.2f}')} | "
                         f"{_f(sp.get('mean_acceptance_length'), '{:.2f}')} | {pp or '-'} | "
                         f"{k} | {st or '-'} | {_f(sp.get('draft_model_share'), '{:.0%}')} | "
                         f"{e['outputs_equal_off']}/{n} | {e['compilations_timed']} |")
        lines.append("")
    lines += ["## Targets", "", "| target | value | limit | met |", "|---|---:|---:|---|"]
    for t in result["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {_f(t['value'], '{:.3g}')} | {t['limit']} | {met} |")
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {x}" for x in result["notes"]]
    return "\n".join(lines) + "\n"


# ---- main ------------------------------------------------------------------------------

def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise ValueError(f"--{name} must be >= 1, got {v}")


def main(argv=None, parts: dict | None = None) -> int:
    """The command line. ``parts`` (tests): ``Engine`` keyword arguments
    (``model_config``, ``params``, ...) used instead of loading ``--model``."""
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.spec_bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default="benchmarks/spec", help="folder for result.json, report.md")
    ap.add_argument("--model", default="smollm2-135m", help="alias, .gguf or HF folder")
    ap.add_argument("--workloads", default="copy,chat,rare", help="any of copy, chat, rare")
    ap.add_argument("--chat_drafts", default="int8,int4,w8a8",
                    help="draft quantizations of W_chat's self-draft (none is f32)")
    ap.add_argument("--num_requests", type=int, default=None, help="W_copy / W_chat requests "
                    f"(default {Sizes.num_requests}; quick {QUICK.num_requests})")
    ap.add_argument("--max_tokens", type=int, default=None, help="W_copy / W_chat max_tokens "
                    f"(default {Sizes.max_tokens}; quick {QUICK.max_tokens})")
    ap.add_argument("--passage_tokens", type=int, default=None, help="W_copy passage tokens "
                    f"(default {Sizes.passage_tokens}; quick {QUICK.passage_tokens})")
    ap.add_argument("--rare_requests", type=int, default=None, help="W_rare concurrent "
                    f"requests (default {Sizes.rare_requests}; quick {QUICK.rare_requests})")
    ap.add_argument("--rare_max_tokens", type=int, default=None, help="W_rare tokens per "
                    f"request (default {Sizes.rare_max_tokens}; quick {QUICK.rare_max_tokens})")
    ap.add_argument("--warmup", choices=("full", "request", "none"), default=None,
                    help="default full (quick: request)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compilation_cache_dir", default=None,
                    help="persistent XLA cache (default $JAXSERVE_CACHE/xla, ~/.cache/jaxserve/xla)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    a = ap.parse_args(argv)
    from jaxserve.bench.quant_bench import parse_list
    from jaxserve.config import QUANTIZATION_METHODS
    try:
        wls = parse_list(a.workloads, ("copy", "chat", "rare"), "--workloads")
        drafts = parse_list(a.chat_drafts, tuple(q for q in QUANTIZATION_METHODS if q != "gguf"),
                            "--chat_drafts")
        for k in ("num_requests", "max_tokens", "passage_tokens", "rare_requests",
                  "rare_max_tokens"):
            _positive(k, getattr(a, k))
    except ValueError as e:
        ap.error(str(e))
    base = QUICK if a.quick else Sizes()
    sizes = Sizes(**{f.name: getattr(a, f.name) or getattr(base, f.name)
                     for f in dataclasses.fields(Sizes)})
    how = a.warmup or ("request" if a.quick else "full")
    t0 = time.monotonic()
    os.makedirs(a.output, exist_ok=True)

    import jax

    from jaxserve import LLM
    result: dict = {"benchmark": "jaxserve speculative decoding (python -m "
                                 "jaxserve.bench.spec_bench)",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": a.quick,
                    "model": "given engine parts" if parts else a.model,
                    "git_commit": writer.git_commit(), "flags": vars(a),
                    "sizes": dataclasses.asdict(sizes), "warmup": how,
                    "machine": writer.machine()}
    mach = result["machine"]
    _log(t0, f"{mach['cpu_model']}, {mach['cpu_count']} cores, {' '.join(mach['avx_flags'])}; "
             f"jax {jax.__version__}")
    if parts is None:
        from checkpoints.loader import load_checkpoint
        ck = load_checkpoint(a.model, show_progress=False)
        parts = dict(model_config=ck.config, params=ck.params, tokenizer=ck.tokenizer,
                     chat_template=ck.chat_template)
        _log(t0, f"{a.model} loaded")
    xla_dir = a.compilation_cache_dir or os.path.join(
        os.environ.get("JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve")), "xla")

    def build(spec):
        return LLM(a.model, **parts, dtype="float32", compilation_cache_dir=xla_dir,
                   speculative_config=spec)

    result["workloads"] = {w: run_workload(build, w, sizes, drafts, how, a.seed, t0)
                           for w in wls}
    notes = [] if not a.quick else ["quick run: sizes too small for the figures to mean "
                                    "anything"]
    load = (mach["load_average_start"] or [0.0])[0]
    if load > writer.BUSY_LOAD:
        notes.append(f"**the machine was busy**: 1-minute load average {load:.2f} at the start "
                     f"on {os.cpu_count()} cores; run it again on a quiet machine")
    timed = sum(e["compilations_timed"] for w in result["workloads"].values()
                for e in w["configs"].values())
    if timed:
        notes.append(f"{timed} XLA compilations happened in timed passes (see `compiles`): "
                     "those figures include compile time")
    result["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["wall_s"] = time.monotonic() - t0
    result["notes"] = notes
    result["targets"] = targets(result)
    paths = [os.path.join(a.output, "result.json"), os.path.join(a.output, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = markdown(result)
    with open(paths[1], "w") as f:
        f.write(text)
    print(text)
    _log(t0, "wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
