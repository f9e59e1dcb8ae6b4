"""What a request asks of sampling: ``SamplingParams`` and
``StructuredOutputsParams`` (vLLM's names and checks), with the limits they
enforce and the text checks the frontends share.

Every check runs once, in ``__post_init__``, and raises ``ValueError`` naming
the field and the value.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Largest ``logprobs`` / ``prompt_logprobs`` a request may ask (vLLM's max_logprobs).
MAX_LOGPROBS = 20
# Largest ``temperature``. Sampling divides the float32 logits by it
# (``sampling.sample``); up to this bound logits/T of any logit above 1e-34
# in magnitude stays a normal float32, so the order of the logits, and with
# it top-k / top-p / min-p, is exact, while the distribution inside the
# filter is already uniform to 1e-3 for logits that span 10. Beyond it
# logits/T underflow towards 0, ties appear and a filter no longer holds
# (3e38 made every token pass top_k 3). vLLM sets no maximum; OpenAI's is 2.
MAX_TEMPERATURE = 1e4
# Most ``logit_bias`` entries of one request (OpenAI's limit): the sampler
# carries a fixed [rows, MAX_LOGIT_BIAS] table, so no step shape depends on it.
MAX_LOGIT_BIAS = 300
# OpenAI's bound on each ``logit_bias`` value.
LOGIT_BIAS_RANGE = 100.0


def escape_text(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) written as
    backslash escapes (``"\\ud800"``), for error messages and logs that echo
    a client's value."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def float32_of(value) -> float:
    """``value`` as the float32 the device will use (0.0 for what underflows,
    inf for what overflows); NaN for what is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    try:
        with np.errstate(over="ignore", under="ignore"):
            return float(np.float32(value))
    except OverflowError:  # an int beyond float64
        return math.inf if value > 0 else -math.inf


