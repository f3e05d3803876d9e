"""Prometheus metrics under vLLM's names, so existing dashboards and llm-d scorers work."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.worker.engine.core_protocol import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineStatsCollector:
    """Gauges and counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model: str,
                 spec: Callable[[], tuple[int, int]]) -> None:
        self._stats, self._model, self._spec = stats, model, spec

    def collect(self):
        s, labels = self._stats(), [self._model]

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(labels, value)
            return m

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(labels, value)
            return m

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use.",
                    s.kv_blocks_used / max(1, s.kv_blocks_total))
        yield counter("vllm:num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        proposed, accepted = self._spec()
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed.", proposed)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.", accepted)


class WorkerMetrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.registry.register(_EngineStatsCollector(stats, model, lambda: (self.spec_proposed, self.spec_accepted)))

        def histogram(name, doc):
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between streamed outputs.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = histogram("vllm:request_queue_time_seconds", "Time from arrival to first schedule.")
