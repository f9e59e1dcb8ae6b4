"""Which projections the CPU kernels (``pallas_kernels.quant_matmul_cpu``)
serve, and the calls into them: a format's kernel target, whether it runs for
a weight of F rows at a column count (built, allowed by
``JAXSERVE_CPU_KERNELS``, measured faster than XLA's form), the matmul itself,
and the in-place dequantization of a scanned layer's 4-bit or Q8_0 weight
before an f32 dot. Each returns None where the kernel does not apply, and the
caller (``jaxserve.models.quant``) takes the XLA form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.quant_format import TensorFormat, quantize_act
from pallas_kernels import quant_matmul_cpu

# From this many activation columns a grouped weight on XLA:CPU is dequantized into
# its own f32 buffer before an f32 dot (the [F, D] write costs less than XLA's fused
# dequantize-in-the-dot loop from a few columns on; where the kernel is built it
# serves these widths up to quant_matmul_cpu.use_kernel's limit).
DEQUANTIZE_FIRST_COLUMNS = 5


# int8 weight-only past the kernel's widths, in XLA's forms (quant.quantized_matmul):
# "int8_dot": x written as two int8 terms, one int8 dot (fastest where XLA's int8 dot
# runs on AMX: the Xeon); "dequantize": the weight dequantized to f32 once, then XLA's
# f32 dot (exact; 1.4-1.6x faster than "int8_dot" on the AMD EPYC, no AMX, at 128-1024
# columns). Per process; ``jaxserve.engine.kernel_widths`` measures which, per machine.
INT8_WIDE_FORMS = ("int8_dot", "dequantize")
_int8_wide = ["int8_dot"]


def int8_wide_form() -> str:
    """This process's form for int8 weight-only past the kernel (``INT8_WIDE_FORMS``)."""
    return _int8_wide[0]


def set_int8_wide_form(form: str) -> str:
    """Set this process's ``int8_wide_form`` for programs traced from now on;
    returns the previous one.

    Raises:
      ValueError: ``form`` not in ``INT8_WIDE_FORMS``.
    """
    if form not in INT8_WIDE_FORMS:
        raise ValueError(f"int8 wide form must be one of {list(INT8_WIDE_FORMS)}, got {form!r}")
    previous, _int8_wide[0] = _int8_wide[0], form
    return previous


def kernel_allowed(x_DT) -> bool:
    """The CPU kernel may run here: CPU backend, 2-D activations, outside a
    mesh of several devices (the engine's abstract mesh, as ``moe`` reads it:
    a custom call does not split over a mesh, XLA would gather its operands)."""
    mesh = jax.sharding.get_abstract_mesh()
    return (jax.default_backend() == "cpu" and x_DT.ndim == 2
            and (mesh.empty or mesh.size == 1))


def kernel_kind(fmt: TensorFormat | None) -> str | None:
    """The CPU kernel's target for a format (``quant_matmul_cpu.use_kernel``'s
    kind); None: a dense f32 weight."""
    if fmt is None:
        return "f32"
    if fmt.act_block:  # gguf_a8 / a16: the block-activation kinds (the weight's groups)
        if fmt.act_block != fmt.group_size:
            return None
        a = f"_a{fmt.act_bits}"
        return "q8g" + a if fmt.bits == 8 else "q4g" + a if fmt.bits == 4 and fmt.zero_point \
            else None
    if fmt.bits == 8 and fmt.group_size is None:
        return "w8a8" if fmt.act_int8 else "int8"
    if fmt.act_int8:
        return None
    if fmt.bits == 8:
        return "q8g"
    return "q4g" if fmt.bits == 4 and fmt.zero_point else None


