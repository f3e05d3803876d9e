"""The openai SDK, sync and async, streaming and whole, against the real gateway over the fake upstream."""

from __future__ import annotations

import threading
import time

import httpx

import openai
import pytest

from tests.gateway.harness import GatewayHarness


@pytest.fixture(scope="module")
def key(gateway: GatewayHarness) -> str:
    return gateway.new_org("sdk")[2]


def client(gateway: GatewayHarness, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, **kw)


def async_client(gateway: GatewayHarness, key: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key=key, **kw)


USER = [{"role": "user", "content": "hi"}]


def test_sync_whole_completion(gateway, key):
    reply = client(gateway, key).chat.completions.create(model="fake-model", messages=USER)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.content == "Hello there friend"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 3
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 3
    assert reply.usage.prompt_tokens_details.cached_tokens == 2
    sent = gateway.fake.calls[-1].request
    assert sent.model == "fake-model" and sent.chat.messages[0].content == "hi"


def test_sync_stream_with_usage(gateway, key):
    stream = client(gateway, key).chat.completions.create(
        model="fake-model", messages=USER, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there friend"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_async_whole_and_stream(gateway, key):
    ai = async_client(gateway, key)
    reply = await ai.chat.completions.create(model="fake-model", messages=USER, max_completion_tokens=2)
    assert reply.choices[0].message.content == "Hello there"
    assert reply.choices[0].finish_reason == "length"
    stream = await ai.chat.completions.create(model="fake-model", messages=USER, stream=True)
    deltas = [c.choices[0].delta.content or "" async for c in stream]
    assert "".join(deltas) == "Hello there friend"
    await ai.close()


def test_n_choices_logprobs_and_sampling_fields(gateway, key):
    reply = client(gateway, key).chat.completions.create(
        model="fake-model", messages=USER, n=2, logprobs=True, top_logprobs=2, temperature=0.5, top_p=0.9,
        seed=7, stop=["zz"], presence_penalty=0.5, frequency_penalty=-0.5, user="u1")
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content == "Hello there friend" for c in reply.choices)
    lp = reply.choices[1].logprobs.content
    assert [t.token for t in lp] == ["Hello", " there", " friend"] and len(lp[0].top_logprobs) == 2
    assert reply.usage.completion_tokens == 6
    sampling = gateway.fake.calls[-1].request.sampling
    assert (sampling.n, sampling.seed, list(sampling.stop), sampling.top_logprobs) == (2, 7, ["zz"], 2)
    assert sampling.temperature == pytest.approx(0.5) and sampling.frequency_penalty == pytest.approx(-0.5)


def test_models(gateway, key):
    models = client(gateway, key).models.list()
    assert {m.id for m in models.data} == {"fake-model", "tiny-model"}
    assert client(gateway, key).models.retrieve("tiny-model").id == "tiny-model"
    with pytest.raises(openai.NotFoundError):
        client(gateway, key).models.retrieve("nope")


def test_errors_map_to_sdk_exceptions(gateway, key):
    with pytest.raises(openai.AuthenticationError) as e:
        client(gateway, "sk-wrong").chat.completions.create(model="fake-model", messages=USER)
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client(gateway, key).chat.completions.create(model="no-such-model", messages=USER)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway, key).chat.completions.create(model="fake-model", messages=USER, temperature=3)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway, key).chat.completions.create(model="fake-model", messages=[
            {"role": "user", "content": "[too-long]"}])
    assert e.value.code == "context_length_exceeded"


def test_failure_mid_stream_is_an_error_event(gateway, key):
    stream = client(gateway, key).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "[fail-mid]"}], stream=True)
    seen = []
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "Hello there" and "worker crashed" in str(e.value)


def test_sdk_retries_honour_retry_after_ms(gateway):
    """tpm 600 (10 tokens/s), all of it reserved by a hanging request: the next one (10 tokens) is
    refused with retry-after-ms ~1000, and the SDK's retry after that wait succeeds."""
    _, _, secret = gateway.new_org("retry", tpm=600)

    def hold_budget():  # prompt estimate 7 + 593 = 600 reserved; the client gives up after 2.5 s
        with pytest.raises(httpx.TimeoutException):
            httpx.post(gateway.base_url + "/v1/chat/completions", timeout=2.5,
                       headers={"Authorization": f"Bearer {secret}"},
                       json={"model": "fake-model", "messages": [{"role": "user", "content": "[hang]"}],
                             "max_completion_tokens": 593})

    hangs = len(gateway.fake.find("[hang]"))
    holder = threading.Thread(target=hold_budget)
    holder.start()
    while len(gateway.fake.find("[hang]")) == hangs:
        time.sleep(0.01)
    started = time.monotonic()
    raw = client(gateway, secret, max_retries=2).chat.completions.with_raw_response.create(
        model="fake-model", messages=USER, max_completion_tokens=4)  # estimate 6 + 4 = 10 tokens
    waited = time.monotonic() - started
    holder.join()
    assert raw.parse().choices[0].message.content == "Hello there friend"
    assert raw.retries_taken == 1
    assert 0.95 <= waited < 2.5, waited


def test_rate_limit_error_without_retries(gateway):
    _, _, secret = gateway.new_org("strict", rpm=1)
    sdk = client(gateway, secret, max_retries=0)
    sdk.chat.completions.create(model="fake-model", messages=USER)
    with pytest.raises(openai.RateLimitError) as e:
        sdk.chat.completions.create(model="fake-model", messages=USER)
    assert e.value.code == "rate_limit_exceeded" and e.value.type == "requests"
    headers = e.value.response.headers
    assert int(headers["retry-after-ms"]) > 50_000 and int(headers["retry-after"]) >= 50
    assert headers["x-ratelimit-limit-requests"] == "1" and headers["x-ratelimit-remaining-requests"] == "0"
