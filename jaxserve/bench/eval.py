"""Quality of an engine config, measured (``--mode eval``): perplexity over a
held-out text and the KL divergence of its next-token distributions from a
reference config's, as llama.cpp's ``llama-perplexity`` (plain and
``--kl-divergence``) reports them.

Source of every definition: llama.cpp ``tools/perplexity/perplexity.cpp``
(``perplexity``, ``kl_divergence``, ``log_softmax``, ``mean_and_uncertainty``,
``percentile``).

Text and windows:
  the text (default ``data/python_reference.txt``, 12,170 SmolLM2 tokens;
  source and license in ``data/README.md``) is tokenized once without special
  tokens and cut into N = min(len, max_tokens) // C non-overlapping windows of
  C = ``context`` tokens (the tail is dropped). A tokenizer that adds BOS gets
  it in place of each window's first token, as llama.cpp does. Each window is
  one prefill in fresh pages (``Engine.prompt_logits``, f32[C, V]).

Scored positions:
  j = C/2 .. C-2 of each window (C - 1 - C/2 per window: 255 for C = 512),
  row j predicting token j + 1, so every scored token has at least C/2 tokens
  of context (llama.cpp's ``first = n_ctx/2``; HF's "perplexity of
  fixed-length models" with stride C/2 is the same idea).

Per scored position i, with log q_i the candidate's log-softmax, log p_i the
reference's (both in f64 from the f32 logits) and y_i the true next token:
  nll_i = -log q_i[y_i]        nll_ref_i = -log p_i[y_i]
  kld_i = sum_v p_i[v] (log p_i[v] - log q_i[v])      KL(P_ref || Q), nats
  dp_i = q_i[y_i] - p_i[y_i]   (probability of the true token, Q minus ref)
  same_top_i = argmax q_i == argmax p_i
and over all n scored positions:
  ppl = exp(mean nll), ref_ppl = exp(mean nll_ref);
  ln_ppl_ratio = mean nll - mean nll_ref, ppl_ratio = exp(ln_ppl_ratio),
  ppl_diff = ppl - ref_ppl, ppl_diff_pct = 100 (ppl_ratio - 1);
  ppl_correlation = Cor(nll, nll_ref) (llama.cpp's "Cor(ln(PPL(Q)), ln(PPL(base)))");
  kld: mean, max, min and the 99.9/99/95/90/50/10/5/1/0.1 percentiles
  (linear interpolation between sorted values, llama.cpp's ``percentile``
  and numpy's default); delta_p: mean, RMS and extremes; same_top_pct.
  Standard errors as llama.cpp: sqrt((mean(x^2) - mean(x)^2) / (n - 1)),
  0 for n <= 10; ppl's is ppl x stderr(nll); the ratio's uses the covariance
  of nll and nll_ref.

Differences from llama.cpp: the reference's log-probs are exact (llama.cpp
stores them as 16-bit codes and drops terms with log p < -16 from the KL);
both configs run in one process, window by window, so no base file is
written.

Reference: ``evaluate(candidate, ids, reference=...)`` compares any two
engines over the same model and tokenizer; the CLI builds the reference from
the candidate's engine args with quantization ``none`` and KV cache ``auto``
(``reference_args``). When the candidate is that config already, no second
engine runs: the candidate is its own reference and every KL figure is 0 by
construction (``reference_run`` false in the JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Sequence

import numpy as np
from tqdm import tqdm

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "python_reference.txt")
DEFAULT_CONTEXT = 512
DEFAULT_MAX_TOKENS = 4096
# kld percentiles reported (llama.cpp's), fraction -> JSON key.
_PERCENTILES = {0.999: "p99_9", 0.99: "p99", 0.95: "p95", 0.90: "p90", 0.5: "median",
                0.10: "p10", 0.05: "p5", 0.01: "p1", 0.001: "p0_1"}


def check_options(context: int, max_tokens: int) -> None:
    """Raises ValueError naming a bad ``context`` (tokens per window, >= 4, so
    that a window scores at least one position) or ``max_tokens`` (text
    tokens used, >= context)."""
    if context < 4:
        raise ValueError(f"eval_context must be >= 4 tokens, got {context}")
    if max_tokens < context:
        raise ValueError(f"eval_max_tokens must be >= eval_context ({context}), got {max_tokens}")


def load_text(path: str | None = None) -> tuple[str, str]:
    """(text, path) of ``path`` (UTF-8), default the shipped ``DEFAULT_TEXT``.

    Raises:
      ValueError: unreadable, not UTF-8 or empty.
    """
    path = path or DEFAULT_TEXT
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read eval_text {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"eval_text {path!r} is not UTF-8: {e}") from None
    if not text.strip():
        raise ValueError(f"eval_text {path!r} is empty")
    return text, path


def tokenize(engine, text: str) -> tuple[list[int], int | None]:
    """(token ids of ``text`` without special tokens, the BOS id to put first
    in each window or None when the tokenizer adds none).

    Raises:
      ValueError: the engine's model has no tokenizer.
    """
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("eval needs a model with a tokenizer")
    bos = tok.bos_token_id
    adds_bos = bos is not None and tok.encode("a")[:1] == [bos] \
        and tok.encode("a", add_special_tokens=False)[:1] != [bos]
    return tok.encode(text, add_special_tokens=False), bos if adds_bos else None


def make_windows(ids: Sequence[int], context: int, max_tokens: int,
                 bos: int | None = None) -> list[list[int]]:
    """The non-overlapping windows of ``context`` tokens of the first
    ``max_tokens`` ids (tail dropped), each with ``bos`` in place of its first
    token when given.

    Raises:
      ValueError: fewer than ``context`` ids, or bad options (``check_options``).
    """
    check_options(context, max_tokens)
    n = min(len(ids), max_tokens) // context
    if n == 0:
        raise ValueError(f"the eval text has {len(ids)} tokens, fewer than eval_context "
                         f"{context}")
    out = []
    for i in range(n):
        w = [int(t) for t in ids[i * context:(i + 1) * context]]
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


def log_softmax(logits):
    """f64[n, V] log-softmax of f32/f64[n, V] logits."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def score_window(logq_nV, logp_nV, targets_n) -> dict[str, np.ndarray]:
    """Per-position figures of one window (module docstring): f64[n] nll,
    nll_ref, kld, dp and bool[n] same_top, from the candidate's and the
    reference's f64[n, V] log-probs and the i32[n] true next tokens."""
    rows = np.arange(len(targets_n))
    lq, lp = logq_nV[rows, targets_n], logp_nV[rows, targets_n]
    return dict(nll=-lq, nll_ref=-lp,
                kld=(np.exp(logp_nV) * (logp_nV - logq_nV)).sum(axis=-1),
                dp=np.exp(lq) - np.exp(lp),
                same_top=logq_nV.argmax(axis=-1) == logp_nV.argmax(axis=-1))


