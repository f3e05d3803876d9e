"""schemathesis over the served OpenAPI document, against the real app on loopback: whatever it
generates, the gateway answers without a 5xx (and with an OpenAI error object on errors)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from services.gateway.routes.openapi import openapi_document
from tests.gateway.harness import ADMIN_TOKEN, GatewayHarness

schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def api_key(gateway: GatewayHarness) -> str:
    return gateway.new_org("fuzz", rpm=0, tpm=0)[2]


def test_document_is_served(gateway: GatewayHarness):
    for path in ("/openapi.json", "/v1/openapi.json"):
        served = gateway.http.get(path)
        assert served.status_code == 200 and served.json()["openapi"].startswith("3.1")
    assert set(served.json()["paths"]) >= {"/v1/chat/completions", "/v1/models", "/v1/conversations",
                                           "/admin/v1/organizations", "/admin/v1/keys/{id}"}


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, gateway: GatewayHarness, api_key: str):
    token = ADMIN_TOKEN if case.path.startswith("/admin/") else api_key
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
    response = case.call(base_url=gateway.base_url, timeout=10)
    assert response.status_code < 500 or response.status_code == 501, (response.status_code, response.text)
    assert response.headers.get("x-request-id")
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
