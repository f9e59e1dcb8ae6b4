"""Quantized KV pages: int8 and fp8 (e4m3) K/V with one f32 scale per token per kv head.

Dimension letters: T tokens, P pages, L page size, K kv heads, H head dim.

Layout. One layer's K (or V) cache is a ``KVPages``: ``pages_PLKH`` [P, L, K, H]
in the cache dtype and, for the quantized dtypes, ``scales_PLK`` f32[P, L, K]
beside it (same page and offset indices, one scale per token per kv head);
``scales_PLK`` is None for float32 / bfloat16 / float16 pages, so those
caches are the plain arrays they always were and compile the same.

Quantization (``quantize``, done by ``kernel.write_kv`` as it writes a
step's tokens): symmetric, per token and kv head, over the head dim,
``scale = amax_H |x| / qmax`` and ``q = x / scale`` (int8: rounded to
nearest and clipped to [-127, 127]; fp8: clipped to [-448, 448], then
cast, round-to-nearest-even). Dequantization is ``q * scale`` in f32
(``dequantize``), done by every attention lowering on the page block it has
gathered, so no dequantized copy of the cache ever exists. A token's K/V is
quantized once, when written, and never requantized: prefix-cache hits and
shared pages read back exactly the bytes another request wrote.

* ``int8``: qmax = 127; the round trip errs by at most ``scale / 2`` per
  element (plus f32 rounding).
* ``float8_e4m3fn``: qmax = 448 (the largest finite e4m3fn). fp8 keeps the
  same per-token scale as int8 (its 3 mantissa bits err by up to 2^-4
  relative either way, but without the scale a K or V row whose values sit
  far from 1 loses its small entries to fp8's subnormals, and keys past 448
  overflow to NaN); the scale costs 4 bytes per 64-byte token row at H = 64.

Bytes per token per layer, K and V: ``2 * K * (H * itemsize + 4)`` when
quantized, ``2 * K * H * itemsize`` otherwise. At SmolLM2's K = 3, H = 64:
f32 1,536, bf16 768, int8 / fp8 408; so a fixed budget holds 256 / 68 =
3.76x the pages of f32 and 128 / 68 = 1.88x the pages of bf16.

Where fp8 works (``fp8_kv_supported``): XLA:CPU converts f8e4m3fn in
software (round-to-nearest-even, checked against ``ml_dtypes`` by the
tests), slowly but exactly; CUDA GPUs of compute capability >= 8.9 (Ada,
Hopper, Blackwell) have e4m3 conversion in hardware; TPUs from v5p on
(v5p, v6e, 7x) handle it, older ones (v2-v4, v5e "v5 lite") do not; ROCm
GPUs use the e4m3fnuz variant, not e4m3fn, and are refused.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp

QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    """True for the KV dtypes stored with scales (int8, float8_e4m3fn)."""
    return jnp.dtype(dtype) in QUANT_MAX


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """One layer's K (or V) paged cache, a pytree.

    Attributes:
      pages_PLKH: [P, L, K, H] in the cache dtype.
      scales_PLK: f32[P, L, K] per-token, per-kv-head scales of int8/fp8
        pages; None for unquantized dtypes (then the pytree has one leaf).
    """

    pages_PLKH: jax.Array
    scales_PLK: jax.Array | None = None

    @property
    def dtype(self):
        """The pages' dtype."""
        return self.pages_PLKH.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The pages' shape [P, L, K, H]."""
        return self.pages_PLKH.shape


def quantize(x_TKH, dtype):
    """Symmetric per-(token, kv head) quantization over H.

    Args:
      x_TKH: [T, K, H] keys or values, any float dtype.
      dtype: int8 or float8_e4m3fn.

    Returns:
      (q_TKH in ``dtype``, scales_TK f32): ``x ~= q * scale``; all-zero rows
      get scale 0 and q 0.
    """
    qmax = QUANT_MAX[jnp.dtype(dtype)]
    x32 = x_TKH.astype(jnp.float32)
    scales_TK = jnp.max(jnp.abs(x32), axis=-1) / qmax
    y_TKH = jnp.clip(x32 / jnp.where(scales_TK > 0, scales_TK, 1.0)[..., None], -qmax, qmax)
    if jnp.issubdtype(dtype, jnp.integer):
        y_TKH = jnp.round(y_TKH)
    return y_TKH.astype(dtype), scales_TK


def dequantize(q_XH, scales_X):
    """``q * scale`` in f32: [..., H] values with [...] scales (None: just the cast)."""
    q32 = q_XH.astype(jnp.float32)
    return q32 if scales_X is None else q32 * scales_X[..., None]


def fp8_kv_supported(backend: str, device_kind: str = "",
                     compute_capability: str | float | None = None) -> bool:
    """Whether a backend stores and converts float8_e4m3fn (module docstring).

    Args:
      backend: ``jax.default_backend()`` or a device's ``platform``: "cpu",
        "gpu"/"cuda", "rocm", "tpu".
      device_kind: ``jax.Device.device_kind`` ("TPU v5 lite", "NVIDIA H100 ...").
      compute_capability: a CUDA device's ``compute_capability`` ("8.9").
    """
    backend = backend.lower()
    if backend == "cpu":
        return True
    if backend in ("gpu", "cuda"):
        if compute_capability is None or "rocm" in device_kind.lower() \
                or "amd" in device_kind.lower():
            return False
        major, _, minor = str(compute_capability).partition(".")
        return (int(major), int(minor or 0)) >= (8, 9)
    if backend == "tpu":
        kind = device_kind.lower()
        m = re.search(r"(\d+)", kind)
        if m is None:
            return False
        version = int(m.group(1))
        return version >= 6 or (version == 5 and "lite" not in kind and "v5e" not in kind)
    return False


def check_kv_cache_dtype(dtype, device: jax.Device) -> None:
    """Refuse a KV cache dtype the device cannot hold (fp8 where unsupported).

    Raises:
      ValueError: naming the dtype, the backend and the device kind.
    """
    if jnp.dtype(dtype) != jnp.float8_e4m3fn:
        return
    cc = getattr(device, "compute_capability", None)
    if not fp8_kv_supported(device.platform, device.device_kind, cc):
        raise ValueError(
            f"kv_cache_dtype {jnp.dtype(dtype).name!r} needs fp8 (e4m3fn) support, which "
            f"{device.platform!r} device {device.device_kind!r}"
            f"{f' (compute capability {cc})' if cc else ''} lacks; fp8 KV runs on CPU, CUDA "
            f"GPUs of compute capability >= 8.9 and TPU v5p or newer: use kv_cache_dtype "
            f"'int8' or 'bfloat16'")
