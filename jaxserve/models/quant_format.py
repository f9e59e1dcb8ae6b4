"""The weight formats of ``--quantization`` as numpy definitions:
``TensorFormat`` (how one weight is stored), the format each method gives a
projection and the LM head, ``QuantizedTensor`` and ``quantize_np`` (the
quantization itself) and ``reference_linear`` (the f64 matmul every lowering
is tested against). ``jaxserve.models.quant`` holds the JAX side (the
module, the matmul forms per backend) and its docstring the formats' table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.config import GGUF_BLOCK_METHODS, QUANTIZATION_METHODS

INT8_MAX = 127
# Grouped formats keep their scales and zero points in f16 (as ggml does:
# Q4_1 is then 5 bits per weight, 0.156x f32); per-channel scales stay f32.
GROUP_SCALE_DTYPE = np.float16


@dataclasses.dataclass(frozen=True)
class TensorFormat:
    """How one weight is stored.

    Attributes:
      bits: 8 (int8 ``q``), 4 (uint4, two per uint8 byte) or 0 (dense f32, no
        quantization: ``gguf`` tensors of other types).
      group_size: input elements per scale; None: the whole input dim (one
        scale per output channel).
      zero_point: the format stores ``zero`` (asymmetric).
      act_int8: activations are quantized per token to int8 (``w8a8``).
      act_block: activations are quantized per token in blocks of this many
        inputs (symmetric, one f32 scale per block: ``gguf_a8`` to int8 as
        llama.cpp quantizes activations to Q8 blocks of 32 before it
        multiplies them with Q4_0 / Q4_1 / Q8_0 weights, ``gguf_a16`` to
        int16); None: precise.
      act_bits: the blocks' integer width with ``act_block``: 8 (levels
        +-127) or 16 (+-32767).
    """

    bits: int
    group_size: int | None = None
    zero_point: bool = False
    act_int8: bool = False
    act_block: int | None = None
    act_bits: int = 8

    def __post_init__(self):
        if self.bits not in (0, 4, 8):
            raise ValueError(f"TensorFormat.bits must be 0, 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"TensorFormat.group_size must be >= 1, got {self.group_size}")
        if self.act_block is not None and (self.act_block < 1 or self.act_int8):
            raise ValueError(f"TensorFormat.act_block must be >= 1 and exclusive of act_int8, "
                             f"got {self.act_block}")
        if self.act_bits not in (8, 16):
            raise ValueError(f"TensorFormat.act_bits must be 8 or 16, got {self.act_bits}")
        if self.bits == 4 and self.group_size is not None and self.group_size % 2:
            raise ValueError(f"int4 groups hold whole bytes: group_size must be even, "
                             f"got {self.group_size}")

    def groups(self, in_dim: int) -> int:
        """G, the scales per output channel for an input dim of ``in_dim``."""
        return 1 if self.group_size is None else in_dim // self.group_size

    def weight_only(self) -> "TensorFormat":
        """The same weight storage with precise activations (``act_block`` None)."""
        return dataclasses.replace(self, act_block=None, act_bits=8) if self.act_block else self


DENSE = TensorFormat(bits=0)
INT8 = TensorFormat(bits=8)
W8A8 = TensorFormat(bits=8, act_int8=True)
Q8_0 = TensorFormat(bits=8, group_size=32)
Q4 = TensorFormat(bits=4, group_size=32, zero_point=True)  # Q4_0 and Q4_1 alike
# gguf_a8's and gguf_a16's activation blocks: llama.cpp's Q8_0 / Q8_1 block of 32
# (QK8_0), and the factor from a block's amax to its scale, 1/127 (int8) or 1/32767
# (int16) rounded to f32.
ACT_BLOCK = 32
ACT_SCALE = np.float32(1 / 127)
ACT_SCALE16 = np.float32(1 / 32767)


def act_levels(bits: int) -> tuple[int, np.float32]:
    """(L, amax-to-scale factor) of activation blocks of ``bits`` (8: 127 and
    ``ACT_SCALE``; 16: 32767 and ``ACT_SCALE16``).

    Raises:
      ValueError: bits other than 8 or 16.
    """
    if bits not in (8, 16):
        raise ValueError(f"activation blocks are 8 or 16 bits, got {bits}")
    return (INT8_MAX, ACT_SCALE) if bits == 8 else (32767, ACT_SCALE16)


def head_format(fmt: TensorFormat | None) -> TensorFormat | None:
    """The LM head's format under a method whose projections take ``fmt``:
    weight-only ``int8`` and ``int4`` keep the head in Q8_0-style groups of 32
    (int8, one f16 scale per group), as llama.cpp keeps ``output.weight`` at 8
    bits: on SmolLM2 a 4-bit head cost +5.6% PPL and a per-channel int8 head
    +0.12% on top of int8's projections (``benchmarks/quant/eval_head``);
    ``w8a8`` keeps its own (per channel, int8 activations); ``gguf`` heads
    keep the file's blocks."""
    if fmt is not None and not fmt.act_int8 and fmt.bits in (4, 8) and fmt != Q8_0:
        return Q8_0
    return fmt


