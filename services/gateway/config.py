"""Gateway configuration: YAML file plus LLMSERVE_GATEWAY__SECTION__KEY environment overrides.

The defaults are the embedded, laptop values: loopback listener, the router on :50050, the
conversations service on :50060, SQLite under ./var/ and the in-process rate limiter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Mapping

from llmserve.config import ConfigError
from services.gateway.ratelimit.base import RateLimitConfig


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    tls_cert_file: str = ""           # PEM; with tls_key_file turns on HTTPS
    tls_key_file: str = ""
    plain_http: bool = False          # serving without TLS must be asked for explicitly
    max_body_bytes: int = 1 << 20     # larger request bodies get 413
    shutdown_timeout_s: float = 10.0


@dataclass
class UpstreamConfig:
    address: str = "127.0.0.1:50050" # the router (or one worker: same Generation contract)
    models_cache_ttl_s: float = 10.0  # ListModels answers are reused this long
    unary_timeout_s: float = 5.0      # ListModels, Tokenize, ListWorkers
    keepalive_interval_s: float = 5.0 # SSE `: keep-alive` comment while no token arrives
    request_timeout_s: float = 600.0  # deadline of a whole generation: a hung upstream cannot hold a request forever


@dataclass
class ConversationsConfig:
    address: str = "127.0.0.1:50060"
    timeout_s: float = 5.0
    min_reply_tokens: int = 256       # room kept for the reply when trimming history
    # A turn's append is retried on UNAVAILABLE / DEADLINE_EXCEEDED with the same idempotency key
    # (the service stores a key once): at most append_attempts calls, append_backoff_s doubling between.
    append_attempts: int = 4
    append_backoff_s: float = 0.25


@dataclass
class DatabaseConfig:
    # sqlite:///relative/path.db, sqlite:////absolute/path.db or postgresql://user@host:port/db
    url: str = "sqlite:///var/gateway.db"


@dataclass
class AuthConfig:
    admin_token: str = ""             # bearer token of the admin API; empty disables it
    cache_ttl_s: float = 5.0          # how long a key lookup is reused (revocation latency elsewhere)


@dataclass
class OverloadConfig:
    # Admission (overload.py). With follow_pool_load, a model's stream limit is what its workers
    # report they can run while each stream gets stream_tokens_per_s, and a request waits while the
    # prompts queued in the pool would delay its first token past ttft_target_s. Before the workers
    # report speeds (or without follow_pool_load): max_in_flight_per_worker x its routable workers
    # (the router's ListWorkers, polled every workers_poll_s; one worker when the upstream is a
    # worker); 0: a fixed max_in_flight_per_model. Always within [min_in_flight_per_model,
    # max_in_flight_per_model]. Replicas sharing the Redis rate limiter share this budget
    # (heartbeats in Redis, one a poll): each admits 1/N of it, rounded up. With the memory backend a
    # replica counts itself alone.
    follow_pool_load: bool = True
    ttft_target_s: float = 1.0            # the product card: first token within 1 s (short prompts)
    # > 0: the target follows the pool instead (the latency target of Envoy's adaptive concurrency
    # filter, its minimum latency x (1 + buffer)): this many times the 95th percentile of the first
    # tokens of the recent requests admitted to an idle pool (the last 64); ttft_target_s until 16
    # were measured. A pool on a slow machine is held to what it can do, a fast one to more than the
    # card's 1 s.
    ttft_target_over_unloaded: float = 0.0
    stream_tokens_per_s: float = 20.0     # and at least 20 tokens/s per stream
    default_output_tokens: int = 256      # the answer length charged to the fair queue without max_tokens
    max_in_flight_per_worker: int = 0
    min_in_flight_per_model: int = 1
    max_in_flight_per_model: int = 64
    workers_poll_s: float = 2.0
    max_queued_per_model: int = 32
    queue_timeout_s: float = 2.0      # a queued request waiting longer is refused
    # Sooner than queue_timeout_s of contention, a queue counts as standing (the short wait bound)
    # once, over this window, newcomers keep finding the pool full faster than slots free; it stands
    # until nobody has been refused for this long.
    sustained_window_s: float = 5.0
    # A burst's requests arrive together: a newcomer that finds the pool full later than this after
    # the queue formed is not part of the burst it absorbs, and waits only the short bound (as do
    # all of a queue that formed with no burst, overload.py).
    burst_arrival_s: float = 2.0
    # A burst: this share of the limit (at least 4 requests) arriving within half a second. A queue
    # that forms with no burst is new load from its first waiter on (0: every queue may be a burst's).
    burst_share: float = 0.25
    refuse_status: int = 429          # 429 or 503
    retry_after_s: float = 1.0


@dataclass
class SafetyConfig:
    policy_file: str = ""             # YAML safety policy; empty: no rules


@dataclass
class TracingConfig:
    exporter: Literal["none", "console"] = "none"
    service_name: str = "llmserve-gateway"


@dataclass
class LocalModeConfig:
    """Only in local mode the gateway creates a dev organization and key at start."""
    enabled: bool = False
    api_key: str = "sk-local-dev"     # overridden by LLMSERVE_DEV_API_KEY
    admin_token: str = "admin-local-dev"  # overridden by LLMSERVE_ADMIN_TOKEN
    organization: str = "dev"


@dataclass
class GatewayConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    conversations: ConversationsConfig = field(default_factory=ConversationsConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    rate_limit: RateLimitConfig = field(default_factory=RateLimitConfig)
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    local_mode: LocalModeConfig = field(default_factory=LocalModeConfig)


def apply_local_environment(cfg: GatewayConfig, environ: Mapping[str, str] = os.environ) -> GatewayConfig:
    """The two well-known local-mode variables, and the admin token they imply."""
    local = cfg.local_mode
    if local.enabled:
        local.api_key = environ.get("LLMSERVE_DEV_API_KEY", local.api_key)
        local.admin_token = environ.get("LLMSERVE_ADMIN_TOKEN", local.admin_token)
        if not cfg.auth.admin_token:
            cfg.auth.admin_token = local.admin_token
    return cfg


def validate(cfg: GatewayConfig) -> None:
    server = cfg.server
    if bool(server.tls_cert_file) != bool(server.tls_key_file):
        raise ConfigError("server.tls_cert_file and server.tls_key_file go together")
    if not server.tls_cert_file and not server.plain_http:
        raise ConfigError("no TLS certificate configured: set server.tls_cert_file/tls_key_file, "
                          "or server.plain_http: true to serve plain HTTP")
    if cfg.overload.refuse_status not in (429, 503):
        raise ConfigError("overload.refuse_status must be 429 or 503")
    overload = cfg.overload
    if not 1 <= overload.min_in_flight_per_model <= overload.max_in_flight_per_model:
        raise ConfigError("overload: 1 <= min_in_flight_per_model <= max_in_flight_per_model")
    if overload.max_in_flight_per_worker < 0 or overload.max_queued_per_model < 0:
        raise ConfigError("overload: max_in_flight_per_worker >= 0 and max_queued_per_model >= 0")
    if overload.workers_poll_s <= 0:
        raise ConfigError("overload.workers_poll_s must be > 0")
    if not 0 < overload.ttft_target_s <= 600:
        raise ConfigError(f"overload.ttft_target_s must be in (0, 600] seconds, got {overload.ttft_target_s}")
    if overload.ttft_target_over_unloaded != 0 and not 1 < overload.ttft_target_over_unloaded <= 100:
        raise ConfigError(f"overload.ttft_target_over_unloaded must be 0 (off) or in (1, 100] (a target below "
                          f"the unloaded first token refuses everyone), got {overload.ttft_target_over_unloaded}")
    if not 0 <= overload.stream_tokens_per_s <= 10_000:
        raise ConfigError(f"overload.stream_tokens_per_s must be in [0, 10000] (0: no speed target), "
                          f"got {overload.stream_tokens_per_s}")
    if not 0 <= overload.queue_timeout_s <= 600 or overload.retry_after_s <= 0:
        raise ConfigError("overload: queue_timeout_s must be in [0, 600] seconds and retry_after_s > 0")
    if not 0 < overload.sustained_window_s <= 600:
        raise ConfigError(f"overload.sustained_window_s must be in (0, 600] seconds, got {overload.sustained_window_s}")
    if not 0 <= overload.burst_arrival_s <= 600:
        raise ConfigError(f"overload.burst_arrival_s must be in [0, 600] seconds, got {overload.burst_arrival_s}")
    if not 0 <= overload.burst_share <= 1:
        raise ConfigError(f"overload.burst_share must be in [0, 1], got {overload.burst_share}")
    if overload.default_output_tokens < 1:
        raise ConfigError("overload.default_output_tokens must be >= 1")
