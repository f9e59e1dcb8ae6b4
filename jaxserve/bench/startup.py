"""The start-up benchmark: ``python -m jaxserve.bench startup`` (and
``python -m jaxserve.main --mode bench --workload startup``).

What a user waits for before the first answer, in one run on one machine:

1. jaxserve cold: ``python -m jaxserve.main --mode serve`` spawned with
   ``--compilation_cache_dir`` an empty temporary folder (the engine flags of
   this command line passed on, ``--warmup`` included), then
2. jaxserve warm: the same command again on the folder the cold start filled.
3. Peers where installed (``--peers``): ``llama_cpp`` or ``llama_cpp_server``
   starts llama.cpp's server (``python -m llama_cpp.server``, the same GGUF,
   ``n_ctx`` 2,048, all cores: ``peers.spawn_llama_cpp_server``);
   ``hf`` loads the same file with ``AutoModelForCausalLM.from_pretrained(
   folder, gguf_file=name)`` (``peers.load_hf``: dequantized to f32) in a
   fresh Python process. A missing package is skipped with a line saying so.

Each is measured from the moment its process is spawned (Python and library
imports included, as a user sees it):

* ready_s: to gRPC health SERVING (polled every 50 ms on the port the
  server prints; with the default background warm-up, once its smallest
  decode and prefill steps are compiled); all_ready_s: to the line saying
  every step program is ready (RSS then too); llama.cpp's server: to its first ``GET /v1/models`` 200
  (polled every 50 ms); HF: to ``from_pretrained`` returning.
* programs compiled and loaded from the persistent cache, all of the start
  and the warm-up's alone: the server's start-up line
  (``compile_cache.StartupReport``, read back with ``parse_line``) and its
  warm-up line, which also splits the warm-up's seconds into tracing,
  lowering, compiling and loading (the rest ran the warm-up steps);
  ``/metrics`` is scraped as well (``jaxserve_startup_*``).
* RSS at ready: ``VmRSS`` of ``/proc/<pid>/status`` of the server process the
  moment it is ready, and of it and its child processes (jaxserve's
  tokenizer workers) together.
* first request: one short greedy completion (``PROMPT``, ``MAX_TOKENS``
  tokens) right after ready: time to the first token and to the end, ms
  (gRPC stream; llama.cpp: one non-streamed ``/v1/completions``; HF: one
  ``generate`` from ``len(HF_PROMPT_IDS)`` token ids).

The machine is named (``machine.describe``: ``lscpu``'s model name, its
AVX-512 and AMX flags, CPU count, memory) and ``result.json`` and
``report.md`` are written to the output folder by ``report.write``
(``machine.environment`` for the versions). The temporary cache folder is deleted at the end; its size after
the cold start is reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import httpx

from jaxserve.bench import machine, report, serving
from jaxserve.bench import peers as peers_mod
from jaxserve.bench.serving_options import OPTIONAL_FLAGS, SERVER_FLAGS, SPEC_FLAGS
from jaxserve.engine.compile_cache import parse_line, process_rss_bytes
from jaxserve.server.client import Client

PROMPT = "The capital of France is"
MAX_TOKENS = 8
HF_PROMPT_IDS = (1, 17, 42, 99, 150, 201)  # any ids inside the vocabulary (tiny ones: 256+)
LLAMA_CPP_N_CTX = 2048
POLL_S = 0.05
# The start-up targets for SmolLM2 (report only; nothing fails on them).
TARGETS = {"cold_ready_s": 30.0, "warm_ready_s": 5.0, "rss_gb": 1.5}

# ``jaxserve.main`` flags read by ``options_from_flags``.
FLAG_NAMES = tuple(dict.fromkeys(SERVER_FLAGS + SPEC_FLAGS + OPTIONAL_FLAGS
                                 + ("model", "peers", "warmup")))


@dataclasses.dataclass(frozen=True)
class StartupOptions:
    """What to start.

    Attributes:
      model: ``--model`` of the servers (alias, .gguf, HF folder).
      engine_flags: more ``jaxserve.main`` flags both jaxserve starts get.
      peers: names from ``peers.PEERS`` (``llama_cpp`` and ``llama_cpp_server``
        both mean llama.cpp's server; ``colocated`` does not apply).
      timeout_s: most seconds one start may take.
    """

    model: str = "smollm2-135m"
    engine_flags: tuple[str, ...] = ()
    peers: tuple[str, ...] = ("hf", "llama_cpp")
    timeout_s: float = 900.0


def options_from_flags(values: dict) -> StartupOptions:
    """``StartupOptions`` of ``jaxserve.main``'s flag values ({name: value}
    for every name of ``FLAG_NAMES``).

    Raises:
      ValueError: a bad peer name.
    """
    def args(names):  # absl takes --name=value for every kind, bools included
        return [f"--{n}={values[n]}" for n in names]
    flags = args(SERVER_FLAGS) + args(["warmup"])
    if values["speculative_method"] != "none":
        flags += args(SPEC_FLAGS)
    flags += args([n for n in OPTIONAL_FLAGS if values[n] is not None])
    return StartupOptions(model=values["model"], engine_flags=tuple(flags),
                          peers=tuple(peers_mod.parse_peers(values["peers"])))


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def tree_rss_bytes(pid: int) -> int | None:
    """RSS of ``pid`` and every process below it (``/proc/*/stat`` parents), bytes."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(c for c, parent in parents.items() if parent == p)
    sizes = [process_rss_bytes(p) for p in tree]
    return sum(s for s in sizes if s) if sizes[0] is not None else None


def _folder_size(path: str) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    n = size = 0
    for root, _, files in os.walk(path):
        for name in files:
            n += 1
            size += os.path.getsize(os.path.join(root, name))
    return n, size


# ---- jaxserve --------------------------------------------------------------------

def run_jaxserve(model: str, engine_flags, cache_dir: str, tag: str,
                 timeout_s: float = 900.0) -> dict:
    """Spawn ``--mode serve`` on ``cache_dir``, measure its start (see the
    module docstring), send the first request, stop it. Returns the figures.

    Raises:
      RuntimeError: it exited or was not SERVING within ``timeout_s`` (its
        last stderr lines in the message).
    """
    cmd = [sys.executable, "-m", "jaxserve.main", "--mode", "serve", "--port", "0",
           "--metrics_port", "0", "--model", model, f"--compilation_cache_dir={cache_dir}",
           *engine_flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    found: dict = {}
    serving_line = threading.Event()
    all_ready: list[float] = []  # when the warm-up's end line came

    def pump():
        for line in proc.stderr:
            lines.append(line)
            if re.match(r"jaxserve: compiled \d+ step shapes in", line):
                all_ready.append(time.monotonic() - t0)
            if m := re.match(r"jaxserve: gRPC on (\S+):(\d+) ", line):
                found["target"] = f"{m[1]}:{m[2]}"
                if u := re.search(r"metrics on (http://\S+/metrics)", line):
                    found["metrics"] = u[1]
            if line.startswith("jaxserve: serving"):
                serving_line.set()
    threading.Thread(target=pump, daemon=True).start()

    def check(what: str):
        if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
            serving.stop_server(proc)
            raise RuntimeError(f"jaxserve ({tag}) {what}: exit status {proc.returncode}; "
                               f"its last output:\n" + "".join(lines[-30:]))
    try:
        while "target" not in found:
            check("never bound its port")
            time.sleep(POLL_S)
        with Client(found["target"]) as client:
            while True:
                try:
                    if client.health(timeout=1.0) == "SERVING":
                        break
                except grpc.RpcError:
                    pass
                check("was not SERVING in time")
                time.sleep(POLL_S)
            ready_s = time.monotonic() - t0
            rss, rss_tree = process_rss_bytes(proc.pid), tree_rss_bytes(proc.pid)
            while not serving_line.wait(POLL_S):
                check("printed no start-up line")
            metrics = serving.scrape(found.get("metrics"))
            t1 = time.monotonic()
            first = None
            for r in client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                     timeout=timeout_s):
                if first is None and any(c.token_ids for c in r.completions):
                    first = time.monotonic()
            t2 = time.monotonic()
            while "--nowarmup" not in engine_flags and not all_ready:  # background warm-up
                check("never finished its warm-up")
                time.sleep(POLL_S)
            rss_all_ready = process_rss_bytes(proc.pid)
    finally:
        serving.stop_server(proc)
    text = "".join(lines)
    warm = re.search(r"compiled \d+ step shapes in ([\d.]+) s \(\d+ XLA programs traced: "
                     r"(\d+) loaded from cache, (\d+) compiled; seconds tracing ([\d.]+), "
                     r"lowering ([\d.]+), compiling ([\d.]+), loading ([\d.]+)", text)
    return {"ready_s": ready_s, "rss_bytes": rss, "rss_with_children_bytes": rss_tree,
            "startup_line": parse_line(text),
            "warmup_programs": None if warm is None else
            {"seconds": float(warm[1]), "loaded": int(warm[2]), "compiled": int(warm[3]),
             "trace_s": float(warm[4]), "lower_s": float(warm[5]),
             "compile_s": float(warm[6]), "load_s": float(warm[7])},
            "metrics": {k: v for k, v in metrics.items()
                        if k.startswith(("jaxserve_startup_", "jaxserve_process_resident"))},
            "all_ready_s": all_ready[0] if all_ready else None,
            "rss_all_ready_bytes": rss_all_ready,
            "first_request_ttft_ms": None if first is None else (first - t1) * 1e3,
            "first_request_e2e_ms": (t2 - t1) * 1e3, "exit_status": proc.returncode,
            "command": cmd}


# ---- peers -------------------------------------------------------------------------

def run_llama_cpp_server(gguf: str, timeout_s: float = 300.0) -> dict:
    """llama.cpp's server on ``gguf``: time to its first ``/v1/models``, RSS,
    one non-streamed completion."""
    t0 = time.monotonic()
    proc, base = peers_mod.spawn_llama_cpp_server(gguf, LLAMA_CPP_N_CTX, timeout_s=timeout_s,
                                                  poll_s=POLL_S)
    try:
        ready_s = time.monotonic() - t0
        rss, rss_tree = process_rss_bytes(proc.pid), tree_rss_bytes(proc.pid)
        t1 = time.monotonic()
        r = httpx.post(base + "/v1/completions", timeout=timeout_s,
                       json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0})
        e2e = (time.monotonic() - t1) * 1e3 if r.status_code == 200 else None
    finally:
        serving.stop_server(proc)
    return {"ready_s": ready_s, "rss_bytes": rss, "rss_with_children_bytes": rss_tree,
            "first_request_e2e_ms": e2e, "n_ctx": LLAMA_CPP_N_CTX}


_HF_SCRIPT = """
import json, sys, time
t0 = time.monotonic()
import torch
from jaxserve.bench.peers import load_hf
from jaxserve.engine.compile_cache import process_rss_bytes
t1 = time.monotonic()
model = load_hf(sys.argv[1])
t2 = time.monotonic()
rss = process_rss_bytes()
ids = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False, pad_token_id=0)
t3 = time.monotonic()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_bytes": rss,
                  "first_request_e2e_ms": (t3 - t2) * 1e3}))
"""


def run_hf_load(model_path: str, timeout_s: float = 600.0) -> dict:
    """HF transformers loading ``model_path`` in a fresh process: time from
    spawn to loaded, its import and load parts, RSS when loaded, one generate.

    Raises:
      RuntimeError: the process failed (its stderr tail in the message).
    """
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _HF_SCRIPT, str(model_path),
                        json.dumps(list(HF_PROMPT_IDS)), str(MAX_TOKENS)],
                       capture_output=True, text=True, timeout=timeout_s, check=False)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"HF load exited with status {p.returncode}:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # The spawn-to-loaded time: the wall less the generate that followed.
    out["ready_s"] = wall - out["first_request_e2e_ms"] / 1e3
    return out


# ---- the run -----------------------------------------------------------------------

def _gguf_of(model: str) -> str | None:
    """The .gguf file a model string names (an alias is fetched), None for a folder."""
    if os.path.isdir(model):
        return None
    if model.endswith(".gguf"):
        return model
    path = peers_mod.model_file(model)
    return path if path.endswith(".gguf") else None


def run(opts: StartupOptions, output_dir: str) -> tuple[dict, list[str]]:
    """The whole benchmark; returns the result and the paths written
    (``result.json``, ``report.md`` in ``output_dir``).

    Raises:
      RuntimeError: a jaxserve start failed.
      ValueError: the model cannot be resolved.
    """
    t0 = time.monotonic()
    gguf = _gguf_of(opts.model)  # fetches an alias now, not inside the timed start
    result = {"benchmark": "startup", "model": opts.model, "model_file": gguf,
              "engine_flags": list(opts.engine_flags), "prompt": PROMPT,
              "max_tokens": MAX_TOKENS, "machine": machine.describe(devices=False),
              "environment": machine.environment(), "engines": {}, "skipped": {}}
    cache = tempfile.mkdtemp(prefix="jaxserve-startup-xla-")
    try:
        for tag in ("cold", "warm"):
            _log(f"jaxserve {tag} start (compilation cache {cache})")
            result["engines"][f"jaxserve_{tag}"] = run_jaxserve(
                opts.model, opts.engine_flags, cache, tag, opts.timeout_s)
            if tag == "cold":
                files, size = _folder_size(cache)
                result["cache_after_cold"] = {"files": files, "bytes": size}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    wanted = set(opts.peers)
    if wanted & {"llama_cpp", "llama_cpp_server"}:
        why = peers_mod.available("llama_cpp_server")
        if why is None and gguf is None:
            why = f"{opts.model} is not a GGUF file"
        if why is None:
            _log("llama.cpp server start")
            result["engines"]["llama_cpp_server"] = run_llama_cpp_server(gguf, opts.timeout_s)
            result["engines"]["llama_cpp_server"]["version"] = \
                peers_mod.version("llama_cpp_server")
        else:
            result["skipped"]["llama_cpp_server"] = why
    if "hf" in wanted:
        why = peers_mod.available("hf")
        if why is None:
            _log("HF transformers load")
            result["engines"]["hf"] = run_hf_load(gguf or opts.model, opts.timeout_s)
            result["engines"]["hf"]["version"] = peers_mod.version("hf")
        else:
            result["skipped"]["hf"] = why
    if "colocated" in wanted:
        result["skipped"]["colocated"] = "a serving-benchmark peer; no start-up figure"
    for name, why in result["skipped"].items():
        _log(f"skipped {name}: {why}")
    result["wall_s"] = time.monotonic() - t0
    return result, report.write(output_dir, result, markdown)


# ---- the report --------------------------------------------------------------------

_LABELS = {"jaxserve_cold": "jaxserve `--mode serve`, empty XLA cache",
           "jaxserve_warm": "jaxserve `--mode serve` again, warm cache",
           "llama_cpp_server": "llama.cpp server (same GGUF)",
           "hf": "HF transformers `from_pretrained` (same GGUF, f32)"}


def _gb(v) -> str:
    return "-" if v is None else f"{v / 1e9:.2f} GB"


def _num(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    """The report: the machine, one row per engine, notes and skipped peers."""
    m = result["machine"]
    mem = f", {m['mem_total_bytes'] / 2**30:.0f} GiB" if m.get("mem_total_bytes") else ""
    flags = " ".join([f for f in m["avx_flags"] if f.startswith("avx512")]
                     + m["amx_flags"]) or "no AVX-512 or AMX flags"
    out = [f"# Start-up: {result['model']}", "",
           f"Machine: {m['cpu_model'] or '?'}, {m['cpu_count']} CPUs{mem}; {flags}.", "",
           "| engine | time to ready, s | every step program ready, s | programs at ready: "
           "compiled / loaded from cache | warm-up programs: compiled / loaded | RSS at ready "
           "(with children) | RSS, all ready | first request TTFT / E2E, ms |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in result["engines"].items():
        line, warm = e.get("startup_line"), e.get("warmup_programs")
        progs = f"{line['compiled']} / {line['loaded']}" if line else "-"
        wprogs = f"{warm['compiled']} / {warm['loaded']}" if warm else "-"
        rss = _gb(e.get("rss_bytes"))
        if e.get("rss_with_children_bytes") not in (None, e.get("rss_bytes")):
            rss += f" ({_gb(e['rss_with_children_bytes'])})"
        first = f"{_num(e.get('first_request_ttft_ms'), '{:.0f}')} / " \
                f"{_num(e.get('first_request_e2e_ms'), '{:.0f}')}"
        out.append(f"| {_LABELS.get(name, name)} | {_num(e['ready_s'])} | "
                   f"{_num(e.get('all_ready_s'))} | {progs} | {wprogs} | {rss} | "
                   f"{_gb(e.get('rss_all_ready_bytes'))} | {first} |")
    out += ["", f"Time to ready counts from the process's spawn (imports included): jaxserve to "
            f"gRPC health SERVING (with a background warm-up, once its smallest decode and "
            f"prefill steps exist; 'every step program ready' is when the rest are), "
            f"llama.cpp's server to its first /v1/models answer, HF to "
            f"from_pretrained returning. First request: {result['max_tokens']} greedy tokens "
            f"after {result['prompt']!r} (HF: from {len(HF_PROMPT_IDS)} token ids). Engine "
            f"flags: {' '.join(result['engine_flags']) or 'defaults'}."]
    if c := result.get("cache_after_cold"):
        out.append(f"The cold start wrote {c['files']} files, {c['bytes'] / 1e6:.1f} MB, to the "
                   f"compilation cache.")
    for name in ("jaxserve_cold", "jaxserve_warm"):
        w = result["engines"].get(name, {}).get("warmup_programs")
        if w:
            rest = w["seconds"] - w["trace_s"] - w["lower_s"] - w["compile_s"] - w["load_s"]
            out.append(f"{_LABELS[name]}: warm-up {w['seconds']:.1f} s: tracing "
                       f"{w['trace_s']:.1f}, lowering {w['lower_s']:.1f}, compiling "
                       f"{w['compile_s']:.1f}, loading {w['load_s']:.1f}, the rest "
                       f"(building plans; beside a background warm-up, serving) {rest:.1f}.")
    if hf := result["engines"].get("hf"):
        out.append(f"HF: {hf['import_s']:.1f} s importing torch and transformers, "
                   f"{hf['load_s']:.1f} s in from_pretrained.")
    cold, warm = result["engines"].get("jaxserve_cold"), result["engines"].get("jaxserve_warm")
    if result["model"] == "smollm2-135m" and cold and warm:
        rss = [e["rss_bytes"] / 1e9 for e in (cold, warm) if e["rss_bytes"] is not None]
        checks = [("cold to SERVING", cold["ready_s"], TARGETS["cold_ready_s"], "s"),
                  ("warm to SERVING", warm["ready_s"], TARGETS["warm_ready_s"], "s"),
                  ("RSS at SERVING", max(rss) if rss else None, TARGETS["rss_gb"], "GB")]
        out += ["", "Start-up targets: " + "; ".join(
            f"{what} {_num(v)} {unit} (<= {limit:g} {unit}: "
            f"{'met' if v is not None and v <= limit else 'not met'})"
            for what, v, limit, unit in checks) + "."]
    for name, why in result["skipped"].items():
        out.append(f"Skipped {_LABELS.get(name, name)}: {why}.")
    return "\n".join(out) + "\n"


__all__ = ["FLAG_NAMES", "StartupOptions", "markdown", "options_from_flags", "run",
           "run_hf_load", "run_jaxserve", "run_llama_cpp_server", "tree_rss_bytes"]
