"""The generate mode of ``python -m jaxserve.main``: the demo batch (or the
``--prompt``s), streamed as it runs, then one table row per request.

With no ``--prompt`` the batch is ``DEMO_PROMPTS``: short chats, a long
prompt with a short answer, a short prompt with a long answer and a raw
completion. Before its first request the step programs the batch can reach
are compiled (or loaded from the persistent cache), so the table shows
serving times; ``--nowarmup`` compiles each shape on its first step instead.
One request streams its text as it comes; several stream whole lines tagged
with their request id. ``--json`` prints one object per request instead.

Ctrl-C while the batch runs ends the loop between two steps (``main`` sets
``interrupt["requested"]``); ``generate`` then aborts the requests and
returns False, and ``main`` leaves.
"""

from __future__ import annotations

import json
import sys
import time

from jaxserve.engine import compile_cache
from jaxserve.flags import FLAGS, sampling_params

_CHAT = "chat"
# (prompt, chat?, max_tokens): short chats, a long prompt with a short answer,
# a short prompt with a long answer, raw completion.
DEMO_PROMPTS = [
    ("What is the capital of France?", _CHAT, 32),
    ("Give me three tips for staying healthy.", _CHAT, 128),
    ("Summarize in one sentence: The Industrial Revolution began in Great Britain in the late "
     "18th century and spread to Europe and North America. It replaced hand production with "
     "machines, brought new chemical and iron making processes, and made steam power and the "
     "factory system common. Living standards rose over the long run, but working conditions "
     "in early factories were often harsh, with long hours, child labour and dangerous "
     "machinery. Cities grew quickly as people moved from farms to find work, and new "
     "railways and canals carried coal, cotton and people across whole countries.", _CHAT, 48),
    ("Write a short story about a robot who learns to paint.", _CHAT, 256),
    ("Translate to French: Good morning, how are you today?", _CHAT, 32),
    ("Explain what a hash table is to a beginner programmer.", _CHAT, 200),
    ("Hi!", _CHAT, 24),
    ("The three primary colors are", None, 40),
]


def requests(llm) -> list[tuple[str, object, object]]:
    """(text, prompt, ``SamplingParams``) of each request: the ``--prompt``s
    (256 tokens each unless ``--max_tokens``), else ``DEMO_PROMPTS``; chat
    prompts rendered with the chat template and stopping at its turn end."""
    if FLAGS.prompt:
        items = [(p, _CHAT if FLAGS.chat else None, 256) for p in FLAGS.prompt]
    else:
        items = DEMO_PROMPTS
    out = []
    for text, chat, max_tokens in items:
        sp = sampling_params(max_tokens)
        prompt = text
        if chat and text:
            prompt = llm.apply_chat_template([{"role": "user", "content": text}])
            sp = sp.with_stop(llm.engine.tokenizer.chat_stop)
        out.append((text, prompt, sp))
    return out


def warmup(engine, reqs) -> None:
    """Compile (or load from the persistent cache) the step programs the
    batch ``reqs`` can reach before its first request, then print the
    start-up line on stderr (stdout may be ``--json``). A step holds at most
    every prompt token plus one token per sequence (k + 1 with speculation);
    only a preemption's recomputation goes past that, and compiles then.

    Raises:
      ValueError: a prompt the tokenizer refuses (before anything compiles;
        a prompt too long for ``max_model_len`` is refused after, by
        ``add_request``).
    """
    per_seq = 1 + engine.spec_max_k
    tokens = sum(len(engine.encode(prompt)) + p.n * per_seq for _, prompt, p in reqs)
    print(f"jaxserve: compiling the step programs of steps up to {tokens} tokens before the "
          f"first request (--nowarmup: each on its first step)", file=sys.stderr, flush=True)
    before = compile_cache.counts()
    # Decode rows: one per sequence; the demo's requests take no penalties
    # and no prompt logprobs (such a request compiles its sampling on first use).
    engine.warmup(max_tokens=tokens, max_rows=sum(p.n for _, _, p in reqs),
                  variants=any(p.presence_penalty or p.frequency_penalty
                               or p.repetition_penalty != 1 or p.prompt_logprobs
                               for _, _, p in reqs))
    report = compile_cache.StartupReport.now(compile_cache.counts() - before)
    print(f"jaxserve: {report.line()}", file=sys.stderr, flush=True)


