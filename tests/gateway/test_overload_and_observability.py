"""Overload shedding (bounded in-flight + short queue per model, fast refusal past that), Prometheus
metrics, and OpenTelemetry spans with GenAI attributes whose context reaches the upstream."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.gateway.harness import GatewayHarness, gateway_config


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def small(tmp_path_factory, conversations_address, spans):
    """One request in flight per model, one queued for at most 0.3 s."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    cfg = gateway_config(f"sqlite:///{Path(tmp_path_factory.mktemp('small')) / 'g.db'}", conversations_address,
                         overload={"max_in_flight_per_model": 1, "max_queued_per_model": 1, "queue_timeout_s": 0.3})
    with GatewayHarness(cfg, tracer_provider=provider) as harness:
        yield harness


def chat(gateway: GatewayHarness, key: str, content: str, timeout: float = 10, **extra) -> httpx.Response:
    return gateway.http.post("/v1/chat/completions", timeout=timeout, headers={"Authorization": f"Bearer {key}"},
                             json={"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra})


def test_excess_is_refused_fast_and_tokens_refunded(small: GatewayHarness):
    org_id, _, key = small.new_org("busy", tpm=6000)
    hangs = len(small.fake.find("[hang]"))

    def occupy():
        with pytest.raises(httpx.TimeoutException):
            chat(small, key, "[hang]", timeout=1.5, max_completion_tokens=10)

    holder = threading.Thread(target=occupy)
    holder.start()
    while len(small.fake.find("[hang]")) == hangs:
        time.sleep(0.01)
    with ThreadPoolExecutor(2) as pool:
        queued = pool.submit(chat, small, key, "hi", max_completion_tokens=2000)
        time.sleep(0.1)                                   # the first waits in the queue, the second finds it full
        started = time.monotonic()
        full = chat(small, key, "hi", max_completion_tokens=2000)
        fast = time.monotonic() - started
        timed_out = queued.result()
    holder.join()
    for reply, why in ((full, "queue full"), (timed_out, "queue timeout")):
        assert reply.status_code == 429, reply.text
        assert reply.json()["error"]["code"] == "overloaded" and why in reply.json()["error"]["message"]
        assert reply.headers["retry-after"] == "1" and reply.headers["retry-after-ms"] == "1000"
    assert fast < 0.25                                   # refused without waiting for the queue timeout
    assert chat(small, key, "hi", max_completion_tokens=10).status_code == 200   # the slot came back
    small.drain()
    from services.gateway.ratelimit import Limit
    bucket = [Limit(f"org:{org_id}", "tokens", 6000)]
    # Charged: the hang's 7 (its prompt estimate; nothing produced) and the last request's 7. The two
    # refused requests' 2006-token reservations came back; without that refund, even with a few
    # seconds of refill (100 tokens/s), 5900 would not fit.
    assert small.call(small.gateway.limiter.acquire(bucket, 0, 5900)).allowed


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_and_spans(small: GatewayHarness, spans: InMemorySpanExporter):
    _, _, key = small.new_org("observed")
    spans.clear()
    reply = chat(small, key, "[words:4]", stream=True, max_completion_tokens=50)
    assert reply.status_code == 200
    small.drain()
    text = small.http.get("/metrics").text
    assert metric(text, "llmserve_gateway_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert metric(text, "llmserve_gateway_time_to_first_token_seconds_count", model="fake-model") >= 1
    assert metric(text, "llmserve_gateway_inter_token_latency_seconds_count", model="fake-model") >= 3
    assert metric(text, "llmserve_gateway_in_flight_requests", model="fake-model") == 0
    assert "llmserve_gateway_queued_requests" in text
    assert metric(text, "llmserve_gateway_ratelimit_decisions_total", result="allowed") >= 1
    assert metric(text, "llmserve_gateway_tokens_total", model="fake-model", kind="completion") >= 4

    [span] = [s for s in spans.get_finished_spans() if s.name == "chat fake-model"]
    a = span.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.response.model"]) == (
        "chat", "fake-model", "fake-model")
    assert a["gen_ai.request.max_tokens"] == 50 and tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (4, 4)
    metadata = small.fake.calls[-1].metadata
    trace_id = format(span.context.trace_id, "032x")
    assert metadata["traceparent"].split("-")[1] == trace_id
    assert metadata["x-request-id"] == reply.headers["x-request-id"]
