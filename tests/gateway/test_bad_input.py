"""Bad input gets the right status and OpenAI error object, never a 5xx or a hang."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.harness import GatewayHarness


@pytest.fixture(scope="module")
def key(gateway: GatewayHarness) -> str:
    return gateway.new_org("bad-input")[2]


def post(gateway: GatewayHarness, key: str | None, body=None, content: bytes | None = None,
         path: str = "/v1/chat/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return gateway.http.post(path, json=body, content=content, headers=headers, timeout=10)


def assert_error(reply: httpx.Response, status: int, code: str | None = None, param: str | None = None,
                 type: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code:
        assert error["code"] == code
    if param:
        assert error["param"] == param
    if type:
        assert error["type"] == type
    assert reply.headers["x-request-id"]
    return error


OK = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def test_malformed_json(gateway, key):
    assert_error(post(gateway, key, content=b'{"model": "fake-model", "messages": ['), 400, "invalid_json")
    assert_error(post(gateway, key, content=b""), 400, "invalid_json")
    assert_error(post(gateway, key, content=b"\xff\xfe"), 400, "invalid_json")
    assert_error(post(gateway, key, body=[1, 2]), 400, "invalid_type")


@pytest.mark.parametrize("patch, param, code", [
    ({"model": None}, "model", "missing_required_parameter"),
    ({"model": 5}, "model", "invalid_type"),
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "unsupported_value"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"n": True}, "n", "invalid_type"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ({"max_completion_tokens": 5000}, "max_completion_tokens", "invalid_value"),  # beyond the 2048 context
    ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),                        # needs logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": 3}, "stop", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),  # without stream
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters",
     "invalid_type"),
    ({"logit_bias": {"1": 200}}, "logit_bias", "invalid_value"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"seed": "x"}, "seed", "invalid_type"),
    ({"conversation_id": ""}, "conversation_id", "invalid_type"),
    ({"top_k": -2}, "top_k", "invalid_value"),                                      # vLLM's extensions
    ({"top_k": 1.5}, "top_k", "invalid_type"),
    ({"min_p": 1.5}, "min_p", "invalid_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"min_tokens": -1}, "min_tokens", "invalid_value"),
    ({"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens", "invalid_value"),
    ({"ignore_eos": "yes"}, "ignore_eos", "invalid_type"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": "2"}, "stop_token_ids", "invalid_value"),
])
def test_invalid_fields_name_the_param(gateway, key, patch, param, code):
    body = {**OK, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    assert_error(post(gateway, key, body), 400, code, param, "invalid_request_error")


def test_unknown_model_is_404(gateway, key):
    assert_error(post(gateway, key, {**OK, "model": "gpt-9"}), 404, "model_not_found", "model")


def test_oversize_body_is_413(gateway, key):
    big = {**OK, "messages": [{"role": "user", "content": "x" * (gateway.cfg.server.max_body_bytes + 1)}]}
    assert_error(post(gateway, key, big), 413, "request_too_large")


def test_prompt_beyond_context(gateway, key):
    body = {**OK, "messages": [{"role": "user", "content": "[too-long]"}]}
    assert_error(post(gateway, key, body), 400, "context_length_exceeded", "messages")
    stream = post(gateway, key, {**body, "stream": True})
    assert_error(stream, 400, "context_length_exceeded")  # refused before the stream started


def test_bad_or_missing_or_revoked_key(gateway):
    assert_error(post(gateway, None, OK), 401, "invalid_api_key", type="authentication_error")
    assert_error(post(gateway, "sk-nope", OK), 401, "invalid_api_key")
    reply = gateway.http.post("/v1/chat/completions", json=OK, headers={"Authorization": "Basic abc"})
    assert_error(reply, 401, "invalid_api_key")
    _, key_id, secret = gateway.new_org("revoked")
    assert post(gateway, secret, OK).status_code == 200
    assert gateway.admin("DELETE", f"/admin/v1/keys/{key_id}").json()["revoked"] is True
    assert_error(post(gateway, secret, OK), 401, "invalid_api_key")
    assert_error(gateway.admin("DELETE", f"/admin/v1/keys/{key_id}"), 404, "key_not_found")


def test_admin_api_refuses_api_keys(gateway, key):
    reply = gateway.http.get("/admin/v1/organizations", headers={"Authorization": f"Bearer {key}"})
    assert_error(reply, 403, "forbidden")
    assert_error(gateway.http.get("/admin/v1/organizations"), 401)
    assert_error(gateway.admin("POST", "/admin/v1/organizations", {"name": ""}), 400, param="name")
    assert_error(gateway.admin("POST", "/admin/v1/organizations", {"name": "x", "rpm_limit": -1}), 400,
                 param="rpm_limit")
    assert_error(gateway.admin("POST", "/admin/v1/organizations/org_missing/keys", {"name": "k"}), 404)


def test_another_orgs_conversation_is_404(gateway, key):
    other = gateway.new_org("other")[2]
    created = post(gateway, key, {"title": "mine"}, path="/v1/conversations")
    assert created.status_code == 201
    cid = created.json()["id"]
    assert_error(gateway.http.get(f"/v1/conversations/{cid}",
                           headers={"Authorization": f"Bearer {other}"}), 404, "conversation_not_found")
    assert_error(post(gateway, other, {**OK, "conversation_id": cid}), 404, "conversation_not_found")
    assert_error(gateway.http.delete(f"/v1/conversations/{cid}",
                              headers={"Authorization": f"Bearer {other}"}), 404)
    assert gateway.http.get(f"/v1/conversations/{cid}",
                     headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_unknown_route_and_method(gateway, key):
    assert_error(gateway.http.get("/v1/nothing-here"), 404)
    assert_error(gateway.http.get("/v1/chat/completions"), 405)


def test_request_id_is_echoed_when_sane(gateway, key):
    mine = gateway.http.get("/v1/models", headers={"Authorization": f"Bearer {key}", "x-request-id": "trace-42.a:b"})
    assert mine.headers["x-request-id"] == "trace-42.a:b"
    odd = gateway.http.get("/v1/models", headers={"Authorization": f"Bearer {key}", "x-request-id": "x" * 300})
    assert odd.headers["x-request-id"].startswith("req_")
    assert gateway.http.get("/nowhere").headers["x-request-id"].startswith("req_")
