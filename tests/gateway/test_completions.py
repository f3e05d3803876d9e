"""POST /v1/completions and /v1/embeddings over the scripted upstream, read by the openai SDK."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.test_bad_input import assert_error, post


def test_text_prompt_whole_echo_and_logprobs(gateway, client):
    whole = client.completions.create(model="fake-model", prompt="Say hi", n=2, logprobs=2, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert [c.text for c in whole.choices] == ["Hello there friend"] * 2
    assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
    lp = whole.choices[0].logprobs
    assert lp.tokens == ["Hello", " there", " friend"] and lp.text_offset == [0, 5, 11]
    assert lp.token_logprobs == [-0.5] * 3 and lp.top_logprobs[0] == {"x": -1.5}
    sent = gateway.fake.calls[-1].request
    assert sent.text == "Say hi" and sent.sampling.max_tokens == 16 and sent.sampling.top_logprobs == 2
    assert whole.usage.completion_tokens == 6

    echoed = client.completions.create(model="fake-model", prompt=["Say hi"], echo=True)
    assert echoed.choices[0].text == "Say hiHello there friend"


def test_token_ids_and_stream_with_usage(gateway, client):
    chunks = list(client.completions.create(model="fake-model", prompt=[1, 2, 3], stream=True, max_tokens=2,
                                            stream_options={"include_usage": True}))
    assert list(gateway.fake.calls[-1].request.token_ids.ids) == [1, 2, 3]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "Hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("patch, param, code", [
    ({"prompt": None}, "prompt", "missing_required_parameter"),
    ({"prompt": {"text": "x"}}, "prompt", "invalid_type"),
    ({"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
    ({"prompt": [1, -2]}, "prompt", "invalid_type"),
    ({"prompt": [1, 999_999]}, "prompt", "invalid_value"),
    ({"prompt": [1, 2], "echo": True}, "echo", "unsupported_value"),
    ({"logprobs": 9}, "logprobs", "invalid_value"),
    ({"suffix": "tail"}, "suffix", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_value"),
    ({"messages": []}, "messages", "unknown_parameter"),
    ({"max_tokens": 5000}, "max_tokens", "invalid_value"),
    ({"min_tokens": 17}, "min_tokens", "invalid_value"),          # past the default max_tokens, 16
    ({"ignore_eos": 1}, "ignore_eos", "invalid_type"),
])
def test_bad_completion_requests_name_the_param(gateway, key, patch, param, code):
    body = {k: v for k, v in {"model": "fake-model", "prompt": "hi", **patch}.items() if v is not None}
    assert_error(post(gateway, key, body, path="/v1/completions"), 400, code, param)


def test_embeddings_say_why_not(gateway, key, client):
    error = assert_error(post(gateway, key, {"model": "fake-model", "input": "x"}, path="/v1/embeddings"),
                         400, "model_not_supported", "model")
    assert "embedding head" in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="fake-model", input="hello")
    assert_error(post(gateway, key, {"model": "nope", "input": "x"}, path="/v1/embeddings"), 404, "model_not_found")


def test_unknown_paths_and_methods_are_openai_errors(gateway, key):
    for method, path, status in [("POST", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("PUT", "/v1/responses", 405), ("GET", "/v2/chat/completions", 404)]:
        reply = gateway.http.request(method, path, headers={"Authorization": f"Bearer {key}"})
        assert reply.headers["content-type"].startswith("application/json")
        assert_error(reply, status)
