"""Command line entry point: ``python -m jaxserve.main``.

Modes:
  generate (default): with no ``--prompt``, a demo batch of prompts of several
    shapes on the default model, streamed, then one table row per request.
    The step programs the batch can reach are compiled (or loaded from the
    persistent cache) before it starts, so the table shows serving times, and
    a start-up line says how (``--nowarmup``: each shape compiles on its first
    step instead).
  bench: ``--bench_workload=throughput`` (default) is the offline throughput
    benchmark (``jaxserve.bench.throughput``); ``prefix_cache`` times TTFT
    with a cached 1,000-token system prompt against cold
    (``jaxserve.bench.prefix_cache``). ``--workload chat|rag|creative|
    shared-prefix|mixed`` runs the serving benchmark instead
    (``jaxserve.bench.suite``): concurrency levels, open or closed loop,
    vLLM-style latency/throughput/goodput figures, a per-phase roofline and
    peers (HF transformers, llama.cpp, llama.cpp's server) side by side,
    written to ``--output`` as JSON, Markdown and PNG plots. ``--backend
    grpc|openai`` drives a spawned server (or ``--target``, a running one;
    openai: any OpenAI-compatible server) instead of the engine in-process.
    ``--workload startup`` is the start-up benchmark instead
    (``jaxserve.bench.startup``): ``--mode serve`` started twice on an empty
    compilation cache folder (cold, then warm), time to SERVING, programs
    compiled and loaded, RSS, first request; llama.cpp's server and HF
    transformers' load beside it.

  serve: the gRPC server (``jaxserve.server``) and, with ``--http_port``, the
    OpenAI HTTP API on the same engine: ``--host``, ``--port``,
    ``--metrics_port``, TLS, bearer token, queue bound, grace period.
  eval: perplexity of ``--model`` in the given ``--quantization`` /
    ``--kv_cache_dtype`` over a held-out text, and the KL divergence of its
    next-token distributions from the unquantized run of the same model
    (``jaxserve.bench.eval``, llama.cpp's ``perplexity --kl-divergence``
    figures): JSON to ``--output`` (else one line on stdout) and a summary
    (on stderr when the JSON takes stdout).
  convert: load ``--model`` (alias, .gguf, HF folder) and write it as an Orbax
    checkpoint folder in ``--output`` (``checkpoints.orbax_ckpt``), tensors in
    ``--dtype``, the projections quantized by ``--quantization`` (int8 /
    uint8 parts and f32 scales; ``gguf`` keeps the file's blocks); prints
    the paths written. ``--model <that folder>`` then restores it straight
    into the mesh's shardings (in the quantization it was converted with).

Speculative decoding (every mode that decodes; eval and convert ignore it):
``--speculative_method ngram|draft`` with ``--num_speculative_tokens``,
``--prompt_lookup_min/max`` (ngram), ``--draft_model`` /
``--draft_quantization`` (draft) and ``--speculative_adaptive``, built into
``EngineConfig.speculative``. The generate table then shows each request's
acceptance rate and a line of engine totals.

Flags live here only; the core takes ``jaxserve.config`` dataclasses. Bad
input (unknown model, empty prompt, a prompt that is not valid Unicode,
out-of-range sampling values, a busy port, unreadable TLS files) prints one
``error: ...`` line on stderr and exits with status 2. Ctrl-C (SIGINT)
exits 130 without a traceback: while generating, after the current step,
with the requests aborted (process 0 of a multi-host job then releases the
others as at a normal end); anywhere else (model load, bench), at once. A
second Ctrl-C leaves at once. ``--mode serve`` instead shuts down gracefully
on SIGINT, as on SIGTERM, and exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from absl import app, flags

from jaxserve.bench.workloads import WORKLOADS
from jaxserve.engine import compile_cache
from jaxserve.engine.request import check_text

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "generate", ["generate", "bench", "serve", "convert", "eval"],
                  "What to run.")
flags.DEFINE_string("model", "smollm2-135m",
                    "Model alias, path to a .gguf file, an HF model folder (config.json + "
                    "safetensors [+ tokenizer.json]) or an Orbax folder (--mode convert).")
flags.DEFINE_string("output", None, "convert: the Orbax checkpoint folder to write (must not "
                    "exist or be empty). bench --workload: the results folder (default "
                    "bench-results/<workload>-<time>). eval: the JSON file to write (default: "
                    "print it).")
flags.DEFINE_multi_string("prompt", None, "Prompt(s); repeat the flag for several.")
flags.DEFINE_bool("chat", False, "Wrap each prompt as a user message in the chat template.")
flags.DEFINE_integer("max_tokens", None, "Most output tokens per request (demo: per prompt).")
flags.DEFINE_float("temperature", 0.3, "Sampling temperature; 0 is greedy.")
flags.DEFINE_float("top_p", 0.9, "Nucleus sampling mass in (0, 1]; 1 is off.")
flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 is off.")
flags.DEFINE_integer("seed", None, "Per-request sampling seed.")
flags.DEFINE_bool("json", False, "Print one JSON object per request instead of text.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter dtype.")
flags.DEFINE_string("quantization", "none", "Weight format of the linear projections: none, "
                    "int8 (weight-only, per channel), w8a8 (int8 weights x int8 activations), "
                    "int4 (groups along the input dim, scale + zero point) or gguf (the "
                    "file's own Q8_0/Q4_0/Q4_1 blocks). Embeddings, norms, router, LM head "
                    "and attention stay precise.")
flags.DEFINE_integer("quantization_group_size", 32, "int4: input elements per scale.")
flags.DEFINE_string("kv_cache_dtype", "auto", "KV cache dtype: auto (the parameter dtype), "
                    "float32, bfloat16, float16, int8 (one scale per token per kv head) or "
                    "fp8_e4m3.")
flags.DEFINE_integer("page_size", 16, "KV cache page size, tokens.")
flags.DEFINE_integer("num_pages", None, "KV cache pages (default: from --kv_cache_mib).")
flags.DEFINE_integer("kv_cache_mib", 512, "KV cache budget, MiB (K and V of every layer; "
                     "raise it on an accelerator).")
flags.DEFINE_integer("max_num_seqs", 64, "Most running sequences.")
flags.DEFINE_integer("max_num_batched_tokens", 2048,
                     "Token budget per step (decode tokens + prefill chunk tokens).")
flags.DEFINE_bool("enable_prefix_caching", True, "Reuse cached K/V pages of shared prefixes.")
flags.DEFINE_bool("enable_chunked_prefill", True,
                  "Split long prompts into chunks that run beside decodes.")
flags.DEFINE_integer("max_model_len", None, "Longest sequence (default: the model's).")
flags.DEFINE_bool("async_scheduling", True, "Plan and launch step N+1 before step N's tokens "
                  "reach the host, so host work overlaps the device (same outputs; steps with "
                  "penalties or prompt logprobs run synchronously).")
flags.DEFINE_enum("speculative_method", "none", ["none", "ngram", "draft"], "Speculative "
                  "decoding: none, ngram (prompt lookup: drafts copied from earlier in the "
                  "sequence) or draft (a second model, --draft_model). Outputs are the same as "
                  "without it (greedy and seeded sampling alike).")
flags.DEFINE_integer("num_speculative_tokens", 3, "speculation: most draft tokens verified per "
                     "sequence per step (k); the policy picks 0..k each step.")
flags.DEFINE_integer("prompt_lookup_min", 2, "speculation ngram: shortest n-gram matched.")
flags.DEFINE_integer("prompt_lookup_max", 5, "speculation ngram: longest n-gram matched.")
flags.DEFINE_string("draft_model", None, "speculation draft: 'self' (the target's own weights, "
                    "typically with --draft_quantization) or any --model string; it must share "
                    "the target's vocabulary.")
flags.DEFINE_string("draft_quantization", "none", "speculation draft: the draft's weight format "
                    "(as --quantization).")
flags.DEFINE_bool("speculative_adaptive", True, "speculation: let the policy choose k per step "
                  "from measured acceptance and step costs (off: always "
                  "--num_speculative_tokens).")
flags.DEFINE_integer("num_devices", None, "Use the first N devices (default: all when --mesh "
                     "is given, else one); the --mesh product must equal it.")
flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'tp=2' or 'dp=1,tp=4,ep=2' (axes dp, tp, "
                    "ep; missing ones are 1; the product must equal the number of devices). "
                    "Default: one device.")
flags.DEFINE_bool("multihost", False, "Join a multi-process job (jax.distributed.initialize): "
                  "process 0 schedules and serves, the others run its steps. Implied on a "
                  "multi-host TPU slice. Needs --mesh over every device of the job.")
flags.DEFINE_string("coordinator_address", None, "multihost: host:port of process 0 (default: "
                    "$JAX_COORDINATOR_ADDRESS or auto-detected on TPU/SLURM/Open MPI).")
flags.DEFINE_integer("num_processes", None, "multihost: processes in the job (with "
                     "--process_id; default auto-detected).")
flags.DEFINE_integer("process_id", None, "multihost: this process, 0..num_processes-1.")
flags.DEFINE_integer("heartbeat_timeout_s", 100, "multihost: seconds without a heartbeat "
                     "before the job declares a process dead and stops every process.")
flags.DEFINE_enum("bench_workload", "throughput", ["throughput", "prefix_cache"],
                  "bench: which benchmark.")
flags.DEFINE_integer("bench_num_requests", 32, "bench: concurrent requests.")
flags.DEFINE_integer("bench_input_len", 120, "bench: prompt tokens (+-10%).")
flags.DEFINE_integer("bench_output_len", 128, "bench: output tokens (EOS ignored).")
flags.DEFINE_enum("workload", None, [*WORKLOADS, "startup"],
                  "bench: the serving benchmark on requests of this shape (see "
                  "jaxserve/bench/workloads.py), or startup: the start-up benchmark "
                  "(jaxserve/bench/startup.py); unset runs --bench_workload.")
flags.DEFINE_string("concurrency", "1,8,32", "bench --workload: concurrency levels (most "
                    "requests in flight), comma-separated.")
flags.DEFINE_float("request_rate", float("inf"), "bench --workload: open-loop Poisson arrival "
                   "rate, requests/s; inf is closed loop.")
flags.DEFINE_integer("num_prompts", None, "bench --workload: requests per level "
                     "(default max(4, concurrency)).")
flags.DEFINE_string("slo", None, "bench --workload: goodput SLOs, e.g. 'ttft_ms=2000,tpot_ms=200' "
                    "(keys ttft_ms, tpot_ms, e2e_ms).")
flags.DEFINE_string("peers", "hf,llama_cpp", "bench --workload: other engines on the same "
                    "prompts (hf, llama_cpp, llama_cpp_server: llama.cpp's OpenAI server, "
                    "none); a missing package is skipped and said so.")
flags.DEFINE_enum("backend", "inprocess", ["inprocess", "grpc", "openai"], "bench --workload: "
                  "drive the engine in this process, or a spawned server over gRPC or over "
                  "the OpenAI HTTP API (SSE streams).")
flags.DEFINE_string("target", None, "bench --workload: a running server instead of a spawned "
                    "one: --backend openai: the base URL of any OpenAI-compatible server "
                    "(http://host:port; bearer token from $OPENAI_API_KEY); --backend grpc: "
                    "host:port of a jaxserve gRPC server.")
flags.DEFINE_float("scale", None, "bench --workload: multiply prompt and output lengths "
                   "(default 1, or 0.2 on CPU).")
flags.DEFINE_bool("warmup", True, "--mode serve: compile every step shape the engine can reach "
                  "before health turns SERVING (the persistent cache makes a second start "
                  "fast); generate: the step shapes the batch can reach, before its first "
                  "request (--nowarmup: each compiles on its first step); bench --workload: "
                  "every shape, then the sweep once untimed.")
flags.DEFINE_bool("scan_layers", True, "Run the decoder layers as one scanned layer body per "
                  "run of identical layers (programs that do not grow with depth); "
                  "--noscan_layers unrolls them.")
flags.DEFINE_bool("warmup_in_background", True, "--mode serve --warmup: turn SERVING once the "
                  "smallest decode and prefill steps are compiled and compile the rest in the "
                  "background, steps staying within the ready ones (a line says when all are); "
                  "--nowarmup_in_background: all before SERVING.")
flags.DEFINE_string("compilation_cache_dir", "auto", "Persistent XLA compilation cache folder: "
                    "compiled programs are written there and a later start loads them. auto: "
                    "$JAXSERVE_CACHE/xla (~/.cache/jaxserve/xla); '' turns it off.")
flags.DEFINE_float("peak_tflops", None, "bench --workload: the device's peak TFLOP/s for "
                   "MFU (default: measured with a large matmul).")
flags.DEFINE_float("peak_gbps", None, "bench --workload: the device's peak GB/s for MBU "
                   "(default: measured with a large copy).")
flags.DEFINE_string("eval_text", None, "eval: UTF-8 text file to score (default: the shipped "
                    "jaxserve/bench/data/python_reference.txt, see its README).")
flags.DEFINE_integer("eval_context", 512, "eval: tokens per window (non-overlapping windows; "
                     "the second half of each is scored, as llama.cpp does).")
flags.DEFINE_integer("eval_max_tokens", 4096, "eval: most text tokens used (whole windows).")

flags.DEFINE_string("host", "127.0.0.1", "serve: address to bind (loopback by default).")
flags.DEFINE_integer("port", 50051, "serve: gRPC port; 0 picks a free one (printed).")
flags.DEFINE_integer("metrics_port", 8000,
                     "serve: Prometheus /metrics port; 0 picks a free one, -1 turns it off.")
flags.DEFINE_integer("http_port", -1, "serve: OpenAI-compatible HTTP API port (/v1/completions, "
                     "/v1/chat/completions, ...); 0 picks a free one, -1 turns it off.")
flags.DEFINE_integer("max_waiting_requests", 256,
                     "serve: sequences allowed to wait; beyond it RESOURCE_EXHAUSTED.")
flags.DEFINE_integer("max_prompt_len", None, "serve: longest prompt, tokens "
                     "(default max_model_len - 1).")
flags.DEFINE_integer("max_message_mib", 16, "serve: largest gRPC message or HTTP body, MiB.")
flags.DEFINE_float("grace_period_s", 30.0, "serve: on SIGTERM, seconds running requests get "
                   "to finish before they are aborted.")
flags.DEFINE_string("tls_cert", None, "serve: PEM certificate chain (TLS with --tls_key).")
flags.DEFINE_string("tls_key", None, "serve: PEM private key.")
flags.DEFINE_string("auth_token_file", None, "serve: file holding the bearer token every call "
                    "must carry (or set JAXSERVE_AUTH_TOKEN).")
flags.DEFINE_enum("role", "both", ["both", "prefill", "decode"], "serve: disaggregated "
                  "prefill/decode role (jaxserve.disagg); both runs each request here. "
                  "bench --backend grpc: decode drives a spawned prefill/decode pair.")
flags.DEFINE_list("prefill_workers", [], "serve --role decode: prefill workers' gRPC host:port.")
flags.DEFINE_integer("disagg_min_prefill_tokens", 256, "serve --role decode: shortest uncached "
                     "prompt handed to a prefill worker, tokens.")
flags.DEFINE_float("disagg_max_cached_ratio", 0.5, "serve --role decode: a prompt this much in "
                   "the prefix cache is prefilled here.")
flags.DEFINE_float("kv_lease_s", 30.0, "serve --role prefill: seconds a finished prompt's KV "
                   "is held for a decode worker's pull.")
flags.DEFINE_float("disagg_prefill_timeout_s", 120.0, "serve --role decode: deadline of a "
                   "prefill worker's Prefill call; past it the prompt is prefilled here.")
flags.DEFINE_float("disagg_transfer_timeout_s", 20.0, "serve --role decode: deadline of a KV "
                   "Pull call and pull; past it the prompt is prefilled here.")

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


def _speculative_config() -> dict | None:
    """The ``LLM(speculative_config=...)`` dict of the speculation flags
    (None when off), checked (``SpeculativeConfig``) before any model loads.

    Raises:
      ValueError: a bad value, or draft flags without ``--speculative_method draft``.
    """
    from jaxserve.config import SpeculativeConfig
    if FLAGS.speculative_method == "none":
        if FLAGS.draft_model is not None:
            raise ValueError(f"--draft_model {FLAGS.draft_model!r} needs --speculative_method "
                             f"draft")
        return None
    d = dict(method=FLAGS.speculative_method, num_speculative_tokens=FLAGS.num_speculative_tokens,
             prompt_lookup_min=FLAGS.prompt_lookup_min, prompt_lookup_max=FLAGS.prompt_lookup_max,
             draft_model=FLAGS.draft_model, draft_quantization=FLAGS.draft_quantization,
             adaptive=FLAGS.speculative_adaptive)
    if d["method"] == "draft" and not d["draft_model"]:
        raise ValueError("--speculative_method draft needs --draft_model ('self' or a model)")
    SpeculativeConfig(**d)  # raises on a bad value, naming the field
    return d


def _engine_args() -> dict:
    extra = {}
    if FLAGS.num_devices is not None:
        import jax
        if not 1 <= FLAGS.num_devices <= len(jax.devices()):
            raise ValueError(f"--num_devices must be in [1, {len(jax.devices())}] (the devices "
                             f"present), got {FLAGS.num_devices}")
        extra["devices"] = jax.devices()[:FLAGS.num_devices]
    return dict(**extra, dtype=FLAGS.dtype, quantization=FLAGS.quantization,
                quantization_group_size=FLAGS.quantization_group_size,
                kv_cache_dtype=FLAGS.kv_cache_dtype,
                page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                kv_cache_memory_bytes=FLAGS.kv_cache_mib << 20, max_num_seqs=FLAGS.max_num_seqs,
                max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                max_model_len=FLAGS.max_model_len, mesh=FLAGS.mesh,
                enable_prefix_caching=FLAGS.enable_prefix_caching,
                enable_chunked_prefill=FLAGS.enable_chunked_prefill,
                async_scheduling=FLAGS.async_scheduling, scan_layers=FLAGS.scan_layers,
                speculative_config=_speculative_config(),
                compilation_cache_dir=compile_cache.resolve_dir(FLAGS.compilation_cache_dir))


def _requests(llm, SamplingParams):
    def params(max_tokens):
        if FLAGS.max_tokens is not None:
            max_tokens = FLAGS.max_tokens
        return SamplingParams(max_tokens=max_tokens,
                              temperature=FLAGS.temperature,
                              top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=FLAGS.seed)
    if FLAGS.prompt:
        items = [(p, _CHAT if FLAGS.chat else None, 256) for p in FLAGS.prompt]
    else:
        items = DEMO_PROMPTS
    out = []
    for text, chat, max_tokens in items:
        sp = params(max_tokens)
        prompt = text
        if chat and text:
            prompt = llm.apply_chat_template([{"role": "user", "content": text}])
            sp = sp.with_stop(llm.engine.tokenizer.chat_stop)
        out.append((text, prompt, sp))
    return out


def _warmup(engine, reqs) -> None:
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
    per_seq = 1 + (FLAGS.num_speculative_tokens if FLAGS.speculative_method != "none" else 0)
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


def _generate(llm, SamplingParams) -> None:
    engine = llm.engine
    reqs = _requests(llm, SamplingParams)
    if FLAGS.warmup:
        _warmup(engine, reqs)
    compilations = engine.stats().num_compilations
    ids = [engine.add_request(None, prompt, p) for _, prompt, p in reqs]
    single = len(ids) == 1
    finals = {}
    t0 = time.monotonic()
    _INTERRUPT["defer"] = True  # Ctrl-C now ends the loop below between two steps
    try:
        _stream(engine, ids, finals)
    finally:
        _INTERRUPT["defer"] = False
    if _INTERRUPT["requested"]:
        engine.abort(ids)  # frees their pages; every process is between steps
        if single and not FLAGS.json:
            print(flush=True)  # end the partial line
        _leave_job_after_interrupt(engine)
        _interrupted()
    wall = time.monotonic() - t0
    if single and not FLAGS.json:
        print()
    if FLAGS.json:
        for rid, (text, _, _) in zip(ids, reqs):
            o = finals[rid]
            m = o.metrics
            print(json.dumps({"request_id": rid, "prompt": text, "text": o.outputs[0].text,
                              "token_ids": o.outputs[0].token_ids,
                              "finish_reason": o.outputs[0].finish_reason,
                              "prompt_tokens": len(o.prompt_token_ids),
                              "output_tokens": len(o.outputs[0].token_ids),
                              "cached_tokens": m.num_cached_tokens, "queue_ms": m.queue_ms,
                              "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms,
                              **_spec_json(engine, m)}))
        return
    _print_table([finals[r] for r in ids], wall, engine.stats().num_compilations - compilations,
                 engine.stats() if engine.speculator is not None else None)


def _stream(engine, ids: list[str], finals: dict) -> None:
    """Step until every request is done (or Ctrl-C), printing text as it
    comes; fills ``finals`` with each request's last output."""
    single = len(ids) == 1
    pending = {rid: "" for rid in ids}
    while engine.has_unfinished_requests() and not _INTERRUPT["requested"]:
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


