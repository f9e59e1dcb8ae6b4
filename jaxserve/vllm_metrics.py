"""vLLM's metric names beside ours, so dashboards, autoscalers and routers
built for vLLM (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ...) read a jaxserve server unchanged.

``VllmNames`` is a Prometheus collector: at each scrape it reads the
``jaxserve_*`` metric objects it was given and yields the same samples
under vLLM v1's names (``vllm/v1/metrics/loggers.py``: ``PrometheusStatLogger``),
each with vLLM's ``model_name`` label (and ``engine="0"``); our own labels
are kept, ``finish_reason`` renamed to vLLM's ``finished_reason``. Nothing
is counted twice: there is one metric object, exported under two names.
The units are the same (seconds, tokens, a 0..1 usage ratio), so only the
names change.

With LoRA adapters it also yields vLLM's ``vllm:lora_requests_info`` gauge:
one sample, labels ``running_lora_adapters`` (the adapters running sequences
use, comma-separated), ``max_lora`` (device slots) and
``waiting_lora_adapters`` (always empty here: the scheduler's waiting queue is
not read), value the scrape's Unix time, as vLLM sets it.
"""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Our name (as the metric object knows it, without ``_total``) -> vLLM's.
VLLM_NAMES = {
    "jaxserve_num_requests_running": "vllm:num_requests_running",
    "jaxserve_num_requests_waiting": "vllm:num_requests_waiting",
    "jaxserve_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "jaxserve_prompt_tokens": "vllm:prompt_tokens",
    "jaxserve_generation_tokens": "vllm:generation_tokens",
    "jaxserve_num_preemptions": "vllm:num_preemptions",
    "jaxserve_request_success": "vllm:request_success",
    "jaxserve_prefix_cache_queries": "vllm:prefix_cache_queries",
    "jaxserve_cached_prompt_tokens": "vllm:prefix_cache_hits",
    "jaxserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "jaxserve_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "jaxserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "jaxserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "jaxserve_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "jaxserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "jaxserve_request_generation_tokens": "vllm:request_generation_tokens",
    "jaxserve_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "jaxserve_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "jaxserve_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "jaxserve_spec_decode_num_accepted_tokens_per_pos":
        "vllm:spec_decode_num_accepted_tokens_per_pos",
}
_LABELS = {"finish_reason": "finished_reason"}


class VllmNames(Collector):
    """Re-exports ``metrics`` (prometheus-client metric objects named in
    ``VLLM_NAMES``) under vLLM's names with ``model_name`` and ``engine``
    labels.

    Args:
      metrics: the metric objects (their ``collect()`` is read at each scrape).
      model_name: the served model's name (vLLM's ``model_name`` label).
      lora_info: ``() -> (running adapter names, max_loras)``, or None while
        (or where) no LoRA figures exist: ``vllm:lora_requests_info``.

    Raises:
      ValueError: a metric whose name has no vLLM name.
    """

    def __init__(self, metrics, model_name: str, lora_info=None):
        self.metrics = list(metrics)
        self.model_name = model_name
        self.lora_info = lora_info  # () -> (running adapter names, max_loras) or None
        for m in self.metrics:
            if m._name not in VLLM_NAMES:
                raise ValueError(f"no vLLM name for {m._name}")

    def collect(self):
        extra = {"model_name": self.model_name, "engine": "0"}
        for m in self.metrics:
            for fam in m.collect():
                name = VLLM_NAMES[fam.name]
                out = Metric(name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue
                    labels = {_LABELS.get(k, k): v for k, v in s.labels.items()} | extra
                    out.add_sample(name + s.name[len(fam.name):], labels, s.value,
                                   s.timestamp, s.exemplar)
                yield out
        info = self.lora_info() if self.lora_info is not None else None
        if info is not None:
            running, max_loras = info
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["running_lora_adapters", "max_lora",
                                          "waiting_lora_adapters"])
            g.add_metric([",".join(running), str(max_loras), ""], time.time())
            yield g


__all__ = ["VLLM_NAMES", "VllmNames"]
