"""The benchmarks' one command line: ``python -m jaxserve.bench COMMAND ...``.

| command | measures | module |
|---|---|---|
| ``serve`` | serving: workloads at concurrency levels, in-process / gRPC / HTTP, beside HF, llama.cpp, its server | ``serving_run`` |
| ``throughput`` | W1 (a batch at once: tok/s) and W2 (one long prompt: TTFT, TPOT) beside HF and llama.cpp, per weight format and KV dtype | ``throughput`` |
| ``latency`` | time per output token with speculative decoding off and on | ``speculation`` |
| ``sweep`` | decode step time over batch rows x context, beside the bandwidth roofline | ``decode_sweep`` |
| ``startup`` | cold and warm start to SERVING, beside llama.cpp's server and HF | ``startup`` |
| ``soak`` | hours of mixed, partly hostile gRPC + HTTP traffic: leaks and wrong endings | ``soak`` |
| ``eval`` | perplexity and KL divergence against the unquantized model | ``eval`` |
| ``structured`` | structured outputs: a JSON-schema batch against the same batch unconstrained; forced-token drafting against plain constrained decoding | ``structured`` |
| ``lora`` | multi-LoRA: a batch spread over adapters against the base alone; the time to swap an adapter into a slot | ``lora`` |
| ``device`` | one GPU: kernel self-check, the kernel against JAX's, a Llama-3-8B-shaped model's steps, formats, workloads; each section time-limited | ``device`` |

``serve`` and ``eval`` build their engine from ``jaxserve.main``'s flags (the
one place engine flags are defined): they run ``python -m jaxserve.main
--mode bench`` / ``--mode eval`` with the arguments given, so every engine
flag (``--dtype``, ``--kv_cache_mib``, ``--quantization``, ...) and every
serving-benchmark flag (``--workload``, ``--concurrency``, ``--backend``,
``--peers``, ...) is accepted as documented there; ``serve`` runs the
``mixed`` workload unless ``--workload`` is given. So do ``throughput
--offline`` (``--mode bench``'s offline pass: N requests at once on the
engine those flags build) and ``latency --prefix_cache`` (TTFT of a cached
against a cold 1,000-token system prompt). ``startup`` and ``soak``
pass the flags after ``--`` to the servers they spawn. The others take the
options listed by ``python -m jaxserve.bench COMMAND --help``. Each writes
its JSON, ``report.md`` and PNGs through ``report.write``; a bad option is one
``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


COMMANDS = {
    "serve": "serving benchmark: workloads at concurrency levels against HF, llama.cpp and "
             "its server (every flag of python -m jaxserve.main --mode bench)",
    "throughput": "W1 (batch tok/s) and W2 (long-prompt TTFT, TPOT) against HF and llama.cpp, "
                  "per weight format and KV cache dtype (--sweep adds the decode sweep)",
    "latency": "time per output token, speculative decoding off against on",
    "sweep": "decode step time over batch rows x context against the bandwidth roofline",
    "startup": "cold and warm start to SERVING against llama.cpp's server and HF's load",
    "soak": "long mixed gRPC + HTTP traffic against one server: leaks, lost or hanging calls",
    "eval": "perplexity and KL divergence (every flag of python -m jaxserve.main --mode eval)",
    "structured": "structured outputs: a JSON-schema batch against the same batch "
                  "unconstrained, forced-token drafting against plain constrained decoding",
    "lora": "multi-LoRA: a batch spread over adapters against the base alone, and the "
            "time to swap an adapter into a slot",
    "device": "GPU: kernel self-check, the kernel against JAX's, then a Llama-3-8B-shaped "
              "model's steps, formats and workloads, each section time-limited",
}


def _parser() -> argparse.ArgumentParser:
    from jaxserve.bench import device, lora, soak, speculation, structured, throughput
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = {name: sub.add_parser(name, help=what, description=what)
         for name, what in COMMANDS.items()}
    for name in ("serve", "eval"):
        p[name].add_argument("flags", nargs="*", help="flags of python -m jaxserve.main "
                             "(python -m jaxserve.main --helpfull lists them)")
    throughput.add_arguments(p["throughput"], sweep_only=False)
    p["throughput"].add_argument("--offline", action="store_true", help="instead: python -m "
                                 "jaxserve.main --mode bench (the offline pass on the engine "
                                 "its flags build; every flag of jaxserve.main is accepted)")
    throughput.add_arguments(p["sweep"], sweep_only=True)
    speculation.add_arguments(p["latency"])
    p["latency"].add_argument("--prefix_cache", action="store_true", help="instead: python -m "
                              "jaxserve.main --mode bench --bench_workload prefix_cache (cached "
                              "against cold TTFT; every flag of jaxserve.main is accepted)")
    p["startup"].add_argument("--output", required=True, help="folder, new or empty")
    p["startup"].add_argument("--model", default="smollm2-135m", help="alias, .gguf, HF folder")
    p["startup"].add_argument("--peers", default="hf,llama_cpp", help="hf, llama_cpp, or none")
    p["startup"].add_argument("--timeout_s", type=float, default=900.0,
                              help="most seconds one start may take")
    p["startup"].add_argument("engine_flags", nargs="*",
                              help="after --: flags of both jaxserve starts")
    soak.add_arguments(p["soak"])
    device.add_arguments(p["device"])
    structured.add_arguments(p["structured"])
    lora.add_arguments(p["lora"])
    return ap


def main_command(argv: list[str]) -> list[str] | None:
    """The ``python -m jaxserve.main`` command line that runs ``argv``, for the
    benchmarks whose engine ``jaxserve.main``'s flags build: ``serve``
    (``--mode bench --workload W``, ``mixed`` unless given), ``eval``
    (``--mode eval``), ``throughput --offline`` (``--mode bench``: the offline
    pass) and ``latency --prefix_cache`` (``--mode bench --bench_workload
    prefix_cache``); None for the others (and for ``--help``)."""
    cmd, rest = argv[0] if argv else None, [f for f in argv[1:] if f != "--"]
    if any(f in ("-h", "--help") for f in rest):
        return None
    if cmd == "serve":
        workload = any(f.split("=")[0] == "--workload" for f in rest)
        mode = ["bench"] + ([] if workload else ["--workload", "mixed"])
    elif cmd == "eval":
        mode = ["eval"]
    elif cmd == "throughput" and "--offline" in rest:
        mode = ["bench"]
        rest.remove("--offline")
    elif cmd == "latency" and "--prefix_cache" in rest:
        mode = ["bench", "--bench_workload", "prefix_cache"]
        rest.remove("--prefix_cache")
    else:
        return None
    return [sys.executable, "-m", "jaxserve.main", "--mode", *mode, *rest]


def _startup(a) -> int:
    from jaxserve.bench import peers, startup
    if os.path.exists(a.output) and (not os.path.isdir(a.output) or os.listdir(a.output)):
        raise ValueError(f"--output {a.output!r} exists and is not an empty folder")
    opts = startup.StartupOptions(model=a.model, engine_flags=tuple(a.engine_flags),
                                  peers=tuple(peers.parse_peers(a.peers)),
                                  timeout_s=a.timeout_s)
    result, paths = startup.run(opts, a.output)
    print(startup.markdown(result))
    print("wrote " + ", ".join(paths))
    return 0


def main(argv=None, parts: dict | None = None) -> int:
    """Parse ``argv`` and run the command; its exit status. ``parts`` (tests):
    ``Engine`` keyword arguments used by ``latency`` instead of loading
    ``--model``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if (cmd := main_command(argv)) is not None:  # jaxserve.main's parser reads the engine flags
        return subprocess.call(cmd)  # (this process imports no benchmark module, nor JAX)
    from jaxserve.bench import device, lora, soak, speculation, structured, throughput
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        if a.command in ("throughput", "sweep"):
            return throughput.run(a)
        if a.command == "latency":
            return speculation.run(a, parts)
        if a.command == "startup":
            return _startup(a)
        if a.command == "soak":
            return soak.run(a)
        if a.command == "structured":
            return structured.run(a)
        if a.command == "lora":
            return lora.run(a)
        return device.run(a)
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
