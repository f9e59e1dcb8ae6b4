"""The serving benchmark with a mix of LoRA adapters (``--lora_mix``): every
level run twice, the base alone and with each request given an adapter
round-robin, and the two passes' output tok/s side by side.

- ``--lora_mix a,b,c``: adapters registered with ``--lora_modules``;
  ``--lora_mix random:N``: N random adapters of rank ``--max_lora_rank``
  (``lora.write_random_adapter``, seeds 0..N-1, all seven projections)
  written into a temporary folder and registered as ``random0..``
  (in-process: ``Engine.add_lora``; a spawned server: its ``--lora_modules``).
- How a request names its adapter: in-process ``Engine.add_request(...,
  lora=name)``, gRPC ``GenerateRequest.lora_name``, OpenAI HTTP the
  ``model`` field (``BenchRequest.lora``).
- Per level, in alternation: the base pass (the level's figures, as without
  ``--lora_mix``), then the mix pass on the same requests; the level's
  ``lora_mix`` entry holds both output tok/s, mix / base, and the adapter
  slot swaps during the mix pass (in-process ``Engine.lora_stats()``;
  over gRPC/HTTP ``jaxserve_lora_swaps_total`` of the server's metrics page,
  None without one).
- The mix pass reuses none of the base pass's KV pages even where the
  prefix cache is not emptied (a server): an adapter's pages hash from its
  own root. The roofline counts the base passes only; in-process the mix
  pass's XLA compilations are in its entry.
- Peers serve no adapters: ``--lora_mix`` with peers is refused.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from jaxserve.bench.workloads import BenchRequest

RANDOM_PREFIX = "random"


def parse_lora_mix(spec: str | None) -> tuple[tuple[str, ...], int]:
    """``"a,b"`` -> (("a", "b"), 0); ``"random:3"`` -> ((), 3); None/"" -> ((), 0).

    Raises:
      ValueError: an empty list, ``random:`` without an integer >= 1, or a
        name given twice.
    """
    if not spec:
        return (), 0
    spec = spec.strip()
    if spec.startswith("random:"):
        try:
            n = int(spec[len("random:"):])
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--lora_mix random:N wants an integer N >= 1, got {spec!r}")
        return (), n
    names = tuple(x.strip() for x in spec.split(",") if x.strip())
    if not names:
        raise ValueError(f"--lora_mix wants adapter names or random:N, got {spec!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"--lora_mix names an adapter twice: {spec!r}")
    return names, 0


def random_names(n: int) -> list[str]:
    return [f"{RANDOM_PREFIX}{i}" for i in range(n)]


def write_random(model_config, n: int, rank: int) -> list[tuple[str, str]]:
    """Write ``n`` random PEFT adapters of ``rank`` for ``model_config`` into a
    new temporary folder; returns (name, folder) pairs (``random0``, ...)."""
    from jaxserve.bench.lora import write_random_adapter
    tmp = tempfile.mkdtemp(prefix="jaxserve-lora-mix-")
    return [(name, write_random_adapter(os.path.join(tmp, name), model_config, rank, seed=i))
            for i, name in enumerate(random_names(n))]


def assign(requests: list[BenchRequest], names) -> list[BenchRequest]:
    """The same requests, request ``i`` given adapter ``names[i % len(names)]``."""
    return [dataclasses.replace(r, lora=names[i % len(names)]) for i, r in enumerate(requests)]


def engine_swaps(engine) -> int | None:
    """Adapter slot swaps so far of an in-process engine (None: LoRA off)."""
    stats = engine.lora_stats()
    return None if stats is None else stats["swaps"]


def pair_dict(base_summary: dict, mix_summary: dict, swaps: int | None) -> dict:
    """A level's ``lora_mix`` entry: both passes' output tok/s, mix / base,
    the slot swaps of the mix pass, and the mix pass's ``stats.summarize``."""
    b, m = base_summary["output_throughput"], mix_summary["output_throughput"]
    return {"base_output_tok_s": b, "mix_output_tok_s": m,
            "ratio": m / b if b else None, "swaps": swaps, "mix_summary": mix_summary}


def markdown(result: dict) -> list[str]:
    """The report's section (no lines without ``--lora_mix``)."""
    mix = result.get("lora_mix")
    if not mix:
        return []
    env = result["env"]
    where = f"{', '.join(env.get('devices') or []) or '?'}, {env.get('cpu_count')} CPUs"
    slots = f", {mix['max_loras']} slots" if mix.get("max_loras") else ""
    lines = [f"## LoRA adapter mix ({where})", "",
             f"Each request given an adapter round-robin over {len(mix['adapters'])} "
             f"({', '.join(mix['adapters'])}; {mix['source']}{slots}), against the same "
             "requests on the base alone; the two passes alternated per level (base, then "
             "mix). Slot swaps: adapters written into a device slot during the mix pass.", "",
             "| concurrency | base output tok/s | mix output tok/s | mix / base | slot swaps |",
             "|---|---|---|---|---|"]
    for lv in result["levels"]:
        p = lv.get("lora_mix")
        if not p:
            continue
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.2f}x"
        swaps = "-" if p["swaps"] is None else str(p["swaps"])
        lines.append(f"| {lv['concurrency']} | {p['base_output_tok_s']:.1f} | "
                     f"{p['mix_output_tok_s']:.1f} | {ratio} | {swaps} |")
    return lines + [""]


def spawn_flags(opts) -> tuple[str, ...]:
    """``opts.engine_flags`` for a spawned server: with ``random:N``, the N
    adapters written (for ``opts.model``'s config, rank ``opts.max_lora_rank``)
    and added to its ``--lora_modules``."""
    _, n = parse_lora_mix(opts.lora_mix)
    if not n:
        return opts.engine_flags
    from checkpoints.loader import load_model_config
    pairs = write_random(load_model_config(opts.model), n, opts.max_lora_rank)
    key = "--lora_modules="
    old = [f[len(key):] for f in opts.engine_flags if f.startswith(key)]
    return tuple(f for f in opts.engine_flags if not f.startswith(key)) + (
        key + ",".join(old + [f"{name}={path}" for name, path in pairs]),)


def metric_swaps(metrics_url: str | None) -> float | None:
    """``jaxserve_lora_swaps_total`` of a server's metrics page (None: no page)."""
    from jaxserve.bench.serving import scrape
    return scrape(metrics_url).get("jaxserve_lora_swaps_total") if metrics_url else None


def swaps_between(a: float | None, b: float | None) -> int | None:
    return None if a is None or b is None else int(b - a)


def result_entry(opts, rank: int | None, max_loras: int | None) -> dict:
    """The result's top-level ``lora_mix``: the adapters, where they came
    from, the slots (``max_loras``) and their rank (None: not known here)."""
    _, n = parse_lora_mix(opts.lora_mix)
    source = (f"random: {n} adapters of rank {rank} on all seven projections "
              "(lora.write_random_adapter)" if n else "registered with --lora_modules")
    return {"spec": opts.lora_mix, "adapters": opts.lora_names(), "source": source,
            "rank": rank, "max_loras": max_loras}
