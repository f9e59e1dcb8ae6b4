"""Every flag of ``python -m jaxserve.main`` and the one conversion of
flags into the core's dataclasses.

Flags live here only; everything below the entry point takes
``jaxserve.config`` dataclasses. ``engine_config()`` is the single path from
flags to an ``EngineConfig`` (model, dtype, KV cache, scheduler, mesh,
quantization, speculation, LoRA slots, compilation cache); ``server_config()`` builds the
``ServerConfig`` of ``--mode serve``. Each raises ``ValueError`` naming the
flag or field at fault, so a bad value fails before anything slow starts
(``main`` prints ``error: ...`` and exits 2).

Importing this module does not import JAX (``--help`` and flag errors stay
fast); the conversions that need JAX-side helpers import them when called.
"""

from __future__ import annotations

import os

from absl import flags

from jaxserve.bench.workloads import WORKLOADS
from jaxserve.config import (CacheConfig, EngineConfig, LoRAConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, kv_cache_dtype_from_name)
from jaxserve.engine import compile_cache
from jaxserve.engine.sampling_params import SamplingParams, check_text
from jaxserve.server_config import DisaggConfig, ServerConfig

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
flags.DEFINE_string("quantization", "auto", "Weight format of the linear projections: auto "
                    "(the default: on CPU the fastest of the formats that keep the checkpoint's "
                    "numerics, measured once per machine and cached; none elsewhere), none, "
                    "int8 (weight-only, per channel), w8a8 (int8 weights x int8 activations), "
                    "int4 (groups along the input dim, scale + zero point), gguf (the "
                    "file's own Q8_0/Q4_0/Q4_1 blocks), gguf_a16 (those blocks x int16 "
                    "activations in blocks of 32, integer dot products) or gguf_a8 (x int8 "
                    "activations, as llama.cpp computes them), and the LM "
                    "head unless --noquantize_lm_head. Embeddings, norms, router and attention "
                    "stay precise.")
flags.DEFINE_integer("quantization_group_size", 32, "int4: input elements per scale.")
flags.DEFINE_bool("quantize_lm_head", True, "Under --quantization, hold the LM head in the "
                  "weight format too (a tied head: a quantized copy beside the exact embedding); "
                  "--noquantize_lm_head keeps it in --dtype.")
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
flags.DEFINE_integer("max_forced_drafts", 8, "Structured outputs: most tokens a grammar forces "
                     "that ride one step as free drafts; 0 turns forced drafting off.")
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
flags.DEFINE_bool("enable_lora", False, "Serve LoRA adapters (PEFT folders) beside the base "
                  "model: --max_loras slots on the device; requests pick one by name (the "
                  "OpenAI model field, gRPC lora_name). Implied by --lora_modules.")
flags.DEFINE_integer("max_loras", 4, "LoRA: adapters held on the device at once (more may be "
                     "registered: they swap in, least recently used out).")
flags.DEFINE_integer("max_lora_rank", 16, "LoRA: the largest adapter rank accepted (every "
                     "adapter is zero-padded to it).")
flags.DEFINE_list("lora_modules", [], "LoRA: adapters registered at start, before serving: "
                  "name=path[,name=path...] (path: a PEFT folder with adapter_config.json and "
                  "adapter_model.safetensors). Turns LoRA on.")
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
flags.DEFINE_string("lora_mix", None, "bench --workload: LoRA adapters given to the "
                    "requests round-robin: names registered with --lora_modules (a,b,...), "
                    "or random:N (N random rank---max_lora_rank adapters written to a temp "
                    "folder and registered); each level runs the base alone and the mix in "
                    "alternation and reports both output tok/s and their ratio. Turns LoRA "
                    "on; no --peers.")
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
flags.DEFINE_float("stream_stall_timeout_s", 30.0, "serve: a stream whose client reads "
                   "nothing for this long while output waits is aborted; 0 turns it off.")
flags.DEFINE_float("stream_pause_after_s", 1.0, "serve: a stream whose client reads nothing "
                   "for this long while output waits (or with over a quarter of "
                   "stream_buffer_outputs waiting) is paused (its slots and pages go to "
                   "others) until the client reads; 0 turns pausing off.")
