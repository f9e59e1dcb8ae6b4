"""What a serving-benchmark run is asked to do: ``BenchOptions`` (checked
in ``__post_init__``, so a bad option fails before any model loads), the
concurrency-level list, and the flags of ``jaxserve.main`` that make them
(``options_from_flags``: ``python -m jaxserve.main --mode bench --workload W``
and ``python -m jaxserve.bench serve``), with the engine flags a spawned
server gets passed on as given.

``scale`` defaults to 1 on GPU and TPU and to ``CPU_SCALE`` (0.2) on CPU,
where the named shapes at full length would take far longer than the 10
minutes a CPU run is meant to take (``run_scale``); the report says which
scale ran.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.bench import peers as peers_mod
from jaxserve.bench import serving_lora, stats
from jaxserve.bench.workloads import WORKLOADS

CPU_SCALE = 0.2


def parse_levels(spec: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> (1, 8, 32).

    Raises:
      ValueError: empty, or an entry that is not an integer >= 1.
    """
    try:
        levels = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency wants a comma list of integers >= 1, got {spec!r}")
    return levels


@dataclasses.dataclass
class BenchOptions:
    """What to run; see the module docstring.

    Attributes:
      workload: one of ``workloads.WORKLOADS``.
      concurrency: levels, most requests in flight.
      request_rate: open-loop Poisson rate, requests/s; inf = closed loop.
      num_prompts: requests per level; None = max(4, C).
      slo: ``stats.parse_slo`` output, for goodput.
      peers: names from ``peers.PEERS``; missing packages are skipped, said so.
      backend: ``"inprocess"``, ``"grpc"`` or ``"openai"`` (a jaxserve server
        is spawned unless ``target`` is given).
      target: grpc: ``host:port`` of a running server; openai: the base URL
        (``http://host:port``) of a running OpenAI-compatible server.
      api_key: bearer token for ``target`` (openai).
      scale: prompt and output length multiplier; None = 1, or 0.2 on CPU.
      seed: requests and arrivals.
      warmup: run the sweep once untimed first.
      peak_flops, peak_bytes: device ceilings, FLOP/s and bytes/s; None = measure.
      model, dtype: what the engine runs (for the peers, the report, the server).
      quantization, kv_cache_dtype: its weight format and KV cache dtype (the
        in-process result takes them from the engine itself).
      engine_flags: ``jaxserve.main`` flags for a spawned server.
      role: ``"both"``, or ``"decode"``: the grpc backend drives a
        disaggregated pair (``jaxserve.disagg``): spawned, a prefill worker
        and a decode worker on half the CPUs each, or ``target`` (a decode
        worker); the ``colocated`` peer runs the same engine flags with
        prefill and decode in one server on all the CPUs.
      disagg_flags: ``jaxserve.main`` flags both spawned workers get.
      lora_mix: ``--lora_mix``: adapter names among ``lora_modules``, or
        ``random:N`` (``serving_lora``); None: the base alone.
      lora_modules: the names registered with ``--lora_modules``.
      max_lora_rank: the rank of ``random:N``'s adapters.
    """

    workload: str = "mixed"
    concurrency: tuple[int, ...] = (1, 8, 32)
    request_rate: float = math.inf
    num_prompts: int | None = None
    slo: dict = dataclasses.field(default_factory=dict)
    peers: tuple[str, ...] = ("hf", "llama_cpp")
    backend: str = "inprocess"
    target: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
    scale: float | None = None
    seed: int = 0
    warmup: bool = True
    peak_flops: float | None = None
    peak_bytes: float | None = None
    model: str = "smollm2-135m"
    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    engine_flags: tuple[str, ...] = ()
    role: str = "both"
    disagg_flags: tuple[str, ...] = ()
    lora_mix: str | None = None
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 16

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request_rate must be > 0 (inf: closed loop), "
                             f"got {self.request_rate}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num_prompts must be >= 1, got {self.num_prompts}")
        if self.backend not in ("inprocess", "grpc", "openai"):
            raise ValueError(f"--backend must be inprocess, grpc or openai, got "
                             f"{self.backend!r}")
        if self.target is not None and self.backend == "inprocess":
            raise ValueError("--target needs --backend grpc (host:port) or openai (a URL)")
        if self.target is not None and self.backend == "openai" and \
                not self.target.startswith(("http://", "https://")):
            raise ValueError(f"--target for --backend openai is a URL such as "
                             f"http://127.0.0.1:8000, got {self.target!r}")
        if self.role not in ("both", "decode"):
            raise ValueError(f"--role for a benchmark must be both or decode (drive a "
                             f"disaggregated pair), got {self.role!r}")
        if self.role == "decode" and self.backend != "grpc":
            raise ValueError("--role decode benchmarks a disaggregated pair over gRPC: "
                             "add --backend grpc")
        if "colocated" in self.peers and self.backend != "grpc":
            raise ValueError("the colocated peer is a spawned gRPC server: add --backend grpc")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        for name, v in (("peak_flops", self.peak_flops), ("peak_bytes", self.peak_bytes)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        peers_mod.parse_peers(",".join(self.peers))
        self._check_lora_mix()

    def _check_lora_mix(self):
        names, n_random = serving_lora.parse_lora_mix(self.lora_mix)
        if not names and not n_random:
            return
        if self.peers:
            raise ValueError(f"--lora_mix runs jaxserve alone: the peers ({', '.join(self.peers)})"
                             " serve no adapters; add --peers=none")
        # A running --target has its own adapters: the server checks the names.
        bad = [n for n in names if n not in self.lora_modules and self.target is None]
        if bad:
            known = ", ".join(self.lora_modules) or "none"
            raise ValueError(f"--lora_mix names adapter(s) {', '.join(bad)} not registered with "
                             f"--lora_modules (registered: {known})")
        if n_random and self.target is not None:
            raise ValueError("--lora_mix random:N writes its adapters for a spawned server; "
                             "with --target, name adapters the server has registered")
        if self.role != "both":
            raise ValueError("--lora_mix with --role decode is not supported")

    def lora_names(self) -> list[str]:
        """The adapters of the mix, in round-robin order ([] without ``--lora_mix``)."""
        names, n_random = serving_lora.parse_lora_mix(self.lora_mix)
        return list(names) or serving_lora.random_names(n_random)

    def prompts_per_level(self) -> list[int]:
        return [self.num_prompts or max(4, c) for c in self.concurrency]


# ``jaxserve.main`` flags a spawned server gets as given (with their values),
# and the speculation flags it gets when --speculative_method is not none.
SERVER_FLAGS = ("dtype", "page_size", "kv_cache_mib", "max_num_seqs", "max_num_batched_tokens",
                "enable_prefix_caching", "enable_chunked_prefill", "quantization",
                "quantization_group_size", "quantize_lm_head", "kv_cache_dtype")
SPEC_FLAGS = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min",
              "prompt_lookup_max", "draft_quantization", "speculative_adaptive")
