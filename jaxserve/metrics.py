"""Prometheus metrics of a serving engine (``prometheus-client``).

Names follow vLLM's (``vllm:time_to_first_token_seconds`` ...) with the
prefix ``jaxserve_`` and Prometheus base units (seconds, tokens, pages):

  histograms  jaxserve_time_to_first_token_seconds, jaxserve_time_per_output_token_seconds,
              jaxserve_inter_token_latency_seconds, jaxserve_request_queue_time_seconds,
              jaxserve_e2e_request_latency_seconds, jaxserve_request_prompt_tokens,
              jaxserve_request_generation_tokens, jaxserve_abort_delay_steps
  gauges      jaxserve_num_requests_running, jaxserve_num_requests_waiting,
              jaxserve_num_requests_paused, jaxserve_kv_cache_pages_used, jaxserve_kv_cache_pages_free,
              jaxserve_kv_cache_pages_total, jaxserve_kv_cache_usage_ratio
  counters    jaxserve_prompt_tokens_total, jaxserve_generation_tokens_total,
              jaxserve_cached_prompt_tokens_total, jaxserve_prefix_cache_queries_total,
              jaxserve_num_preemptions_total, jaxserve_request_success_total{finish_reason},
              jaxserve_request_aborted_total, jaxserve_request_failure_total,
              jaxserve_request_rejected_total{code}, jaxserve_request_received_total,
              jaxserve_engine_steps_total,
              jaxserve_stream_backpressure_total{action,reason} (streams nobody read:
              action "paused" / "resumed" (reason "unread" / "read"), "aborted"
              (reason "stalled" or "buffer_full"); ``jaxserve.server.backpressure``)
  structured outputs (``jaxserve.engine.structured``):
    counters  jaxserve_structured_output_requests_total, jaxserve_grammar_compiled_total,
              jaxserve_grammar_compile_seconds_total, jaxserve_grammar_cache_hits_total,
              jaxserve_token_mask_fills_total, jaxserve_token_mask_fill_seconds_total,
              jaxserve_forced_tokens_total
  speculative decoding (vLLM's spec_decode_* names; 0, and no per-position
  series, without speculation):
    counters  jaxserve_spec_decode_num_drafts_total, jaxserve_spec_decode_num_draft_tokens_total,
              jaxserve_spec_decode_num_accepted_tokens_total,
              jaxserve_spec_decode_num_accepted_tokens_per_pos_total{position} (0-based)
    gauge     jaxserve_spec_decode_k (draft tokens per sequence the policy chose last)
  start-up (set once, at health SERVING; ``jaxserve.engine.compile_cache.StartupReport``):
    gauges    jaxserve_startup_seconds, jaxserve_startup_xla_programs_compiled,
              jaxserve_startup_xla_programs_loaded (from the persistent cache),
              jaxserve_startup_warmup_seconds (warm-up start to every step program
              ready: after SERVING with a background warm-up; 0 until then)
  attention (set from ``EngineStats``; ``jaxserve.engine.attention_check``):
    counter   jaxserve_attention_fallback_total{reason} (the Pallas kernel failed its
              start-up self-check, reason "compile_error", "mismatch" or
              "unsupported_cache", and the engine serves with the XLA path)
    gauge     jaxserve_attention_impl{impl} (1 for the path serving: "pallas" or "xla")
  the process (prometheus-client's ``ProcessCollector``, read at each scrape; Linux):
    gauges    jaxserve_process_resident_memory_bytes, jaxserve_process_virtual_memory_bytes,
              jaxserve_process_start_time_seconds, jaxserve_process_open_fds,
              jaxserve_process_max_fds
    counter   jaxserve_process_cpu_seconds_total
  disaggregated prefill/decode (a decode worker's; ``jaxserve.disagg``):
    histogram jaxserve_kv_transfer_seconds
    counters  jaxserve_kv_transfer_bytes_total, jaxserve_disagg_routed_total{route},
              jaxserve_disagg_fallbacks_total{reason}, jaxserve_kv_lease_expired_total
              (a prefill worker's)

  LoRA adapters (``jaxserve.engine.adapters``; none without --enable_lora):
    counters  jaxserve_lora_requests_total{lora_name} (requests admitted with
              that adapter), jaxserve_lora_tokens_total{lora_name, kind}
              (prompt / generation tokens), jaxserve_lora_swaps_total (adapters written into a
              device slot)
    gauge     jaxserve_lora_slots_resident (slots holding an adapter)

A server also exports the serving figures under vLLM's names
(``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ... with vLLM's ``model_name`` label:
``export_vllm_names``, ``jaxserve.vllm_metrics``).

Running/waiting count sequences (one per choice), as the scheduler does.
Each ``ServingMetrics`` owns its ``CollectorRegistry`` so several servers
(or tests) in one process do not collide. Thread safety: prometheus-client
metrics are thread-safe; ``observe_step`` is called by the engine thread only.
"""

