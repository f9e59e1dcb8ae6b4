"""Step shapes: the bucket ladders and the finite set of XLA programs a config reaches.

A step's only static dimensions are its token count T, its row count S and
which of the two step programs runs it (``runner.ModelRunner``); how many
rows are decode rows, how many sequences are real, their kv lengths and their
pages are device values, and the attention loops over what is real. So:

* a **decode step** (every row one new token: ``decode_step``) has T = S =
  the row count rounded up the **decode ladder**, two values per octave
  (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, ...: ``m * 2^k`` for m in 2, 3),
  up to the ladder value of ``max_num_seqs``. Decode streams the weights
  once whatever the row count, so a padded row costs only its attention and
  sampling: 12 programs for 64 rows.
* a **prefill step** (prompt chunks or verified drafts, decode rows riding
  along: ``prefill_step``) has T = its token count rounded up the **prefill
  ladder**, two values per octave from 16 (16, 24, 32, 48, ..., 1536, 2048),
  and S = min(T, the decode ladder value of ``max_num_seqs``): under 50%
  padding, 15 programs for a 2,048-token budget. (The single ladder before,
  four values per octave from 1 for both kinds, gave 40 programs.)
* the page table is always ``pages_per_row`` wide (``max_model_len`` /
  page size, rounded up to whole page blocks): its width is no dimension.
* prompt logprobs are computed from the step's last-layer output by a small
  jit (LM head and log-softmax over the T tokens), one per T, on first use.

``bucket`` and ``ladder`` (four values per octave) remain the finer ladder
that speculative decoding's cost model keys its samples by.
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


# The smallest prefill step: a prompt chunk shorter than this pads to it.
MIN_PREFILL_TOKENS = 16


def coarse_bucket(n: int, lo: int = 1) -> int:
    """The smallest value >= max(n, lo) of the two-per-octave ladder
    ``m * 2^k``, m in {2, 3} (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), so
    ``coarse_bucket(n) < 1.5 * n`` for n >= lo.

    Raises:
      ValueError: n below 1.
    """
    if n < 1:
        raise ValueError(f"coarse_bucket: n must be >= 1, got {n}")
    n = max(n, lo)
    if n <= 4:
        return n
    shift = n.bit_length() - 2  # keep the top two bits
    top = n >> shift
    if top << shift < n:
        top += 1
    return top << shift


def coarse_ladder(hi: int, lo: int = 1) -> list[int]:
    """Every ``coarse_bucket`` value from ``coarse_bucket(lo)`` to
    ``coarse_bucket(hi)``, ascending."""
    out, n = [], coarse_bucket(lo)
    while n <= coarse_bucket(hi):
        out.append(n)
        n = coarse_bucket(n + 1)
    return out


def decode_bucket(rows: int, max_rows: int) -> int:
    """T = S of a decode step of ``rows`` rows (``coarse_bucket``).

    Raises:
      ValueError: rows below 1 or above ``max_rows``.
    """
    if not 1 <= rows <= max_rows:
        raise ValueError(f"decode step of {rows} rows; the runner holds 1..{max_rows}")
    return coarse_bucket(rows)


def decode_buckets(max_rows: int) -> list[int]:
    """Every decode step's T = S up to ``max_rows`` rows."""
    return coarse_ladder(max_rows)


def prefill_bucket(tokens: int, max_tokens: int) -> int:
    """T of a prefill step of ``tokens`` tokens (``coarse_bucket``, at least
    ``MIN_PREFILL_TOKENS``). A scheduler never exceeds ``max_tokens``; the
    scoring paths that build their own batches (``Engine.last_token_logits``,
    eval's ``prompt_logits``) may, and get a bucket past the warmed-up set
    (compiled on first use).

    Raises:
      ValueError: tokens below 1.
    """
    if tokens < 1:
        raise ValueError(f"prefill step of {tokens} tokens; a step has at least 1")
    return coarse_bucket(tokens, MIN_PREFILL_TOKENS)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Every prefill step's T up to ``max_tokens`` tokens (at least the
    ``MIN_PREFILL_TOKENS`` bucket, which a smaller budget's steps pad to)."""
    return coarse_ladder(max(max_tokens, MIN_PREFILL_TOKENS), MIN_PREFILL_TOKENS)


def max_step_tokens(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                    enable_chunked_prefill: bool = True) -> int:
    """The most tokens one step of a scheduler with these limits computes:
    the token budget, except that without chunked prefill one prompt longer
    than the budget runs whole (up to ``max_model_len`` tokens) beside the
    decodes."""
    hi = max(max_num_batched_tokens, max_num_seqs)
    if not enable_chunked_prefill:
        hi = max(hi, max_model_len + max_num_seqs)
    return hi


__all__ = ["MIN_PREFILL_TOKENS", "bucket", "coarse_bucket", "coarse_ladder", "decode_bucket",
           "decode_buckets", "ladder", "max_step_tokens", "prefill_bucket", "prefill_buckets",
           "step_token_counts"]
