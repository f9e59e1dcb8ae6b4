"""The numpy form of ``sampling_cpu.greedy`` (f64 sums)."""

from __future__ import annotations

import numpy as np


def greedy(logits_SV: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids i32[S], logprobs f64[S]): the first index of each row's largest
    value (the first NaN where a row has one) and log_softmax there."""
    x = np.asarray(logits_SV, np.float64)
    ids = np.argmax(x, axis=-1).astype(np.int32)  # numpy's argmax: the first NaN wins
    mx = np.max(x, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.log(np.sum(np.exp(x - mx), axis=-1))
        lp = np.take_along_axis(x - mx, ids[:, None].astype(np.int64), -1)[:, 0] - lse
    return ids, lp