def kernel_serves(fmt: TensorFormat | None, F: int, x_DT) -> bool:
    """True when a weight of ``fmt`` (None: dense f32) with F rows runs on the
    CPU kernel for activations ``x_DT`` [D, M] (lowering ``"auto"``)."""
    kind = kernel_kind(fmt)
    return (kind is not None and kernel_allowed(x_DT)
            and quant_matmul_cpu.use_kernel(kind, F, x_DT.shape[0], x_DT.shape[1])
            and (quant_matmul_cpu.has_target(f"jaxserve_qmm_{kind}") if "_a" in kind
                 else quant_matmul_cpu.available()))


def cpu_kernel(fmt: TensorFormat, q, scale, zero, x_DT, layer=None):
    """``W x`` by ``pallas_kernels.quant_matmul_cpu`` where it is built, allowed
    (``JAXSERVE_CPU_KERNELS``) and measured faster than the XLA form for this
    format and column count; None otherwise (the caller takes the XLA form).
    Only a 2-D weight (stacked experts keep their ragged dots), or with
    ``layer`` (an i32 scalar) parts stacked over a scanned run of layers
    (``StackedRead``: the kernel reads that layer's part in place)."""
    if q.ndim != (2 if layer is None else 3):
        return None
    kind = kernel_kind(fmt)
    if kind is None or not kernel_serves(fmt, scale.shape[-2], x_DT):
        return None
    if kind == "w8a8":
        xq, sx = quantize_act(x_DT)
        return quant_matmul_cpu.w8a8_matmul(q, scale, xq, sx, layer=layer)
    if kind == "int8":
        return quant_matmul_cpu.int8_matmul(q, scale, x_DT, layer=layer)
    if kind == "q8g":
        return quant_matmul_cpu.q8g_matmul(q, scale, x_DT, layer=layer)
    if kind == "q8g_a8":
        return quant_matmul_cpu.q8g_a8_matmul(q, scale, x_DT, layer=layer)
    if kind == "q4g_a8":
        return quant_matmul_cpu.q4g_a8_matmul(q, scale, zero, x_DT, layer=layer)
    if kind == "q8g_a16":
        return quant_matmul_cpu.q8g_a16_matmul(q, scale, x_DT, layer=layer)
    if kind == "q4g_a16":
        return quant_matmul_cpu.q4g_a16_matmul(q, scale, zero, x_DT, layer=layer)
    return quant_matmul_cpu.q4g_matmul(q, scale, zero, x_DT, layer=layer)


def kernel_dequantized(fmt: TensorFormat, q, scale, zero, x_DT, layer):
    """A scanned layer's 4-bit-group or Q8_0 weight as f32 [F, D], dequantized
    in place by the CPU kernel library (``q4g_dequantize`` / ``q8g_dequantize``:
    ``dequantize``'s values) where ``quantized_matmul`` would write the
    dequantized weight out before an f32 dot (CPU, from
    ``DEQUANTIZE_FIRST_COLUMNS`` columns, past the kernel's matmul widths);
    None elsewhere. A 940-token SmolLM2 prefill in ``gguf``: XLA's unpack
    fusions took ~250 ms of its ~1.3 s (2-core Xeon)."""
    kind = kernel_kind(fmt)
    if (kind not in ("q4g", "q8g") or q.ndim != 3 or x_DT.shape[1] < DEQUANTIZE_FIRST_COLUMNS
            or not kernel_allowed(x_DT)
            or not quant_matmul_cpu.has_target(f"jaxserve_qmm_dequant_{kind}")):
        return None
    if kind == "q4g":
        return quant_matmul_cpu.q4g_dequantize(q, scale, zero, layer=layer)
    return quant_matmul_cpu.q8g_dequantize(q, scale, layer=layer)


def dense_kernel(w, x_DT):
    """A scanned layer's dense f32 projection ``W x`` (``w`` a
    ``quant.StackedRead``) read in place by the CPU kernel at decode widths;
    None where it does not apply (XLA slices)."""
    if w.dtype != jnp.float32 or not kernel_serves(None, w.shape[0], x_DT):
        return None
    return quant_matmul_cpu.f32_matmul(w.stacked, x_DT, layer=w.index)
