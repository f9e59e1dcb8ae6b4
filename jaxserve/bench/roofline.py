"""Per-phase roofline: FLOPs and bytes of each engine step from the model
config, against the device's measured (or given) ceilings.

Counting (per step; T = tokens computed in the step, S = sequences in it):

* **FLOPs** (multiply-add = 2): the matmuls only; norms, RoPE, softmax and
  sampling are left out (a few % at most).
  - projections, per layer and token: ``2 * D * (N*H + 2*K*H)`` (q, k, v)
    ``+ 2 * N*H * D`` (o) ``+ 3 * 2 * D * F`` (gated MLP gate, up, down); an MoE
    layer has ``2 * D * E`` (router) ``+ k * 3 * 2 * D * F_e`` instead of the
    MLP;
  - attention, per layer and visible (query, key) pair: ``4 * N * H``
    (``q @ k`` and ``p @ v``); a sequence computing ``q`` new tokens on top of
    ``c`` cached ones has ``sum_{i=1..q} min(c + i, W)`` pairs (W the layer's
    sliding window, ``ModelConfig.layer_window``, else unbounded: Gemma 3
    mixes both kinds): causal, padding not counted;
  - LM head: ``2 * D * V`` per sequence (the engine computes logits only for
    each sequence's last token).
* **Bytes moved**: every weight once per step (projections, norms, the LM
  head's ``D * V``; the embedding lookup reads ``T * D``; an MoE layer reads
  the router and the experts the step's tokens are expected to touch,
  ``E * (1 - (1 - k/E)^T)``, uniform routing) at the parameter dtype's size;
  the KV cache read ``min(kv_len, q + W - 1)`` positions per sequence and
  layer (all of them without a window), ``2 * K * H`` values each, and the
  ``T`` new positions written, at the cache dtype's size. Activations are left
  out (small next to the weights at decode; prefill is compute-bound anyway).

A step is ``decode`` (every row one new token), ``prefill`` (no decode row)
or ``mixed``. For each phase: achieved FLOP/s and bytes/s over the steps'
wall time, MFU = achieved FLOP/s / peak FLOP/s, MBU = achieved bytes/s /
peak bytes/s; the phase is called ``compute``-bound when MFU >= MBU, else
``bandwidth``-bound. The arithmetic intensity (FLOP/byte) and the device's
ridge point (peak FLOP/s / peak bytes/s) are reported beside it.

Ceilings (``measure_ceilings``): a large square matmul in the model dtype
(``2 n^3`` FLOPs) and a large elementwise ``x + 1`` done in place (donated;
reads and writes the array: ``2 * nbytes``), median of a few timed runs after
a warm-up; or given.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from pallas_kernels.bench import median_time


@dataclasses.dataclass
class StepRecord:
    """One engine step as the bench saw it.

    Attributes:
      start: when the step started, s since the level began.
      seconds: its wall time (the runner's ``execute``: metadata, the jitted
        step, sampling and the copy back to the host), s.
      q_lens: new tokens per sequence, decode rows first.
      kv_lens: tokens in each sequence's cache after the step.
      num_decode: leading rows with one new token each.
      compiled: XLA compiled something during the step (its time is not
        representative; such steps are left out of the roofline).
    """

    start: float
    seconds: float
    q_lens: list[int]
    kv_lens: list[int]
    num_decode: int
    compiled: bool = False

    @property
    def phase(self) -> str:
        if self.num_decode == len(self.q_lens):
            return "decode"
        return "prefill" if self.num_decode == 0 else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Device peaks: FLOP/s and bytes/s, and where they came from."""

    flops_per_s: float
    bytes_per_s: float
    source: str

    @property
    def ridge(self) -> float:
        """FLOP/byte where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s


def _moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.num_experts > 0 and layer not in cfg.mlp_only_layers


def attention_pairs(q_len: int, kv_len: int, window: int | None = None) -> int:
    """Visible (query, key) pairs of ``q_len`` new tokens ending at ``kv_len``,
    causal, with an optional sliding window W (query at position p sees
    ``min(p + 1, W)`` keys)."""
    c = kv_len - q_len
    if window is None:
        return q_len * c + q_len * (q_len + 1) // 2
    return sum(min(c + i, window) for i in range(1, q_len + 1))


def step_flops(cfg: ModelConfig, q_lens, kv_lens) -> float:
    """FLOPs of one step (see the module docstring)."""
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = sum(q_lens)
    pairs = {w: sum(attention_pairs(q, kv, w) for q, kv in zip(q_lens, kv_lens))
             for w in {cfg.layer_window(i) for i in range(cfg.num_layers)}}
    flops = 0.0
    for layer in range(cfg.num_layers):
        flops += (2 * T * (D * (N * H + 2 * K * H) + N * H * D)
                  + 4 * N * H * pairs[cfg.layer_window(layer)])
        if _moe_layer(cfg, layer):
            flops += 2 * T * (D * cfg.num_experts
                              + cfg.num_experts_per_tok * 3 * D * cfg.moe_intermediate_size)
        else:
            flops += 2 * T * 3 * D * cfg.intermediate_size
    return flops + 2 * D * cfg.vocab_size * len(q_lens)


def step_bytes(cfg: ModelConfig, q_lens, kv_lens, param_bytes: int, kv_bytes: int) -> dict:
    """Bytes one step moves: {"weights", "kv_read", "kv_written", "total"}.

    Args:
      param_bytes: bytes per parameter (4 for f32, 2 for bf16).
      kv_bytes: bytes per KV cache element.
    """
    D, N, K, H, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.vocab_size)
    T = sum(q_lens)
    attn = D * (N * H + 2 * K * H) + N * H * D + 2 * D  # q, k, v, o, two norms
    if cfg.attention_bias:
        attn += N * H + 2 * K * H
    if cfg.attention_out_bias:
        attn += D
    if cfg.qk_norm:
        attn += 2 * H
    if cfg.architecture == "gemma3":  # two more norms per block
        attn += 2 * D
    params = 0.0
    for layer in range(cfg.num_layers):
        params += attn
        if _moe_layer(cfg, layer):
            E, k = cfg.num_experts, cfg.num_experts_per_tok
            touched = E * (1 - (1 - k / E) ** T)
            params += D * E + touched * 3 * D * cfg.moe_intermediate_size
        else:
            params += 3 * D * cfg.intermediate_size
    params += D + D * V + T * D  # final norm, LM head, embedding rows looked up
    read_pos = 0  # positions read, summed over layers (a sliding layer reads its window)
    for layer in range(cfg.num_layers):
        W = cfg.layer_window(layer)
        read_pos += sum(kv if W is None else min(kv, q + W - 1) for q, kv in zip(q_lens, kv_lens))
    per_pos = 2 * K * H * kv_bytes
    out = {"weights": params * param_bytes, "kv_read": float(read_pos * per_pos),
           "kv_written": float(T * per_pos * cfg.num_layers)}
    out["total"] = out["weights"] + out["kv_read"] + out["kv_written"]
    return out


def measure_ceilings(dtype: str, *, matmul_n: int | None = None, copy_mib: int | None = None,
                     iters: int = 3, device=None) -> Ceilings:
    """Peak FLOP/s (``n x n @ n x n`` in ``dtype``) and bytes/s (``x + 1`` over
    ``copy_mib`` MiB) of ``device`` (default the first). Sizes default to
    8192 / 4096 MiB on GPU and TPU, 2048 / 256 MiB on CPU."""
    device = device or jax.devices()[0]
    big = device.platform in ("gpu", "cuda", "rocm", "tpu")
    n = matmul_n or (8192 if big else 2048)
    mib = copy_mib or (4096 if big else 256)
    dt = jnp.dtype(dtype)
    with jax.default_device(device):
        a = jnp.ones((n, n), dt)
        mm = jax.jit(lambda x, y: x @ y)
        flops = 2 * n ** 3 / median_time(mm, a, a, iters=iters, warmup=1)
        del a
        # In place (donated): a fresh output buffer each call would time the
        # allocator's page faults, not the memory.
        add = jax.jit(lambda v: v + 1, donate_argnums=0)
        state = [jnp.ones(((mib << 20) // dt.itemsize,), dt)]
        nbytes = state[0].nbytes

        def step():
            state[0] = add(state[0])
            return state[0]
        bw = 2 * nbytes / median_time(step, iters=iters, warmup=1)
        state.clear()
    return Ceilings(flops, bw, f"measured on {device.device_kind}: {n}x{n} {dt.name} matmul, "
                               f"{mib} MiB x + 1 in place (read + write)")


def analyze(steps: list[StepRecord], cfg: ModelConfig, ceilings: Ceilings, *,
            param_bytes: int, kv_bytes: int) -> dict:
    """Per-phase roofline figures of ``steps`` (compiling steps left out).

    Returns:
      {phase: {"steps", "seconds", "tokens", "tokens_per_step", "ms_per_step",
      "flops_per_step", "bytes_per_step", "weight_bytes_per_step",
      "kv_bytes_per_step", "flops_per_s", "bytes_per_s", "intensity", "mfu",
      "mbu", "bound"}, and "warning" when MFU or MBU exceeds 100%} for each
      phase that ran, plus "points": one per
      (phase, batch rows or token bucket) group with its median step (its
      FLOPs, bytes and time each the median): {"phase", "group", "steps",
      "ms", "intensity", "flops_per_s", "bytes_per_s", "mfu", "mbu", "bound"}.
    """
    out: dict = {}
    points: dict = {}
    for s in steps:
        if s.compiled or s.seconds <= 0:
            continue
        f = step_flops(cfg, s.q_lens, s.kv_lens)
        b = step_bytes(cfg, s.q_lens, s.kv_lens, param_bytes, kv_bytes)
        p = out.setdefault(s.phase, {"steps": 0, "seconds": 0.0, "tokens": 0, "flops": 0.0,
                                     "bytes": 0.0, "weight_bytes": 0.0, "kv_bytes": 0.0})
        p["steps"] += 1
        p["seconds"] += s.seconds
        p["tokens"] += s.num_tokens
        p["flops"] += f
        p["bytes"] += b["total"]
        p["weight_bytes"] += b["weights"]
        p["kv_bytes"] += b["kv_read"] + b["kv_written"]
        # Decode groups by batch rows; prefill and mixed by a power-of-two token bucket.
        group = len(s.q_lens) if s.phase == "decode" else 1 << (s.num_tokens - 1).bit_length()
        points.setdefault((s.phase, group), []).append((s.seconds, f, b["total"]))
    for p in out.values():
        n, sec = p["steps"], p["seconds"]
        p.update(tokens_per_step=p["tokens"] / n, ms_per_step=1e3 * sec / n,
                 flops_per_step=p.pop("flops") / n, bytes_per_step=p.pop("bytes") / n,
                 weight_bytes_per_step=p.pop("weight_bytes") / n,
                 kv_bytes_per_step=p.pop("kv_bytes") / n)
        p["flops_per_s"] = p["flops_per_step"] * n / sec
        p["bytes_per_s"] = p["bytes_per_step"] * n / sec
        p["intensity"] = p["flops_per_step"] / p["bytes_per_step"]
        p["mfu"] = p["flops_per_s"] / ceilings.flops_per_s
        p["mbu"] = p["bytes_per_s"] / ceilings.bytes_per_s
        p["bound"] = "compute" if p["mfu"] >= p["mbu"] else "bandwidth"
        if max(p["mfu"], p["mbu"]) > 1.0:
            # Above a roof: the ceiling is too low (measured on a busy machine,
            # or the copy kernel is slower than the model's reads) or given wrong.
            p["warning"] = (f"achieved {'MFU' if p['mfu'] > 1 else 'MBU'} above 100%: the "
                            f"ceiling ({ceilings.source}) is below what the step reached; "
                            "measure on an idle device or give --peak_tflops/--peak_gbps")
    pts = []
    for (phase, group), xs in sorted(points.items()):
        sec = float(np.median([x[0] for x in xs]))
        f = float(np.median([x[1] for x in xs]))
        b = float(np.median([x[2] for x in xs]))
        mfu, mbu = f / sec / ceilings.flops_per_s, b / sec / ceilings.bytes_per_s
        pts.append({"phase": phase, "group": group, "steps": len(xs), "ms": 1e3 * sec,
                    "intensity": f / b, "flops_per_s": f / sec, "bytes_per_s": b / sec,
                    "mfu": mfu, "mbu": mbu, "bound": "compute" if mfu >= mbu else "bandwidth"})
    out["points"] = pts
    out["ceilings"] = {"flops_per_s": ceilings.flops_per_s, "bytes_per_s": ceilings.bytes_per_s,
                       "ridge_flop_per_byte": ceilings.ridge, "source": ceilings.source}
    return out