from __future__ import annotations

import threading

import prometheus_client as prom

# Latency buckets, seconds: 1 ms .. 5 min (CPU steps of a 135M model take
# 0.1-1 s; GPU/TPU decode steps take milliseconds).
_LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
              1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class ServingMetrics:
    """The metric objects and the helpers that move them.

    Args:
      registry: where to register; a fresh ``CollectorRegistry`` by default.
    """

    def __init__(self, registry: prom.CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else prom.CollectorRegistry()
        h = lambda name, doc, b=_LATENCY_S: prom.Histogram(name, doc, buckets=b, registry=r)
        self.ttft = h("jaxserve_time_to_first_token_seconds",
                      "Arrival to first output token (TTFT), seconds.")
        self.tpot = h("jaxserve_time_per_output_token_seconds",
                      "Mean time per output token after the first (TPOT) of a finished "
                      "request, seconds.")
        self.itl = h("jaxserve_inter_token_latency_seconds",
                     "Time between consecutive output tokens of one choice (ITL), seconds.")
        self.queue = h("jaxserve_request_queue_time_seconds",
                       "Arrival to first scheduled step, seconds.")
        self.e2e = h("jaxserve_e2e_request_latency_seconds",
                     "Arrival to finish of a finished request, seconds.")
        self.prompt_len = h("jaxserve_request_prompt_tokens",
                            "Prompt tokens per finished request.", _TOKENS)
        self.output_len = h("jaxserve_request_generation_tokens",
                            "Output tokens (all choices) per finished request.", _TOKENS)
        self.abort_delay = h("jaxserve_abort_delay_steps",
                             "Engine steps started between a client's cancel (or deadline) "
                             "and the engine freeing the request.", (0, 1, 2, 4, 8, 16))
        g = lambda name, doc: prom.Gauge(name, doc, registry=r)
        self.running = g("jaxserve_num_requests_running", "Sequences running (one per choice).")
        self.waiting = g("jaxserve_num_requests_waiting",
                         "Sequences waiting for a step, submitted-not-yet-queued included.")
        self.paused = g("jaxserve_num_requests_paused", "Sequences set aside because their "
                        "stream's client stopped reading (no slot, no page held).")
        self.pages_used = g("jaxserve_kv_cache_pages_used", "KV pages held by sequences.")
        self.pages_free = g("jaxserve_kv_cache_pages_free",
                            "KV pages free (including cached pages no sequence holds).")
        self.pages_total = g("jaxserve_kv_cache_pages_total", "KV pages in the cache.")
        self.kv_usage = g("jaxserve_kv_cache_usage_ratio", "pages_used / pages_total.")
        c = lambda name, doc, labels=(): prom.Counter(name, doc, labels, registry=r)
        # prometheus-client appends ``_total`` to counter names.
        self.prompt_tokens = c("jaxserve_prompt_tokens",
                               "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = c("jaxserve_generation_tokens", "Output tokens sampled.")
        self.cached_tokens = c("jaxserve_cached_prompt_tokens",
                               "Prompt tokens served from the prefix cache.")
        self.prefix_queries = c("jaxserve_prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.")
        self.preemptions = c("jaxserve_num_preemptions", "Sequences preempted (recomputed).")
        self.success = c("jaxserve_request_success", "Requests finished, by finish reason.",
                         ("finish_reason",))
        self.aborted = c("jaxserve_request_aborted",
                         "Requests aborted: client cancel, deadline or shutdown.")
        self.failed = c("jaxserve_request_failure", "Requests ended by an engine error.")
        self.rejected = c("jaxserve_request_rejected", "Requests refused before the engine, "
                          "by gRPC status code.", ("code",))
        self.received = c("jaxserve_request_received", "Generate calls that reached the "
                          "server's handler (each ends as success, aborted, failed or rejected).")
        self.steps = c("jaxserve_engine_steps", "Engine steps run.")
        self.stream_backpressure = c(
            "jaxserve_stream_backpressure", "Streams whose client read nothing, by what was "
            "done and why (paused/unread: unread past the pause time, its sequences set "
            "aside; resumed/read: its client read again; aborted/stalled: unread past the "
            "stall timeout; aborted/buffer_full: too many outputs waiting).",
            ("action", "reason"))
        for action, reason in (("paused", "unread"), ("resumed", "read"),
                               ("aborted", "stalled"), ("aborted", "buffer_full")):
            self.stream_backpressure.labels(action, reason)
        self.structured_requests = c("jaxserve_structured_output_requests",
                                     "Requests with a token constraint (structured outputs, "
                                     "allowed_token_ids, bad_words).")
        self.grammar_compiled = c("jaxserve_grammar_compiled", "Grammars compiled (schema, "
                                  "regex, choice, grammar; cache misses).")
        self.grammar_compile_seconds = c("jaxserve_grammar_compile_seconds",
                                         "Wall seconds spent compiling grammars.")
        self.grammar_cache_hits = c("jaxserve_grammar_cache_hits",
                                    "Grammar compiles answered from the cache.")
        self.mask_fills = c("jaxserve_token_mask_fills", "Token bitmask rows filled on the "
                            "host by grammar matchers (one per constrained row a step).")
        self.mask_fill_seconds = c("jaxserve_token_mask_fill_seconds",
                                   "Wall seconds spent filling token bitmask rows.")
        self.forced_tokens = c("jaxserve_forced_tokens", "Output tokens a grammar forced "
                               "that rode a step as free drafts.")
        self.compilations = c("jaxserve_xla_compilations",
                              "XLA programs compiled (one per new bucket shape; each is kept "
                              "in memory).")
        self.spec_drafts = c("jaxserve_spec_decode_num_drafts",
                             "Speculative verification rows that carried drafts.")
        self.spec_draft_tokens = c("jaxserve_spec_decode_num_draft_tokens",
                                   "Speculative draft tokens verified.")
        self.spec_accepted_tokens = c("jaxserve_spec_decode_num_accepted_tokens",
                                      "Speculative draft tokens accepted.")
        self.spec_accepted_per_pos = c("jaxserve_spec_decode_num_accepted_tokens_per_pos",
                                       "Speculative draft tokens accepted, by draft position "
                                       "(0-based).", ("position",))
        self.spec_k = g("jaxserve_spec_decode_k", "Draft tokens per sequence the speculation "
                        "policy chose for the latest step (0: not speculating).")
        self.startup_seconds = g("jaxserve_startup_seconds",
                                 "Process start to health SERVING, seconds (0 until then).")
        self.startup_compiled = g("jaxserve_startup_xla_programs_compiled",
                                  "XLA programs compiled before health SERVING (model load "
                                  "and warm-up), not found in the persistent cache.")
        self.startup_loaded = g("jaxserve_startup_xla_programs_loaded",
                                "XLA programs read from the persistent compilation cache "
                                "before health SERVING.")
        self._compilations_lock = threading.Lock()
        self._compilations_seen = 0  # the engine's num_compilations counted so far
        self.startup_warmup = g("jaxserve_startup_warmup_seconds",
                                "Warm-up start to every step program ready, seconds (0 until "
                                "then; a background warm-up ends after health SERVING).")
        # RSS, CPU seconds, fds: jaxserve_process_* (standard names, read at each scrape).
        prom.ProcessCollector(namespace="jaxserve", registry=r)
        # Disaggregated prefill/decode (``jaxserve.disagg``; zero elsewhere).
        self.kv_transfer_seconds = h("jaxserve_kv_transfer_seconds",
                                     "A handed-off request's KV pull: Pull call to pages in "
                                     "this worker's cache, seconds.")
        self.kv_transfer_bytes = c("jaxserve_kv_transfer_bytes",
                                   "KV bytes pulled from prefill workers.")
        self.disagg_routed = c("jaxserve_disagg_routed", "Routing decisions of a decode worker: "
                               "handoff, or the reason a request ran locally (short, cached, "
                               "unsupported, no_worker); one per request.", ("route",))
        self.disagg_fallbacks = c("jaxserve_disagg_fallbacks", "Handoffs that failed and were "
                                  "prefilled locally, by reason (each also counted as routed "
                                  "handoff).", ("reason",))
        self.kv_lease_expired = c("jaxserve_kv_lease_expired", "A prefill worker's held "
                                  "prompts freed because nobody pulled them within the lease.")
        self.attention_fallback = c("jaxserve_attention_fallback", "Start-up self-checks of "
                                    "the Pallas attention kernel that failed, so the engine "
                                    "serves with the XLA path, by reason (compile_error, "
                                    "mismatch, unsupported_cache).", ("reason",))
        self.attention_impl = prom.Gauge("jaxserve_attention_impl", "1 for the attention path "
                                         "the engine serves with (pallas, xla).", ("impl",),
                                         registry=r)
        self.lora_requests = c("jaxserve_lora_requests", "Requests admitted with a LoRA "
                               "adapter, by adapter name.", ("lora_name",))
        self.lora_swaps = c("jaxserve_lora_swaps", "LoRA adapters written into a device "
                            "slot (a slot's previous adapter evicted, or an empty slot filled).")
        self.lora_resident = g("jaxserve_lora_slots_resident",
                               "LoRA slots holding an adapter.")
        self.lora_tokens = c("jaxserve_lora_tokens", "Tokens computed with a LoRA adapter, "
                             "by adapter name and kind (prompt: prefill tokens computed, "
                             "cache hits excluded; generation: tokens sampled).",
                             ("lora_name", "kind"))
        self.lora_info: tuple[tuple[str, ...], int] | None = None  # (running, max_loras)
        self._lora_swaps_seen = 0
        self._lora_tokens_seen: dict = {}  # (adapter key, kind) -> count exported
        self._last = None

    def observe_lora(self, st: dict, max_loras: int) -> None:
        """Advance the LoRA figures from the engine's ``Engine.lora_stats()``
        (engine thread): swaps, resident slots, tokens per adapter, and the
        adapters that running sequences pin (vLLM's ``vllm:lora_requests_info``)."""
        if st["swaps"] > self._lora_swaps_seen:
            self.lora_swaps.inc(st["swaps"] - self._lora_swaps_seen)
            self._lora_swaps_seen = st["swaps"]
        self.lora_resident.set(st["resident"])
        for key, name, prompt, generation in st["tokens"]:
            for kind, n in (("prompt", prompt), ("generation", generation)):
                seen = self._lora_tokens_seen.get((key, kind), 0)
                if n > seen:
                    self.lora_tokens.labels(name, kind).inc(n - seen)
                    self._lora_tokens_seen[(key, kind)] = n
        self.lora_info = (st["running"], max_loras)

    def export_vllm_names(self, model_name: str) -> None:
        """Also export the serving figures under vLLM's names
        (``vllm:num_requests_waiting`` ...; ``jaxserve.vllm_metrics``) with
        ``model_name`` as vLLM's label; call once."""
        from jaxserve.vllm_metrics import VllmNames
        self.registry.register(VllmNames(
            [self.running, self.waiting, self.kv_usage, self.prompt_tokens,
             self.generation_tokens, self.preemptions, self.success, self.prefix_queries,
             self.cached_tokens, self.ttft, self.tpot, self.itl, self.e2e, self.queue,
             self.prompt_len, self.output_len, self.spec_drafts, self.spec_draft_tokens,
             self.spec_accepted_tokens, self.spec_accepted_per_pos], model_name,
            lora_info=lambda: self.lora_info))

    def observe_stats(self, stats, extra_waiting: int = 0) -> None:
        """Set gauges and advance counters from an ``EngineStats`` snapshot
        (counters move by the change since the previous snapshot)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + extra_waiting)
        self.paused.set(stats.num_paused)
        self.pages_used.set(stats.pages_used)
        self.pages_free.set(stats.pages_free)
        self.pages_total.set(stats.pages_total)
        self.kv_usage.set(stats.pages_used / max(1, stats.pages_total))
        last = self._last
        for counter, field in ((self.prompt_tokens, "prompt_tokens"),
                               (self.generation_tokens, "generation_tokens"),
                               (self.cached_tokens, "prefix_cache_hits"),
                               (self.prefix_queries, "prefix_cache_queries"),
                               (self.preemptions, "num_preemptions"),
                               (self.steps, "num_steps"),
                               (self.spec_drafts, "spec_num_drafts"),
                               (self.spec_draft_tokens, "spec_num_draft_tokens"),
                               (self.spec_accepted_tokens, "spec_num_accepted_tokens"),
                               (self.structured_requests, "structured_requests"),
                               (self.grammar_compiled, "grammar_compiled"),
                               (self.grammar_compile_seconds, "grammar_compile_seconds"),
                               (self.grammar_cache_hits, "grammar_cache_hits"),
                               (self.mask_fills, "mask_fills"),
                               (self.mask_fill_seconds, "mask_fill_seconds"),
                               (self.forced_tokens, "num_forced_tokens")):
            delta = getattr(stats, field, 0) - (getattr(last, field, 0) if last else 0)
            if delta > 0:
                counter.inc(delta)
        self._observe_compilations(stats.num_compilations)
        before = last.spec_accepted_per_position if last else ()
        for pos, n in enumerate(stats.spec_accepted_per_position):
            delta = n - (before[pos] if pos < len(before) else 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(str(pos)).inc(delta)
        self.spec_k.set(stats.spec_k)
        self._observe_attention(stats, last)
        self._last = stats

    def _observe_attention(self, stats, last) -> None:
        impl = getattr(stats, "attention_impl", "")
        fallback = getattr(stats, "attention_fallback", "")
        if impl and (last is None or getattr(last, "attention_impl", "") != impl):
            for name in ("pallas", "xla"):
                self.attention_impl.labels(name).set(1 if name == impl else 0)
        if fallback and (last is None or getattr(last, "attention_fallback", "") != fallback):
            self.attention_fallback.labels(fallback).inc()

    def observe_startup(self, ready_s: float, programs_compiled: int,
                        programs_loaded: int) -> None:
        """Record how the start went: seconds from process start to SERVING,
        and the XLA programs compiled and loaded from the persistent cache
        by then."""
        self.startup_seconds.set(ready_s)
        self.startup_compiled.set(programs_compiled)
        self.startup_loaded.set(programs_loaded)

    def observe_warmup_done(self, seconds: float, num_compilations: int) -> None:
        """Record that every step program is ready, ``seconds`` after the
        warm-up began, and the engine's compilations so far (a background
        warm-up's last ones come after the last step; safe beside the
        engine thread's ``observe_stats``)."""
        self.startup_warmup.set(seconds)
        self._observe_compilations(num_compilations)

    def _observe_compilations(self, total: int) -> None:
        with self._compilations_lock:
            if total > self._compilations_seen:
                self.compilations.inc(total - self._compilations_seen)
                self._compilations_seen = total

    def observe_finished(self, out) -> None:
        """Record a finished ``RequestOutput``: latencies and lengths, and the
        success counter (``finish_reason`` of its first choice) or the abort
        counter."""
        m = out.metrics
        if any(c.finish_reason == "abort" for c in out.outputs):
            self.aborted.inc()
            return
        self.success.labels(out.outputs[0].finish_reason or "unknown").inc()
        for hist, ms in ((self.queue, m.queue_ms), (self.tpot, m.tpot_ms), (self.e2e, m.e2e_ms)):
            if ms is not None:
                hist.observe(ms / 1e3)
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.output_len.observe(sum(len(c.token_ids) for c in out.outputs))

    def render(self) -> bytes:
        """The text exposition format of every metric (what ``/metrics`` serves)."""
        return prom.generate_latest(self.registry)

    def start_http_server(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the
        bound port (useful with ``port=0``)."""
        server, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
