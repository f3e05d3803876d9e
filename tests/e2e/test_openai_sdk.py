"""The `openai` SDK, sync and async, whole and streamed, against both model pools: the same
greedy answer either way, the right finish reason, and usage that adds up."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.e2e.platform import MODELS, Platform

# Greedy SmolLM2 answers "Yes." and stops by itself; the count goes on past max_tokens. Each greedy
# token leads the next best by 0.4 logits or more (transformers, float32): the answers compared are
# not computed alike (other sequences in the batch, what the prefix cache holds), and in bfloat16
# (dtype auto on a CPU with AMX) that moves logits enough to flip a near tie: "Write a poem about
# the sea." (0.12 ahead) gave "The waves of the" whole and "In the depths of" streamed in CI.
ENDS_BY_ITSELF = ([{"role": "user", "content": "Reply with one word: yes or no?"}], 16, "stop")
CUT_SHORT = ([{"role": "user", "content": "Count from 1 to 10."}], 4, "length")


@dataclass
class Answer:
    model: str
    text: str
    finish_reason: str
    usage: object


def whole(completion) -> Answer:
    assert completion.object == "chat.completion" and completion.id
    [choice] = completion.choices
    assert choice.message.role == "assistant"
    return Answer(completion.model, choice.message.content, choice.finish_reason, completion.usage)


def streamed(chunks: list) -> Answer:
    """Checks the chunk framing the SDK relies on, then joins the deltas."""
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None        # include_usage: one last usage chunk
    assert all(c.usage is None for c in deltas)
    assert deltas[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason]
    assert len(finishes) == 1 and deltas[-1].choices[0].finish_reason == finishes[0]
    assert sum(1 for c in deltas if c.choices[0].delta.content) >= 2  # tokens arrived in pieces
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    return Answer(last.model, text, finishes[0], last.usage)


def check(model: str, max_tokens: int, finish_reason: str, answers: list[Answer]) -> None:
    first = answers[0]
    for answer in answers:
        assert answer.model == model
        assert answer.finish_reason == finish_reason
        assert answer.text.strip() and answer.text == first.text
        usage = answer.usage
        assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert (usage.prompt_tokens, usage.completion_tokens) == (first.usage.prompt_tokens,
                                                                  first.usage.completion_tokens)
    if finish_reason == "length":
        assert first.usage.completion_tokens == max_tokens
    else:
        assert 0 < first.usage.completion_tokens < max_tokens


def request(model: str, messages: list, max_tokens: int) -> dict:
    return dict(model=model, messages=messages, max_completion_tokens=max_tokens, temperature=0)


STREAM = dict(stream=True, stream_options={"include_usage": True})


@pytest.mark.parametrize("model", MODELS)
def test_sync_client_whole_and_streamed(platform: Platform, model: str):
    with platform.openai(max_retries=0) as client:
        for messages, max_tokens, finish_reason in (ENDS_BY_ITSELF, CUT_SHORT):
            body = request(model, messages, max_tokens)
            answers = [whole(client.chat.completions.create(**body)),
                       streamed(list(client.chat.completions.create(**body, **STREAM)))]
            check(model, max_tokens, finish_reason, answers)


@pytest.mark.parametrize("model", MODELS)
async def test_async_client_whole_and_streamed(platform: Platform, model: str):
    async with platform.async_openai(max_retries=0) as client:
        for messages, max_tokens, finish_reason in (ENDS_BY_ITSELF, CUT_SHORT):
            body = request(model, messages, max_tokens)
            answers = [whole(await client.chat.completions.create(**body)),
                       streamed([c async for c in await client.chat.completions.create(**body, **STREAM)])]
            check(model, max_tokens, finish_reason, answers)


def test_both_model_pools_are_listed(platform: Platform):
    with platform.openai(max_retries=0) as client:
        assert sorted(m.id for m in client.models.list()) == sorted(MODELS)
        assert client.models.retrieve(MODELS[1]).id == MODELS[1]
