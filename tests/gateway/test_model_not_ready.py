"""A model the router knows but none of whose workers has reported yet (its context unknown) is a
retryable 503, not a 400 about the context, and the gateway asks again on the next request."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.harness import GatewayHarness, gateway_config


def test_a_model_without_a_ready_worker_is_503_until_one_reports(tmp_path: Path):
    cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", "127.0.0.1:1")
    with GatewayHarness(cfg) as gateway:
        gateway.fake.models["cold-model"] = 0
        _, _, key = gateway.new_org("cold")
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "cold-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        reply = gateway.http.post("/v1/chat/completions", headers=auth, json=body)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "upstream_unavailable"
        assert reply.headers["retry-after"] == "1"
        gateway.fake.models["cold-model"] = 2048     # a worker reported: not hidden behind a cached listing
        reply = gateway.http.post("/v1/chat/completions", headers=auth, json=body)
        assert reply.status_code == 200, reply.text
