"""ModelRunner: metadata building, shape buckets and the two jitted steps.

``prefill_step`` and ``decode_step`` are pure functions of
``(params, k_cache, v_cache, AttentionMetadata)`` (the metadata carries the
token ids, positions, ``cu_q_lens``, ``kv_lens`` and page table) returning the
logits of each sequence's last token and the caches, which are donated so XLA
updates them in place. Sampling is a third jitted function over the logits
(still on device), compiled once per row bucket. Every dimension that
varies with the batch is padded to a power-of-two bucket:

* decode: sequences B (>= 8) and pages per sequence (>= 4, in steps of
  2^k and 3 * 2^(k-1));
* prefill: tokens T (>= 16), sequences S (>= 4), the per-sequence query
  window (power of two >= the longest query) and pages per sequence.

so the number of compilations is bounded by the product of bucket counts, not
by the number of requests. ``num_compilations`` counts traces of both steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.page_table import cdiv
from jaxserve.engine.sampling import MAX_BANNED, SamplingTensors, sample
from jaxserve.engine.scheduler import ScheduledBatch, next_pow2, page_bucket
from jaxserve.models.llama import AttentionMetadata


class ModelRunner:
    """Owns the parameters and the paged KV cache and runs steps.

    Args:
      model: an NNX model whose ``__call__`` follows ``LlamaForCausalLM``.
      num_pages: pages P of the cache; page_size L tokens each.
      max_model_len: longest sequence, tokens (caps the page bucket).
      kv_dtype: cache dtype.
    """

    def __init__(self, model: nnx.Module, *, num_pages: int, page_size: int,
                 max_model_len: int, kv_dtype):
        cfg = model.cfg
        self.model_config = cfg
        self.graphdef, self.state = nnx.split(model)
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = cdiv(max_model_len, page_size)
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_cache = jnp.zeros(shape, kv_dtype)
        self.v_cache = jnp.zeros(shape, kv_dtype)
        self.num_compilations = 0
        self.prefill_step = jax.jit(functools.partial(self._step, decode=False),
                                static_argnames=("max_q_len",),
                                donate_argnums=(1, 2))
        self.decode_step = jax.jit(functools.partial(self._step, decode=True, max_q_len=1),
                               donate_argnums=(1, 2))
        # Sampling is its own jit: its compilations depend only on the row
        # bucket, so they are shared by every prefill/decode shape.
        self._sample = jax.jit(self._sample_fn)

    @staticmethod
    def kv_bytes_per_page(cfg, page_size: int, dtype) -> int:
        """Bytes of K and V for one page across all layers."""
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * \
            jnp.dtype(dtype).itemsize

    def _step(self, state, k_cache, v_cache, md, *, decode, max_q_len):
        self.num_compilations += 1  # runs once per trace, i.e. per compilation
        model = nnx.merge(self.graphdef, state)
        return model(k_cache, v_cache, md, decode=decode, max_q_len=max_q_len)

    def _sample_fn(self, logits, st):
        self.num_compilations += 1
        return sample(logits, st)

    # ---- host-side metadata -------------------------------------------------

    def _page_bucket(self, reqs) -> int:
        need = max(len(r.page_ids) for r in reqs)
        return min(page_bucket(need), max(self.max_pages_per_seq, need))

    def _sampling_tensors(self, reqs, rows: int) -> SamplingTensors:
        temp = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        min_p = np.zeros(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        steps = np.zeros(rows, np.int32)
        banned = np.full((rows, MAX_BANNED), -1, np.int32)
        for i, r in enumerate(reqs):
            p = r.params
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            seeds[i] = r.seed
            steps[i] = len(r.output_token_ids)
            if len(r.output_token_ids) < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(r.eos_token_ids))
                ids = ids[:MAX_BANNED]
                banned[i, :len(ids)] = ids
        return SamplingTensors(temp, top_k, top_p, min_p, seeds, steps, banned)

    def execute(self, batch: ScheduledBatch, return_logits: bool = False):
        """Run one step on device.

        Returns:
          (token_ids i32[n], logprobs f32[n], logits f32[n, V] or None) as
          numpy arrays, one row per request of ``batch`` in order.
        """
        reqs, q_lens = batch.requests, batch.q_lens
        n = len(reqs)
        L = self.page_size
        Pb = self._page_bucket(reqs)
        if batch.decode:
            rows = next_pow2(n, 8)
            T = rows
        else:
            rows = next_pow2(n, 4)
            T = next_pow2(sum(q_lens), 16)
        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_pages = np.full(T, self.num_pages, np.int32)  # out of range: dropped
        slot_offsets = np.zeros(T, np.int32)
        kv_lens = np.zeros(rows, np.int32)
        page_indices = np.zeros((rows, Pb), np.int32)
        cu_q_lens = np.zeros(rows + 1, np.int32)
        logits_indices = np.zeros(rows, np.int32)
        t = 0
        for i, (r, q) in enumerate(zip(reqs, q_lens)):
            start = r.num_computed_tokens
            toks = r.all_token_ids[start:start + q]
            pos = np.arange(start, start + q, dtype=np.int32)
            pages = np.asarray(r.page_ids, np.int32)
            input_ids[t:t + q] = toks
            positions[t:t + q] = pos
            slot_pages[t:t + q] = pages[pos // L]
            slot_offsets[t:t + q] = pos % L
            kv_lens[i] = start + q
            page_indices[i, :len(pages)] = pages
            t += q
            cu_q_lens[i + 1] = t
            logits_indices[i] = t - 1
        cu_q_lens[n + 1:] = t
        md = AttentionMetadata(input_ids, positions, slot_pages, slot_offsets, kv_lens,
                               page_indices, cu_q_lens, np.array([n], np.int32),
                               logits_indices)
        st = self._sampling_tensors(reqs, rows)
        if batch.decode:
            out = self.decode_step(self.state, self.k_cache, self.v_cache, md)
        else:
            out = self.prefill_step(self.state, self.k_cache, self.v_cache, md,
                                    max_q_len=next_pow2(max(q_lens), 1))
        logits, self.k_cache, self.v_cache = out
        token_ids, logprobs = self._sample(logits, st)
        token_ids = np.asarray(token_ids)[:n]
        logprobs = np.asarray(logprobs)[:n]
        return token_ids, logprobs, (np.asarray(logits)[:n] if return_logits else None)