def _mean_stderr(x) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: mean and its standard error."""
    n = len(x)
    mean = float(np.mean(x))
    var = float(np.mean(np.square(x))) - mean * mean
    return mean, (float(np.sqrt(var / (n - 1))) if var > 0 and n > 10 else 0.0)


def summarize(per: dict[str, np.ndarray]) -> dict:
    """The JSON figures (module docstring) of the concatenated per-position
    arrays of ``score_window``."""
    n = len(per["nll"])
    nll, se = _mean_stderr(per["nll"])
    nll_ref, se_ref = _mean_stderr(per["nll_ref"])
    cov = 0.0 if n < 10 else (float(np.mean(per["nll"] * per["nll_ref"])) - nll * nll_ref) / (n - 1)
    ppl, ref_ppl = float(np.exp(nll)), float(np.exp(nll_ref))
    ln_ratio = nll - nll_ref
    ln_ratio_se = float(np.sqrt(max(0.0, se * se + se_ref * se_ref - 2 * cov)))
    ratio = float(np.exp(ln_ratio))
    kld_mean, kld_se = _mean_stderr(per["kld"])
    kld = dict(mean=kld_mean, mean_stderr=kld_se, max=float(per["kld"].max()),
               **{k: float(np.quantile(per["kld"], q)) for q, k in _PERCENTILES.items()},
               min=float(per["kld"].min()))
    dp_mean, dp_se = _mean_stderr(per["dp"])
    same = float(np.mean(per["same_top"]))
    return dict(
        tokens_scored=n, ppl=ppl, ppl_stderr=ppl * se, ref_ppl=ref_ppl,
        ref_ppl_stderr=ref_ppl * se_ref,
        ppl_correlation=cov / (se * se_ref) if se > 0 and se_ref > 0 else None,
        ln_ppl_ratio=ln_ratio, ln_ppl_ratio_stderr=ln_ratio_se, ppl_ratio=ratio,
        ppl_ratio_stderr=ratio * ln_ratio_se, ppl_diff=ppl - ref_ppl,
        ppl_diff_pct=100.0 * (ratio - 1.0), kld=kld,
        delta_p=dict(mean=dp_mean, mean_stderr=dp_se,
                     rms=float(np.sqrt(np.mean(np.square(per["dp"])))),
                     max=float(per["dp"].max()), min=float(per["dp"].min())),
        same_top_pct=100.0 * same,
        same_top_pct_stderr=100.0 * float(np.sqrt(same * (1 - same) / (n - 1))) if n > 1 else 0.0)


def engine_config(engine) -> dict:
    """The numerics-relevant settings of an engine, for the JSON, and its
    ``weight_bytes`` (every array of the model state, as stored)."""
    from jaxserve.bench import formats
    c = engine.config
    return dict(dtype=c.dtype, quantization=c.quantization,
                quantization_group_size=c.quantization_group_size,
                quantize_lm_head=c.quantize_lm_head, kv_cache_dtype=c.cache.dtype or "auto",
                weight_bytes=formats.weight_bytes(engine)["total"])


def reference_args(engine_args: dict) -> dict:
    """The reference's engine args: the candidate's with quantization
    ``none`` and KV cache ``auto`` (the parameter dtype)."""
    return {**engine_args, "quantization": "none", "kv_cache_dtype": "auto"}


def is_reference(engine_args: dict) -> bool:
    """Whether ``engine_args`` already are their own reference config."""
    return engine_args.get("quantization", "none") == "none" and \
        engine_args.get("kv_cache_dtype", "auto") == "auto"


def evaluate(candidate, token_ids: Sequence[int], *, reference=None,
             context: int = DEFAULT_CONTEXT, max_tokens: int = DEFAULT_MAX_TOKENS,
             bos: int | None = None, progress: bool = True) -> dict:
    """Perplexity of ``candidate`` and its KL divergence from ``reference``
    over ``token_ids`` (module docstring has every definition).

    Args:
      candidate, reference: ``Engine``s over the same vocabulary; reference
        None means the candidate is its own reference (KL 0 by construction,
        one run per window; ``reference_run`` False). Passing the same engine
        twice runs it twice.
      token_ids: the text's ids (``tokenize``).
      context, max_tokens: window length and text tokens used, tokens.
      bos: id put first in each window (``tokenize``), or None.
      progress: a tqdm bar over the windows on stderr.

    Returns:
      a JSON-ready dict: ``context``, ``num_windows``, ``candidate`` and
      ``reference`` configs, ``reference_run``, ``seconds``,
      ``tokens_per_second`` (window tokens through every run per second) and
      the figures of ``summarize``.

    Raises:
      ValueError: bad options, too short a text, vocabularies that differ, or
        a window longer than an engine's max_model_len.
    """
    windows = make_windows(token_ids, context, max_tokens, bos)
    engines = [candidate] + ([reference] if reference is not None else [])
    vocab = {e.model_config.vocab_size for e in engines}
    if len(vocab) != 1:
        raise ValueError(f"candidate and reference vocabularies differ: {sorted(vocab)}")
    for e in engines:
        if context > e.max_model_len:
            raise ValueError(f"eval_context {context} exceeds max_model_len {e.max_model_len}")
    first = context // 2
    parts: list[dict] = []
    t0 = time.monotonic()
    for w in tqdm(windows, desc="eval", unit="window", disable=not progress, file=sys.stderr):
        logq = log_softmax(candidate.prompt_logits(w)[first:context - 1])
        logp = logq if reference is None else \
            log_softmax(reference.prompt_logits(w)[first:context - 1])
        parts.append(score_window(logq, logp, np.asarray(w[first + 1:], np.int64)))
    seconds = time.monotonic() - t0
    per = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return dict(
        context=context, num_windows=len(windows),
        scored=f"positions {first}..{context - 2} of each window (llama.cpp)",
        candidate=engine_config(candidate),
        reference=engine_config(reference if reference is not None else candidate),
        reference_run=reference is not None, seconds=seconds,
        tokens_per_second=len(windows) * context * len(engines) / seconds,
        **summarize(per))


def text_info(text: str, path: str, num_tokens: int) -> dict:
    """The JSON's ``text`` entry: path, SHA-256 of the UTF-8 text and token count."""
    return dict(path=path, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                tokens=num_tokens)


