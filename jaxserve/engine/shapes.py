"""Which compiled shape a step runs in: a bounded set of XLA programs.

``ModelRunner.prepare`` pads every varying dimension of a step to a bucket
(see ``runner.py``), but the buckets of a mixed prefill step multiply (decode
rows x prefill sequences x tokens x pages per sequence x query window x
prompt-logprob rows x top-N) into thousands of possible shapes. Each shape is
its own XLA program, compiled once (seconds on CPU) and kept in host memory
for good: 40-60 MB each for SmolLM2 on XLA:CPU (AMD EPYC, 2 cores, AVX-512),
measured by the soak benchmark. A 20-minute soak of varied traffic built 205
of them and the server's RSS rose from 2.3 to 12 GB.

``StepShapes`` keeps the set finite. A step's own buckets are its ``need``,
a tuple of dimensions where larger is always safe (more padding rows, tokens,
pages or window: the runner's padding conventions make every extra slot a
no-op). ``choose(decode, need)`` answers with the shape to run:

1. the cheapest compiled shape that holds ``need`` and costs at most 1.5x
   as much (a little padding beats seconds of compiling);
2. else, while fewer than ``max_shapes`` shapes of this kind (decode, or
   prefill/mixed) exist, ``need`` itself (a new compilation);
3. else the cheapest compiled shape that holds ``need``, however padded;
4. else (nothing compiled holds it) the elementwise maximum of ``need`` and
   every compiled shape: a new shape that holds all earlier ones, so every
   later step finds a home and compilation stops.

So at most ``max_shapes`` + 1 + (the number of distinct bucket values over
all dimensions) programs of each kind are ever built: past the bound, a new
shape is the maximum of everything so far, which either raises some
dimension's largest value or is the one shape that holds all others. A shape's cost is a rough model of a step's work,
in tokens through the weights: 16 (streaming the weights once) + the tokens T
(decode rows are one token each) + the attention of the padded shape, every
query row against its ``pages x page_size`` keys, at ``attention_weight``
tokens per (query, key) pair (``2 N H / per-layer weights``; 3.3e-4 for
SmolLM2). The padded query window matters most: a prefill shape with a
512-token window and 64 pages per row costs 1,000 times a 16-token one's
attention. Prompt-logprob rows and top-N only have to fit. Sampling (``_postprocess``) is keyed by the row
dimensions of the chosen shape, so it is bounded with them.
"""

from __future__ import annotations


class StepShapes:
    """The compiled step shapes of a runner, by kind.

    Args:
      max_shapes: shapes of each kind compiled freely before steps are
        placed in existing ones (rule 3 above).
      page_size: tokens per KV page.
      attention_weight: one (query, key) pair of attention in tokens through
        the weights (the cost model above).

    Raises:
      ValueError: ``max_shapes`` below 1.
    """

    def __init__(self, max_shapes: int, page_size: int = 16, attention_weight: float = 3e-4):
        if max_shapes < 1:
            raise ValueError(f"max_step_shapes must be >= 1, got {max_shapes}")
        self.max_shapes = max_shapes
        self.key_weight = page_size * attention_weight  # per (query row, page)
        self.shapes: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
        self.num_reused = 0  # steps run in a larger compiled shape than their own

    def cost(self, decode: bool, shape: tuple[int, ...]) -> float:
        """The model of a step's work above, in tokens. Decode shapes are
        ``(rows, pages, top)``; prefill shapes ``(decode rows, prefill rows,
        prefill tokens, pages, query window, prompt-logprob rows, top)``."""
        if decode:
            rows, pages = shape[0], shape[1]
            return 16 + rows + rows * pages * self.key_weight
        bd, sp, tp, pages, window = shape[:5]
        return 16 + bd + tp + (bd + sp * window) * pages * self.key_weight

    def choose(self, decode: bool, need: tuple[int, ...]) -> tuple[int, ...]:
        """The shape (same length as ``need``, each entry >= need's) to run a
        step of this kind in; records it as compiled."""
        have = self.shapes[decode]
        if need in have:
            return need
        holds = [s for s in have if all(a >= b for a, b in zip(s, need))]
        limit = 1.5 * self.cost(decode, need)
        near = [s for s in holds if self.cost(decode, s) <= limit]
        if near or (holds and len(have) >= self.max_shapes):
            self.num_reused += 1
            return min(near or holds, key=lambda s: self.cost(decode, s))
        shape = need if len(have) < self.max_shapes else \
            tuple(max(col) for col in zip(need, *have))
        have.append(shape)
        return shape


__all__ = ["StepShapes"]
