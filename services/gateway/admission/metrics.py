"""Admission decisions per model and organization, and the estimates beside what happened."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter("llmserve_gateway_admission_decisions", "Admission decisions: admitted at once, "
                                 "queued (then admitted or refused), refused", ["model", "organization", "decision"],
                                 registry=r)
        self.queue_wait = Histogram("llmserve_gateway_admission_queue_wait_seconds", "Time queued requests waited "
                                    "before admission", ["model"], buckets=_BUCKETS, registry=r)
        self.queue_wait_estimate = Histogram("llmserve_gateway_admission_queue_wait_estimate_seconds",
                                             "Estimated wait of the same requests when they were queued", ["model"],
                                             buckets=_BUCKETS, registry=r)
        self.ttft_estimate = Histogram("llmserve_gateway_admission_ttft_estimate_seconds", "Estimated time to first "
                                       "token at admission", ["model"], buckets=_BUCKETS, registry=r)
        self.ttft_ratio = Histogram("llmserve_gateway_admission_ttft_actual_over_estimate", "Measured time to first "
                                    "token from admission over the estimate", ["model"], buckets=_RATIO_BUCKETS,
                                    registry=r)
        self.stream_speed_estimate = Gauge("llmserve_gateway_admission_stream_tokens_per_second_estimate",
                                           "Estimated per-stream speed with one more stream", ["model"], registry=r)
        self.ttft_target = Gauge("llmserve_gateway_admission_ttft_target_seconds", "The first-token target "
                                 "admission plans to: overload.ttft_target_s, or the multiple of the pool's unloaded "
                                 "first token (overload.ttft_target_over_unloaded)", ["model"], registry=r)
