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
    ``--lora_modules name=path,...`` ships those PEFT adapters in the folder
    (each checked against the model first: a bad one exits 2 naming the
    entry, writing nothing); serving the folder registers them under their
    names, LoRA on (``checkpoints.orbax_lora``).

Speculative decoding (every mode that decodes; eval and convert ignore it):
``--speculative_method ngram|draft`` with ``--num_speculative_tokens``,
``--prompt_lookup_min/max`` (ngram), ``--draft_model`` /
``--draft_quantization`` (draft) and ``--speculative_adaptive``, built into
``EngineConfig.speculative``. The generate table then shows each request's
acceptance rate and a line of engine totals.

Flags live in ``jaxserve.flags`` (with the one flags -> ``EngineConfig``
conversion) and the demo's batch and printing in ``jaxserve.demo``; this
module dispatches the modes, joins a multi-host job and handles signals. Bad
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

import dataclasses
import logging
import os
import signal
import sys
import time

import numpy as np
from absl import app, flags

from jaxserve import demo
from jaxserve import flags as cli
from jaxserve.config import EngineConfig, LoRAConfig, SpeculativeConfig
from jaxserve.engine import compile_cache
from jaxserve.engine.page_table import cdiv
from jaxserve.flags import FLAGS

# JAX and every module that imports it (the engine, ``multihost``, the
# benchmarks, the servers, ``checkpoints``) load inside the functions that use
# them: ``--help``, a bad flag and ``--mode bench --workload startup`` (which
# only spawns servers) never pay JAX's import of several seconds.


def _llm(config: EngineConfig):
    """The ``LLM`` facade over an ``Engine`` built from ``config`` (the flags'
    ``EngineConfig``; ``LLM(...)`` itself takes vLLM's keyword arguments),
    with the adapters an Orbax checkpoint ships (``checkpoints.orbax_lora``;
    they turn LoRA on, with ``--max_loras`` / ``--max_lora_rank``, except in a
    multi-host job, which serves the base only, with a warning) and the
    ``--lora_modules`` adapters registered; a ``--lora_modules`` entry of a
    shipped adapter's name replaces it.

    Raises:
      ValueError: a model that fails to load, or an adapter folder the model
        cannot take (naming the ``--lora_modules`` entry or the checkpoint's
        adapter, the file and field).
    """
    from checkpoints.orbax_lora import checkpoint_adapters
    from jaxserve import LLM, Engine
    modules = cli.lora_modules()
    shipped = [(n, p) for n, p in checkpoint_adapters(config.model)
               if n not in dict(modules)]  # an explicit --lora_modules entry wins
    if shipped and config.lora is None:  # adapters in the checkpoint turn LoRA on
        from jaxserve.engine import multihost
        if multihost.in_job():  # LoRA is one-process only: serve the base
            logging.warning("LoRA adapters of the checkpoint not served (%s): a multi-host "
                            "job serves the base model only", ", ".join(n for n, _ in shipped))
            shipped = []
        else:
            config = dataclasses.replace(config, lora=LoRAConfig(FLAGS.max_loras,
                                                                 FLAGS.max_lora_rank))
    llm = LLM.from_engine(Engine(config, devices=cli.engine_devices()))
    for name, path in shipped:
        try:
            llm.engine.add_lora(name, path)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {name!r} of the checkpoint {config.model}: "
                             f"{e}") from None
    for name, path in modules:
        try:
            llm.engine.add_lora(name, path)
        except ValueError as e:
            raise ValueError(f"--lora_modules entry '{name}={path}': {e}") from None
    if shipped:
        logging.info("LoRA adapters of the checkpoint registered: %s",
                     ", ".join(n for n, _ in shipped))
    return llm


def _bench(llm) -> None:
    """``--mode bench`` (no ``--workload``): the offline throughput or the
    prefix-cache benchmark on the engine."""
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
    if engine.speculative:
        print("  " + demo.spec_summary(engine.stats()) + " (both runs)")


def _eval(speculative: SpeculativeConfig) -> None:
    """``--mode eval``: options and text checked before any model loads; the
    reference engine (quantization none, KV auto) is built only when the
    candidate is not that config already (``jaxserve.bench.eval``)."""
    from jaxserve.bench import eval as ev
    ev.check_options(FLAGS.eval_context, FLAGS.eval_max_tokens)
    text, path = ev.load_text(FLAGS.eval_text)
    config = cli.engine_config(speculative)
    if config.speculative.method is not None:
        print("jaxserve: eval ignores --speculative_method (scoring runs no decode steps)",
              file=sys.stderr, flush=True)
        config = dataclasses.replace(config, speculative=SpeculativeConfig())
    if FLAGS.num_pages is None:  # one window's pages, not --kv_cache_mib of zeros per engine
        config = dataclasses.replace(config, cache=dataclasses.replace(
            config.cache, num_pages=cdiv(FLAGS.eval_context, FLAGS.page_size)))
    engine = _llm(config).engine
    ids, bos = ev.tokenize(engine, text)
    reference = None
    if engine.config.quantization != "none" or config.cache.dtype is not None:  # auto resolved
        reference = _llm(dataclasses.replace(config, quantization="none", cache=dataclasses.replace(
            config.cache, dtype=None))).engine
    result = ev.evaluate(engine, ids, reference=reference, context=FLAGS.eval_context,
                         max_tokens=FLAGS.eval_max_tokens, bos=bos)
    result = dict(model=FLAGS.model, text=ev.text_info(text, path, len(ids)), **result)
    ev.write_json(result, FLAGS.output)
    print(ev.format_summary(result), file=sys.stdout if FLAGS.output else sys.stderr,
          flush=True)
    if FLAGS.output:
        print(f"wrote {FLAGS.output}")


