"""Speculative decoding's policy: how many draft tokens k each step verifies
(``SpecPolicy.choose_k``), from measured acceptance and step costs.

Letters: R decode rows of a step, K draft positions (``max_k``).

With conditional acceptances alpha_j = P(draft j accepted | drafts < j
accepted), a row verifying k drafts
yields 1 + E_k tokens, E_k = sum_{i=1..k} prod_{j<i} alpha_j (Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding": their
(1 - alpha^(k+1)) / (1 - alpha) for one alpha, here per position; the 1 is
the target's own token, always produced). A
step of R decode rows and O other (prefill) tokens then generates, per
second::

    tps(k) = R (1 + E_k) / (cost(R (k+1) + O) + k draft_cost(R)),   k >= 1
    tps(0) = R / cost(R + O)

``choose_k`` returns argmax_k tps(k), the smallest such k on ties. Because
cost(T) is flat while decode is bandwidth-bound and grows once it is
compute-bound, the chosen k falls smoothly as R grows instead of flipping at
a batch-size threshold (vLLM #49548: a hard threshold whose flip collapsed
throughput).

*Hysteresis*: from off (k = 0) speculation turns on only when the best gain
tps(k*) / tps(0) >= ``min_gain`` (1.05); once on it stays on while the gain
is >= 1.0. A gain inside [1.0, min_gain) keeps whichever state it found, so
estimation noise around break-even does not flap k.

*Target cost* cost(T), T the step's total tokens: ``cost_fn`` if given, else
learned from ``observe_step`` (device seconds of steps that did not compile).
Samples are keyed by ``shapes.bucket(T)``, the padded token count the device
really ran; each bucket keeps a running mean (an EMA of weight 1/8 after 8
samples) of samples clipped to [1/2, 2] x its estimate once it has 3, so a
stray slow step moves it by at most 1/8. Prediction fits the buckets with a
weighted isotonic regression (pool adjacent violators: a step of more tokens
never costs less), interpolates linearly between fitted buckets, holds the
largest bucket's cost flat above it, and scales the smallest bucket's cost in
proportion to T below it. Both extrapolations favour the option whose cost is
unknown: above the data speculation looks free, below it plain decoding
looks cheap, so whichever is unmeasured gets chosen once and measured, and
the policy can never stay on only because it never saw what k = 0 costs.
With no sample at all cost is flat in T (bandwidth-bound decode) and the
draft cost is taken as 0, so speculation is tried first. A bucket with
fewer than 3 samples may lower a prediction but not raise it (the
prediction is the smaller of the fit over all buckets and the fit over the
trusted ones): one stray slow verification step, seen once before the
policy turned off, would otherwise price speculation out for good, since
while off that bucket is never measured again (seen on SmolLM2: a first
4-token step of 140 ms against 48 ms after; the policy then stayed at k = 0
for a whole copy workload). A bucket that is truly slow is measured 3 times
and then trusted.

*Draft cost* draft_cost(R), seconds for one draft token of R rows:
``draft_cost_fn`` if given, else learned the same way from
``observe_draft_step`` (one draft-model decode step), 0 before any sample;
for "ngram" it is 0 unless given or observed.

*Acceptance*: per position j, discounted counts a_j (accepted) and n_j
(tested) forget by (1 - 1/256) per observation of j, and alpha_j =
(a_j + 4 p) / (n_j + 4), p = ``prior_acceptance``: the prior weighs like 4
observations, and the estimate follows the last ~256 rows that tested j. A
verified row with d drafts and a accepted tests positions 0..min(a, d-1);
a row verified with 0 drafts (the proposer found nothing while k > 0) counts
as a rejection at position 0, so alpha_0 includes the proposer's hit rate,
which is what the step's throughput sees.

*Coming back*: a policy that switched off must be able to switch on again
(vLLM #4565, whose first step #4592 could not re-enable speculation for a
request once it was disabled) and its estimate must not go stale
(TensorRT-LLM #16888; its gates #7283 / #12905 turn speculation off for good
once a rolling acceptance falls below a threshold). For "ngram" the engine
keeps proposing while k = 0 and reports what would have been accepted
(``observe_shadow``, same update as ``observe_acceptance``). When no
acceptance or shadow observation arrived since the previous call (always so
for "draft"), each ``choose_k`` made while off multiplies every a_j, n_j by
0.99, so the estimate returns toward the prior (half-way in ~70 calls) and
eventually probes again; a probe that finds acceptance still low turns off
within a few dozen rows.

Not modelled: attention cost growing with context length (cost depends on T
only), and the host time an ngram step spends waiting for the previous
step's tokens before it can propose.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

from jaxserve.engine.shapes import bucket

_ACCEPT_FORGET = 1.0 - 1.0 / 256  # per observation of a position: ~256-row memory
_PRIOR_WEIGHT = 4.0  # prior_acceptance counts as this many observations
_OFF_DECAY = 0.99  # per choose_k while off with no fresh observation
_COST_EMA_MIN_WEIGHT = 1.0 / 8  # running mean for 8 samples, then EMA 1/8
_COST_CLIP_AFTER = 3  # samples before new ones are clipped to [1/2, 2] x estimate
_COST_FIT_WEIGHT_CAP = 16  # isotonic weight of a bucket: its sample count, capped
_COST_TRUST = 3  # samples before a bucket's estimate may raise a prediction
_MIN_SECONDS = 1e-12  # floor of a predicted cost, so tps never divides by zero


class _CostCurve:
    """Seconds as a monotone non-decreasing function of a count (tokens or
    rows), learned from samples keyed by ``shapes.bucket(count)``; see the
    module docstring ("Target cost") for the estimator and extrapolation."""

    def __init__(self):
        self._est: dict[int, list[float]] = {}  # bucket -> [seconds, samples]
        self._fit: tuple[list[int], list[float]] | None = None

    def __bool__(self) -> bool:
        return bool(self._est)

    def observe(self, count: int, seconds: float) -> None:
        b = bucket(count)
        if b not in self._est:
            self._est[b] = [seconds, 1.0]
        else:
            est = self._est[b]
            if est[1] >= _COST_CLIP_AFTER:
                seconds = min(max(seconds, 0.5 * est[0]), 2.0 * est[0])
            est[1] += 1
            est[0] += (seconds - est[0]) * max(1.0 / est[1], _COST_EMA_MIN_WEIGHT)
        self._fit = None

    @staticmethod
    def _isotonic(est: dict) -> tuple[list[int], list[float]]:
        """Weighted pool-adjacent-violators over the buckets, ascending."""
        blocks: list[list[float]] = []  # [value, weight, num buckets pooled]
        xs = sorted(est)
        for x in xs:
            value, n = est[x]
            blocks.append([value, min(n, _COST_FIT_WEIGHT_CAP), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                v2, w2, c2 = blocks.pop()
                v1, w1, c1 = blocks[-1]
                blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
        return xs, [v for v, _, c in blocks for _ in range(c)]

    def _fitted(self) -> tuple:
        """The fit over every bucket, and the fit over the trusted ones
        (>= ``_COST_TRUST`` samples; None when none or all are)."""
        if self._fit is None:
            trusted = {x: e for x, e in self._est.items() if e[1] >= _COST_TRUST}
            self._fit = (self._isotonic(self._est),
                         self._isotonic(trusted) if 0 < len(trusted) < len(self._est)
                         else None)
        return self._fit

    def __call__(self, count: int) -> float:
        full, trusted = self._fitted()
        value = self._interpolate(*full, count)
        if trusted is not None:  # a bucket of 1-2 samples may only lower the estimate
            value = min(value, self._interpolate(*trusted, count))
        return value

    @staticmethod
    def _interpolate(xs, ys, count: int) -> float:
        b = bucket(max(1, count))
        if b <= xs[0]:
            return ys[0] * b / xs[0]
        if b >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_left(xs, b)
        if xs[i] == b:
            return ys[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


class SpecPolicy:
    """Chooses each step's k in 0..max_k so that expected tokens per second
    never falls below plain decoding (model, hysteresis and estimators: the
    module docstring).

    Attributes:
      k: the value ``choose_k`` last returned (0 before the first call).
      max_k, method, min_gain, prior_acceptance: as given.
    """

    def __init__(self, max_k: int, *, method: str,
                 cost_fn: Callable[[int], float] | None = None,
                 draft_cost_fn: Callable[[int], float] | None = None,
                 prior_acceptance: float = 0.7, min_gain: float = 1.05):
        """
        Args:
          max_k: most drafts per row, >= 1.
          method: "ngram" (the engine reports shadow acceptance while off)
            or "draft" (a draft model; no shadow, estimates decay while off).
          cost_fn: cost_fn(T) = seconds of one target step of T tokens;
            None: learned from ``observe_step``.
          draft_cost_fn: draft_cost_fn(R) = seconds to propose one draft
            token for R rows; None: learned from ``observe_draft_step``
            (0 until a sample arrives).
          prior_acceptance: starting alpha_j, in [0, 1].
          min_gain: gain over k = 0 needed to switch on, >= 1.0.

        Raises:
          ValueError: any argument out of range, naming it.
        """
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"SpecPolicy: max_k must be an int >= 1, got {max_k!r}")
        if method not in ("ngram", "draft"):
            raise ValueError(f"SpecPolicy: method must be 'ngram' or 'draft', got {method!r}")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"SpecPolicy: prior_acceptance must be in [0, 1], "
                             f"got {prior_acceptance}")
        if not (math.isfinite(min_gain) and min_gain >= 1.0):
            raise ValueError(f"SpecPolicy: min_gain must be finite and >= 1.0, got {min_gain}")
        for name, fn in (("cost_fn", cost_fn), ("draft_cost_fn", draft_cost_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"SpecPolicy: {name} must be callable or None, got {fn!r}")
        self.max_k = max_k
        self.method = method
        self.prior_acceptance = float(prior_acceptance)
        self.min_gain = float(min_gain)
        self.k = 0
        self._cost_fn = cost_fn
        self._draft_cost_fn = draft_cost_fn
        self._cost = _CostCurve()
        self._draft_cost = _CostCurve()
        self._accepted_K = [0.0] * max_k  # discounted accepted count per position
        self._tested_K = [0.0] * max_k  # discounted tested count per position
        self._on = False  # hysteresis state (unchanged by rows == 0 steps)
        self._fresh = False  # an acceptance/shadow observation since the last choose_k

    # -- observations -----------------------------------------------------

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """One target step's real token count and device seconds (a step that
        compiled must not be passed). Ignored when ``cost_fn`` was given.

        Raises:
          ValueError: num_tokens < 1 or seconds not finite and >= 0.
        """
        _check_sample("observe_step", "num_tokens", num_tokens, seconds)
        if self._cost_fn is None:
            self._cost.observe(num_tokens, float(seconds))

    def observe_draft_step(self, num_rows: int, seconds: float) -> None:
        """Seconds the proposer spent producing one draft token for
        ``num_rows`` rows (one draft-model decode step). Ignored when
        ``draft_cost_fn`` was given.

        Raises:
          ValueError: num_rows < 1 or seconds not finite and >= 0.
        """
        _check_sample("observe_draft_step", "num_rows", num_rows, seconds)
        if self._draft_cost_fn is None:
            self._draft_cost.observe(num_rows, float(seconds))

    def observe_acceptance(self, num_drafted: int, num_accepted: int) -> None:
        """One verified row of a step that speculated: ``num_drafted`` drafts,
        the first ``num_accepted`` accepted. num_drafted == 0 (nothing
        proposed for this row) counts as a rejection at position 0.

        Raises:
          ValueError: not 0 <= num_accepted <= num_drafted <= max_k.
        """
        self._observe("observe_acceptance", num_drafted, num_accepted)

    def observe_shadow(self, num_proposed: int, num_would_accept: int) -> None:
        """One row of a step that did not speculate (k = 0; "ngram"): the
        proposer's ``num_proposed`` drafts, of which the first
        ``num_would_accept`` match what the target then produced. Updates the
        estimates exactly as ``observe_acceptance``.

        Raises:
          ValueError: not 0 <= num_would_accept <= num_proposed <= max_k.
        """
        self._observe("observe_shadow", num_proposed, num_would_accept)

    def _observe(self, who: str, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted <= self.max_k:
            raise ValueError(f"SpecPolicy.{who}: need 0 <= accepted={num_accepted} <= "
                             f"drafted={num_drafted} <= max_k={self.max_k}")
        tested = min(num_accepted + 1, num_drafted) if num_drafted else 1
        for j in range(tested):
            self._accepted_K[j] = self._accepted_K[j] * _ACCEPT_FORGET + (j < num_accepted)
            self._tested_K[j] = self._tested_K[j] * _ACCEPT_FORGET + 1.0
        self._fresh = True

    # -- the model --------------------------------------------------------

    @property
    def acceptance(self) -> list[float]:
        """[K] the current alpha_j = P(draft j accepted | drafts < j accepted)."""
        c, p = _PRIOR_WEIGHT, self.prior_acceptance
        return [(a + c * p) / (n + c) for a, n in zip(self._accepted_K, self._tested_K)]

    @property
    def speculating(self) -> bool:
        """The hysteresis state: True once switched on, until switched off."""
        return self._on

    def expected_accepted(self, k: int) -> float:
        """E_k = sum_{i=1..k} prod_{j<i} alpha_j: expected accepted drafts of a
        row verifying k drafts (the target's own token not included)."""
        total, prod = 0.0, 1.0
        for alpha in self.acceptance[:k]:
            prod *= alpha
            total += prod
        return total

    def predicted_cost(self, num_tokens: int) -> float:
        """Seconds of a target step of ``num_tokens`` tokens (cost_fn, or the
        learned curve; 1.0 for any T before a sample)."""
        if self._cost_fn is not None:
            return float(self._cost_fn(num_tokens))
        return self._cost(num_tokens) if self._cost else 1.0

    def predicted_draft_cost(self, num_rows: int) -> float:
        """Seconds to propose one draft token for ``num_rows`` rows
        (draft_cost_fn, or the learned curve; 0.0 before a sample, and while
        the target cost has none)."""
        if self._draft_cost_fn is not None:
            return float(self._draft_cost_fn(num_rows))
        if not self._draft_cost or (self._cost_fn is None and not self._cost):
            return 0.0
        return self._draft_cost(num_rows)

    def tokens_per_second(self, k: int, num_decode_rows: int, num_other_tokens: int = 0) -> float:
        """Expected generated tokens per second of a step verifying k drafts
        on each of ``num_decode_rows`` rows beside ``num_other_tokens``
        prefill tokens (the module docstring's tps(k)).

        Raises:
          ValueError: k outside 0..max_k.
        """
        if not 0 <= k <= self.max_k:
            raise ValueError(f"SpecPolicy.tokens_per_second: k must be in 0..{self.max_k}, "
                             f"got {k}")
        rows, other = num_decode_rows, num_other_tokens
        if k == 0:
            return rows / max(self.predicted_cost(rows + other), _MIN_SECONDS)
        seconds = (self.predicted_cost(rows * (k + 1) + other)
                   + k * self.predicted_draft_cost(rows))
        return rows * (1.0 + self.expected_accepted(k)) / max(seconds, _MIN_SECONDS)

    # -- the choice -------------------------------------------------------

    def choose_k(self, num_decode_rows: int, num_other_tokens: int = 0) -> int:
        """k in 0..max_k for a step of ``num_decode_rows`` decode rows (each
        verifying k drafts: k + 1 tokens) and ``num_other_tokens`` prefill
        tokens: argmax tps(k), switched on only at gain >= min_gain and kept
        on while gain >= 1.0. Sets ``self.k``. num_decode_rows == 0 returns
        0 and leaves the on/off state as it was.

        Raises:
          ValueError: a negative argument.
        """
        if num_decode_rows < 0 or num_other_tokens < 0:
            raise ValueError(f"SpecPolicy.choose_k: num_decode_rows={num_decode_rows} and "
                             f"num_other_tokens={num_other_tokens} must be >= 0")
        if num_decode_rows == 0:
            self.k = 0
            return 0
        if not self._on and not self._fresh:
            for j in range(self.max_k):
                self._accepted_K[j] *= _OFF_DECAY
                self._tested_K[j] *= _OFF_DECAY
        self._fresh = False
        tps0 = self.tokens_per_second(0, num_decode_rows, num_other_tokens)
        best_k, best_tps = 0, -1.0
        for k in range(1, self.max_k + 1):
            tps = self.tokens_per_second(k, num_decode_rows, num_other_tokens)
            if tps > best_tps:
                best_k, best_tps = k, tps
        gain = best_tps / tps0
        self._on = gain >= (1.0 if self._on else self.min_gain)
        self.k = best_k if self._on else 0
        return self.k


class ForcedDraftPolicy:
    """Whether a step carries constrained rows' forced tokens as drafts
    (``constraints.forced_drafts``), and how many per row, so that tokens
    per second never fall below plain constrained decoding.

    A forced draft is accepted almost always (the grammar allows nothing
    else there) and costs no draft model, so, with the module docstring's
    cost(T), a step of R rows carrying D drafts generates R + D tokens::

        tps(D) = (R + D) / cost(R + D),   tps(0) = R / cost(R)

    ``choose`` caps every row at c drafts, c in 0..``max_drafts``, and takes
    the c of highest tps (the smallest on ties), switched on at a gain of
    ``min_gain`` over c = 0 and kept on while the gain is >= 1.0 (the
    hysteresis of ``SpecPolicy``). cost(T) is learned from ``observe_step``
    exactly as ``SpecPolicy``'s target cost, so unmeasured larger steps
    look free and are tried, then priced. On a CPU at batch 1 a step of 9
    tokens costs about what a step of 1 does and the drafts are taken; at a
    full batch (SmolLM2, batch 32, AMD EPYC) a drafted step cost 1.7x a
    plain one for 1.45x its tokens, and they are not.

    Args:
      min_gain: gain over no drafts needed to switch on, >= 1.0.
      cost_fn: cost_fn(T) = seconds of a step of T tokens; None: learned.

    Raises:
      ValueError: ``min_gain`` below 1.0 or not finite.
    """

    def __init__(self, min_gain: float = 1.05, cost_fn: Callable[[int], float] | None = None):
        if not (math.isfinite(min_gain) and min_gain >= 1.0):
            raise ValueError(f"ForcedDraftPolicy: min_gain must be finite and >= 1.0, "
                             f"got {min_gain}")
        self.min_gain = float(min_gain)
        self._cost_fn = cost_fn
        self._cost = _CostCurve()
        self.on = False  # the last choice carried drafts

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """One step's real token count and device seconds (not a step that
        compiled).

        Raises:
          ValueError: num_tokens < 1 or seconds not finite and >= 0.
        """
        _check_sample("observe_step", "num_tokens", num_tokens, seconds)
        self._cost.observe(num_tokens, float(seconds))

    def predicted_cost(self, num_tokens: int) -> float:
        """Seconds of a step of ``num_tokens`` tokens (1.0 before a sample)."""
        if self._cost_fn is not None:
            return float(self._cost_fn(num_tokens))
        return self._cost(num_tokens) if self._cost else 1.0

    def best_cap(self, num_rows: int, lengths: Sequence[int]) -> int:
        """The per-row cap c of drafts (0: none) for a step of ``num_rows``
        rows whose constrained rows have ``lengths`` forced tokens each, under
        the hysteresis state as it is (unchanged)."""
        rows = max(1, num_rows)
        tps0 = rows / max(self.predicted_cost(rows), _MIN_SECONDS)
        best_c, best_tps = 0, tps0
        for c in range(1, max(lengths, default=0) + 1):
            d = sum(min(c, n) for n in lengths)
            tps = (rows + d) / max(self.predicted_cost(rows + d), _MIN_SECONDS)
            if tps > best_tps:
                best_c, best_tps = c, tps
        return best_c if best_tps >= tps0 * (1.0 if self.on else self.min_gain) else 0

    def choose(self, num_rows: int, forced: dict) -> dict:
        """``forced`` ({sequence: its forced tokens}) cut to ``best_cap``
        tokens a row ({} for none); sets ``on``."""
        c = self.best_cap(num_rows, [len(f) for f in forced.values()])
        self.on = c > 0
        return {r: f[:c] for r, f in forced.items()} if c else {}


def _check_sample(who: str, name: str, count: int, seconds: float) -> None:
    if count < 1:
        raise ValueError(f"SpecPolicy.{who}: {name} must be >= 1, got {count}")
    if not (math.isfinite(seconds) and seconds >= 0.0):
        raise ValueError(f"SpecPolicy.{who}: seconds must be finite and >= 0, got {seconds}")



__all__ = ["ForcedDraftPolicy", "SpecPolicy"]