def generate(llm, interrupt: dict) -> bool:
    """Run the batch and print it; returns False when Ctrl-C stopped it (its
    requests aborted, every process between two steps).

    Args:
      interrupt: ``main``'s Ctrl-C state: ``defer`` is set while the loop
        runs (Ctrl-C then only sets ``requested``, read between steps).
    """
    engine = llm.engine
    reqs = requests(llm)
    if FLAGS.warmup:
        warmup(engine, reqs)
    compilations = engine.num_compilations
    ids = [engine.add_request(None, prompt, p) for _, prompt, p in reqs]
    single = len(ids) == 1
    finals = {}
    t0 = time.monotonic()
    interrupt["defer"] = True  # Ctrl-C now ends the loop below between two steps
    try:
        _stream(engine, ids, finals, interrupt)
    finally:
        interrupt["defer"] = False
    if interrupt["requested"]:
        engine.abort(ids)  # frees their pages; every process is between steps
        if single and not FLAGS.json:
            print(flush=True)  # end the partial line
        return False
    wall = time.monotonic() - t0
    if single and not FLAGS.json:
        print()
    if FLAGS.json:
        for rid, (text, _, _) in zip(ids, reqs):
            print(json.dumps(_json_row(engine, rid, text, finals[rid])))
        return True
    print_table([finals[r] for r in ids], wall, engine.num_compilations - compilations,
                engine.stats() if engine.speculative else None)
    return True


def _stream(engine, ids: list[str], finals: dict, interrupt: dict) -> None:
    """Step until every request is done (or Ctrl-C), printing text as it
    comes; fills ``finals`` with each request's last output."""
    single = len(ids) == 1
    pending = {rid: "" for rid in ids}
    while engine.has_unfinished_requests() and not interrupt["requested"]:
        for out in engine.step():
            rid, comp = out.request_id, out.outputs[0]
            if out.finished:
                finals[rid] = out
            if FLAGS.json:
                continue
            if single:
                sys.stdout.write(comp.delta_text)
                sys.stdout.flush()
                continue
            pending[rid] += comp.delta_text
            # Stream whole lines per request, tagged, so concurrent outputs stay readable.
            while "\n" in pending[rid] or (out.finished and pending[rid]):
                line, sep, rest = pending[rid].partition("\n")
                print(f"[{rid}] {line}", flush=True)
                pending[rid] = rest if sep else ""
            if out.finished:
                print(f"[{rid}] <{comp.finish_reason}>", flush=True)


def _json_row(engine, rid: str, text: str, o) -> dict:
    """One request's ``--json`` object (speculation figures when it is on)."""
    m = o.metrics
    row = {"request_id": rid, "prompt": text, "text": o.outputs[0].text,
           "token_ids": o.outputs[0].token_ids, "finish_reason": o.outputs[0].finish_reason,
           "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.outputs[0].token_ids),
           "cached_tokens": m.num_cached_tokens, "queue_ms": m.queue_ms, "ttft_ms": m.ttft_ms,
           "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms}
    if engine.speculative:
        row.update(draft_tokens=m.num_draft_tokens, accepted_tokens=m.num_accepted_tokens,
                   acceptance_rate=m.spec_acceptance_rate)
    return row


def print_table(outs, wall: float, compilations: int, spec_stats=None) -> None:
    """One row per request; ``compilations``: XLA compilations during the
    batch; ``spec_stats`` (an ``EngineStats``, speculation on) adds each
    request's acceptance rate and a line of engine totals."""
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    spec = spec_stats is not None
    print(f"\n{'req':>4} {'prompt':>7} {'output':>7} {'cached':>7} {'queue ms':>9} "
          f"{'TTFT ms':>9} {'TPOT ms':>8} {'E2E ms':>9}" + (f" {'accept':>7}" if spec else "")
          + "  finish")
    for o in outs:
        m = o.metrics
        print(f"{o.request_id:>4} {len(o.prompt_token_ids):>7} {len(o.outputs[0].token_ids):>7} "
              f"{m.num_cached_tokens:>7} {fmt(m.queue_ms):>9} {fmt(m.ttft_ms):>9} "
              f"{fmt(m.tpot_ms):>8} {fmt(m.e2e_ms):>9}"
              + (f" {pct(m.spec_acceptance_rate):>7}" if spec else "")
              + f"  {o.outputs[0].finish_reason}")
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if FLAGS.warmup:
        how = (f"serving times: the batch's step shapes were compiled before its first "
               f"request; {compilations} XLA compilations during the batch")
    else:
        how = (f"includes compilation: --nowarmup compiles lazily, {compilations} XLA "
               f"compilations, each step shape's first step waits for its own")
    print(f"total: {len(outs)} requests, {n_in} prompt + {n_out} output tokens in {wall:.2f} s "
          f"({how}); {n_out / wall:.1f} output tokens/s")
    if spec:
        print(spec_summary(spec_stats))


def spec_summary(st) -> str:
    """Engine totals of speculation (an ``EngineStats``), one line."""
    rate = f"{100 * st.spec_num_accepted_tokens / st.spec_num_draft_tokens:.0f}%" \
        if st.spec_num_draft_tokens else "-"
    length = f"{st.spec_mean_acceptance_length:.2f}" if st.spec_num_drafts else "-"
    return (f"speculation ({FLAGS.speculative_method}, k <= {FLAGS.num_speculative_tokens}): "
            f"{st.spec_num_drafts} drafted rows, {st.spec_num_draft_tokens} draft tokens, "
            f"{st.spec_num_accepted_tokens} accepted; acceptance rate {rate}, mean acceptance "
            f"length {length} tokens per drafted row; latest k {st.spec_k}")