def _results_folder(name: str) -> str:
    """``--output`` or ``bench-results/<name>-<time>``; never a folder
    holding another run's files (a run writes only some of them)."""
    out = FLAGS.output or os.path.join("bench-results", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--output {out!r} exists and is not an empty folder")
    return out


def _serving_bench(speculative: SpeculativeConfig) -> None:
    """``--mode bench --workload W``: options checked before the model loads."""
    from jaxserve.bench import suite
    opts = suite.options_from_flags({n: getattr(FLAGS, n) for n in suite.FLAG_NAMES},
                                    api_key=os.environ.get("OPENAI_API_KEY"))
    out = _results_folder(FLAGS.workload)
    started = time.monotonic()
    llm = _llm(cli.engine_config(speculative)) if opts.backend == "inprocess" else None
    result, paths = suite.run(opts, out, llm, started=started)
    with open(paths[1]) as f:
        print(f.read())
    print("wrote " + ", ".join(paths))


def _startup_bench() -> None:
    """``--mode bench --workload startup``: options checked before any server starts."""
    from jaxserve.bench import startup
    opts = startup.options_from_flags({n: getattr(FLAGS, n) for n in startup.FLAG_NAMES})
    result, paths = startup.run(opts, _results_folder("startup"))
    print(startup.markdown(result))
    print("wrote " + ", ".join(paths))


def _serve() -> None:
    """``--mode serve``: every flag checked before the port is bound (the
    server module has loaded the engine's code by then, so the engine config
    costs nothing more); the engine itself loads in the server's worker
    thread; ``--role`` wires the disaggregated worker's parts into the server."""
    from jaxserve.server.serve import serve
    engine_config = cli.engine_config()
    config = cli.server_config()
    role = None
    if config.disagg.role != "both":  # only a disaggregated worker loads jax's transfer API
        from jaxserve.disagg.roles import server_role
        role = server_role(config)

    def load_engine():
        compile_cache.install()  # count every program of the start, the cache's or not
        return _llm(engine_config).engine
    if not _is_leader():
        _follow(load_engine())  # does not return
    serve(config, load_engine, FLAGS.model, warmup=FLAGS.warmup,
          background_warmup=FLAGS.warmup_in_background, role=role)


def _convert() -> None:
    import jax.numpy as jnp

    from checkpoints.loader import convert_to_orbax
    if not FLAGS.output:
        raise ValueError("--mode convert needs --output (the Orbax folder to write)")
    # A conversion keeps f32 unless a format is named (auto picks at serving time).
    method = "none" if FLAGS.quantization == "auto" else FLAGS.quantization
    written = convert_to_orbax(FLAGS.model, FLAGS.output, dtype=np.dtype(jnp.dtype(FLAGS.dtype)),
                               quantization=method,
                               group_size=FLAGS.quantization_group_size,
                               lora_modules=cli.lora_modules(),
                               quantize_lm_head=FLAGS.quantize_lm_head)
    quantized = "" if method == "none" else f", projections {method}"
    print(f"converted {FLAGS.model} ({FLAGS.dtype}{quantized}) to an Orbax checkpoint:")
    for path in written:
        print(f"  {path}")


# ---- multi-host -----------------------------------------------------------------

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
    if FLAGS.mode == "serve" and FLAGS.role != "both" and FLAGS.multihost:
        raise ValueError(f"--role {FLAGS.role} runs in one-process workers (each with "
                         f"its own mesh); a multi-host prefill or decode slice is not "
                         f"supported yet")
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


def _leave_job_after_interrupt(engine) -> None:
    """Multi-host, process 0 after Ctrl-C between steps: release the other
    processes and leave the job, as at a normal end. When they are gone
    already (Ctrl-C reached the whole process group), leave without them."""
    from jaxserve.engine import multihost
    if not multihost.in_job():
        return
    try:
        engine.stop_followers()
        multihost.shutdown()
    except Exception:  # noqa: BLE001 - the job is broken: exit anyway
        pass


# ---- dispatch -------------------------------------------------------------------

def _generate_or_bench() -> None:
    """generate, bench and eval: every flag checked before the (slow) model load."""
    cli.sampling_params(1)  # raises on an out-of-range sampling flag
    speculative = cli.speculative_config()
    cli.check_prompts()
    if FLAGS.mode == "bench" and FLAGS.workload == "startup":
        return _startup_bench()
    if FLAGS.mode == "bench" and FLAGS.workload is not None:
        return _serving_bench(speculative)
    if FLAGS.mode == "eval":
        return _eval(speculative)
    config = cli.engine_config(speculative)
    compile_cache.install()  # count every program of the start, the cache's or not
    llm = _llm(config)
    if not _is_leader():
        _follow(llm.engine)  # does not return
    try:
        if FLAGS.mode == "bench":
            _bench(llm)
        elif not demo.generate(llm, _INTERRUPT):
            _leave_job_after_interrupt(llm.engine)
            _interrupted()
    finally:
        llm.engine.stop_followers()  # multi-host: release the other processes


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
    try:
        _init_multihost()
    except ValueError as e:
        _usage_error(e)
    if FLAGS.mode == "serve":
        try:
            _serve()
        except ValueError as e:
            _usage_error(e)
        return
    from jaxserve.engine.multihost import MultihostError, exit_on_fatal, shutdown
    try:
        _generate_or_bench()
    except ValueError as e:
        _usage_error(e)
    except MultihostError as e:
        exit_on_fatal(e)
    shutdown()


# ---- Ctrl-C ---------------------------------------------------------------------

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
