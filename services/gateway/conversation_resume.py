"""Resuming a stored conversation: history + new messages, trimmed to the model's context.

The oldest turns (a user message and the replies after it) go first; system messages never do.
The prompt is measured with the upstream Tokenize RPC, so the chat template's framing counts.
"""

from __future__ import annotations

from llmserve.v1 import conversations_pb2, worker_pb2
from services.gateway.errors import ApiError
from services.gateway.upstream import Upstream


def _turns(messages: list[worker_pb2.ChatMessage]) -> list[list[worker_pb2.ChatMessage]]:
    turns: list[list[worker_pb2.ChatMessage]] = []
    for m in messages:
        if m.role == "user" or not turns:
            turns.append([])
        turns[-1].append(m)
    return turns


async def fit_history(upstream: Upstream, model: str, context: int, stored: list[conversations_pb2.StoredMessage],
                      new: list[worker_pb2.ChatMessage], reply_tokens: int,
                      metadata: list[tuple[str, str]]) -> list[worker_pb2.ChatMessage]:
    history = [worker_pb2.ChatMessage(role=m.role, content=m.content) for m in stored]
    if not history:
        return new
    system = [m for m in history if m.role == "system"]
    turns = _turns([m for m in history if m.role != "system"])
    budget = context - min(reply_tokens, context // 2)
    while True:
        prompt = system + [m for turn in turns for m in turn] + new
        if await upstream.count_chat_tokens(model, prompt, metadata) <= budget:
            return prompt
        if not turns:
            raise ApiError(400, f"the new messages alone do not fit the context of {model} ({context} tokens)",
                           param="messages", code="context_length_exceeded")
        turns.pop(0)


def messages_to_store(new: list[tuple[str, str]], reply: str, model: str, partial: bool
                      ) -> list[conversations_pb2.NewMessage]:
    stored = [conversations_pb2.NewMessage(role=role, content=text) for role, text in new]
    if reply or not partial:
        stored.append(conversations_pb2.NewMessage(role="assistant", content=reply, partial=partial, model=model))
    return stored
