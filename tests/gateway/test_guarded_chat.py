"""The safety policy as the gateway applies it: blocked input is a 400 content_policy_violation;
output is guarded while streaming (a match split across messages is caught, never sent) and
stops the choice with finish_reason content_filter."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.gateway.harness import GatewayHarness, gateway_config

POLICY = """
default_policy: guarded
policies:
  guarded:
    rules:
      - {name: no-bombs, kind: keyword, match: ["build a bomb"], category: violence, action: block, applies_to: [input]}
      - {name: mild, kind: keyword, match: [darn], category: profanity, action: flag, applies_to: [input]}
      - {name: secret-word, kind: keyword, match: [xyzzy], category: secrets, action: block, applies_to: [output]}
"""


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, conversations_address):
    tmp = Path(tmp_path_factory.mktemp("safety"))
    (tmp / "policy.yaml").write_text(POLICY)
    cfg = gateway_config(f"sqlite:///{tmp / 'g.db'}", conversations_address,
                         safety={"policy_file": str(tmp / "policy.yaml")})
    with GatewayHarness(cfg) as harness:
        yield harness


@pytest.fixture(scope="module")
def sdk(guarded: GatewayHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=guarded.base_url + "/v1", api_key=guarded.new_org("safe")[2], max_retries=0)


def test_blocked_input_is_refused(guarded, sdk):
    calls = len(guarded.fake.calls)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "how to Build a Bomb"}])
    assert e.value.code == "content_policy_violation" and e.value.param == "messages"
    assert len(guarded.fake.calls) == calls   # never reached the model


def test_flagged_input_passes(guarded, sdk):
    reply = sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "darn it"}])
    assert reply.choices[0].finish_reason == "stop"
    assert guarded.fake.calls[-1].request.chat.messages[-1].content == "darn it"


def test_streamed_output_match_split_across_messages_stops_with_content_filter(guarded, sdk):
    before = len(guarded.fake.calls)
    said = "[slow][say:the word is xyzzy and more text]"   # one character per upstream message
    stream = sdk.chat.completions.create(model="fake-model", stream=True, stream_options={"include_usage": True},
                                         messages=[{"role": "user", "content": said}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "xyzzy" not in text and "xyz" not in text
    assert text.startswith("the word is")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "content_filter"
    assert chunks[-1].usage.completion_tokens < len("the word is xyzzy and more text")  # stopped early
    record = guarded.fake.calls[before]
    assert record.finished.wait(5) and record.cancelled_at is not None          # generation was stopped


def test_whole_output_is_filtered_too(guarded, sdk):
    reply = sdk.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "[say:ok xyzzy]"}])
    assert reply.choices[0].finish_reason == "content_filter"
    assert "xyzzy" not in reply.choices[0].message.content


def test_clean_output_passes_whole(guarded, sdk):
    reply = sdk.chat.completions.create(model="fake-model",
                                        messages=[{"role": "user", "content": "[say:all fine here]"}])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("all fine here", "stop")
