"""Prefix-cache benchmark: TTFT of a request whose long system prompt is
already cached, against the same request cold.

Each trial builds a fresh system prompt of about ``system_len`` tokens (real
English text, re-tokenized, with a trial-specific opening line so trials do
not share pages) and two user turns of a few dozen tokens. The cold request is
system prompt + first turn on an empty cache; the warm one is system prompt +
second turn right after it, so every full page of the system prompt is a
cache hit and only the tail is prefilled. Requests run alone (no batching),
``output_len`` tokens each. A warm-up trial compiles every shape first, then
the cache is emptied. Reports TTFT in ms (median over trials) and the cached
token counts.
"""

from __future__ import annotations

import dataclasses
import statistics

from jaxserve.bench.workloads import PREFIX_TURNS, system_prompt
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class PrefixResult:
    trials: int
    system_tokens: int
    cold_ttft_ms: list[float]
    warm_ttft_ms: list[float]
    warm_cached_tokens: list[int]

    @property
    def cold_p50(self) -> float:
        return statistics.median(self.cold_ttft_ms)

    @property
    def warm_p50(self) -> float:
        return statistics.median(self.warm_ttft_ms)


def _ttft(engine: Engine, ids: list[int], output_len: int) -> tuple[float, int]:
    rid = engine.add_request(None, ids, SamplingParams(temperature=0, max_tokens=output_len,
                                                       ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.metrics.ttft_ms, out.metrics.num_cached_tokens


def run(engine: Engine, *, trials: int = 3, system_len: int = 1000,
        output_len: int = 8) -> PrefixResult:
    """Measure cold and cached TTFT; see the module docstring.

    Raises:
      ValueError: the engine has no tokenizer or prefix caching is off.
    """
    if engine.tokenizer is None:
        raise ValueError("the prefix-cache benchmark needs a model with a tokenizer")
    if not engine.prefix_caching:
        raise ValueError("prefix caching is off (--enable_prefix_caching=false)")
    tok = engine.tokenizer
    turns = [tok.encode(t) for t in PREFIX_TURNS]
    cold, warm, cached = [], [], []
    for trial in range(-1, trials):  # trial -1 compiles
        system = system_prompt(tok, trial, system_len)
        c_ms, c_cached = _ttft(engine, system + turns[0], output_len)
        w_ms, w_cached = _ttft(engine, system + turns[1], output_len)
        if trial >= 0:
            assert c_cached == 0, c_cached
            cold.append(c_ms)
            warm.append(w_ms)
            cached.append(w_cached)
        engine.reset_prefix_cache()
    return PrefixResult(trials, system_len, cold, warm, cached)


def format_result(r: PrefixResult) -> str:
    return (f"prefix cache, {r.trials} trials, {r.system_tokens}-token system prompt + a "
            f"~20-token user turn, alone:\n"
            f"  cold TTFT p50 {r.cold_p50:.1f} ms  ({', '.join(f'{x:.0f}' for x in r.cold_ttft_ms)})\n"
            f"  cached TTFT p50 {r.warm_p50:.1f} ms  ({', '.join(f'{x:.0f}' for x in r.warm_ttft_ms)})"
            f", {r.warm_cached_tokens[0]} prompt tokens from the cache\n"
            f"  speed-up {r.cold_p50 / r.warm_p50:.1f}x")
