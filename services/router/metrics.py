"""The router's Prometheus metrics, in a registry of its own (several routers may share a process)."""

from __future__ import annotations

from typing import Callable, Iterable

from llmserve.metrics_http import MetricsServer
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from .pool import Worker


class RouterMetrics(MetricsServer):
    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.routed = Counter(
            "llmserve_router_requests_total", "Requests dispatched, by worker and policy decision.",
            ["model", "worker", "decision"], registry=self.registry)
        self.affinity_hits = Counter(
            "llmserve_router_cache_affinity_hits_total",
            "Requests sent to a worker for the prompt prefix it already holds.",
            ["model", "worker"], registry=self.registry)
        self.prefix_blocks = Counter(
            "llmserve_router_prefix_blocks_total",
            "Routing-key blocks of dispatched requests, and how many the chosen worker already held.",
            ["model", "kind"], registry=self.registry)
        self.retries = Counter(
            "llmserve_router_retries_total", "Requests retried on another worker, by the failed worker.",
            ["model", "worker"], registry=self.registry)
        self.mid_stream_failures = Counter(
            "llmserve_router_mid_stream_failures_total", "Streams ended by a worker failing after output.",
            ["model", "worker"], registry=self.registry)

    def watch(self, workers: Callable[[], Iterable[Worker]]) -> None:
        """Worker gauges are read from the live pool at scrape time, never kept in step by hand."""
        self.registry.register(_WorkerCollector(workers))


class _WorkerCollector:
    def __init__(self, workers: Callable[[], Iterable[Worker]]):
        self._workers = workers

    def describe(self) -> list:
        return []

    def collect(self):
        labels = ["model", "worker"]
        healthy = GaugeMetricFamily("llmserve_router_worker_healthy",
                                    "1 when the worker passes its health checks.", labels=labels)
        draining = GaugeMetricFamily("llmserve_router_worker_draining",
                                     "1 when the worker takes no new requests.", labels=labels)
        in_flight = GaugeMetricFamily("llmserve_router_worker_in_flight",
                                      "Requests dispatched to the worker and not yet ended.", labels=labels)
        for w in self._workers():
            healthy.add_metric([w.model, w.address], float(w.healthy))
            draining.add_metric([w.model, w.address], float(w.draining or w.load.draining))
            in_flight.add_metric([w.model, w.address], float(w.in_flight))
        yield from (healthy, draining, in_flight)