def _spec_json(engine, m) -> dict:
    """A request's speculation figures for ``--json`` (none when speculation is off)."""
    if engine.speculator is None:
        return {}
    return {"draft_tokens": m.num_draft_tokens, "accepted_tokens": m.num_accepted_tokens,
            "acceptance_rate": m.spec_acceptance_rate}


def _print_table(outs, wall: float, compilations: int, spec_stats=None) -> None:
    """One row per request; ``compilations``: XLA compilations during the
    batch; ``spec_stats`` (an ``EngineStats``, speculation on) adds each
    request's acceptance rate and a line of engine totals."""
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"
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
        print(_spec_summary(spec_stats))


def _spec_summary(st) -> str:
    """Engine totals of speculation (an ``EngineStats``), one line."""
    rate = f"{100 * st.spec_num_accepted_tokens / st.spec_num_draft_tokens:.0f}%" \
        if st.spec_num_draft_tokens else "-"
    length = f"{st.spec_mean_acceptance_length:.2f}" if st.spec_num_drafts else "-"
    return (f"speculation ({FLAGS.speculative_method}, k <= {FLAGS.num_speculative_tokens}): "
            f"{st.spec_num_drafts} drafted rows, {st.spec_num_draft_tokens} draft tokens, "
            f"{st.spec_num_accepted_tokens} accepted; acceptance rate {rate}, mean acceptance "
            f"length {length} tokens per drafted row; latest k {st.spec_k}")


