"""With the router (and the conversations service) unreachable the gateway answers 503 with
Retry-After, an error object the SDK retries on, never a hang or a 500."""

from __future__ import annotations

from pathlib import Path

from tests.gateway.harness import GatewayHarness, gateway_config


def test_unreachable_upstreams_are_503(tmp_path: Path):
    cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", "127.0.0.1:1")
    cfg.upstream.address = "127.0.0.1:1"
    cfg.upstream.unary_timeout_s = 1.0
    with GatewayHarness(cfg, fake_upstream=False) as gateway:
        _, _, key = gateway.new_org("lonely")
        auth = {"Authorization": f"Bearer {key}"}
        for reply in (gateway.http.get("/v1/models", headers=auth),
                      gateway.http.post("/v1/chat/completions", headers=auth, json={
                          "model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                      gateway.http.get("/v1/conversations", headers=auth)):
            assert reply.status_code in (503, 504), reply.text
            assert reply.json()["error"]["code"] in ("upstream_unavailable", "upstream_timeout")
        assert gateway.http.get("/v1/models", headers=auth).headers.get("retry-after") == "1"
