"""Prometheus metrics of one gateway app, in its own registry (several apps can share a process).
The rate limiter counts its decisions and Redis errors itself (ratelimit/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class ModelMetrics:
    """One model's per-token series, looked up once per request instead of once per token."""
    ttft: Histogram
    inter_token: Histogram
    request_latency: Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmserve_gateway_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("llmserve_gateway_time_to_first_token_seconds", "Time to the first streamed token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("llmserve_gateway_inter_token_latency_seconds", "Time between streamed chunks",
                                     ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.request_latency = Histogram("llmserve_gateway_request_duration_seconds", "Chat completion duration",
                                         ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("llmserve_gateway_in_flight_requests", "Admitted chat completions", ["model"],
                               registry=r)
        self.queued = Gauge("llmserve_gateway_queued_requests", "Chat completions waiting for a slot", ["model"],
                            registry=r)
        self.overload_limit = Gauge("llmserve_gateway_overload_limit", "In-flight limit of the overload guard",
                                    ["model"], registry=r)
        self.overload_refusals = Counter("llmserve_gateway_overload_refusals", "Requests shed by the overload guard",
                                         ["model"], registry=r)
        self.tokens = Counter("llmserve_gateway_tokens", "Tokens served", ["model", "kind"], registry=r)
        self.conversation_store_failures = Counter(
            "llmserve_gateway_conversation_store_failures", "Conversation turns not stored after every retry, "
            "by the last error's code", ["code"], registry=r)
        self._models: dict[str, ModelMetrics] = {}

    def model(self, name: str) -> ModelMetrics:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = ModelMetrics(self.ttft.labels(model=name),
                                                      self.inter_token.labels(model=name),
                                                      self.request_latency.labels(model=name))
        return found
