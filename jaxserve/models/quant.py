"""Quantized linear weights: the formats of ``--quantization`` and their matmuls.

Dimension letters as in ``llama.py`` (F a projection's output dim, D its
input dim, T tokens), plus G groups along D and E experts (a leading dim of
stacked expert weights).

One weight is a ``QuantizedWeight`` (an NNX module holding up to three
``nnx.Param``s) whose ``TensorFormat`` says how to read them::

    w[f, d] = scale[f, d // g] * q[f, d] + zero[f, d // g]      (zero: 0 if absent)

| method (``EngineConfig.quantization``) | q | g | zero | activations |
|---|---|---|---|---|
| ``int8`` | int8 in [-127, 127] | D (one scale per output channel) | no | precise |
| ``w8a8`` | int8 in [-127, 127] | D | no | int8 per token, int32 accumulation |
| ``int4`` | uint4 in [0, 15], two per byte | ``group_size`` (32) | yes (the group minimum) | precise |
| ``gguf`` Q8_0 | int8 | 32 | no | precise |
| ``gguf`` Q4_0 | uint4 | 32 | yes, ``-8 d`` | precise |
| ``gguf`` Q4_1 | uint4 | 32 | yes, ``m`` | precise |
| ``gguf_a16`` | as ``gguf`` | 32 | as ``gguf`` | int16 per token in blocks of 32 (``act_block``, ``act_bits``) |
| ``gguf_a8`` | as ``gguf`` | 32 | as ``gguf`` | int8 per token in blocks of 32 (``act_block``) |

Each holds its source exactly: ggml's Q8_0 block is ``d * q`` (``d`` f16),
Q4_0's ``d * (q - 8)`` = ``d * q - 8 d`` (both products exact in f32), Q4_1's
``d * q + m``, computed in the same f32 order as ``gguf.quants`` (so
``QuantizedTensor.dequantize`` equals ``gguf.quants.dequantize`` bit for bit).
A GGUF tensor of another type (F32, F16, Q4_K, ...) under ``gguf`` stays a
dense f32 weight (``bits=0``), its values exactly the library's dequantization.

int4 packing: byte ``j`` of a row holds input ``2j`` in its low nibble and
``2j + 1`` in its high nibble.

``gguf_a8`` multiplies the same blocks by activations quantized per token in
blocks of 32 inputs (``quant_format.quantize_act_blocks``: llama.cpp's Q8
"vec_dot" blocks): ``W x_q`` with ``x_q`` the blocks' values. On CPU with
AVX-512 VNNI the kernel's a8 targets sum the integer products exactly
(``kernel_a8.cc``); every other lowering replaces x by ``x_q``
(``fake_quantize_act_blocks``) and runs the weight-only form, the same
values up to f32 rounding. ``gguf_a16`` is the same with int16 blocks
(``vpdpwssd``): a block's rounding error is 1/258 of int8's, so its eval and
greedy tokens are ``gguf``'s within what the eval resolves, while its dot
products still run on the integer units.

The w8a8 activation quantization is symmetric per token (one scale per column
of ``x_DT``: ``amax / 127``), as in SmoothQuant's dynamic per-token scheme
(Xiao et al. 2023) and vLLM's ``w8a8`` int8 path; accumulation is exact in
int32 (|q_w q_x| <= 127^2, so D < 2^31 / 127^2 = 133,144 cannot overflow).

Lowerings (measured on the AVX-512 dev machine, XLA:CPU, jax 0.10.2; 30
SmolLM2 layers, 106M weights, ms per forward at M columns 1 / 2 / 8 / 32 / 128):

| form | M=1 | 2 | 8 | 32 | 128 |
|---|---|---|---|---|---|
| f32 ``W @ x`` | 20.8 | 21.9 | 25.8 | 47.8 | 144 |
| int8 x int8 -> int32, M padded to >= 2 | 15.3 | 14.1 | 17.0 | 34.9 | 109 |
| ``dot(convert(q_int8) * s, x)`` | 138 | 138 | 144 | 172 | 257 |
| grouped dequantize, then dot | 164 | 148 | 151 | 193 | 280 |
| packed int4 unpacked in the dot | 168 | 187 | 189 | 313 | 599 |

The C++ kernel of ``pallas_kernels/quant_matmul_cpu`` (jax.ffi; optional,
built by setup.py) reads the stored weights directly; same machine, loaded
box, ms per forward of the same 30 layers (its docstring has every format):

| form | M=1 | 2 | 8 | 32 | 128 |
|---|---|---|---|---|---|
| f32 ``W @ x`` (this run) | 155 | 165 | 188 | 270 | 529 |
| int4: XLA, packed int4 unpacked in the dot | 347 | 368 | 360 | 426 | 677 |
| int4: the kernel | 55 | 54 | 77 | 231 | 818 |
| Q8_0: XLA / the kernel (f32 119 ... 503) | 76 / 41 | 104 / 54 | 83 / 89 | 198 / 208 | 424 / 732 |
| int8: XLA two-term / the kernel | 33.6 / 31.9 | 33.0 / 37.6 | 37.5 / 61 | 57 / 222 | 99 / 662 |
| w8a8: XLA / the kernel | 42.8 / 35.5 | 44.5 / 43.5 | 51 / 64 | 56 / 157 | 72 / 489 |

Inside the model the layers run under a ``lax.scan`` over stacked weights,
and XLA:CPU copies each layer's slice of a scanned input before a dot reads
it (a ``dynamic-slice`` fusion writing the layer's whole weights, which the
dot then reads again). So ``stack.run_layers`` hands the layer body the 2-D
projections as ``StackedRead`` (the stacked array and the layer's offset),
and the kernel reads the layer's part in place (``matmul_parts``); it also
has a dense f32 target for this (use_kernel below). Whole decode steps of
SmolLM2 (engine ``shaped_step``, 1 row at 1,000 context / 4 rows at 500 /
32 rows at 180; same loaded Xeon, separate processes, kernel vs
``JAXSERVE_CPU_KERNELS=0``, two runs each): f32 48-51 vs 63-71 ms, 71-77
vs 97-99 ms, 215 vs 218 ms; ``gguf`` 30-33 vs 200-204 ms, 48-52 vs 232-235
ms, 217-237 vs 338-352 ms. With the kernel's panel path serving wide
activations (``bench sweep``, 32 rows at 180 context, this branch vs the
row tiles before it, alternated processes, two rounds, load 1.8): ``gguf``
142 vs 181 ms and 84 vs 109 ms, f32 105 vs 231 ms and 103 vs 134 ms; 4
rows unchanged (tiles both ways).

So on CPU, where the library is built (``quant_matmul_cpu.available()``),
``lowering="auto"`` calls the kernel for int4 / Q4_0 / Q4_1 at M <= 512,
Q8_0 at M <= 128, int8 and w8a8 at M = 1, and a scanned layer's f32
projections at M <= 256 on the Xeon these were measured on (the built-in
table; an engine measures its machine's once, ``jaxserve.engine.kernel_widths``,
and ``quant_matmul_cpu.use_kernel`` reads that; from 12 columns,
f32 8, its GEMM-style panel path, which runs at the f32 GEMM's speed);
past those widths a scanned layer's 4-bit / Q8_0 weight is dequantized by the
library's threads (``q4g_dequantize``, the same values) for XLA's f32 dot
(``gguf`` 940-token prefill 1254 -> 1150 ms, A/B processes); elsewhere,
without the library, or with ``JAXSERVE_CPU_KERNELS=0``, the XLA forms below.

XLA:CPU runs only one quantized form fast: an int8 x int8 dot with at least
two columns (one column falls onto a slow path: 140 ms above). A convert
fused into a dot, a grouped scale and int4 are all 6-9x slower than f32. So:

* CPU, ``w8a8``: quantize x per token, int8 dot, M padded to 2.
* CPU, ``int8``: the activations are written exactly enough as two int8
  terms, ``x = s1 q1 + s2 q2`` (``s1 = amax / 127``, ``s2 = s1 / 254``, so
  ``|x - s1 q1 - s2 q2| <= amax / 64516`` per element: ~16 bits, finer than
  the bf16 activations GPU/TPU serving uses); both terms go through ONE int8
  dot as 2M columns (so M = 1 needs no padding). ``lowering="exact"`` gives
  the dequantize-then-dot form instead (f32 rounding only). Where XLA's int8
  dot has no AMX to run on (the AMD EPYC: 1.4-1.6x slower than dequantizing
  first at 128-1024 columns), ``quant_cpu.int8_wide_form()`` is
  ``"dequantize"``: from ``DEQUANTIZE_FIRST_COLUMNS`` columns the weight is
  dequantized to f32 once and XLA's f32 dot reads it (``kernel_widths``
  measures which form a machine gets).
* CPU, grouped formats (``int4``, Q8_0, Q4_0/1): dequantize to f32 inside
  the dot. Correct, and slower than f32 on this machine: they save memory
  (0.16x of f32's bytes), not time, until XLA:CPU gains a grouped int8 dot.
* GPU / TPU: the dequantization fuses into the dot (XLA:GPU's Triton GEMM
  fusion, XLA:TPU's MXU feed) in the activation dtype (bf16); ``w8a8`` is
  a native int8 dot with int32 accumulation (MXU / IMMA).

Grouped scales and zero points are stored in f16, as ggml stores them
(exact for its blocks; int4 is then 4 + 32/32 = 5 bits per weight).

The LM head [V, D] takes the method's format too (``params.lm_head``;
``EngineConfig.quantize_lm_head``), read like any projection; ``is_projection``
leaves it out because a tied head has no tensor name of its own.

Sharding: ``q`` carries the weight's logical axis names; ``scale`` and
``zero`` carry the output axis and, when grouped, the input axis (their G
dim splits like D, so ``tp`` must divide G); per-channel scales have one
column, replicated along the input axis.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The formats' numpy definitions (``quant_format``) are this module's names too:
# callers read ``quant.TensorFormat``, ``quant.quantize_np`` and the rest.
from jaxserve.models.quant_format import (  # noqa: F401
    ACT_BLOCK, ACT_SCALE, ACT_SCALE16, DENSE, GROUP_SCALE_DTYPE, INT8, INT8_MAX, Q4, Q8_0, W8A8,
    QuantizedTensor, TensorFormat, act_levels, adopted_format, check_shapes,
    fake_quantize_act_blocks, head_format, method_format, pack_int4_np, quantize_act_blocks,
    quantize_act_blocks_np, quantize_act_np, quantize_np, quantize_act, reference_linear,
    unpack_int4_np,
)
from jaxserve.models import quant_cpu
from pallas_kernels import quant_matmul_cpu

_SPLIT = 2 * INT8_MAX  # s2 = s1 / 254: the residual of the first int8 term fills [-127, 127]


def _unpack_int4(p):
    """uint8 [..., n] packed bytes -> uint8 [..., 2n] values in [0, 15]."""
    return jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def _int8_dot(q_FD, xq_DM):
    """int8 [F, D] x int8 [D, M] -> int32 [F, M]; M is padded to 2 and cut
    back (XLA:CPU's one-column int8 dot is ~10x slower than two columns)."""
    M = xq_DM.shape[1]
    if M == 1:
        xq_DM = jnp.pad(xq_DM, ((0, 0), (0, 1)))
    return jax.lax.dot_general(q_FD, xq_DM, (((q_FD.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.int32)[..., :M]


def dequantize(fmt: TensorFormat, q, scale, zero, dtype=jnp.float32):
    """``[..., F, D]`` values of a quantized weight in ``dtype`` (math in f32)."""
    if fmt.bits == 0:
        return q.astype(dtype)
    q = _unpack_int4(q) if fmt.bits == 4 else q
    *lead, F, D = q.shape
    G = scale.shape[-1]
    w = scale[..., None].astype(jnp.float32) * q.reshape(*lead, F, G, D // G).astype(jnp.float32)
    if zero is not None:
        w = w + zero[..., None].astype(jnp.float32)
    return w.reshape(*lead, F, D).astype(dtype)


def matmul_parts(fmt: TensorFormat | None, parts, x_DT, lowering: str = "auto"):
    """``W x`` for a weight given as its parts: ``(w,)`` dense (``fmt`` None;
    [F, T] in x's dtype) or ``(q, scale, zero)`` (f32 [F, T]), each an array
    or, inside a scanned layer, a ``StackedRead``: the CPU kernel reads those
    in place where it serves the format and width, anything else slices them."""
    if fmt is None:
        (w,) = parts
        if isinstance(w, StackedRead) and (y := quant_cpu.dense_kernel(w, x_DT)) is not None:
            return y.astype(x_DT.dtype)
        return jnp.einsum("fd,dt->ft", layer_slice(w), x_DT)
    if fmt.act_block:
        if lowering == "auto":  # the int8-activation kernel (panel widths), in place
            read = isinstance(parts[0], StackedRead)
            y = quant_cpu.cpu_kernel(
                fmt, *[p.stacked if read and p is not None else p for p in parts], x_DT,
                layer=parts[0].index if read else None)
            if y is not None:
                return y
        # Any other lowering: x replaced by its blocks' values, then the weight-only forms.
        fmt, x_DT = fmt.weight_only(), fake_quantize_act_blocks(x_DT, fmt.act_block,
                                                                fmt.act_bits)
    if isinstance(parts[0], StackedRead) and lowering == "auto":
        stacked = [None if p is None else p.stacked for p in parts]
        y = quant_cpu.cpu_kernel(fmt, *stacked, x_DT, layer=parts[0].index)
        if y is not None:
            return y
        w = quant_cpu.kernel_dequantized(fmt, *stacked, x_DT, layer=parts[0].index)
        if w is not None:  # the XLA form's values and dot, the dequantization threaded
            return jnp.einsum("fd,dt->ft", w, x_DT.astype(jnp.float32),
                              preferred_element_type=jnp.float32)
    q, scale, zero = (None if p is None else layer_slice(p) for p in parts)
    return quantized_matmul(fmt, q, scale, zero, x_DT, lowering)


def quantized_matmul(fmt: TensorFormat, q, scale, zero, x_DT, lowering: str = "auto"):
    """``W x`` for a quantized weight W [F, D] and feature-major x [D, T];
    f32 [F, T] (the caller casts).

    ``lowering``: ``"auto"`` (the fastest form measured for the backend,
    on CPU the C++ kernel where it wins; see the module docstring),
    ``"exact"`` (dequantize, then one dot in f32) or
    ``"cpu"`` (the XLA:CPU forms on any backend, for tests; never the kernel).
    """
    backend = "cpu" if lowering == "cpu" else jax.default_backend()
    if lowering == "auto" and backend == "cpu":
        y = quant_cpu.cpu_kernel(fmt, q, scale, zero, x_DT)
        if y is not None:
            return y
    if fmt.act_block:  # gguf_a8 / a16 elsewhere: x replaced by its blocks, then weight-only
        return quantized_matmul(fmt.weight_only(), q, scale, zero,
                                fake_quantize_act_blocks(x_DT, fmt.act_block, fmt.act_bits),
                                lowering)
    if fmt.act_int8:  # w8a8: the definition quantizes x; one int8 dot everywhere
        xq, sx = quantize_act(x_DT)
        if fmt.group_size is None:
            acc = (_int8_dot(q, xq) if backend == "cpu" else jax.lax.dot_general(
                q, xq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32))
            return acc.astype(jnp.float32) * sx * scale
        x_DT = xq.astype(jnp.float32) * sx  # grouped w8a8: dequantized x, then as below
    wide = x_DT.shape[1] >= quant_cpu.DEQUANTIZE_FIRST_COLUMNS
    int8_dequantized = (lowering == "auto" and backend == "cpu" and wide and fmt.bits == 8
                        and quant_cpu.int8_wide_form() == "dequantize")
    if lowering == "exact" or fmt.bits != 8 or fmt.group_size is not None or int8_dequantized:
        dtype = jnp.float32 if backend == "cpu" or lowering == "exact" else x_DT.dtype
        w = dequantize(fmt, q, scale, zero, dtype)
        if backend == "cpu" and q.ndim == 2 and wide:
            # Wide on XLA:CPU: the dequantization written out once,
            # then a plain f32 dot, instead of XLA's fused dequantize-in-the-dot
            # loop (2-7x slower than the dot; module docstring). Same values.
            w = jax.lax.optimization_barrier(w)
        return jnp.einsum("fd,dt->ft", w, x_DT.astype(dtype), preferred_element_type=jnp.float32)
    if backend != "cpu":  # per-channel int8, weight-only: dequantize in the dot
        w = q.astype(x_DT.dtype)
        return jnp.einsum("fd,dt->ft", w, x_DT, preferred_element_type=jnp.float32) * scale
    # CPU per-channel int8, weight-only: x = s1 q1 + s2 q2, one int8 dot of 2T columns.
    T = x_DT.shape[1]
    x = x_DT.astype(jnp.float32)
    q1, s1 = quantize_act(x)
    s2 = s1 / _SPLIT
    q2 = jnp.clip(jnp.round((x - s1 * q1.astype(jnp.float32)) / s2), -INT8_MAX,
                  INT8_MAX).astype(jnp.int8)
    acc = _int8_dot(q, jnp.concatenate([q1, q2], axis=1)).astype(jnp.float32)
    return (acc[:, :T] * s1 + acc[:, T:] * s2) * scale


@jax.tree_util.register_pytree_node_class
class StackedRead:
    """A projection weight of a scanned layer, read in place: the whole
    stacked array ``[n, ...]`` of its run of layers and this layer's index
    (an i32 scalar) instead of the layer's slice.

    ``stack.run_layers`` hands the layer body these for the leaves marked
    ``stacked_read`` (2-D projections: ``weight``) so that no copy of the
    layer's weights is made before the matmul (a scan's per-layer slice of
    its inputs is a copy on XLA:CPU: the layer's whole weights written, then
    read again by the dot). A matmul that can read at an offset takes the
    pair as it is; anything else calls ``layer_slice`` (the slice, as before).
    """

    def __init__(self, stacked, index):
        self.stacked = stacked
        self.index = index

    def tree_flatten(self):
        return (self.stacked, self.index), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def shape(self):
        return self.stacked.shape[1:]

    @property
    def dtype(self):
        return self.stacked.dtype


def layer_slice(a):
    """The per-layer array of ``a`` (a ``StackedRead`` sliced; anything else as is)."""
    if isinstance(a, StackedRead):
        return jax.lax.dynamic_index_in_dim(a.stacked, a.index, keepdims=False)
    return a


def is_stacked_read(path, variable) -> bool:
    """``nnx`` filter: the variables ``weight`` marked to be read in place."""
    meta = getattr(variable, "get_metadata", None)
    return bool(meta and meta().get("stacked_read", False))


class QuantizedWeight(nnx.Module):
    """One quantized projection weight ``[..., F, D]`` (HF's ``[out, in]``,
    optionally stacked over experts), replacing an ``nnx.Param`` in a model.

    Args:
      shape: the logical weight shape.
      names: its logical axis names (``sharding.rules``), e.g. ``("mlp", "embed")``.
      fmt: the ``TensorFormat``; ``adopt=True`` lets ``load`` switch it to a
        loaded tensor's own format (``gguf``: each tensor keeps its file's type).

    Attributes:
      q, scale, zero: ``nnx.Param``s as in ``QuantizedTensor`` (zero and,
        for bits 0, scale are None).
      lowering: see ``quantized_matmul`` (``"auto"`` by default).
    """

    def __init__(self, shape, names, fmt: TensorFormat, adopt: bool = False,
                 lowering: str = "auto"):
        self.shape = tuple(shape)
        self.names = tuple(names)
        self.adopt = adopt
        self.placeholder = fmt  # what adopt=True turns a loaded format into (adopted_format)
        self.lowering = lowering
        self._build(fmt)

    def _build(self, fmt: TensorFormat) -> None:
        *lead, F, D = self.shape
        G = fmt.groups(D)
        self.fmt = fmt
        two_d = len(self.shape) == 2  # a 2-D projection is read in place in a scan
        param = lambda a, n: nnx.Param(a, sharding_names=n, eager_sharding=False,  # noqa: E731
                                       stacked_read=two_d)
        q_dtype = {0: jnp.float32, 4: jnp.uint8, 8: jnp.int8}[fmt.bits]
        q_shape = (*lead, F, D // 2) if fmt.bits == 4 else self.shape
        self.q = param(jnp.zeros(q_shape, q_dtype), self.names)
        # Per-channel scales have one column: no input axis to split.
        scale_names = self.names[:-1] + ((self.names[-1],) if fmt.group_size else (None,))
        sdt = jnp.float32 if fmt.group_size is None else GROUP_SCALE_DTYPE
        self.scale = None if fmt.bits == 0 else param(jnp.ones((*lead, F, G), sdt), scale_names)
        self.zero = param(jnp.zeros((*lead, F, G), sdt), scale_names) if fmt.zero_point else None

    def load(self, value, name: str = "weight") -> None:
        """Fill from a float array (quantized here to ``self.fmt``) or a
        ``QuantizedTensor`` (its format must equal ``self.fmt`` unless
        ``adopt``), numpy or already-placed ``jax.Array``s.

        Raises:
          ValueError: a shape or format that does not match (names ``name``).
        """
        if not isinstance(value, QuantizedTensor):
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                raise ValueError(f"{name}: a float weight spread over several processes cannot "
                                 f"be quantized on load; convert the checkpoint first "
                                 "(--mode convert --quantization METHOD)")
            if tuple(value.shape) != self.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model "
                                 f"{self.shape}")
            value = quantize_np(np.asarray(value, np.float32), self.fmt)
        if tuple(value.shape) != self.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model "
                             f"{self.shape}")
        fmt = adopted_format(value.fmt, self.placeholder) if self.adopt else value.fmt
        if fmt != self.fmt:
            if not self.adopt:
                raise ValueError(f"{name}: checkpoint format {value.fmt} != model {self.fmt}")
            self._build(fmt)
        for part in ("q", "scale", "zero"):
            p, arr = getattr(self, part), getattr(value, part)
            if (p is None) != (arr is None):
                raise ValueError(f"{name}: checkpoint {part} is "
                                 f"{'missing' if arr is None else 'unexpected'}")
            if p is None:
                continue
            if tuple(arr.shape) != tuple(p.value.shape):
                raise ValueError(f"{name}.{part}: checkpoint shape {tuple(arr.shape)} != "
                                 f"model {tuple(p.value.shape)}")
            p.value = arr if isinstance(arr, jax.Array) and arr.dtype == p.value.dtype \
                else jnp.asarray(arr, p.value.dtype)

    def parts(self):
        """(q, scale, zero) arrays (None where absent); a scanned layer's
        ``StackedRead``s are sliced (``layer_slice``)."""
        return tuple(None if p is None else layer_slice(p.value)
                     for p in (self.q, self.scale, self.zero))

    def matmul(self, x_DT):
        """``W x``: [F, D] @ [D, T] -> f32 [F, T] (2-D weights only; inside a
        scanned layer the CPU kernel reads the stacked parts in place)."""
        parts = [None if p is None else p.value for p in (self.q, self.scale, self.zero)]
        return matmul_parts(self.fmt, parts, x_DT, self.lowering)

    def dense(self, dtype=jnp.float32):
        """The dequantized ``[..., F, D]`` weight (for ops without a quantized
        form, e.g. the experts' ragged dots)."""
        return dequantize(self.fmt, *self.parts(), dtype)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in self.parts() if a is not None)


def param(shape, names, dtype, rngs: nnx.Rngs | None, scale: float = 0.02, ones=False):
    """A plain ``nnx.Param`` of ``shape`` with logical axis ``names``: ones
    (``ones``), zeros (no ``rngs``: filled by ``load_params``) or random
    N(0, scale^2) cast to ``dtype``."""
    if ones:
        value = jnp.ones(shape, dtype)
    elif rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, sharding_names=names, eager_sharding=False)


def weight(shape, names, dtype, rngs, fmt: TensorFormat | None, adopt: bool = False,
           scale: float = 0.02):
    """A projection weight: an ``nnx.Param`` (``fmt`` None) or a
    ``QuantizedWeight``; random init (``rngs``) draws N(0, scale^2) and
    quantizes it."""
    if fmt is None:
        p = param(shape, names, dtype, rngs, scale=scale)
        if len(shape) == 2:  # a 2-D projection is read in place in a scan (StackedRead)
            p.set_metadata("stacked_read", True)
        return p
    w = QuantizedWeight(shape, names, fmt, adopt=adopt)
    if rngs is not None and fmt.bits != 0:
        value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
        w.load(np.asarray(value), "random init")
    return w


def linear(w, x_DT, b_F=None):
    """``W x (+ b)`` for feature-major activations: [F, D] @ [D, T] (+ [F]) ->
    [F, T] in x's dtype; ``w`` an ``nnx.Param`` or a ``QuantizedWeight``,
    either holding its arrays or ``StackedRead``s of them (inside a scanned
    layer)."""
    if isinstance(w, QuantizedWeight):
        y_FT = w.matmul(x_DT).astype(x_DT.dtype)
    else:
        y_FT = matmul_parts(None, (w.value,), x_DT)
    return y_FT if b_F is None else y_FT + b_F[:, None]


def linears(ws, x_DT, bs=None):
    """``[linear(w, x_DT, b) for w, b in zip(ws, bs)]`` for projections of the
    same activations (a layer's q/k/v, or gate/up): one CPU kernel call for
    them all where each is a 4-bit-group ``QuantizedWeight`` read in place
    (``StackedRead``s of one layer) at row-tile widths (below
    ``PANEL_COLUMNS``) and the kernel serves it (``quant_matmul_cpu.
    q4g_matmul_parts``: bit-equal to one call each, with one pool hand-off
    and one x preparation; 30 SmolLM2 layers' projections at one column
    measured 5-11% faster fused, 2-core AVX-512 Xeon); else one ``linear``
    each."""
    bs = [None] * len(ws) if bs is None else list(bs)
    ys = _q4g_fused(ws, x_DT)
    if ys is None:
        return [linear(w, x_DT, b) for w, b in zip(ws, bs)]
    ys = [y.astype(x_DT.dtype) for y in ys]
    return [y if b is None else y + b[:, None] for y, b in zip(ys, bs)]


def _q4g_fused(ws, x_DT):
    if len(ws) < 2 or len(ws) > 4 or x_DT.shape[1] >= quant_matmul_cpu.PANEL_COLUMNS["q4g"]:
        return None
    if not all(isinstance(w, QuantizedWeight) for w in ws):
        return None
    act = {(w.fmt.act_block, w.fmt.act_bits) for w in ws}
    if len(act) != 1:
        return None
    block, bits = act.pop()  # gguf_a8 / a16: the kernel replaces x by its blocks' values first
    if block not in (None, ACT_BLOCK):
        return None
    parts, index = [], None
    for w in ws:
        if not (w.lowering == "auto" and quant_cpu.kernel_kind(w.fmt.weight_only()) == "q4g"
                and w.zero is not None):
            return None
        q, s, z = (w.q.value, w.scale.value, w.zero.value)
        if not all(isinstance(a, StackedRead) for a in (q, s, z)):
            return None
        if index is None:
            index = q.index
        if any(a.index is not index for a in (q, s, z)) or q.stacked.ndim != 3 \
                or not quant_cpu.kernel_serves(w.fmt.weight_only(), s.stacked.shape[-2], x_DT):
            return None
        parts.append((q.stacked, s.stacked, z.stacked))
    if len({p[1].shape[-1] for p in parts}) != 1:  # one G
        return None
    return quant_matmul_cpu.q4g_matmul_parts(parts, x_DT, layer=index, act_block=block or 0,
                                             act_bits=bits)


def weight_bytes(state) -> int:
    """Bytes of every array of an NNX state (parameters as stored)."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))


_PROJECTION_RE = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123]|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight")


def is_projection(hf_name: str) -> bool:
    """True for an HF tensor name that ``--quantization`` quantizes:
    ``self_attn.{q,k,v,o}_proj.weight``, ``mlp.{gate,up,down}_proj.weight``,
    Mixtral's ``block_sparse_moe.experts.{e}.w{1,2,3}.weight`` and Qwen3-MoE's
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``; False for the routers
    (``mlp.gate.weight``, ``block_sparse_moe.gate.weight``), embeddings,
    norms, biases and the LM head."""
    return _PROJECTION_RE.fullmatch(hf_name) is not None


__all__ = ["DENSE", "INT8", "Q4", "Q8_0", "W8A8", "QuantizedTensor", "QuantizedWeight",
           "TensorFormat", "check_shapes", "dequantize", "is_projection", "linear", "method_format",
           "pack_int4_np", "quantize_act_np", "quantize_np", "quantized_matmul",
           "param", "reference_linear", "unpack_int4_np", "weight", "weight_bytes"]