flags.DEFINE_integer("stream_buffer_outputs", 256, "serve: outputs (one a step) that may wait "
                     "unread per request of a stream; one more aborts it.")
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


def speculative_config() -> SpeculativeConfig:
    """The ``EngineConfig.speculative`` of the speculation flags (a default,
    off ``SpeculativeConfig`` for ``--speculative_method none``).

    Raises:
      ValueError: a bad value (``SpeculativeConfig`` names the field), or
        draft flags without ``--speculative_method draft``.
    """
    if FLAGS.speculative_method == "none":
        if FLAGS.draft_model is not None:
            raise ValueError(f"--draft_model {FLAGS.draft_model!r} needs --speculative_method "
                             f"draft")
        return SpeculativeConfig()
    if FLAGS.speculative_method == "draft" and not FLAGS.draft_model:
        raise ValueError("--speculative_method draft needs --draft_model ('self' or a model)")
    return SpeculativeConfig(
        method=FLAGS.speculative_method, num_speculative_tokens=FLAGS.num_speculative_tokens,
        prompt_lookup_min=FLAGS.prompt_lookup_min, prompt_lookup_max=FLAGS.prompt_lookup_max,
        draft_model=FLAGS.draft_model, draft_quantization=FLAGS.draft_quantization,
        adaptive=FLAGS.speculative_adaptive)


def lora_modules() -> list[tuple[str, str]]:
    """``--lora_modules`` as (name, path) pairs, in the given order.

    Raises:
      ValueError: an entry that is not ``name=path``, a name given twice or
        equal to ``--model``, or a path that is not a folder (naming the entry).
    """
    out, seen = [], set()
    for entry in FLAGS.lora_modules:
        name, eq, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            raise ValueError(f"--lora_modules entry {entry!r}: expected name=path")
        if name in seen:
            raise ValueError(f"--lora_modules entry {entry!r}: the name {name!r} is given twice")
        if name == FLAGS.model:
            raise ValueError(f"--lora_modules entry {entry!r}: the name is --model's (requests "
                             f"naming it get the base model)")
        if not os.path.isdir(path):
            raise ValueError(f"--lora_modules entry {entry!r}: {path!r} is not a folder")
        seen.add(name)
        out.append((name, path))
    return out


def lora_config() -> LoRAConfig | None:
    """The ``EngineConfig.lora`` of the LoRA flags: None (off) unless
    ``--enable_lora``, ``--lora_modules`` or (``--mode bench``) ``--lora_mix``.

    Raises:
      ValueError: a bad ``--lora_modules`` entry, or ``--max_loras`` /
        ``--max_lora_rank`` out of range (naming the flag).
    """
    modules = lora_modules()
    if not FLAGS.enable_lora and not modules and not (FLAGS.mode == "bench"
                                                       and FLAGS.lora_mix):
        return None
    try:
        return LoRAConfig(max_loras=FLAGS.max_loras, max_lora_rank=FLAGS.max_lora_rank)
    except ValueError as e:
        raise ValueError(f"--{e}") from None


def engine_config(speculative: SpeculativeConfig | None = None) -> EngineConfig:
    """The ``EngineConfig`` of the flags: the one conversion of engine flags.

    Args:
      speculative: ``speculative_config()`` when the caller built it already
        (to fail early, before a port is bound); None builds it here.

    Raises:
      ValueError: a bad mesh spec, KV cache dtype or any other engine value
        (the config's ``__post_init__`` names the field).
    """
    from sharding.mesh import parse_mesh_spec  # imports JAX: only when an engine is built
    parallel = ParallelConfig() if FLAGS.mesh is None else \
        ParallelConfig.from_mesh_shape(parse_mesh_spec(FLAGS.mesh))
    return EngineConfig(
        model=FLAGS.model, dtype=FLAGS.dtype, seed=FLAGS.seed or 0,
        cache=CacheConfig(page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                          memory_bytes=FLAGS.kv_cache_mib << 20,
                          dtype=kv_cache_dtype_from_name(FLAGS.kv_cache_dtype),
                          enable_prefix_caching=FLAGS.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=FLAGS.max_num_seqs,
                                  max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                                  max_model_len=FLAGS.max_model_len,
                                  enable_chunked_prefill=FLAGS.enable_chunked_prefill,
                                  max_forced_drafts=FLAGS.max_forced_drafts),
        parallel=parallel,
        compilation_cache_dir=compile_cache.resolve_dir(FLAGS.compilation_cache_dir),
        scan_layers=FLAGS.scan_layers, async_scheduling=FLAGS.async_scheduling,
        quantization=FLAGS.quantization, quantization_group_size=FLAGS.quantization_group_size,
        quantize_lm_head=FLAGS.quantize_lm_head,
        speculative=speculative if speculative is not None else speculative_config(),
        lora=lora_config())


