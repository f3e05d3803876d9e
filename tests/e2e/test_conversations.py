"""A conversation created over HTTP, resumed by chat completions that name it (the second answer
knows what only the first turn said), read back with both turns, and listed."""

from __future__ import annotations

import uuid

from tests.e2e.platform import MODELS, Platform

NAME = "Zorblax"   # a name the model cannot know unless the first turn is in its prompt


def test_conversation_is_created_resumed_and_listed(platform: Platform):
    model = MODELS[0]
    with platform.http() as http, platform.openai(max_retries=0) as client:
        created = http.post("/v1/conversations", json={"title": "e2e resume", "model": model})
        assert created.status_code == 201, created.text
        conversation = created.json()
        assert conversation["object"] == "conversation" and conversation["message_count"] == 0

        def ask(text: str):
            return client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_completion_tokens=12,
                temperature=0, extra_body={"conversation_id": conversation["id"]})

        first = ask(f"My name is {NAME}. Please remember it.")
        second = ask("What is my name?")
        assert NAME in second.choices[0].message.content
        # The second prompt carried the first turn: more than the new question alone.
        alone = client.chat.completions.create(model=model, max_completion_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": "What is my name?"}])
        assert second.usage.prompt_tokens > alone.usage.prompt_tokens + first.usage.completion_tokens

        stored = http.get(f"/v1/conversations/{conversation['id']}").json()
        assert [(m["role"], m["content"]) for m in stored["messages"]] == [
            ("user", f"My name is {NAME}. Please remember it."), ("assistant", first.choices[0].message.content),
            ("user", "What is my name?"), ("assistant", second.choices[0].message.content)]
        assert stored["message_count"] == 4 and not any(m["partial"] for m in stored["messages"])

        listed = http.get("/v1/conversations", params={"limit": 100}).json()
        [entry] = [c for c in listed["data"] if c["id"] == conversation["id"]]
        assert entry["title"] == "e2e resume" and entry["message_count"] == 4


def test_unknown_conversation_is_a_404(platform: Platform):
    with platform.http() as http:
        reply = http.post("/v1/chat/completions", json={
            "model": MODELS[0], "conversation_id": str(uuid.uuid4()), "max_completion_tokens": 1,
            "messages": [{"role": "user", "content": "hello"}]})
    assert reply.status_code == 404
    assert set(reply.json()["error"]) >= {"message", "type", "param", "code"}