def method_format(method: str, group_size: int = 32) -> TensorFormat | None:
    """The ``TensorFormat`` every quantized projection gets under ``method``;
    None for ``"none"``; for ``"gguf"``, ``"gguf_a8"`` and ``"gguf_a16"`` a
    placeholder (each tensor then takes its file's format when it loads,
    ``gguf_a8`` / ``gguf_a16`` with ``act_block`` and ``act_bits`` added:
    ``adopted_format``).

    Raises:
      ValueError: an unknown method, or a bad group size.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, "
                         f"got {method!r}")
    if method == "none":
        return None
    if method == "int4":
        return TensorFormat(bits=4, group_size=group_size, zero_point=True)
    if method in ("gguf_a8", "gguf_a16"):
        return dataclasses.replace(Q4, act_block=ACT_BLOCK, act_bits=int(method[6:]))
    return {"int8": INT8, "w8a8": W8A8, "gguf": Q4}[method]


def adopted_format(loaded: TensorFormat, placeholder: TensorFormat) -> TensorFormat:
    """The format a weight built as ``placeholder`` (``method_format`` of
    ``gguf`` / ``gguf_a8`` / ``gguf_a16``) takes for a loaded GGUF tensor of
    format ``loaded``: the tensor's own, with the placeholder's ``act_block``
    and ``act_bits`` where it is quantized (a dense tensor of another ggml
    type keeps precise activations)."""
    if loaded.bits == 0 or placeholder.act_block is None:
        return loaded
    return dataclasses.replace(loaded, act_block=placeholder.act_block,
                               act_bits=placeholder.act_bits)


def check_shapes(method: str, group_size: int, shapes) -> None:
    """Check, before any weight loads, that ``method`` can hold every
    projection of ``shapes`` (``[..., out, in]`` tuples).

    Raises:
      ValueError: ``int4`` with a group size that does not divide an input dim
        (names the dim and the size), or an odd input dim for int4.
    """
    fmt = method_format(method, group_size)
    if fmt is None or fmt.bits != 4 or method in GGUF_BLOCK_METHODS:
        return
    for shape in shapes:
        if shape[-1] % group_size:
            raise ValueError(f"int4 quantization_group_size={group_size} does not divide the "
                             f"input dim {shape[-1]} of a {tuple(shape)} weight; pick a group "
                             f"size that divides every input dim (e.g. 32)")


@dataclasses.dataclass
class QuantizedTensor:
    """A quantized weight on the host (numpy arrays), or read back from device.

    Attributes:
      fmt: its ``TensorFormat``.
      shape: the logical weight shape ``[..., F, D]`` (HF's ``[out, in]``).
      q: int8 ``[..., F, D]`` (bits 8), uint8 ``[..., F, D/2]`` (bits 4) or
        f32 ``[..., F, D]`` (bits 0, the dense weight itself).
      scale: ``[..., F, G]``, f32 per channel (G = 1), f16 when grouped
        (``GROUP_SCALE_DTYPE``); None for bits 0.
      zero: ``[..., F, G]`` f16, or None.
    """

    fmt: TensorFormat
    shape: tuple[int, ...]
    q: np.ndarray
    scale: np.ndarray | None
    zero: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scale, self.zero) if a is not None)

    def dequantize(self) -> np.ndarray:
        """f32 ``[..., F, D]`` values: ``scale * q + zero`` per group, in that
        f32 order (bit-equal to ``gguf.quants.dequantize`` for Q8_0/Q4_0/Q4_1)."""
        if self.fmt.bits == 0:
            return np.asarray(self.q, np.float32)
        q = unpack_int4_np(self.q) if self.fmt.bits == 4 else self.q
        *lead, F, D = self.shape
        G = self.scale.shape[-1]
        qg = q.reshape(*lead, F, G, D // G).astype(np.float32)
        w = self.scale[..., None].astype(np.float32) * qg
        if self.zero is not None:
            w = w + self.zero[..., None].astype(np.float32)
        return w.reshape(self.shape)


def pack_int4_np(q: np.ndarray) -> np.ndarray:
    """uint8 ``[..., D/2]`` of uint4 values ``q`` ``[..., D]`` in [0, 15]
    (input 2j in the low nibble of byte j, 2j + 1 in the high one)."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4_np(p: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 2 * n]`` values in [0, 15] of packed bytes ``p`` ``[..., n]``."""
    return np.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def quantize_np(w: np.ndarray, fmt: TensorFormat) -> QuantizedTensor:
    """Quantize a float weight ``w`` ``[..., F, D]`` to ``fmt`` (round to nearest).

    * bits 8 (symmetric): ``scale = amax / 127`` per group (1 where the group
      is all zero), ``q = clip(round(w / scale), -127, 127)``.
    * bits 4 (asymmetric, as ggml's Q4_1): ``zero = min``, ``scale = (max -
      min) / 15`` (1 where max == min), ``q = clip(round((w - zero) / scale), 0, 15)``.
    * bits 0: the weight as f32.

    Grouped scales and zeros are rounded to f16 first and q is computed from
    the rounded values (so ``dequantize`` is what was meant).

    Raises:
      ValueError: the group size does not divide D, int4 with an odd D, or a
        group scale beyond f16's range.
    """
    w = np.asarray(w, np.float32)
    *lead, F, D = w.shape
    if fmt.bits == 0:
        return QuantizedTensor(fmt, w.shape, w.copy(), None)
    g = D if fmt.group_size is None else fmt.group_size
    if D % g or (fmt.bits == 4 and D % 2):
        raise ValueError(f"group size {g} does not divide the input dim {D} of a "
                         f"{tuple(w.shape)} weight" + (" (int4 also needs an even dim)"
                                                       if fmt.bits == 4 else ""))
    wg = w.reshape(*lead, F, D // g, g)
    sdt = np.float32 if fmt.group_size is None else GROUP_SCALE_DTYPE

    def stored(a):
        out = a.astype(sdt)
        if not np.all(np.isfinite(out)):
            raise ValueError(f"a group scale of a {tuple(w.shape)} weight is beyond "
                             f"{np.dtype(sdt).name}'s range (|w| up to {np.abs(w).max():.3g})")
        return out
    if fmt.bits == 8:
        scale = np.abs(wg).max(axis=-1) / INT8_MAX
        scale = stored(np.where(scale > 0, scale, 1.0))
        q = np.clip(np.rint(wg / scale[..., None].astype(np.float32)), -INT8_MAX,
                    INT8_MAX).astype(np.int8)
        return QuantizedTensor(fmt, w.shape, q.reshape(w.shape), scale)
    lo, hi = wg.min(axis=-1), wg.max(axis=-1)
    scale = stored(np.where(hi > lo, (hi - lo) / 15, 1.0))
    zero = stored(lo)
    q = np.clip(np.rint((wg - zero[..., None].astype(np.float32))
                        / scale[..., None].astype(np.float32)), 0, 15).astype(np.uint8)
    return QuantizedTensor(fmt, w.shape, pack_int4_np(q.reshape(w.shape)), scale, zero)


def quantize_act_np(x_DT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token symmetric int8 of feature-major activations: (q i8[D, T],
    scale f32[T]) with ``x ~= scale * q`` (the w8a8 definition)."""
    amax = np.abs(x_DT).max(axis=0)
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(x_DT / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def quantize_act(x_DT):
    """Per-token (column) symmetric int8 of activations x [D, T] under jit:
    (q i8[D, T], scale f32[1, T]); ``quantize_act_np``'s definition in jnp."""
    x = x_DT.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=0, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def quantize_act_blocks_np(x_DT: np.ndarray, block: int,
                           bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Per-token symmetric int8 (``bits`` 8) or int16 (16) of feature-major
    activations in blocks of ``block`` inputs (``TensorFormat.act_block``):
    (q i8 / i16 [D, T], scale f32[D / block, T]) with ``x[d, t] ~= scale[d //
    block, t] q[d, t]``; ``scale = amax * ACT_SCALE`` (``ACT_SCALE16``) over
    the block (1 where the block is all zero), ``q = clip(rint(x * (1 /
    scale)), -L, L)`` with L = 127 (32767) (llama.cpp's ``x * id``), all in
    f32. (Products, not ``amax / 127`` and ``x / scale``: XLA rewrites a
    division by a constant or a broadcast value into a product with its
    rounded reciprocal, so only these forms are computed alike by numpy, XLA
    and the C++ kernel.)

    Raises:
      ValueError: ``block`` does not divide D; ``bits`` not 8 or 16.
    """
    levels, factor = act_levels(bits)
    x = np.asarray(x_DT, np.float32)
    D, T = x.shape
    if D % block:
        raise ValueError(f"activation block {block} does not divide the input dim {D}")
    xb = x.reshape(D // block, block, T)
    amax = np.abs(xb).max(axis=1)
    scale = np.where(amax > 0, amax * factor, np.float32(1)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, None]), -levels, levels).astype(
        np.int8 if bits == 8 else np.int16)
    return q.reshape(D, T), scale


def quantize_act_blocks(x_DT, block: int, bits: int = 8):
    """``quantize_act_blocks_np`` under jit: (q i8 / i16 [D, T], scale f32[D /
    block, T]).

    Raises:
      ValueError: ``block`` does not divide D; ``bits`` not 8 or 16.
    """
    levels, factor = act_levels(bits)
    D, T = x_DT.shape
    if D % block:
        raise ValueError(f"activation block {block} does not divide the input dim {D}")
    xb = x_DT.astype(jnp.float32).reshape(D // block, block, T)
    amax = jnp.max(jnp.abs(xb), axis=1)
    scale = jnp.where(amax > 0, amax * factor, 1.0)
    q = jnp.clip(jnp.round(xb * (1.0 / scale)[:, None]), -levels, levels).astype(
        jnp.int8 if bits == 8 else jnp.int16)
    return q.reshape(D, T), scale


def fake_quantize_act_blocks(x_DT, block: int, bits: int = 8):
    """f32 [D, T]: ``x`` replaced by its ``quantize_act_blocks`` values
    ``scale q`` (the activations ``gguf_a8`` / ``gguf_a16`` multiply; any
    weight-only lowering then computes that format's definition up to f32
    rounding)."""
    q, scale = quantize_act_blocks(x_DT, block, bits)
    D, T = q.shape
    return (q.reshape(D // block, block, T).astype(jnp.float32) * scale[:, None]).reshape(D, T)


def reference_linear(qt: QuantizedTensor, x_DT: np.ndarray) -> np.ndarray:
    """The numpy (f64) reference of a format's definition: ``W x`` with W the
    dequantized weight [F, D] and, for ``act_int8``, x replaced by its
    per-token int8 quantization (``act_block``: by its int8 / int16 blocks);
    f64 [F, T]."""
    x = np.asarray(x_DT, np.float64)
    if qt.fmt.act_int8:
        q, s = quantize_act_np(np.asarray(x_DT, np.float32))
        x = q.astype(np.float64) * s.astype(np.float64)
    if qt.fmt.act_block:
        q, s = quantize_act_blocks_np(np.asarray(x_DT, np.float32), qt.fmt.act_block,
                                      qt.fmt.act_bits)
        x = q.astype(np.float64) * np.repeat(s.astype(np.float64), qt.fmt.act_block, axis=0)
    return qt.dequantize().astype(np.float64) @ x


# ---- device side ---------------------------------------------------------
