"""Step shapes: the bucket ladder and the finite set of XLA programs a config reaches.

A step's only static dimensions are its token count T and its row count S
(``AttentionMetadata``'s shapes); how many rows are decode rows, how many
sequences are real, their kv lengths and their pages are device values, and
the attention (``pallas_kernels.ragged_paged_attention.kernel_xla`` on CPU,
the Pallas kernels on GPU/TPU) loops over what is real. So:

* T is the step's token count rounded up the **ladder**: 1..8, then four
  values per octave, ``m * 2^k`` for m in 4, 5, 6, 7 (8, 10, 12, 14, 16, 20,
  24, 28, 32, 40, ...): a step pads its tokens by less than 25%, where powers
  of two pad by up to 100%.
* S = min(T, the ladder value of ``max_num_seqs``): every row computes at
  least one token, so a step never has more rows than tokens; padding rows
  cost only their sampling row.
* the page table is always ``pages_per_row`` wide (``max_model_len`` /
  page size, rounded up to whole page blocks): its width is no dimension.
* prompt logprobs are computed from the step's last-layer output by a small
  jit (LM head and log-softmax over the T tokens), one per T, on first use.

``step_token_counts`` lists every T a config can reach, so ``--mode serve``
compiles all of them before it reports ready. For SmolLM2 with the default
2,048-token budget that is 40 programs (48 with chunked prefill off and an
8k context), against thousands of (rows x pages x window) shapes before.
"""

from __future__ import annotations


def bucket(n: int) -> int:
    """The smallest ladder value >= n (n >= 1): exact up to 8, then
    ``m * 2^k`` with m in {4, 5, 6, 7}, so ``bucket(n) < 1.25 * n``.

    Raises:
      ValueError: n below 1.
    """
    if n < 1:
        raise ValueError(f"bucket: n must be >= 1, got {n}")
    if n <= 8:
        return n
    shift = n.bit_length() - 3  # keep the top three bits
    top = n >> shift
    if top << shift < n:
        top += 1
    return top << shift


def ladder(hi: int, lo: int = 1) -> list[int]:
    """Every ladder value from ``bucket(lo)`` to ``bucket(hi)``, ascending."""
    out, n = [], bucket(lo)
    while n <= bucket(hi):
        out.append(n)
        n = bucket(n + 1)
    return out


def step_token_counts(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                      enable_chunked_prefill: bool = True) -> list[int]:
    """Every step token count T a scheduler with these limits can produce.

    A step computes at most the token budget, except that without chunked
    prefill one prompt longer than the budget runs whole (up to
    ``max_model_len`` tokens) beside the decodes."""
    hi = max(max_num_batched_tokens, max_num_seqs)
    if not enable_chunked_prefill:
        hi = max(hi, max_model_len + max_num_seqs)
    return ladder(hi)


__all__ = ["bucket", "ladder", "step_token_counts"]
