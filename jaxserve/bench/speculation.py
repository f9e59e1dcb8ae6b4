"""Speculative decoding, off against on, on three workloads in one run:
``python -m jaxserve.bench latency --output benchmarks/spec`` (per-token
latency of one request at a time, and what speculation costs a batch).

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
* **W_chat**: short questions (``workloads.CHAT_QUESTIONS``) through the chat
  template, ``--max_tokens``, EOS honoured. Configurations: off, ``ngram`` k = 3 (for
  reference), and a draft model ``{"method": "draft", "model": "self",
  "quantization": q}`` for each q of ``--chat_drafts`` (int8, int4, w8a8),
  k = 3, adaptive and forced (``adaptive=False``: k = 3 every step, what
  speculation costs when the policy cannot turn it off). Figure: TPOT.
* **W_rare** (drafts rarely right): ``--rare_requests`` (32) requests of
  ``workloads``' ``chat`` shape (~118 tokens of shuffled corpus text and a
  question, as the throughput benchmark's W1), all added at once and drained with
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
and the draft model (``Engine.warmup(max_tokens=)``), then runs one untimed
request of the workload (a different prompt; for W_rare its concurrent run
at 8 tokens each), which also gives the policy its first cost and acceptance
samples, as a serving engine's first requests would; ``request`` runs only
the untimed request(s) (quick runs); ``none`` nothing. The prefix cache is
emptied before the timed pass. XLA executables built in the timed pass
(target and draft model: ``compile_cache.counts``) are counted and reported;
they must be 0 for the figures to mean anything.

Figures per configuration: the timed pass's speculation counters (drafts,
draft and accepted tokens, acceptance rate, mean acceptance length = 1 +
accepted / drafts, per-position acceptance = drafts accepted at position j /
drafts reaching j, the latter counted from the verification rows of the
steps, ``_Steps.count``), the policy's k at the end (``EngineStats.spec_k``)
and how often each k was in force after a step, its conditional acceptance
estimates (``Engine.spec_policy``), the median device ms
of the target's steps per token count T (``Engine.last_step``: what verifying
k + 1 tokens costs against a 1-token decode), and whether each request's
tokens equal ``off``'s (speculation is exact, so they should).

Targets (printed, not tests): W_copy ngram TPOT <= 0.55x off; W_chat draft
TPOT <= 0.7x off (adaptive configurations); W_rare ngram adaptive tok/s >=
0.95x off (``speculation_report``). ``--quick`` shrinks every size (and warms up by request) to check
the script in a minute or two; its figures mean nothing. Times are
``time.monotonic`` seconds, shown in ms.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import os
import statistics
import sys
import time

import jax
import numpy as np

from checkpoints.loader import load_checkpoint
from jaxserve import LLM
from jaxserve.bench import machine, report, speculation_report, workloads
from jaxserve.bench.formats import parse_list
from jaxserve.bench.report import fmt as _f
from jaxserve.config import GGUF_BLOCK_METHODS, QUANTIZATION_METHODS
from jaxserve.engine import compile_cache
from jaxserve.engine.sampling_params import SamplingParams
from jaxserve.engine.shapes import bucket

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


def log(t0: float, msg: str) -> None:
    print(f"bench [{time.monotonic() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ---- configurations and requests -------------------------------------------------------

def configs(workload: str, drafts: list[str]) -> list[tuple[str, dict | None]]:
    """(label, ``speculative_config``) of each configuration; ``off`` first."""
    ng = lambda k, adaptive=True: {"method": "ngram", "num_speculative_tokens": k,  # noqa: E731
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


def make_requests(llm, workload: str, sizes: Sizes, n: int, seed: int) -> list[Req]:
    """``n`` requests of ``workload`` (see the module docstring), seeded."""
    tok, vocab = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0)
    if workload == "copy":
        out = []
        for i in range(n):
            kind, ask = workloads.COPY_TASKS[i % len(workloads.COPY_TASKS)]
            text = f"{ask}\n\n{workloads.passage(tok, rng, sizes.passage_tokens)}"
            out.append(Req(kind, _chat_ids(llm, rng, vocab, text), greedy))
        return out
    if workload == "chat":
        qs = rng.permutation(len(workloads.CHAT_QUESTIONS))
        return [Req("chat", _chat_ids(llm, rng, vocab, workloads.CHAT_QUESTIONS[qs[i % len(qs)]]),
                    greedy) for i in range(n)]
    scale = 118 / workloads.SHAPES["chat"].input_len
    return [Req("rare", r.prompt_ids, SamplingParams(
        max_tokens=sizes.rare_max_tokens, temperature=1.0, seed=seed * 1000 + i,
        ignore_eos=True)) for i, r in enumerate(workloads.make_requests(
            tok, vocab, "chat", n, seed=seed, scale=scale))]


# ---- running -------------------------------------------------------------------------

def _programs() -> int:
    """XLA executables this process has built so far (compiled or loaded):
    the target's and the draft model's programs alike (``compile_cache``)."""
    return compile_cache.counts().programs


@dataclasses.dataclass
class _Steps:
    """What one pass saw of its steps: the policy's k after each step (``ks``),
    (device ms, host ms) of each step of T tokens that did not compile
    (``steps[T]``), and ``drafted[j]``: verification rows whose drafts
    reached position j (``count``)."""

    max_k: int
    ks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    steps: dict = dataclasses.field(default_factory=dict)
    drafted: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.drafted = [0] * self.max_k

    def count(self, info, prompt_len: int) -> None:
        """One step (``Engine.last_step``). A row after the decode rows that
        computes 2..k + 1 tokens on top of at least ``prompt_len`` cached ones
        is a verification row of q - 1 drafts (a prefill chunk starts inside
        its prompt); ``prompt_len`` is the shortest prompt that may run."""
        if not info.compiled:
            self.steps.setdefault(sum(info.q_lens), []).append((info.device_ms, info.host_ms))
        rows = zip(info.q_lens[info.num_decode:], info.kv_lens[info.num_decode:])
        for q, kv in rows:
            if 2 <= q <= self.max_k + 1 and kv - q >= prompt_len:
                for j in range(q - 1):
                    self.drafted[j] += 1


def _drain(engine, ids: set[str], seen: _Steps, prompt_len: int) -> dict:
    """Step until every request of ``ids`` finished; their final outputs."""
    final, last = {}, engine.last_step
    while len(final) < len(ids):
        for out in engine.step():
            if out.request_id in ids and out.finished:
                final[out.request_id] = out
        if engine.speculative:
            seen.ks[engine.spec_k] += 1
        if (info := engine.last_step) is not None and info is not last:
            last = info
            seen.count(info, prompt_len)
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


def run_pass(engine, reqs: list[Req], concurrent: bool) -> tuple[list[dict], float, _Steps]:
    """Every request of ``reqs``: one at a time, or all added at once
    (``concurrent``) and drained. Returns (records in request order, wall s
    from the first add to the last finish, what the steps showed)."""
    seen = _Steps(engine.spec_max_k)
    t = time.monotonic()
    if concurrent:
        ids = [engine.add_request(None, r.prompt_ids, r.params) for r in reqs]
        final = _drain(engine, set(ids), seen, min(len(r.prompt_ids) for r in reqs))
        recs = [_record(r, final[i]) for r, i in zip(reqs, ids)]
    else:
        recs = []
        for r in reqs:
            rid = engine.add_request(None, r.prompt_ids, r.params)
            recs.append(_record(r, _drain(engine, {rid}, seen, len(r.prompt_ids))[rid]))
    return recs, time.monotonic() - t, seen


def spec_figures(engine, before, seen: _Steps) -> dict | None:
    """The timed pass's speculation figures: ``Engine.stats()`` after -
    ``before``, the policy (``Engine.spec_policy``) and the drafts per
    position counted from the steps (None, per position, where that count
    disagrees with the engine's drafts and draft tokens). The draft model's
    own time and steps are not visible through ``Engine`` (None)."""
    if not engine.speculative:
        return None
    after = engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted_n = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    accepted = [a - b for a, b in itertools.zip_longest(
        after.spec_accepted_per_position, before.spec_accepted_per_position, fillvalue=0)]
    drafted = seen.drafted if sum(seen.drafted) == tokens and \
        (seen.drafted or [0])[0] == drafts else [None] * len(seen.drafted)
    policy = engine.spec_policy
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted_n,
            "acceptance_rate": accepted_n / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted_n / drafts if drafts else None,
            "accepted_per_position": accepted, "drafts_per_position": drafted,
            "per_position_acceptance": [a / r if r else None for a, r in zip(accepted, drafted)],
            "final_k": after.spec_k, "policy_speculating": policy.speculating,
            "policy_acceptance": [round(a, 4) for a in policy.acceptance],
            "draft_model_s": None, "draft_model_steps": None, "draft_model_share": None}


def reachable_counts(engine, reqs: list[Req], concurrent: bool) -> list[int]:
    """Step token counts T the workload can reach: every one of the engine's
    when requests run together; one at a time, those up to the longest
    prompt + k + 2 (a prefill, or the draft's catch-up on the prompt and the
    first tokens, is the largest step; decodes verify k + 1)."""
    counts = engine.step_token_counts()
    if concurrent:
        return counts
    hi = bucket(max(len(r.prompt_ids) for r in reqs) + engine.spec_max_k + 2)
    return [T for T in counts if T <= hi] or counts[:1]


def warm_up(engine, warm: list[Req], counts: list[int], how: str, concurrent: bool) -> dict:
    """``how`` = full / request / none (module docstring); returns what it cost."""
    t, comp = time.monotonic(), _programs()
    if how == "full":  # the target's and the draft model's step programs up to max(counts)
        engine.warmup(max_tokens=None if concurrent else max(counts), variants=False)
    if how != "none":
        run_pass(engine, warm, concurrent)
    return {"how": how, "step_token_counts": len(counts) if how == "full" else 0,
            "seconds": time.monotonic() - t, "compilations": _programs() - comp}


def run_config(llm, reqs: list[Req], warm: list[Req], how: str, concurrent: bool) -> dict:
    """Warm-up, then the timed pass of one configuration; its figures."""
    engine = llm.engine
    counts = reachable_counts(engine, reqs + warm, concurrent)
    entry = {"warmup": warm_up(engine, warm, counts, how, concurrent)}
    engine.reset_prefix_cache()
    before, comp = engine.stats(), _programs()
    recs, wall, seen = run_pass(engine, reqs, concurrent)
    tpots = [r["tpot_ms"] for r in recs if r["tpot_ms"] is not None]
    out_tokens = sum(r["output_tokens"] for r in recs)
    entry.update(
        wall_s=wall, output_tokens=out_tokens,
        tok_per_s=out_tokens / wall if wall > 0 else None,
        tpot_ms_median=statistics.median(tpots) if tpots else None,
        tpot_ms_mean=statistics.fmean(tpots) if tpots else None,
        ttft_ms_median=statistics.median(r["ttft_ms"] for r in recs),
        compilations_timed=_programs() - comp, policy_k_steps=dict(sorted(seen.ks.items())),
        steps_by_tokens=step_figures(seen.steps),
        spec=spec_figures(engine, before, seen), requests=recs)
    return entry


def run_workload(build, workload: str, sizes: Sizes, drafts: list[str], how: str, seed: int,
                 t0: float) -> dict:
    """Every configuration of ``workload``, one engine at a time."""
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
                 kv_pages=llm.engine.num_pages)
        result["configs"][label] = e
        sp = e["spec"] or {}
        fig = f"tok/s {e['tok_per_s']:.1f}" if concurrent else \
            f"TPOT median {_f(e['tpot_ms_median'])} ms"
        acc = (f", acceptance {_f(sp.get('acceptance_rate'), '{:.2f}')}, mean length "
               f"{_f(sp.get('mean_acceptance_length'), '{:.2f}')}, final k {sp['final_k']}"
               if sp else "")
        log(t0, f"{workload} {label}: {fig}{acc}; warm-up {e['warmup']['seconds']:.0f} s, "
                f"{e['compilations_timed']} compilations timed")
        del llm
        gc.collect()
        jax.clear_caches()
    speculation_report.summarize_workload(result)
    for e in result["configs"].values():  # token ids only for the comparison
        for r in e["requests"]:
            del r["token_ids"]
            if e is not result["configs"]["off"]:
                del r["text"]
            else:
                r["text"] = r["text"][:300]
    return result


# ---- the command line ---------------------------------------------------------------

def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise ValueError(f"--{name} must be >= 1, got {v}")


def add_arguments(ap) -> None:
    """The ``latency`` subcommand's options."""
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


def run(a, parts: dict | None = None) -> int:
    """The whole run (see the module docstring). ``parts`` (tests): ``Engine``
    keyword arguments (``model_config``, ``params``, ...) used instead of
    loading ``--model``.

    Raises:
      ValueError: a bad option (before anything loads).
    """
    wls = parse_list(a.workloads, ("copy", "chat", "rare"), "--workloads")
    drafts = parse_list(a.chat_drafts,
                        tuple(q for q in QUANTIZATION_METHODS if q not in GGUF_BLOCK_METHODS),
                        "--chat_drafts")
    for k in ("num_requests", "max_tokens", "passage_tokens", "rare_requests",
              "rare_max_tokens"):
        _positive(k, getattr(a, k))
    base = QUICK if a.quick else Sizes()
    sizes = Sizes(**{f.name: getattr(a, f.name) or getattr(base, f.name)
                     for f in dataclasses.fields(Sizes)})
    how = a.warmup or ("request" if a.quick else "full")
    t0 = time.monotonic()
    os.makedirs(a.output, exist_ok=True)
    compile_cache.install()  # count every program built (target and draft model)
    result: dict = {"benchmark": "jaxserve speculative decoding (python -m "
                                 "jaxserve.bench latency)",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": a.quick,
                    "model": "given engine parts" if parts else a.model,
                    "git_commit": machine.git_commit(), "flags": vars(a),
                    "sizes": dataclasses.asdict(sizes), "warmup": how,
                    "machine": machine.describe()}
    mach = result["machine"]
    log(t0, f"{mach['cpu_model']}, {mach['cpu_count']} cores, {' '.join(mach['avx_flags'])}; "
            f"jax {jax.__version__}")
    if parts is None:
        ck = load_checkpoint(a.model, show_progress=False)
        parts = dict(model_config=ck.config, params=ck.params, tokenizer=ck.tokenizer,
                     chat_template=ck.chat_template)
        log(t0, f"{a.model} loaded")
    xla_dir = a.compilation_cache_dir or os.path.join(
        os.environ.get("JAXSERVE_CACHE", os.path.expanduser("~/.cache/jaxserve")), "xla")

    def build(spec):
        return LLM(a.model, **parts, dtype="float32", compilation_cache_dir=xla_dir,
                   speculative_config=spec)

    result["workloads"] = {w: run_workload(build, w, sizes, drafts, how, a.seed, t0)
                           for w in wls}
    notes = [] if not a.quick else ["quick run: sizes too small for the figures to mean "
                                    "anything"]
    if busy := machine.busy_note(mach):
        notes.append(busy)
    timed = sum(e["compilations_timed"] for w in result["workloads"].values()
                for e in w["configs"].values())
    if timed:
        notes.append(f"{timed} XLA compilations happened in timed passes (see `compiles`): "
                     "those figures include compile time")
    result["load_average_end"] = machine.load_average()
    result["wall_s"] = time.monotonic() - t0
    if any((e["speculative_config"] or {}).get("method") == "draft"
           for w in result["workloads"].values() for e in w["configs"].values()):
        notes.append("the draft model's own time is not measured (the draft share column is "
                     "empty): the engine has no public draft-model timer")
    result["notes"] = notes
    result["targets"] = speculation_report.targets(result)
    paths = report.write(a.output, result, speculation_report.markdown)
    print(report.read_report(paths))
    log(t0, "wrote " + ", ".join(paths))
    return 0
