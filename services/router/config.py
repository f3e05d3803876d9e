"""Router configuration: YAML file plus LLMSERVE_ROUTER__SECTION__KEY environment overrides.

    models:
      smollm2-135m-instruct:
        addresses: [10.0.0.5:50051, 10.0.0.6:50051]
        dns_name: worker-smollm2.llmserve.svc.cluster.local   # a headless service
        dns_port: 50051
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50050
    metrics_port: int = 9150          # Prometheus /metrics over HTTP; 0 disables
    grace_period_s: float = 5.0       # on SIGTERM: stop taking requests, finish running ones


@dataclass
class PoolConfig:
    """Where one model's workers are found; both sources may be used together."""
    addresses: list[str] = field(default_factory=list)   # static host:port list
    dns_name: str = ""                # every address the name resolves to is a worker
    dns_port: int = 50051


@dataclass
class DiscoveryConfig:
    dns_interval_s: float = 10.0      # how often DNS names are re-resolved


@dataclass
class HealthConfig:
    interval_s: float = 1.0           # grpc.health.v1 check + GetLoad poll per worker
    timeout_s: float = 1.0            # per check call
    service: str = ""                 # health service name asked for; "" = the whole server


@dataclass
class PolicyConfig:
    name: Literal["cache_aware", "round_robin", "least_loaded"] = "cache_aware"
    # SGLang's defaults: imbalanced when (max - min) > abs and max > rel * min.
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3      # matched fraction above which affinity wins
    block_chars: int = 64             # routing-key characters per hashed block (~16 tokens)
    max_blocks_per_worker: int = 200_000  # prefix memory per worker, LRU beyond it


@dataclass
class ForwardConfig:
    max_attempts: int = 3             # workers tried for a request that has not streamed yet
    connect_timeout_s: float = 2.0    # waiting for a worker's channel to be ready
    request_timeout_s: float = 600.0  # whole Generate stream, capped by the caller's deadline
    unary_timeout_s: float = 10.0     # Tokenize, ListModels
    # Caller metadata passed through to the worker (trace context, request ids).
    passthrough_metadata: list[str] = field(
        default_factory=lambda: ["traceparent", "tracestate", "baggage", "x-request-id"])


@dataclass
class RouterConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    models: dict[str, PoolConfig] = field(default_factory=dict)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
