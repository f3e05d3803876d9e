"""Bad input through the real gateway process: each kind is refused with a clear OpenAI error
object, and none reaches an engine (the workers' prefix-cache query counters, which count every
admitted prompt token, do not move).

The gateway bounds the body size (413), the parameters' types and ranges and the stop list itself;
it has no own bound on the number of messages or the length of a content: those are bounded by
the body size and then by the worker's context check (400 context_length_exceeded, before queueing).
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tests.reliability.clients import Admin, chat_body, load
from tests.reliability.platform import MAX_BODY_BYTES, MODEL


def msgs(content="Hi", n=1):
    return [{"role": "user", "content": content}] * n


BAD_BODIES = [
    # (case, body, status, error code)
    ("body too large", {"model": MODEL, "messages": msgs("a" * (MAX_BODY_BYTES + 1))}, 413, "request_too_large"),
    ("too many messages", {"model": MODEL, "messages": msgs("hi there", 3000)}, 400, "context_length_exceeded"),
    ("content too long", {"model": MODEL, "messages": msgs("word " * 40_000)}, 400, "context_length_exceeded"),
    ("no messages", {"model": MODEL, "messages": []}, 400, "invalid_value"),
    ("messages missing", {"model": MODEL}, 400, "missing_required_parameter"),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value"),
    ("null content", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, 400, "missing_required_parameter"),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported_value"),
    ("model missing", {"messages": msgs()}, 400, "missing_required_parameter"),
    ("model not a string", {"model": 7, "messages": msgs()}, 400, "invalid_type"),
    ("unknown model", {"model": "gpt-17", "messages": msgs()}, 404, "model_not_found"),
    ("unknown parameter", {**chat_body("x"), "frobnicate": 1}, 400, "unknown_parameter"),
    ("tool without function", {**chat_body("x"), "tools": [{"type": "function"}]}, 400, "missing_required_parameter"),
    ("tool_choice unknown tool", {**chat_body("x"), "tool_choice": {"type": "function", "function": {"name": "f"}}},
     400, "invalid_value"),
    ("max_tokens 0", chat_body("x", 0), 400, "invalid_value"),
    ("max_tokens negative", chat_body("x", -5), 400, "invalid_value"),
    ("max_tokens huge", chat_body("x", 2**40), 400, "invalid_value"),
    ("max_tokens string", chat_body("x", "8"), 400, "invalid_type"),
    ("max_tokens over context", chat_body("x", 5000), 400, "invalid_value"),
    ("prompt + max_tokens over context", chat_body("word " * 700, 1000), 400, "context_length_exceeded"),
    ("n 0", {**chat_body("x"), "n": 0}, 400, "invalid_value"),
    ("n 17", {**chat_body("x"), "n": 17}, 400, "invalid_value"),
    ("n float", {**chat_body("x"), "n": 2.5}, 400, "invalid_type"),
    ("stop 5 strings", {**chat_body("x"), "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("stop empty string", {**chat_body("x"), "stop": [""]}, 400, "invalid_value"),
    ("stop number", {**chat_body("x"), "stop": 7}, 400, "invalid_type"),
    ("logprobs string", {**chat_body("x"), "logprobs": "yes"}, 400, "invalid_type"),
    ("top_logprobs 21", {**chat_body("x"), "logprobs": True, "top_logprobs": 21}, 400, "invalid_value"),
    ("top_logprobs alone", {**chat_body("x"), "top_logprobs": 2}, 400, "invalid_value"),
    ("temperature 2.5", {**chat_body("x"), "temperature": 2.5}, 400, "invalid_value"),
    ("top_p 0", {**chat_body("x"), "top_p": 0}, 400, "invalid_value"),
    ("presence_penalty 3", {**chat_body("x"), "presence_penalty": 3}, 400, "invalid_value"),
    ("stream_options without stream", {**chat_body("x"), "stream_options": {"include_usage": True}}, 400,
     "invalid_value"),
    ("response_format unknown type", {**chat_body("x"), "response_format": {"type": "xml"}}, 400, "invalid_value"),
    ("json_schema not a schema", {**chat_body("x"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 7}}}}, 400, "invalid_json_schema"),
]

RAW_BODIES = [
    ("empty body", b"", 400, "invalid_json"),
    ("not json", b"{model: x", 400, "invalid_json"),
    ("not utf-8", b"\xff\xfe\x00{", 400, "invalid_json"),
    ("json array", b"[1, 2]", 400, "invalid_type"),
    ("json string", b'"hello"', 400, "invalid_type"),
]


@pytest.fixture(scope="module")
def secret(platform) -> str:
    return Admin(platform.gateway_url).new_org("bounds")[2]


def raw(base_url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    """One request sent as written (no client-side path normalisation); -> (status, headers, body)."""
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(body)),
                            **(headers or {})}.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def engine_queries(platform) -> int:
    return sum(load(w.address).prefix_cache_queries for w in platform.workers)


def error_of(status: int, body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_bad_bodies_are_refused_before_any_engine(platform, secret):
    auth = {"Authorization": f"Bearer {secret}"}
    before = engine_queries(platform)
    wrong = []
    cases = [(case, json.dumps(body).encode(), status, code) for case, body, status, code in BAD_BODIES] + RAW_BODIES
    for case, body, status, code in cases:
        got, _, reply = raw(platform.gateway_url, "POST", "/v1/chat/completions", body, auth)
        error = error_of(got, reply) if got != 200 else {}
        if (got, error.get("code")) != (status, code):
            wrong.append(f"{case}: expected {status} {code}, got {got} {reply[:200]!r}")
    assert not wrong, "\n".join(wrong)
    assert engine_queries(platform) == before, "a refused request reached an engine"
    # The same key still works: refusals do not poison anything.
    ok, _, reply = raw(platform.gateway_url, "POST", "/v1/chat/completions", json.dumps(chat_body("Hi", 2)).encode(),
                       auth)
    assert ok == 200, reply
    assert engine_queries(platform) > before


BAD_REQUESTS = [
    # (case, method, path, headers, status)
    ("no authorization", "POST", "/v1/chat/completions", {}, 401),
    ("basic auth", "POST", "/v1/chat/completions", {"Authorization": "Basic dXNlcjpwYXNz"}, 401),
    ("empty bearer", "POST", "/v1/chat/completions", {"Authorization": "Bearer "}, 401),
    ("unknown key", "POST", "/v1/chat/completions", {"Authorization": "Bearer sk-unknown-key-000"}, 401),
    ("GET on a POST route", "GET", "/v1/chat/completions", None, 405),
    ("unknown path", "POST", "/v1/chat/completion", None, 404),
    ("trailing slash", "POST", "/v1/chat/completions/", None, 404),
    ("double slash", "POST", "//v1/chat/completions", None, 404),
    ("NUL in path", "POST", "/v1/chat/completions%00", None, 404),
    ("dot-dot to the admin API", "GET", "/v1/../admin/v1/organizations", None, 404),   # not normalised
    ("very long path", "GET", "/v1/" + "a" * 6000, None, 404),
]


def test_odd_headers_and_paths_get_clear_errors(platform, secret):
    before = engine_queries(platform)
    body = json.dumps(chat_body("Hi", 2)).encode()
    wrong = []
    for case, method, path, headers, status in BAD_REQUESTS:
        headers = {"Authorization": f"Bearer {secret}"} if headers is None else headers
        got, _, reply = raw(platform.gateway_url, method, path, body, headers)
        if got != status:
            wrong.append(f"{case}: expected {status}, got {got} {reply[:200]!r}")
        else:
            error_of(got, reply)
    assert not wrong, "\n".join(wrong)
    assert engine_queries(platform) == before


def test_odd_request_ids_and_oversized_headers(platform, secret):
    auth = {"Authorization": f"Bearer {secret}"}
    status, headers, _ = raw(platform.gateway_url, "GET", "/v1/models", b"",
                             {**auth, "x-request-id": "evil\tid<script>" + "x" * 300})
    assert status == 200
    request_id = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    assert request_id.startswith("req_") and "<" not in request_id     # an unsafe id is replaced
    status, _, _ = raw(platform.gateway_url, "GET", "/v1/models", b"", {**auth, "X-Big": "b" * 20_000})
    assert status in (400, 431)      # refused by the HTTP parser, the process lives on
    assert raw(platform.gateway_url, "GET", "/v1/models", b"", auth)[0] == 200