def _cfg(c: dict) -> str:
    q = c["quantization"] + (f"/g{c['quantization_group_size']}"
                             if c["quantization"] == "int4" else "")
    if c["quantization"] != "none" and not c.get("quantize_lm_head", True):
        q += ", LM head dense"
    return f"{c['dtype']}, weights {q}, KV cache {c['kv_cache_dtype']}"


def format_summary(r: dict) -> str:
    """Human-readable lines of an ``evaluate`` result, llama.cpp's labels."""
    k, d = r["kld"], r["delta_p"]
    ref = _cfg(r["reference"]) + ("" if r["reference_run"] else
                                  " (the candidate itself: no second run, KL 0 by construction)")
    cor = "-" if r["ppl_correlation"] is None else f"{100 * r['ppl_correlation']:.2f}%"
    lines = [
        f"candidate: {_cfg(r['candidate'])}", f"reference: {ref}",
        f"{r['num_windows']} windows x {r['context']} tokens, {r['tokens_scored']} scored "
        f"({r['scored']}) in {r['seconds']:.1f} s ({r['tokens_per_second']:.0f} tokens/s)",
        f"Mean PPL(Q)                   : {r['ppl']:10.6f} ± {r['ppl_stderr']:10.6f}",
        f"Mean PPL(base)                : {r['ref_ppl']:10.6f} ± {r['ref_ppl_stderr']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {cor}",
        f"Mean ln(PPL(Q)/PPL(base))     : {r['ln_ppl_ratio']:10.6f} ± "
        f"{r['ln_ppl_ratio_stderr']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {r['ppl_ratio']:10.6f} ± {r['ppl_ratio_stderr']:10.6f}"
        f" ({r['ppl_diff_pct']:+.3f}%)",
        f"Mean PPL(Q)-PPL(base)         : {r['ppl_diff']:10.6f}",
        f"Mean    KLD: {k['mean']:10.6f} ± {k['mean_stderr']:10.6f}",
        f"Maximum KLD: {k['max']:10.6f}", f"99.9%   KLD: {k['p99_9']:10.6f}",
        f"99.0%   KLD: {k['p99']:10.6f}", f"Median  KLD: {k['median']:10.6f}",
        f"Minimum KLD: {k['min']:10.6f}",
        f"Mean    Δp: {100 * d['mean']:6.3f} ± {100 * d['mean_stderr']:5.3f} %",
        f"RMS Δp    : {100 * d['rms']:6.3f} %",
        f"Same top p: {r['same_top_pct']:6.3f} ± {r['same_top_pct_stderr']:5.3f} %"]
    return "\n".join(lines)


def write_json(result: dict, path: str | None) -> None:
    """``result`` as indented JSON to ``path``, or one line on stdout when None.

    Raises:
      ValueError: the file cannot be written.
    """
    if path is None:
        print(json.dumps(result), flush=True)
        return
    try:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise ValueError(f"cannot write --output {path!r}: {e.strerror}") from None
