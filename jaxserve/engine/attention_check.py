"""The attention self-check at engine start-up, and the fallback to XLA.

On an accelerator ``attention_impl="auto"`` would put the Pallas ragged paged
attention kernel on every step. Before that, ``choose_attention_impl`` runs
the kernel once on a small ragged batch built from the model's own attention
(``check_attention``) and compares it with the XLA path
(``pallas_kernels/ragged_paged_attention/kernel_xla.py``):

* the batch: 3 decode rows (kv lengths 1, 37 and ``ctx``) and 2 prefill rows
  (a fresh 13-token prompt, and a 40-token chunk ending at ``ctx``), packed
  into 64 tokens with a padding row; ``ctx = 256``, or the widest window + 48
  so that windows cut. The model's query heads N, kv heads K, head dim H,
  score scale and soft cap, the engine's activation dtype for q and its KV
  cache dtype (int8 / fp8 pages quantized by ``quant.quantize``, with their
  f32 scales), its page size; one run per distinct window of its layers
  (Gemma 3: the sliding window and None). Pages and page-table slots no row
  owns hold large finite garbage, so a kernel reading the wrong page shows.
  Queries are scaled by 3 so the softmax is peaked and a wrong page, mask or
  head shows as an O(1) error rather than hiding in a flat average.
* the verdict: ``max |pallas - xla| / max |xla|`` over every element
  (padding rows included, which must be 0) within ``TOLERANCE`` of q's dtype
  (f32 1e-2: XLA's f32 dots may use TF32 on GPU; bf16 / f16 4e-2: the kernel
  feeds the softmax weights to its second dot in bf16). An exception from
  the Pallas path (lowering, Mosaic / Triton compile, run) is
  ``"compile_error"``; a result out of tolerance or not finite is
  ``"mismatch"``.

What happens then (``choose_attention_impl``): with ``"auto"`` a failure logs
one line (what failed, the error or max error, and that the engine now uses
the XLA path), is kept as ``EngineParts.attention_check`` (``Engine.stats``
-> ``jaxserve_attention_fallback_total{reason}`` in ``/metrics``), and the
engine is built with ``"xla"``; with ``"pallas"`` (explicit) it raises
``AttentionCheckError``. ``"xla"`` runs no check. On CPU ``"auto"`` is XLA
with no check, unless ``attention_interpret`` is set: then the check (and,
when it passes, the engine) runs the kernel in the Pallas interpreter, which
is how tests exercise it.

In a multi-host job every process checks on its own devices, and
``build`` then compares the chosen paths across processes
(``multihost.check_same_setup``): processes that disagree fail at start
with a ValueError instead of compiling different steps.

What it does not cover: off-by-one window boundaries and other errors too
small for this tolerance (the interpret-mode kernel tests hold the kernels to
the reference for those), long contexts, and the kernel under the engine's
mesh (it runs on the default device alone). Cost: two compiles of the
kernel and of the XLA path per distinct window, on a 64-token batch: on the
2-core CPU in the Pallas interpreter 3-5 s per window (tiny and SmolLM2 heads,
f32 and int8 KV; max error 2e-7..6e-7 in f32, 2e-3..5e-3 in bf16), ~0.4 s
when the persistent compilation cache holds its programs; not yet timed on
an accelerator.

Tests force a failure by monkeypatching ``pallas_attention`` (this module's
call of the kernel): raising gives a compile error, a wrong result a mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from pallas_kernels.ragged_paged_attention import kernel as rpa_kernel
from pallas_kernels.ragged_paged_attention import kernel_xla as rpa_xla
from pallas_kernels.ragged_paged_attention.kernel_gpu_plan import check_addressing
from pallas_kernels.ragged_paged_attention.quant import is_quantized, quantize

log = logging.getLogger(__name__)

# max |pallas - xla| / max |xla| allowed, by q's dtype.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-2, jnp.dtype(jnp.bfloat16): 4e-2,
             jnp.dtype(jnp.float16): 4e-2}
NUM_TOKENS = 64
NUM_DECODE = 3
Q_SCALE = 3.0
GARBAGE = 50.0  # magnitude of what unowned pages hold


class AttentionCheckError(RuntimeError):
    """The Pallas attention failed its start-up check under ``attention_impl="pallas"``."""


@dataclasses.dataclass(frozen=True)
class AttentionCheck:
    """The outcome of the start-up self-check.

    Attributes:
      impl: the path the engine uses: ``"pallas"`` or ``"xla"``.
      reason: None (passed), ``"compile_error"``, ``"mismatch"``, or
        ``"unsupported_cache"`` (the engine's KV cache is one the kernel
        refuses: ``cache_refusal``; the kernel is then not run).
      detail: one line: what was checked, the error or the max error.
      max_error: max |pallas - xla| / max |xla| of the worst window, or None
        when the kernel did not run.
      seconds: wall time of the check.
    """

    impl: str
    reason: str | None
    detail: str
    max_error: float | None
    seconds: float


def pallas_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                     cu_q_lens_S1, num_seqs, *, interpret, **kw):
    """The Pallas kernel as the check calls it (a test's injection point).
    Arguments as ``kernel.ragged_paged_attention``'s; returns [T, N, H]."""
    fn = jax.jit(functools.partial(rpa_kernel.ragged_paged_attention, interpret=interpret,
                                   **kw))
    return jax.block_until_ready(fn(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S,
                                    page_indices_SP, cu_q_lens_S1, num_seqs))


def _xla_attention(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S, page_indices_SP,
                   cu_q_lens_S1, num_seqs, **kw):
    fn = jax.jit(functools.partial(rpa_xla.ragged_paged_attention, **kw))
    return jax.block_until_ready(fn(q_TNH, k_pages_PLKH, v_pages_PLKH, kv_lens_S,
                                    page_indices_SP, cu_q_lens_S1, num_seqs, NUM_DECODE))


def check_batch(model_config: ModelConfig, q_dtype, kv_dtype, page_size: int, seed: int = 0):
    """The check's ragged batch (module docstring) as device arrays.

    Returns:
      dict of ``q_TNH`` [64, N, H] in ``q_dtype``; ``k_pages_PLKH`` /
      ``v_pages_PLKH`` [P, L, K, H] in ``kv_dtype``; ``k_scales_PLK`` /
      ``v_scales_PLK`` f32[P, L, K] or None; ``kv_lens_S`` i32[6];
      ``page_indices_SP`` i32[6, pages_per_seq]; ``cu_q_lens_S1`` i32[7];
      ``num_seqs`` i32[1] (5).
    """
    N, K, H, L = (model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
                  page_size)
    windows = [w for w in _windows(model_config) if w is not None]
    ctx = max(256, max(windows, default=0) + 48)
    q_lens = [1] * NUM_DECODE + [13, 40]
    kv_lens = [1, 37, ctx, 13, ctx]
    S = len(q_lens) + 1  # one padding row
    pages_per_seq = -(-ctx // L)
    rng = np.random.default_rng(seed)
    # Page 0 is garbage no row owns; each row gets its own pages, shuffled.
    num_pages = 1 + sum(-(-n // L) for n in kv_lens)
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((S, pages_per_seq), np.int32)
    start = 0
    for s, n in enumerate(kv_lens):
        n_pages = -(-n // L)
        page_indices[s, :n_pages] = perm[start:start + n_pages]
        start += n_pages
    kv = rng.standard_normal((2, num_pages, L, K, H)).astype(np.float32)
    owned = np.zeros((num_pages, L), bool)
    for s, n in enumerate(kv_lens):
        for pos in range(n):
            owned[page_indices[s, pos // L], pos % L] = True
    kv = np.where(owned[None, :, :, None, None], kv, GARBAGE)
    pages, scales = [], []
    for x in kv:
        if is_quantized(kv_dtype):
            p, sc = quantize(jnp.asarray(x.reshape(-1, K, H)), kv_dtype)
            pages.append(p.reshape(num_pages, L, K, H))
            scales.append(sc.reshape(num_pages, L, K))
        else:
            pages.append(jnp.asarray(x, kv_dtype))
            scales.append(None)
    T = sum(q_lens)
    q = np.zeros((NUM_TOKENS, N, H), np.float32)
    q[:T] = Q_SCALE * rng.standard_normal((T, N, H))
    return dict(q_TNH=jnp.asarray(q, q_dtype), k_pages_PLKH=pages[0], v_pages_PLKH=pages[1],
                k_scales_PLK=scales[0], v_scales_PLK=scales[1],
                kv_lens_S=jnp.asarray(kv_lens + [0], jnp.int32),
                page_indices_SP=jnp.asarray(page_indices),
                cu_q_lens_S1=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), [T]]),
                                         jnp.int32),
                num_seqs=jnp.asarray([len(q_lens)], jnp.int32))


def _windows(model_config: ModelConfig) -> list:
    return sorted({model_config.layer_window(i) for i in range(model_config.num_layers)},
                  key=lambda w: -1 if w is None else w)


def check_attention(model_config: ModelConfig, q_dtype, kv_dtype, page_size: int, *,
                    interpret=False) -> AttentionCheck:
    """Run the Pallas kernel and the XLA path on ``check_batch`` once per
    distinct window of the model's layers and compare them.

    Args:
      model_config: the model (heads, head dim, score scale, soft cap, windows).
      q_dtype: the engine's activation dtype; kv_dtype: its KV cache dtype.
      page_size: tokens per page.
      interpret: as ``kernel.ragged_paged_attention``'s (True on CPU tests).

    Returns:
      ``AttentionCheck`` with ``impl="pallas"`` when every window passes, else
      ``impl="xla"`` and the first failure's reason and detail.
    """
    t0 = time.perf_counter()
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    tol = TOLERANCE[q_dtype]
    batch = check_batch(model_config, q_dtype, kv_dtype, page_size)
    args = [batch[k] for k in ("q_TNH", "k_pages_PLKH", "v_pages_PLKH", "kv_lens_S",
                               "page_indices_SP", "cu_q_lens_S1", "num_seqs")]
    worst = 0.0
    for window in _windows(model_config):
        what = (f"N{model_config.num_heads}/K{model_config.num_kv_heads}/"
                f"H{model_config.head_dim} q {q_dtype.name} kv {kv_dtype.name} "
                f"L{page_size} window={window} soft_cap={model_config.attn_logit_softcapping}")
        kw = dict(sm_scale=model_config.sm_scale, sliding_window=window,
                  soft_cap=model_config.attn_logit_softcapping,
                  k_scales_PLK=batch["k_scales_PLK"], v_scales_PLK=batch["v_scales_PLK"])
        want = np.asarray(_xla_attention(*args, **kw), np.float32)
        try:
            got = np.asarray(pallas_attention(*args, interpret=interpret, **kw), np.float32)
        except Exception as e:  # noqa: BLE001 - any failure of the kernel is the verdict
            first = (str(e).strip().splitlines() or [""])[0][:300]
            return AttentionCheck("xla", "compile_error",
                                  f"{what}: {type(e).__name__}: {first}", None,
                                  time.perf_counter() - t0)
        scale = max(float(np.max(np.abs(want))), 1e-6)
        err = float(np.max(np.abs(got - want))) / scale if np.all(np.isfinite(got)) \
            else float("inf")
        worst = max(worst, err)
        if not err <= tol:
            return AttentionCheck("xla", "mismatch",
                                  f"{what}: max error {err:.3g} (of max |out| {scale:.3g}) > "
                                  f"tolerance {tol:g}", err, time.perf_counter() - t0)
    return AttentionCheck("pallas", None, f"max error {worst:.3g} <= {tol:g}", worst,
                          time.perf_counter() - t0)


def cache_refusal(model_configs, num_pages: int, page_size: int, kv_dtype) -> str | None:
    """Why the GPU kernel cannot run on the engine's KV cache, or None.

    The kernel gets a model's stacked cache, [layers * num_pages, L, K, H]
    (``models.stack.flat_kv``), and refuses one it would address with
    wrapping 32-bit offsets (``kernel_gpu_plan.check_addressing``: a 1-byte
    cache of more than 2^31 elements and at most 2^32 bytes). The self-check's
    small batch never meets that size, so the engine's own shape is checked
    here before the first step would raise."""
    for mc in model_configs:
        shape = (mc.num_layers * num_pages, page_size, mc.num_kv_heads, mc.head_dim)
        try:
            check_addressing(jax.ShapeDtypeStruct(shape, kv_dtype))
        except ValueError as e:
            return str(e)
    return None


def choose_attention_impl(config: EngineConfig, model_configs, *, num_pages: int | None = None
                          ) -> tuple[str, AttentionCheck | None]:
    """The attention path of an engine (module docstring): ``"xla"`` or
    ``"pallas"``, and the check that decided it (None when none ran).

    Args:
      config: the engine's config (``attention_impl``, ``attention_interpret``,
        ``dtype``, ``cache``).
      model_configs: the models that will use the path (the target, and a
        draft model); each is checked, the first failure decides.

    Raises:
      ValueError: ``"pallas"`` on a backend without a Pallas lowering and
        without ``attention_interpret``.
      AttentionCheckError: ``"pallas"`` (explicit) and the check failed.
    """
    if not model_configs:
        raise ValueError("choose_attention_impl: no model config to check")
    impl, backend = config.attention_impl, jax.default_backend()
    accelerator = backend in ("gpu", "tpu")
    if impl == "xla" or (impl == "auto" and not accelerator and not config.attention_interpret):
        return "xla", None
    if not accelerator and not config.attention_interpret:
        raise ValueError(f"attention_impl='pallas' has no lowering on {backend!r}; "
                         f"set attention_interpret=True")
    q_dtype = jnp.dtype(config.dtype)
    kv_dtype = jnp.dtype(config.cache.dtype or config.dtype)
    interpret = bool(config.attention_interpret)
    result = None
    # The GPU kernel serves on GPU, and in the interpreter on CPU.
    refusal = None if num_pages is None or backend == "tpu" else cache_refusal(
        model_configs, num_pages, config.cache.page_size, kv_dtype)
    if refusal is not None:
        result = AttentionCheck("xla", "unsupported_cache", refusal, None, 0.0)
    else:
        for mc in model_configs:
            result = check_attention(mc, q_dtype, kv_dtype, config.cache.page_size,
                                     interpret=interpret)
            if result.reason is not None:
                break
    if result.reason is None:
        log.info("attention: Pallas kernel passed its start-up check (%s, %.1f s)",
                 result.detail, result.seconds)
        return "pallas", result
    then = ("attention_impl='pallas' was asked for: not falling back" if impl == "pallas"
            else "the engine serves with the XLA path")
    line = f"attention self-check of the Pallas kernel failed ({result.reason}): " \
           f"{result.detail}; {then}"
    if impl == "pallas":
        raise AttentionCheckError(line)
    log.warning(line)
    return "xla", result
