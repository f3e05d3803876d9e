"""Prometheus metrics of the conversations service, in a registry of its own (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmserve_conversations_requests", "gRPC calls by method and status code",
            ["method", "code"], registry=self.registry)
        self.store_seconds = Histogram(
            "llmserve_conversations_store_seconds", "Latency of store operations",
            ["operation"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
        self._http = None

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics over HTTP until close(); port 0 disables it."""
        if port:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