def _bench(llm) -> None:
    from jaxserve.bench import prefix_cache, throughput
    engine = llm.engine
    if FLAGS.bench_workload == "prefix_cache":
        print(prefix_cache.format_result(prefix_cache.run(engine)))
        return
    prompts = throughput.make_prompts(engine, FLAGS.bench_num_requests, FLAGS.bench_input_len,
                                      seed=FLAGS.seed or 0)
    cold = throughput.run_once(engine, prompts, FLAGS.bench_output_len)
    print(throughput.format_result("warm-up (includes compilation)", cold), flush=True)
    warm = throughput.run_once(engine, prompts, FLAGS.bench_output_len)
    print(throughput.format_result("timed run", warm))
    print(f"  new compilations in timed run: {warm.num_compilations - cold.num_compilations}")
    if engine.speculator is not None:
        print("  " + _spec_summary(engine.stats()) + " (both runs)")


def _eval() -> None:
    """``--mode eval``: options and text checked before any model loads; the
    reference engine (quantization none, KV auto) is built only when the
    candidate is not that config already (``jaxserve.bench.eval``)."""
    from jaxserve import LLM
    from jaxserve.bench import eval as ev
    from jaxserve.engine.page_table import cdiv
    ev.check_options(FLAGS.eval_context, FLAGS.eval_max_tokens)
    text, path = ev.load_text(FLAGS.eval_text)
    args = _engine_args()
    if args.pop("speculative_config") is not None:
        print("jaxserve: eval ignores --speculative_method (scoring runs no decode steps)",
              file=sys.stderr, flush=True)
    if FLAGS.num_pages is None:  # one window's pages, not --kv_cache_mib of zeros per engine
        args["num_pages"] = cdiv(FLAGS.eval_context, FLAGS.page_size)
    llm = LLM(FLAGS.model, seed=FLAGS.seed or 0, **args)
    ids, bos = ev.tokenize(llm.engine, text)
    reference = None if ev.is_reference(args) else \
        LLM(FLAGS.model, seed=FLAGS.seed or 0, **ev.reference_args(args)).engine
    result = ev.evaluate(llm.engine, ids, reference=reference, context=FLAGS.eval_context,
                         max_tokens=FLAGS.eval_max_tokens, bos=bos)
    result = dict(model=FLAGS.model, text=ev.text_info(text, path, len(ids)), **result)
    ev.write_json(result, FLAGS.output)
    print(ev.format_summary(result), file=sys.stdout if FLAGS.output else sys.stderr,
          flush=True)
    if FLAGS.output:
        print(f"wrote {FLAGS.output}")


