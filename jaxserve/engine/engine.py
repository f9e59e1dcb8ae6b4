"""Engine (add_request / step / abort) and the vLLM-style ``LLM`` facade.

One thread, one loop: ``step()`` asks the scheduler for a plan, runs it on
device through the ModelRunner, appends the sampled tokens, detokenizes, and
retires finished requests. Nothing here is asynchronous; the gRPC server
drives ``step()`` from its own loop.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.page_table import PageAllocator, cdiv
from jaxserve.engine.request import (CompletionOutput, Request, RequestOutput,
                                     SamplingParams)
from jaxserve.engine.runner import ModelRunner
from jaxserve.engine.sampling import MAX_BANNED
from jaxserve.engine.scheduler import ScheduledBatch, Scheduler
from jaxserve.models import MODEL_CLASSES, llama


class Engine:
    """The serving engine.

    Args:
      config: ``EngineConfig``.
      model_config, params, tokenizer, chat_template: give these to bypass
        loading ``config.model`` (tests use tiny random models this way);
        ``params=None`` with a ``model_config`` means random initialisation.

    Raises:
      ValueError: unknown model alias, missing file, bad config.
    """

    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None,
                 params: dict | None = None, tokenizer=None, chat_template: str | None = None):
        self.config = config
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        dtype = jnp.dtype(config.dtype)
        if model_config is None:
            from checkpoints.fetch import resolve_model
            from checkpoints.gguf_loader import load_gguf
            ckpt = load_gguf(resolve_model(config.model), dtype=np.dtype(
                "float32" if config.dtype != "float16" else "float16"))
            model_config, params = ckpt.config, ckpt.params
            tokenizer, chat_template = ckpt.tokenizer, ckpt.chat_template
        if model_config.architecture not in MODEL_CLASSES:
            raise ValueError(f"unsupported architecture {model_config.architecture!r}; "
                             f"supported: {sorted(MODEL_CLASSES)}")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        model = MODEL_CLASSES[model_config.architecture](
            model_config, dtype=dtype, rngs=nnx.Rngs(config.seed) if params is None else None)
        if params is not None:
            llama.load_params(model, params)
        self.max_model_len = config.scheduler.max_model_len or model_config.max_position_embeddings
        cache: CacheConfig = config.cache
        kv_dtype = jnp.dtype(cache.dtype or config.dtype)
        num_pages = cache.num_pages or max(
            1, cache.memory_bytes // ModelRunner.kv_bytes_per_page(model_config, cache.page_size,
                                                                   kv_dtype))
        self.allocator = PageAllocator(num_pages, cache.page_size)
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.max_model_len)
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=cache.page_size,
                                  max_model_len=self.max_model_len, kv_dtype=kv_dtype)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | (
            frozenset([tokenizer.eos_token_id]) if tokenizer is not None
            and tokenizer.eos_token_id is not None else frozenset())
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()

    # ---- requests -----------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (a string, or ids passed through).

        Raises:
          ValueError: empty prompt, ids outside the vocabulary, text without a tokenizer.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: ''")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError(f"prompt is empty: {prompt!r}")
        bad = [i for i in ids if not 0 <= i < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        return ids

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a request; returns its id.

        Raises:
          ValueError: bad prompt or params, duplicate id, a prompt that leaves no
            room in ``max_model_len``, or a sequence larger than the whole KV cache.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self._requests:  # skip ids the caller chose
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than "
                             f"max_model_len={self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if cdiv(longest, self.allocator.page_size) > self.allocator.num_pages:
            raise ValueError(f"a sequence of {longest} tokens needs more than the "
                             f"{self.allocator.num_pages} pages of the KV cache")
        if params.min_tokens and len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED:
            raise ValueError(f"min_tokens supports at most {MAX_BANNED} stop and EOS ids, "
                             f"got {len(params.stop_token_ids) + len(self.eos_token_ids)}")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        req = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                      seed, self.eos_token_ids)
        self._requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes from the next step."""
        req = self._requests.get(str(request_id))
        if req is None or req.finished:
            return
        self.scheduler.finish(req, "abort")
        self._pending.append(self._retire(req, ""))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs of requests that changed."""
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        now = time.monotonic()
        for r in batch.requests:
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
        token_ids, logprobs, _ = self.runner.execute(batch)
        now = time.monotonic()
        for r, q, tok, lp in zip(batch.requests, batch.q_lens, token_ids, logprobs):
            outputs.append(self._append(r, q, int(tok), float(lp), now))
        return outputs

    def _append(self, r: Request, q_len: int, tok: int, logprob: float, now: float):
        r.num_computed_tokens += q_len
        r.output_token_ids.append(tok)
        r.output_logprobs.append(logprob)
        r.metrics.num_output_tokens = len(r.output_token_ids)
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = now
        detok = self._detok[r.request_id]
        p, n_out = r.params, len(r.output_token_ids)
        delta = detok.add(tok, check_stop=n_out >= p.min_tokens)
        reason, stop_reason = None, None
        if detok.stopped_on is not None:
            reason, stop_reason = "stop", detok.stopped_on
        elif n_out >= p.min_tokens and not p.ignore_eos and tok in r.eos_token_ids:
            reason = "stop"
        elif n_out >= p.min_tokens and tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif n_out >= p.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return self._output(r, delta, [tok])
        self.scheduler.finish(r, reason, stop_reason)
        r.metrics.finished_time = now
        return self._retire(r, delta + detok.finish(), [tok])

    def _retire(self, r: Request, delta: str, delta_ids=()) -> RequestOutput:
        if r.metrics.finished_time is None:
            r.metrics.finished_time = time.monotonic()
        out = self._output(r, delta, list(delta_ids))
        del self._requests[r.request_id]
        del self._detok[r.request_id]
        return out

    def _output(self, r: Request, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        detok = self._detok[r.request_id]
        comp = CompletionOutput(
            index=0, text=detok.output_text, token_ids=list(r.output_token_ids),
            finish_reason=r.finish_reason, stop_reason=r.stop_reason,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            delta_text=delta_text, delta_token_ids=delta_ids)
        return RequestOutput(r.request_id, r.prompt, list(r.prompt_token_ids), [comp],
                             r.finished, r.metrics)

    # ---- numerics hooks -----------------------------------------------------

    def last_token_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """f32[n, V] next-token logits of each prompt, computed in one ragged
        prefill (nothing is kept in the cache). For parity tests and scoring.

        Raises:
          ValueError: bad prompt, or the prompts do not fit in the free pages.
        """
        reqs = []
        try:
            for ids in prompts:
                ids = self.encode(ids)
                r = Request(f"_logits{len(reqs)}", None, ids, SamplingParams(temperature=0),
                            0, self.eos_token_ids)
                r.page_ids = self.allocator.allocate(cdiv(len(ids), self.allocator.page_size))
                reqs.append(r)
            batch = ScheduledBatch(decode=False, requests=reqs,
                                   q_lens=[r.num_tokens for r in reqs])
            return self.runner.execute(batch, return_logits=True)[2]
        finally:
            for r in reqs:
                self.allocator.free(r.page_ids)


class LLM:
    """vLLM-style offline facade: ``LLM(model=...).generate(prompts, params)``.

    Args:
      model: alias (``"smollm2-135m"``) or a ``.gguf`` path.
      dtype, seed, page_size, num_pages, kv_cache_memory_bytes, max_num_seqs,
      max_num_batched_tokens, max_model_len, compilation_cache_dir: engine args.
      model_config, params, tokenizer, chat_template: see ``Engine``.
    """

    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "float32", seed: int = 0,
                 page_size: int = 16, num_pages: int | None = None,
                 kv_cache_memory_bytes: int = 1 << 30, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 compilation_cache_dir: str | None = None, **parts):
        config = EngineConfig(
            model=model, dtype=dtype, seed=seed,
            cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                              memory_bytes=kv_cache_memory_bytes),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            compilation_cache_dir=compilation_cache_dir)
        self.engine = Engine(config, **parts)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in prompt order.

        Args:
          prompts: a string, a list of strings, or a list of token-id lists.
          sampling_params: one ``SamplingParams`` for all, or a list, one each.

        Raises:
          ValueError: any bad prompt or params (nothing is queued then).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for "
                             f"{len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        others: list[RequestOutput] = []  # outputs of requests added elsewhere: handed back
        try:
            for p, sp in zip(prompts, sampling_params):
                ids.append(engine.add_request(None, p, sp))
        except ValueError:
            for rid in ids:
                engine.abort(rid)
            engine._pending = [o for o in engine._pending if o.request_id not in ids]
            raise
        mine = set(ids)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in engine.step():
                    if out.request_id not in mine:
                        others.append(out)
                    elif out.finished:
                        final[out.request_id] = out
        finally:
            engine._pending[:0] = others
        return [final[rid] for rid in ids]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        Raises:
          ValueError: the model has no chat template, or a message is malformed.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer / chat template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """Generate replies to one conversation (list of role/content dicts) or
        a list of conversations, each rendered with the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params)
