"""Serving a Prometheus registry over HTTP beside a gRPC service, and stopping it cleanly."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._http = None

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics until close(); port 0 disables it."""
        if port:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