def _serving_bench() -> None:
    """``--mode bench --workload W``: options checked before the model loads."""
    from jaxserve.bench import suite
    opts = suite.options_from_flags({n: getattr(FLAGS, n) for n in suite.FLAG_NAMES},
                                    api_key=os.environ.get("OPENAI_API_KEY"))
    out = FLAGS.output or os.path.join(
        "bench-results", f"{FLAGS.workload}-{time.strftime('%Y%m%d-%H%M%S')}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        # A run writes only some files (no roofline.png over gRPC): never mix two runs.
        raise ValueError(f"--output {out!r} exists and is not an empty folder")
    started = time.monotonic()
    llm = None
    if opts.backend == "inprocess":
        from jaxserve import LLM
        llm = LLM(FLAGS.model, seed=FLAGS.seed or 0, **_engine_args())
    result, paths = suite.run(opts, out, llm, started=started)
    with open(paths[1]) as f:
        print(f.read())
    print("wrote " + ", ".join(paths))


def _startup_bench() -> None:
    """``--mode bench --workload startup``: options checked before any server starts."""
    from jaxserve.bench import startup
    opts = startup.options_from_flags({n: getattr(FLAGS, n) for n in startup.FLAG_NAMES})
    out = FLAGS.output or os.path.join("bench-results",
                                       f"startup-{time.strftime('%Y%m%d-%H%M%S')}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--output {out!r} exists and is not an empty folder")
    result, paths = startup.run(opts, out)
    print(startup.markdown(result))
    print("wrote " + ", ".join(paths))


def _serve() -> None:
    from jaxserve.config import DisaggConfig, ServerConfig
    from jaxserve.server.serve import serve
    _speculative_config()  # bad speculation flags fail before the port is bound
    token = os.environ.get("JAXSERVE_AUTH_TOKEN") or None
    if FLAGS.auth_token_file:
        try:
            with open(FLAGS.auth_token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --auth_token_file {FLAGS.auth_token_file!r}: "
                             f"{e.strerror}") from None
    config = ServerConfig(
        host=FLAGS.host, port=FLAGS.port,
        metrics_port=None if FLAGS.metrics_port < 0 else FLAGS.metrics_port,
        http_port=None if FLAGS.http_port < 0 else FLAGS.http_port,
        max_http_body_bytes=FLAGS.max_message_mib << 20,
        max_waiting_requests=FLAGS.max_waiting_requests, max_prompt_len=FLAGS.max_prompt_len,
        max_message_bytes=FLAGS.max_message_mib << 20, grace_period_s=FLAGS.grace_period_s,
        tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key, auth_token=token,
        disagg=DisaggConfig(role=FLAGS.role, prefill_workers=tuple(FLAGS.prefill_workers),
                            min_prefill_tokens=FLAGS.disagg_min_prefill_tokens,
                            max_cached_ratio=FLAGS.disagg_max_cached_ratio,
                            kv_lease_s=FLAGS.kv_lease_s,
                            prefill_timeout_s=FLAGS.disagg_prefill_timeout_s,
                            transfer_timeout_s=FLAGS.disagg_transfer_timeout_s))

    def load_engine():
        from jaxserve import LLM
        compile_cache.install()  # count every program of the start, the cache's or not
        return LLM(FLAGS.model, seed=FLAGS.seed or 0, **_engine_args()).engine
    if not _is_leader():
        _follow(load_engine())  # does not return
    serve(config, load_engine, FLAGS.model, warmup=FLAGS.warmup,
          background_warmup=FLAGS.warmup_in_background)


def _usage_error(e: ValueError) -> None:
    """Print ``error: ...`` and exit 2; in a multi-host job first record the
    reason, so the other processes name it in their own errors."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    if "jax" in sys.modules:
        from jaxserve.engine import multihost
        if multihost.in_job():
            import jax
            multihost.record_failure(f"process {jax.process_index()}: {e}")
    sys.exit(2)


def _init_multihost() -> None:
    """Join the job when asked (or on a multi-host TPU slice)."""
    from jaxserve.engine import multihost
    job_flags = [f"--{f}" for f in ("coordinator_address", "num_processes", "process_id")
                 if getattr(FLAGS, f) is not None]
    if job_flags and not FLAGS.multihost:
        raise ValueError(f"{', '.join(job_flags)} given without --multihost")
    if FLAGS.multihost or multihost.pod_environment():
        multihost.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                             heartbeat_timeout_s=FLAGS.heartbeat_timeout_s)


def _is_leader() -> bool:
    import jax
    return jax.process_index() == 0


def _follow(engine) -> None:
    """Processes other than 0: run process 0's steps until it stops; exit 0,
    or 1 with the job's error."""
    import jax

    from jaxserve.engine import multihost
    print(f"jaxserve: process {jax.process_index()} of {jax.process_count()} following "
          f"process 0", file=sys.stderr, flush=True)
    try:
        steps = engine.follow()
    except multihost.MultihostError as e:
        multihost.exit_on_fatal(e)
    print(f"jaxserve: process {jax.process_index()} done after {steps} steps", file=sys.stderr,
          flush=True)
    multihost.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _convert() -> None:
    import jax.numpy as jnp
    import numpy as np

    from checkpoints.loader import convert_to_orbax
    if not FLAGS.output:
        raise ValueError("--mode convert needs --output (the Orbax folder to write)")
    written = convert_to_orbax(FLAGS.model, FLAGS.output, dtype=np.dtype(jnp.dtype(FLAGS.dtype)),
                               quantization=FLAGS.quantization,
                               group_size=FLAGS.quantization_group_size)
    quantized = "" if FLAGS.quantization == "none" else f", projections {FLAGS.quantization}"
    print(f"converted {FLAGS.model} ({FLAGS.dtype}{quantized}) to an Orbax checkpoint:")
    for path in written:
        print(f"  {path}")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # absl shows INFO logs; JAX's "Unable to initialize backend 'tpu'" is noise
    # before every start-up (and every one-line error).
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per bench HTTP request
    if FLAGS.mode == "convert":
        try:
            _convert()
        except ValueError as e:
            _usage_error(e)
        return
    if FLAGS.mode != "convert":
        try:
            if FLAGS.mode == "serve" and FLAGS.role != "both" and FLAGS.multihost:
                raise ValueError(f"--role {FLAGS.role} runs in one-process workers (each with "
                                 f"its own mesh); a multi-host prefill or decode slice is not "
                                 f"supported yet")
            _init_multihost()
        except ValueError as e:
            _usage_error(e)
    if FLAGS.mode == "serve":
        try:
            _serve()
        except ValueError as e:
            _usage_error(e)
        return
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.multihost import MultihostError, exit_on_fatal, shutdown
    try:
        # Check sampling flags before the (slow) model load.
        SamplingParams(max_tokens=1 if FLAGS.max_tokens is None else FLAGS.max_tokens,
                       temperature=FLAGS.temperature,
                       top_p=FLAGS.top_p, top_k=FLAGS.top_k, seed=FLAGS.seed)
        _speculative_config()
        if FLAGS.prompt is not None and any(not p for p in FLAGS.prompt):
            raise ValueError(f"prompt is empty: {FLAGS.prompt!r}")
        for i, p in enumerate(FLAGS.prompt or ()):
            check_text(p, "--prompt" if len(FLAGS.prompt) == 1 else f"--prompt #{i + 1}")
        if FLAGS.mode == "bench" and FLAGS.workload == "startup":
            _startup_bench()
            return
        if FLAGS.mode == "bench" and FLAGS.workload is not None:
            _serving_bench()
            return
        if FLAGS.mode == "eval":
            _eval()
            return
        compile_cache.install()  # count every program of the start, the cache's or not
        llm = LLM(FLAGS.model, seed=FLAGS.seed or 0, **_engine_args())
        if not _is_leader():
            _follow(llm.engine)  # does not return
        try:
            if FLAGS.mode == "bench":
                _bench(llm)
            else:
                _generate(llm, SamplingParams)
        finally:
            llm.engine.stop_followers()  # multi-host: release the other processes
    except ValueError as e:
        _usage_error(e)
    except MultihostError as e:
        exit_on_fatal(e)
    shutdown()


# Ctrl-C (SIGINT) in the CLI, handled by ``_on_sigint`` rather than as a
# KeyboardInterrupt (which a gc callback or ``__del__`` can swallow, printing a
# traceback, and which can land between a multi-host step's broadcast and its
# collectives). "defer": the generation loop is running and ends itself
# between two steps (its requests aborted); "requested": Ctrl-C came.
_INTERRUPT = {"defer": False, "requested": False}


def _on_sigint(signum, frame) -> None:
    if _INTERRUPT["defer"] and not _INTERRUPT["requested"]:
        _INTERRUPT["requested"] = True
        return
    _interrupted()  # loading, or a second Ctrl-C: nothing to abort, leave now


def _leave_job_after_interrupt(engine) -> None:
    """Multi-host, process 0 after Ctrl-C between steps: release the other
    processes and leave the job, as at a normal end. When they are gone
    already (Ctrl-C reached the whole process group), leave without them."""
    from jaxserve.engine import multihost
    if engine.runner.channel is None:
        return
    try:
        engine.stop_followers()
        multihost.shutdown()
    except Exception:  # noqa: BLE001 - the job is broken: exit anyway
        pass


def _interrupted() -> None:
    """Ctrl-C: exit 130 (128 + SIGINT, as shells report it), no traceback.

    ``os._exit``: interpreter teardown after an interrupt inside JAX can take
    seconds or print noise. In a multi-host job the reason is recorded first,
    so the other processes can name it when their collectives fail."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - e.g. a reentrant flush from the handler
        pass
    try:
        if "jax" in sys.modules:
            from jaxserve.engine import multihost
            if multihost.in_job():
                import jax
                multihost.record_failure(f"process {jax.process_index()}: interrupted (Ctrl-C)")
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    os._exit(130)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parse, but a bad flag value (an unknown enum choice, a string
    where a number belongs, an unknown flag) is a usage error like any other:
    ``error: ...`` and exit 2 (absl's own parser exits 1)."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}\nPass --helpfull to see every flag.", file=sys.stderr, flush=True)
        sys.exit(2)


def run() -> None:
    """The command. Ctrl-C: see ``_on_sigint`` (``--mode serve`` installs its
    own handler for its event loop: a graceful shutdown)."""
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        app.run(main, flags_parser=_parse_flags)
    except KeyboardInterrupt:  # raised by code that re-raises SIGINT itself
        _interrupted()


if __name__ == "__main__":
    run()
