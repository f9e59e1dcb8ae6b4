"""XLA:CPU kernels for quantized weights, through ``jax.ffi``: weight [F, D] as
``jaxserve.models.quant`` stores it x f32 activations [D, M] -> f32 [F, M].

TABLE_PLACEHOLDER
"""

from pallas_kernels.quant_matmul_cpu.ffi import (available, int8_matmul, library_path,
                                                 q4g_matmul, q8g_matmul, w8a8_matmul)

# The largest column count M at which the kernel measured faster than the XLA
# form, per kind (the table above); None: the XLA form at every M.
_MAX_COLUMNS = {"int8": None, "w8a8": 8, "q8g": 32, "q4g": 32}


def use_kernel(kind: str, F: int, D: int, M: int) -> bool:
    """Whether ``quantized_matmul`` should call the kernel for a weight [F, D] of
    ``kind`` (``"int8"``, ``"w8a8"``, ``"q8g"``, ``"q4g"``) and M columns."""
    limit = _MAX_COLUMNS[kind]
    return limit is not None and M <= limit

__all__ = ["available", "int8_matmul", "library_path", "q4g_matmul", "q8g_matmul",
           "use_kernel", "w8a8_matmul"]