def engine_devices() -> list | None:
    """The devices ``--num_devices`` picks (the first N), or None (the
    engine's default: all with ``--mesh``, else one).

    Raises:
      ValueError: more devices than present, or fewer than 1.
    """
    if FLAGS.num_devices is None:
        return None
    import jax  # the backend starts here, after a multi-host job was joined
    if not 1 <= FLAGS.num_devices <= len(jax.devices()):
        raise ValueError(f"--num_devices must be in [1, {len(jax.devices())}] (the devices "
                         f"present), got {FLAGS.num_devices}")
    return jax.devices()[:FLAGS.num_devices]


def server_config() -> ServerConfig:
    """The ``ServerConfig`` of ``--mode serve``'s flags; the bearer token
    comes from ``--auth_token_file`` or ``$JAXSERVE_AUTH_TOKEN``.

    Raises:
      ValueError: an unreadable token file, or a bad value (naming the flag).
    """
    token = os.environ.get("JAXSERVE_AUTH_TOKEN") or None
    if FLAGS.auth_token_file:
        try:
            with open(FLAGS.auth_token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --auth_token_file {FLAGS.auth_token_file!r}: "
                             f"{e.strerror}") from None
    return ServerConfig(
        host=FLAGS.host, port=FLAGS.port,
        metrics_port=None if FLAGS.metrics_port < 0 else FLAGS.metrics_port,
        http_port=None if FLAGS.http_port < 0 else FLAGS.http_port,
        max_http_body_bytes=FLAGS.max_message_mib << 20,
        max_waiting_requests=FLAGS.max_waiting_requests, max_prompt_len=FLAGS.max_prompt_len,
        stream_stall_timeout_s=FLAGS.stream_stall_timeout_s or None,
        stream_buffer_outputs=FLAGS.stream_buffer_outputs,
        stream_pause_after_s=FLAGS.stream_pause_after_s or None,
        max_message_bytes=FLAGS.max_message_mib << 20, grace_period_s=FLAGS.grace_period_s,
        tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key, auth_token=token,
        disagg=DisaggConfig(role=FLAGS.role, prefill_workers=tuple(FLAGS.prefill_workers),
                            min_prefill_tokens=FLAGS.disagg_min_prefill_tokens,
                            max_cached_ratio=FLAGS.disagg_max_cached_ratio,
                            kv_lease_s=FLAGS.kv_lease_s,
                            prefill_timeout_s=FLAGS.disagg_prefill_timeout_s,
                            transfer_timeout_s=FLAGS.disagg_transfer_timeout_s))


def sampling_params(max_tokens: int) -> SamplingParams:
    """The sampling flags as ``SamplingParams``; ``--max_tokens``, when
    given, replaces ``max_tokens`` (a demo prompt's own budget).

    Raises:
      ValueError: an out-of-range value (``SamplingParams`` names the field).
    """
    return SamplingParams(max_tokens=max_tokens if FLAGS.max_tokens is None else FLAGS.max_tokens,
                          temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
                          seed=FLAGS.seed)


def check_prompts() -> None:
    """Refuse an empty ``--prompt`` or one that is not valid Unicode.

    Raises:
      ValueError: naming the prompt (``--prompt #2`` when there are several).
    """
    if FLAGS.prompt is not None and any(not p for p in FLAGS.prompt):
        raise ValueError(f"prompt is empty: {FLAGS.prompt!r}")
    for i, p in enumerate(FLAGS.prompt or ()):
        check_text(p, "--prompt" if len(FLAGS.prompt) == 1 else f"--prompt #{i + 1}")