def check_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8: no lone surrogate,
    as ``surrogateescape`` makes of undecodable bytes in ``sys.argv``).

    Raises:
      ValueError: ``"<what>: is not valid Unicode: lone surrogate U+DCFF at
        character 3 (byte 0xff that was not UTF-8)"``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        byte = f" (byte 0x{c - 0xDC00:02x} that was not UTF-8)" if 0xDC80 <= c <= 0xDCFF else ""
        raise ValueError(f"{what}: is not valid Unicode: lone surrogate U+{c:04X} at "
                         f"character {e.start}{byte}") from None
    return text


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output: exactly one of its fields (vLLM's
    ``StructuredOutputsParams``; OpenAI's ``response_format`` and vLLM's
    ``guided_*`` fields map onto it).

    Attributes:
      json: a JSON Schema (a dict, or its JSON text): the output is one JSON
        value that validates against it.
      regex: the output matches this regular expression (whole output).
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar in Lark syntax (or GBNF/EBNF as the
        grammar backend takes it; ``jaxserve.engine.structured``).
      json_object: the output is one JSON object, any keys
        (``response_format: {"type": "json_object"}``).

    Raises:
      ValueError: none or more than one field set, or a field of the wrong
        type (naming it). A schema, regex or grammar the backend cannot
        compile is refused when the request is added
        (``jaxserve.engine.structured``).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        set_ = [f for f in ("json", "regex", "choice", "grammar")
                if getattr(self, f) is not None] + (["json_object"] if self.json_object else [])
        if len(set_) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema (object or its "
                             f"JSON text), got {type(self.json).__name__}")
        for f in ("regex", "grammar"):
            v = getattr(self, f)
            if v is not None:
                if not isinstance(v, str) or not v:
                    raise ValueError(f"structured_outputs.{f} must be a non-empty string, "
                                     f"got {v!r:.80}")
                check_text(v, f"structured_outputs.{f}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or any(
                    not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))
            for i, c in enumerate(self.choice):
                check_text(c, f"structured_outputs.choice[{i}]")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got "
                             f"{self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which field is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for f in ("json", "regex", "choice", "grammar"):
            if getattr(self, f) is not None:
                return f
        return "json_object"


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's output (vLLM's ``SamplingParams``).

    Attributes:
      max_tokens: most output tokens (>= 1).
      temperature: in [0, ``MAX_TEMPERATURE``]; 0 means greedy.
      top_k: keep the k most likely tokens; 0 or -1 turns it off.
      top_p: nucleus mass in (0, 1]; 1 turns it off.
      min_p: in [0, 1]; drop tokens below min_p * the top probability.
      seed: per-request seed; the same seed gives the same tokens alone or
        batched. None draws one from the engine's seed.
      stop: strings that end the output (not included in the text).
      stop_token_ids: ids that end the output (included in token_ids).
      ignore_eos: keep going past EOS.
      min_tokens: EOS and stop ids are suppressed until this many tokens.
      n: independent choices sampled for the prompt; they share its pages.
        With a seed, choice i uses seed + i (vLLM).
      logprobs: None, or return the log probability of each sampled token and
        the top ``logprobs`` candidates (0..20) per position, from the raw
        model distribution (before penalties, temperature and filters).
      prompt_logprobs: None, or the same for every prompt token but the first.
        Such requests skip the prefix cache (every position must be computed).
      presence_penalty, frequency_penalty: in [-2, 2]; subtract
        ``presence * (count > 0) + frequency * count`` over the output so far
        (OpenAI definitions).
      repetition_penalty: > 0 and finite as float32; 1 is off. Tokens seen in the prompt or output
        have their logit divided by it when positive, multiplied when negative
        (Keskar et al. 2019, CTRL; HF ``RepetitionPenaltyLogitsProcessor``).
      skip_special_tokens: leave special tokens out of the output text
        (token ids keep them).
      include_stop_str_in_output: the text ends with the stop string that
        matched instead of just before it.
      structured_outputs: a ``StructuredOutputsParams`` the output must
        satisfy (JSON Schema, regex, choice, grammar), applied as a token
        bitmask in the sampler; None: unconstrained.
      logit_bias: {token id: bias in [-100, 100]} added to the logits before
        sampling (OpenAI's; at most ``MAX_LOGIT_BIAS`` entries).
      allowed_token_ids: only these ids may be sampled (vLLM's).
      bad_words: words never generated (vLLM's): each is tokenized (with and
        without a leading space) and its last token is banned wherever the
        output so far ends with the tokens before it.

    Every float is checked as the float32 the device samples with
    (``float32_of``), so no value passes here that overflows, underflows
    to 0, or turns a filter off on the device.

    Raises:
      ValueError: naming the field and value, from ``__post_init__``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self):
        def bad(field, why):
            got = repr(getattr(self, field))
            got = got if len(got) <= 80 else got[:77] + "..."
            raise ValueError(f"SamplingParams.{field} {why}, got {got}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        # Floats are checked as the device's float32 values (``float32_of``):
        # 1e-300 is 0 there and 1e39 is inf.
        t32 = float32_of(self.temperature)
        if not 0.0 <= t32 <= MAX_TEMPERATURE:
            bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (as float32)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 < float32_of(self.top_p) <= 1.0:
            bad("top_p", "must be in (0, 1] (as float32)")
        if not 0.0 <= float32_of(self.min_p) <= 1.0:
            bad("min_p", "must be in [0, 1] (as float32)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            bad("seed", "must be an integer in [0, 2**32)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        for i, s in enumerate(self.stop):
            check_text(s, f"SamplingParams.stop[{i}]")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative integers")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for f in ("logprobs", "prompt_logprobs"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)
                                  or not 0 <= v <= MAX_LOGPROBS):
                bad(f, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not -2.0 <= float32_of(v) <= 2.0:
                bad(f, "must be in [-2, 2] (as float32)")
        r32 = float32_of(self.repetition_penalty)
        if not (math.isfinite(r32) and r32 > 0):
            bad("repetition_penalty", "must be a finite number > 0 (as float32)")
        for f in ("skip_special_tokens", "include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be a bool")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a dict {token id: bias}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"must have at most {MAX_LOGIT_BIAS} entries")
            lb = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)  # JSON object keys arrive as strings
                except (TypeError, ValueError):
                    bad("logit_bias", f"keys must be token ids, not {k!r:.40}")
                if isinstance(k, (bool, float)) or tid < 0 or str(tid) != str(k).strip():
                    bad("logit_bias", f"keys must be non-negative token ids, not {k!r:.40}")
                if not -LOGIT_BIAS_RANGE <= float32_of(v) <= LOGIT_BIAS_RANGE:
                    bad("logit_bias", f"values must be numbers in [-100, 100], not {v!r:.40} "
                        f"(token {tid})")
                lb[tid] = float(v)
            self.logit_bias = lb or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not ids or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                bad("bad_words", "must be a list of non-empty strings")
            self.bad_words = list(self.bad_words)
            for i, w in enumerate(self.bad_words):
                check_text(w, f"SamplingParams.bad_words[{i}]")

    def with_stop(self, stop: tuple[str, ...] | list[str]) -> "SamplingParams":
        """A copy that also stops at each of ``stop`` (those not already
        there); ``self`` when there is nothing to add. Chat entry points
        pass ``Tokenizer.chat_stop``."""
        extra = [s for s in stop if s not in self.stop]
        return dataclasses.replace(self, stop=self.stop + extra) if extra else self

    @property
    def has_token_mask(self) -> bool:
        """Whether the host fills a token bitmask for this request's rows
        (structured outputs, allowed_token_ids or bad_words)."""
        return (self.structured_outputs is not None or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
