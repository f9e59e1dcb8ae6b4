"""The numpy reference of the four kernels: the stored weight dequantized
exactly (``w = scale * q + zero`` per group, in f32 as quant.py does), then
an f64 matmul with the f32 activations; w8a8 as exact int32 products.

Names by shape: q_FD i8[F, D], p_FD2 u8[F, D/2] (input 2j in the low nibble of
byte j, 2j + 1 in the high one), scale_F1 f32[F, 1], scale_FG / zero_FG
f16[F, G] (G groups of D / G inputs), x_DM f32[D, M]; results f64 [F, M]
(w8a8's ``int32_matmul``: int64 [F, M], exact).
"""

from __future__ import annotations

import numpy as np


def _grouped(q_FD: np.ndarray, scale_FG: np.ndarray, zero_FG: np.ndarray | None) -> np.ndarray:
    F, D = q_FD.shape
    G = scale_FG.shape[1]
    w = scale_FG[:, :, None].astype(np.float32) * q_FD.reshape(F, G, D // G).astype(np.float32)
    if zero_FG is not None:
        w = w + zero_FG[:, :, None].astype(np.float32)
    return w.reshape(F, D)


def int8_matmul(q_FD, scale_F1, x_DM) -> np.ndarray:
    """Per-channel int8: ``scale * q`` [F, D] @ x."""
    w = np.asarray(scale_F1, np.float32) * np.asarray(q_FD, np.float32)
    return w.astype(np.float64) @ np.asarray(x_DM, np.float64)


def q8g_matmul(q_FD, scale_FG, x_DM) -> np.ndarray:
    """Grouped int8 (Q8_0): ``scale[f, d // gs] * q`` @ x."""
    return _grouped(np.asarray(q_FD), np.asarray(scale_FG), None).astype(np.float64) \
        @ np.asarray(x_DM, np.float64)


def q4g_matmul(p_FD2, scale_FG, zero_FG, x_DM) -> np.ndarray:
    """Grouped uint4: ``scale * q + zero`` @ x, q unpacked from ``p_FD2``."""
    p = np.asarray(p_FD2, np.uint8)
    q = np.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[0], 2 * p.shape[1])
    return _grouped(q, np.asarray(scale_FG), np.asarray(zero_FG)).astype(np.float64) \
        @ np.asarray(x_DM, np.float64)


def int32_matmul(q_FD, xq_DM) -> np.ndarray:
    """w8a8's exact integer part: int8 [F, D] @ int8 [D, M] (int64, no overflow)."""
    return np.asarray(q_FD, np.int64) @ np.asarray(xq_DM, np.int64)


def w8a8_matmul(q_FD, scale_F1, xq_DM, sx_1M) -> np.ndarray:
    """``float(q @ xq) * sx * scale`` in f64."""
    return int32_matmul(q_FD, xq_DM).astype(np.float64) * np.asarray(sx_1M, np.float64) \
        * np.asarray(scale_F1, np.float64)
