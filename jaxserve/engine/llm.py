"""The vLLM-style offline facade: ``LLM(model=...).generate(prompts, params)``,
``LLM.chat``, ``LLM.stream``; and the converters of its vLLM-named
arguments (``config.kv_cache_dtype_from_name``, ``speculative_config_from_dict``).

``LLM`` only uses ``Engine``'s public methods: it adds requests, drives
``step`` until its own requests finish, and hands the outputs of requests
added elsewhere back to the engine (``Engine.requeue_outputs``), so several
callers can share one engine.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from checkpoints.orbax_lora import checkpoint_adapters
from jaxserve.config import (CacheConfig, EngineConfig, LoRAConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, kv_cache_dtype_from_name)
from jaxserve.engine import compile_cache
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import RequestOutput
from jaxserve.engine.sampling_params import SamplingParams, check_text
from sharding.mesh import parse_mesh_spec


def speculative_config_from_dict(d: dict | None) -> SpeculativeConfig:
    """``SpeculativeConfig`` of vLLM's ``speculative_config`` dict (``model``
    and ``quantization`` name the draft's; our field names work too).

    Raises:
      ValueError: an unknown key (names it) or a bad value.
    """
    if not d:
        return SpeculativeConfig()
    alias = {"model": "draft_model", "quantization": "draft_quantization"}
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    out = {}
    for k, v in d.items():
        name = alias.get(k, k)
        if name not in fields:
            raise ValueError(f"speculative_config: unknown key {k!r}; known: "
                             f"{sorted(fields | set(alias))}")
        out[name] = v
    return SpeculativeConfig(**out)


class LLM:
    """vLLM-style offline facade: ``LLM(model=...).generate(prompts, params)``.

    Args:
      model: alias (``"smollm2-135m"``), a ``.gguf`` path, an HF folder or an
        Orbax folder (``checkpoints.orbax_ckpt``; restored straight into the
        params' shardings on the mesh).
      dtype, seed, page_size, num_pages, kv_cache_memory_bytes, max_num_seqs,
      max_num_batched_tokens, max_model_len, enable_prefix_caching,
      enable_chunked_prefill, attention_impl, scan_layers, attention_interpret,
      async_scheduling: engine args (see ``jaxserve.config``).
      compilation_cache_dir: the persistent XLA compilation cache folder.
        ``"auto"`` (the default) is the CLI's, ``$JAXSERVE_CACHE/xla``
        (``~/.cache/jaxserve/xla``), so a second run (a notebook restarted)
        loads its programs instead of compiling them; None or ``""``: no
        persistent cache (nothing read or written, unless an earlier engine
        or the user set one up in this process: JAX keeps one cache folder
        per process, the first one set, see ``jaxserve.engine.compile_cache``);
        any other string is a folder (``./auto`` for one named auto).
      mesh: device mesh spec such as ``"tp=2"`` or ``"dp=1,tp=4,ep=2"``
        (``sharding.mesh.parse_mesh_spec``); None means one device.
      quantization, quantization_group_size: the weight format
        (``EngineConfig.quantization``): none, int8, w8a8, int4 or gguf.
      quantize_lm_head: the LM head in that format too
        (``EngineConfig.quantize_lm_head``); False keeps it in ``dtype``.
      kv_cache_dtype: ``"auto"`` (the parameter dtype), ``"float32"``,
        ``"bfloat16"``, ``"float16"``, ``"int8"`` or ``"fp8_e4m3"``.
      speculative_config: vLLM's dict: ``{"method": "ngram" | "draft",
        "num_speculative_tokens": k, "prompt_lookup_min": .., "prompt_lookup_max":
        .., "model": draft model ("self" or a model string), "quantization":
        the draft's, "adaptive": bool}`` (``SpeculativeConfig``); None is off.
      enable_lora, max_loras, max_lora_rank: LoRA adapter slots (vLLM's
        names; ``LoRAConfig``): ``max_loras`` adapters on device at once,
        ranks up to ``max_lora_rank``; requests pick one with
        ``generate(..., lora_request=LoRARequest(name, id, path))``. With
        ``enable_lora``, the adapters an Orbax checkpoint ``model`` ships
        (converted with ``lora_modules``) are registered under their names.
      model_config, params, tokenizer, chat_template, devices: see ``Engine``.

    Raises:
      ValueError: a bad engine arg or mesh spec (before any weights are read).
    """

    def __init__(self, model: str = "smollm2-135m", *, dtype: str = "float32", seed: int = 0,
                 page_size: int = 16, num_pages: int | None = None,
                 kv_cache_memory_bytes: int = 512 << 20, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 compilation_cache_dir: str | None = compile_cache.AUTO,
                 attention_impl: str = "auto", scan_layers: bool = True,
                 attention_interpret: bool = False, async_scheduling: bool = True,
                 mesh: str | None = None, quantization: str = "none",
                 quantization_group_size: int = 32, quantize_lm_head: bool = True,
                 kv_cache_dtype: str = "auto",
                 speculative_config: dict | None = None, max_forced_drafts: int = 8,
                 enable_lora: bool = False, max_loras: int = 4, max_lora_rank: int = 16,
                 **parts):
        parallel = ParallelConfig() if mesh is None else \
            ParallelConfig.from_mesh_shape(parse_mesh_spec(mesh))
        config = EngineConfig(
            model=model, dtype=dtype, seed=seed,
            cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                              memory_bytes=kv_cache_memory_bytes,
                              dtype=kv_cache_dtype_from_name(kv_cache_dtype),
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      max_forced_drafts=max_forced_drafts),
            compilation_cache_dir=compile_cache.resolve_dir(compilation_cache_dir),
            attention_impl=attention_impl, scan_layers=scan_layers,
            attention_interpret=attention_interpret, async_scheduling=async_scheduling,
            parallel=parallel, quantization=quantization,
            quantization_group_size=quantization_group_size,
            quantize_lm_head=quantize_lm_head,
            speculative=speculative_config_from_dict(speculative_config),
            lora=LoRAConfig(max_loras, max_lora_rank) if enable_lora else None)
        self.engine = Engine(config, **parts)
        if enable_lora and "params" not in parts:  # the adapters an Orbax checkpoint ships
            for name, path in checkpoint_adapters(model):
                self.engine.add_lora(name, path)

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """The facade over an ``Engine`` already built (the CLI builds one
        from its flags' ``EngineConfig``)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):
        """The model's tokenizer (None for a model without one)."""
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, lora_request=None) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in prompt order.

        Args:
          prompts: a string, a list of strings, a list of token-id lists, or
            vLLM's dict prompts (``{"prompt": ...}``, ``{"prompt_token_ids": ...}``).
          sampling_params: one ``SamplingParams`` for all, or a list, one each.
          lora_request: a ``LoRARequest`` (or an adapter's name) for all, a
            list with one per prompt (None entries: the base), or None.

        Raises:
          ValueError: any bad prompt or params, or an unknown adapter
            (``UnknownAdapterError``); nothing is queued then.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for "
                             f"{len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else \
            [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        others: list[RequestOutput] = []  # outputs of requests added elsewhere: handed back
        try:
            for p, sp, lr in zip(prompts, sampling_params, loras):
                ids.append(engine.add_request(None, p, sp, lora=lr))
        except ValueError:
            for rid in ids:
                engine.abort(rid)
            engine.discard_outputs(ids)
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
            engine.requeue_outputs(others, front=True)
        return [final[rid] for rid in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Yield one request's outputs as it runs (``delta_text`` per step).

        Closing the iterator early (``break``, garbage collection, an
        exception in the consumer) aborts the request at once, freeing its
        pages. Outputs of other requests in the engine are kept for their owners.

        Raises:
          ValueError: bad prompt or params (raised at the first ``next``).
        """
        engine = self.engine
        rid = engine.add_request(request_id, prompt, sampling_params)
        done = False
        try:
            while not done:
                outs = engine.step()
                for out in outs:
                    if out.request_id == rid:
                        done = out.finished
                        yield out
                    else:
                        engine.requeue_outputs([out])
        finally:
            if not done:
                engine.abort(rid)
                engine.discard_outputs({rid})

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        Raises:
          ValueError: the model has no chat template, or a message is malformed.
        """
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer / chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
            if isinstance(m["content"], str):
                check_text(m["content"], f"messages[{i}].content")
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """Generate replies to one conversation (list of role/content dicts) or
        a list of conversations, each rendered with the chat template (or,
        for a model without one, as a transcript that stops at the next
        user line: ``Tokenizer.chat_stop``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in convs]
        stop = self.engine.tokenizer.chat_stop
        if isinstance(sampling_params, (list, tuple)):
            sampling_params = [p.with_stop(stop) for p in sampling_params]
        else:
            sampling_params = (sampling_params or SamplingParams()).with_stop(stop)
        return self.generate(prompts, sampling_params)
