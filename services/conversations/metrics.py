"""Prometheus metrics of the conversations service, in a registry of its own (no globals)."""

from __future__ import annotations

from llmserve.metrics_http import MetricsServer
from prometheus_client import CollectorRegistry, Counter, Histogram


class Metrics(MetricsServer):
    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.requests = Counter(
            "llmserve_conversations_requests", "gRPC calls by method and status code",
            ["method", "code"], registry=self.registry)
        self.store_seconds = Histogram(
            "llmserve_conversations_store_seconds", "Latency of store operations",
            ["operation"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
