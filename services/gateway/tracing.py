"""OpenTelemetry: one span "chat {model}" per completion with the GenAI attributes, and its W3C
trace context carried to the router and workers in gRPC metadata."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.gateway.config import TracingConfig

_PROPAGATOR = TraceContextTextMapPropagator()


def make_tracer_provider(cfg: TracingConfig) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    if cfg.exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    return provider


def grpc_metadata(span: trace.Span, request_id: str) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return [("x-request-id", request_id), *carrier.items()]


def set_request_attributes(span: trace.Span, model: str, max_tokens: int | None, conversation_id: str | None,
                           temperature: float | None) -> None:
    span.set_attribute("gen_ai.operation.name", "chat")
    span.set_attribute("gen_ai.system", "llmserve")
    span.set_attribute("gen_ai.request.model", model)
    if max_tokens:
        span.set_attribute("gen_ai.request.max_tokens", max_tokens)
    if temperature is not None:
        span.set_attribute("gen_ai.request.temperature", temperature)
    if conversation_id:
        span.set_attribute("gen_ai.conversation.id", conversation_id)


def set_response_attributes(span: trace.Span, model: str, finish_reasons: list[str], input_tokens: int,
                            output_tokens: int, response_id: str) -> None:
    span.set_attribute("gen_ai.response.model", model)
    span.set_attribute("gen_ai.response.id", response_id)
    span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
    span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