OPTIONAL_FLAGS = ("num_pages", "max_model_len", "mesh", "num_devices", "seed", "draft_model")
BENCH_FLAGS = ("workload", "concurrency", "request_rate", "num_prompts", "slo", "peers",
               "backend", "target", "scale", "seed", "warmup", "peak_tflops", "peak_gbps",
               "model", "role", "lora_mix", "lora_modules", "enable_lora", "max_loras",
               "max_lora_rank")
DISAGG_FLAGS = ("disagg_min_prefill_tokens", "disagg_max_cached_ratio", "kv_lease_s")
FLAG_NAMES = tuple(dict.fromkeys(SERVER_FLAGS + SPEC_FLAGS + OPTIONAL_FLAGS + BENCH_FLAGS
                                 + DISAGG_FLAGS))


def options_from_flags(values: dict, api_key: str | None = None) -> BenchOptions:
    """``BenchOptions`` of ``jaxserve.main``'s flag values ({name: value} for
    every name of ``FLAG_NAMES``), with the flags a spawned server gets.

    Raises:
      ValueError: a bad level list, SLO, peer name or option.
    """
    def server_args(names):  # absl takes --name=value for every kind, bools included
        return [f"--{n}={values[n]}" for n in names]
    flag_args = server_args(SERVER_FLAGS)
    if values["speculative_method"] != "none":
        flag_args += server_args(SPEC_FLAGS)
    flag_args += server_args([n for n in OPTIONAL_FLAGS if values[n] is not None])
    modules = list(values["lora_modules"] or [])
    if values["enable_lora"] or modules or values["lora_mix"]:
        flag_args += ["--enable_lora=True"] + server_args(["max_loras", "max_lora_rank"])
        if modules:  # a list flag: one comma list
            flag_args.append("--lora_modules=" + ",".join(modules))
    return BenchOptions(
        workload=values["workload"], concurrency=parse_levels(values["concurrency"]),
        request_rate=values["request_rate"], num_prompts=values["num_prompts"],
        slo=stats.parse_slo(values["slo"]), peers=tuple(peers_mod.parse_peers(values["peers"])),
        backend=values["backend"], target=values["target"], api_key=api_key,
        scale=values["scale"], seed=values["seed"] or 0, warmup=values["warmup"],
        peak_flops=values["peak_tflops"] * 1e12 if values["peak_tflops"] else None,
        peak_bytes=values["peak_gbps"] * 1e9 if values["peak_gbps"] else None,
        model=values["model"], dtype=values["dtype"], quantization=values["quantization"],
        kv_cache_dtype=values["kv_cache_dtype"], engine_flags=tuple(flag_args),
        role=values["role"], disagg_flags=tuple(server_args(DISAGG_FLAGS)),
        lora_mix=values["lora_mix"], max_lora_rank=values["max_lora_rank"],
        lora_modules=tuple(m.partition("=")[0].strip() for m in modules))


def run_scale(opts: BenchOptions, platform: str) -> float:
    """``opts.scale``, else 1, or ``CPU_SCALE`` on a CPU ``platform``."""
    if opts.scale is not None:
        return opts.scale
    return CPU_SCALE if platform == "cpu" else 1.0
