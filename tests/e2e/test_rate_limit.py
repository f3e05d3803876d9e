"""An organization allowed 2 requests a minute: its third request is a 429 in OpenAI's shape, with
the headers the SDK and proxies read, and the SDK raises RateLimitError."""

from __future__ import annotations

import math

import openai
import pytest

from tests.e2e.platform import MODELS, Platform

RPM = 2


def test_third_request_in_a_minute_is_refused_with_headers(platform: Platform):
    with platform.http(platform.admin_token) as admin:
        org = admin.post("/admin/v1/organizations", json={"name": "e2e-rate-limited", "rpm_limit": RPM})
        assert org.status_code == 201, org.text
        key = admin.post(f"/admin/v1/organizations/{org.json()['id']}/keys", json={"name": "e2e"})
        assert key.status_code == 201, key.text
        secret = key.json()["key"]

    body = {"model": MODELS[0], "max_completion_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with platform.http(secret) as http:
        admitted = [http.post("/v1/chat/completions", json=body) for _ in range(RPM)]
        refused = http.post("/v1/chat/completions", json=body)

    assert [r.status_code for r in admitted] == [200] * RPM, admitted[-1].text
    assert [r.headers["x-ratelimit-remaining-requests"] for r in admitted] == [str(RPM - 1 - i) for i in range(RPM)]

    assert refused.status_code == 429
    error = refused.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
    assert str(RPM) in error["message"]
    headers = refused.headers
    assert headers["x-ratelimit-limit-requests"] == str(RPM)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")       # a duration such as "29.5s"
    wait_ms = int(headers["retry-after-ms"])
    assert 0 < wait_ms <= 60_000 / RPM                                # one request's refill at most
    assert int(headers["Retry-After"]) == math.ceil(wait_ms / 1000)
    assert headers["x-request-id"]

    with platform.openai(secret, max_retries=0) as client, pytest.raises(openai.RateLimitError) as refusal:
        client.chat.completions.create(**body)
    assert refusal.value.status_code == 429 and refusal.value.code == "rate_limit_exceeded"
