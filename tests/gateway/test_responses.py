"""The Responses API over the scripted upstream and the real conversations service, read by the
openai SDK: output items, the streamed event sequence, storage, previous_response_id chains,
function tools, and privacy between organizations."""

from __future__ import annotations

import json
import time
import uuid

import openai
import pytest

from tests.gateway.test_bad_input import assert_error, post

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_create_get_delete(gateway, client):
    response = client.responses.create(model="fake-model", input="Say hi", instructions="Be brief.")
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == "Hello there friend"
    assert response.usage.output_tokens == 3 and response.usage.input_tokens > 0
    sent = gateway.fake.calls[-1].request.chat.messages
    assert [(m.role, m.content) for m in sent] == [("system", "Be brief."), ("user", "Say hi")]
    gateway.drain()
    got = client.responses.retrieve(response.id)
    assert got.id == response.id and got.output_text == "Hello there friend" and got.instructions == "Be brief."
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_stream_event_sequence(gateway, client):
    events = list(client.responses.create(model="fake-model", input="Say hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there friend"
    final = events[-1].response
    assert final.output_text == "Hello there friend" and final.id == events[0].response.id
    with client.responses.stream(model="fake-model", input="Say hi") as stream:
        assert stream.get_final_response().output_text == "Hello there friend"


def test_previous_response_id_chain(gateway, client):
    first = client.responses.create(model="fake-model", input="My name is Ada.", instructions="Only once.")
    gateway.drain()
    second = client.responses.create(model="fake-model", input="What is my name?", previous_response_id=first.id)
    sent = gateway.fake.calls[-1].request.chat.messages
    assert [(m.role, m.content) for m in sent] == [
        ("user", "My name is Ada."), ("assistant", "Hello there friend"), ("user", "What is my name?")]
    assert second.previous_response_id == first.id
    gateway.drain()
    third = client.responses.create(model="fake-model", input="And again?", previous_response_id=second.id)
    assert len(gateway.fake.calls[-1].request.chat.messages) == 5 and third.status == "completed"


def test_function_tools_required_streamed_and_tool_results_in_input(gateway, client):
    script = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    body = dict(model="fake-model", tools=[WEATHER], tool_choice="required",
                input=[{"role": "system", "content": script}, {"role": "user", "content": "[reply-system]"}])
    whole = client.responses.create(**body)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert json.loads(gateway.fake.calls[-1].request.constraint.json_schema)["type"] == "array"
    events = list(client.responses.create(**body, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert done.arguments == args and events[-1].type == "response.completed"

    client.responses.create(model="fake-model", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "18C"}])
    sent = gateway.fake.calls[-1].request.chat.messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert sent[1].tool_calls[0].id == "call_9" and (sent[2].tool_call_id, sent[2].content) == ("call_9", "18C")


def test_text_format_json_schema_goes_upstream(gateway, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client.responses.create(model="fake-model", input="count", text={"format": {
        "type": "json_schema", "name": "count", "schema": schema, "strict": True}})
    sent = gateway.fake.calls[-1].request.constraint
    assert json.loads(sent.json_schema) == {**schema, "additionalProperties": False} and sent.strict


def test_responses_are_private_to_the_organization(gateway, client, key):
    mine = client.responses.create(model="fake-model", input="secret")
    gateway.drain()
    other = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=gateway.new_org("snoop")[2], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    error = assert_error(post(gateway, other.api_key, {"model": "fake-model", "input": "x",
                                                      "previous_response_id": mine.id}, path="/v1/responses"),
                         404, "response_not_found", "previous_response_id")
    assert mine.id in error["message"]
    assert client.responses.retrieve(mine.id).output_text == "Hello there friend"
    # Stored responses stay out of the organization's conversation list.
    chat = post(gateway, key, {"title": "a chat"}, path="/v1/conversations").json()["id"]
    listed = gateway.http.get("/v1/conversations", headers={"Authorization": f"Bearer {key}"}).json()
    ids = [c["id"] for c in listed["data"]]
    stored = str(uuid.UUID(hex=mine.id.removeprefix("resp_")))
    assert chat in ids and stored not in ids
    # ... and out of the conversation routes: not read, renamed or deleted as a chat.
    auth = {"Authorization": f"Bearer {key}"}
    assert gateway.http.get(f"/v1/conversations/{stored}", headers=auth).status_code == 404
    assert gateway.http.post(f"/v1/conversations/{stored}", headers=auth, json={"title": "x"}).status_code == 404
    assert gateway.http.delete(f"/v1/conversations/{stored}", headers=auth).status_code == 404
    assert client.responses.retrieve(mine.id).output_text == "Hello there friend"


def test_store_false_is_not_retrievable(gateway, client):
    response = client.responses.create(model="fake-model", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize("patch, param, code", [
    ({"input": None}, "input", "missing_required_parameter"),
    ({"input": []}, "input", "invalid_type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]", "unsupported_value"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "unsupported_value"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "missing_required_parameter"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}, "tools[0].parameters",
     "invalid_json_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}, "text.format.schema",
     "invalid_json_schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"messages": []}, "messages", "unknown_parameter"),
])
def test_bad_responses_requests_name_the_param(gateway, key, patch, param, code):
    body = {k: v for k, v in {"model": "fake-model", "input": "hi", **patch}.items() if v is not None}
    assert_error(post(gateway, key, body, path="/v1/responses"), 400, code, param)


def test_unknown_or_malformed_response_ids_are_404(gateway, key):
    for rid in ("resp_nothex", "resp_" + "0" * 32, "chatcmpl-abc"):
        reply = gateway.http.get(f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
        assert_error(reply, 404, "response_not_found", "response_id")
    assert_error(post(gateway, key, {"model": "fake-model", "input": "x", "previous_response_id": "resp_x"},
                      path="/v1/responses"), 404, "response_not_found", "previous_response_id")


def test_a_reply_cut_at_max_output_tokens_is_incomplete(gateway, client):
    whole = client.responses.create(model="fake-model", input="Say hi", max_output_tokens=2)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == "Hello there"
    events = list(client.responses.create(model="fake-model", input="Say hi", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_stream_the_client_left_is_stored_as_incomplete_with_what_was_produced(gateway, client, key):
    body = {"model": "fake-model", "input": "[drip]", "stream": True}
    with gateway.http.stream("POST", "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}) as reply:
        lines = reply.iter_lines()
        created = None
        deltas = 0
        for line in lines:
            if line.startswith("data: "):
                event = json.loads(line[6:])
                created = created or event["response"]["id"]
                deltas += event["type"] == "response.output_text.delta"
            if deltas >= 5:
                break
    deadline = time.monotonic() + 5
    while True:   # the gateway notices the client left at its next write, then stores what it had
        gateway.drain()
        try:
            stored = client.responses.retrieve(created)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "the cut stream's response was never stored"
            time.sleep(0.05)
    assert stored.status == "incomplete"
    [message] = stored.output
    text = message.content[0].text
    assert text.startswith("d0 d1 d2 d3 d4 ") and text.count("d0 ") == 1


def test_a_stored_response_is_no_chat_conversation_to_resume(gateway, client, key):
    response = client.responses.create(model="fake-model", input="hi")
    gateway.drain()
    conversation_id = str(uuid.UUID(hex=response.id.removeprefix("resp_")))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "conversation_id": conversation_id}
    assert_error(post(gateway, key, body), 404, "conversation_not_found", "conversation_id")


def test_input_items_list_the_context_with_pages(gateway, client):
    first = client.responses.create(model="fake-model", input="My name is Ada.")
    gateway.drain()
    second = client.responses.create(model="fake-model", previous_response_id=first.id, input=[
        {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_7", "output": "18C"},
        {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]}])
    gateway.drain()
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "function_call", "function_call_output", "message"]
    assert items.data[0].content[0].text == "My name is Ada." and items.data[1].role == "assistant"
    assert (items.data[2].call_id, items.data[3].output) == ("call_7", "18C") and not items.has_more
    newest = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in newest.data] == [items.data[4].id, items.data[3].id] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=10, after=newest.last_id)
    assert [i.id for i in rest.data] == [i.id for i in reversed(items.data[:3])] and not rest.has_more
    every = [i.id for i in client.responses.input_items.list(second.id, limit=2)]   # the SDK follows the pages
    assert every == [i.id for i in reversed(items.data)]
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=0)
