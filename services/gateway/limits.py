"""Which rate limits a request falls under, what it reserves at admission, and the 429 it gets.

TPM is reserved as prompt estimate + n x max tokens (max tokens defaulting to what the context
leaves), then reconciled with the real usage when the request ends (see metering.py).
"""

from __future__ import annotations

from services.gateway.auth import Principal
from services.gateway.errors import ApiError
from services.gateway.ratelimit import Decision, Limit, RateLimiter

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4  # chat-template framing per message


def estimate_prompt_tokens(texts: list[str], context: int) -> int:
    estimate = sum(len(t) for t in texts) // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE * len(texts) + 2
    return min(estimate, context)


def reservation(prompt_tokens: int, n: int, max_tokens: int | None, context: int) -> int:
    per_choice = max_tokens if max_tokens else max(context - prompt_tokens, 0)
    return prompt_tokens + n * per_choice


def limits_for(principal: Principal) -> list[Limit]:
    """Organization first: every scope of one request shares the org's hash tag."""
    org, key = principal.organization, principal.key
    org_scope, key_scope = f"org:{org.id}", f"org:{org.id}:key:{key.id}"
    wanted = [(org_scope, "requests", org.rpm_limit), (org_scope, "tokens", org.tpm_limit),
              (key_scope, "requests", key.rpm_limit), (key_scope, "tokens", key.tpm_limit)]
    return [Limit(scope, dimension, per_minute) for scope, dimension, per_minute in wanted if per_minute]


def refusal(decision: Decision) -> ApiError:
    if decision.unavailable:
        return ApiError(503, decision.message, code="rate_limiter_unavailable", headers=decision.headers)
    dimension = decision.violated.dimension if decision.violated else "requests"
    return ApiError(429, decision.message, type=dimension, code="rate_limit_exceeded", headers=decision.headers)


async def admit(limiter: RateLimiter, limits: list[Limit], tokens: int) -> Decision:
    """The decision for one request costing `tokens`; raises the refusal when it may not run."""
    decision = await limiter.acquire(limits, 1, tokens)
    if not decision.allowed:
        raise refusal(decision)
    return decision
