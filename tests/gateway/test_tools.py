"""Tools and structured outputs at the gateway: tool_choice to constraint, tool-call parsing per
format on fixed model outputs (auto mode is not reliable from a tiny model, so its parsers are
tested here), streamed tool-call deltas as OpenAI sends them (assembled by the real openai SDK),
and each kind of bad input a 400 naming the param."""

from __future__ import annotations

import json

import pytest

from services.gateway.structured import closed, parse_response_format, parse_tools
from services.gateway.tool_calls import ToolCallParser, parse_whole
from tests.gateway.test_bad_input import assert_error, post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def streamed(fmt: str, text: str, step: int, function: str | None = None) -> tuple[str, list[list]]:
    """The content and calls a client assembles from the deltas, checking OpenAI's delta rules."""
    parser, content, calls = ToolCallParser(fmt, function), "", []
    for i in range(0, len(text), step):
        out = parser.feed(text[i:i + step])
        content += out.content
        for d in out.calls:
            entry = d.entry()
            if d.index == len(calls):          # a new call: id, type and name come first, once
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                calls.append([entry["function"]["name"], entry["function"]["arguments"]])
            else:                              # then only argument fragments, of an existing index
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                assert d.index == len(calls) - 1
                calls[d.index][1] += entry["function"]["arguments"]
    return content + parser.finish().content, calls


MODEL_OUTPUTS = [   # (format, model text, content, [(name, arguments)])
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name":"a","arguments":{"s":"</tool_call> {}"}}</tool_call>\n<tool_call>'
               '{"arguments": {"n": [1, {"m": null}]}, "name": "b"}</tool_call>',
     "\n", [("a", {"s": "</tool_call> {}"}), ("b", {"n": [1, {"m": None}]})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("a", {"x": 1})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag", "No tools needed: 2 < 3 and <tool is not a tag", []),
    ("hermes", "<tool_call>this is not JSON", "<tool_call>this is not JSON", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
                    '"parameters": {}}', "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("llama3_json", 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure ",
     [("get_weather", {"city": "Rome"})]),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Lima \\"centro\\""}}, '
                 '{"name": "get_time", "arguments": {}}]', "",
     [("get_weather", {"city": 'Lima "centro"'}), ("get_time", {})]),
]


@pytest.mark.parametrize("fmt, text, content, calls", MODEL_OUTPUTS)
def test_parsers_on_fixed_model_outputs(fmt, text, content, calls):
    whole_content, whole_calls = parse_whole(fmt, text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    for step in (1, 2, 5, 17, len(text)):   # whatever way the text is split, the same deltas' sum
        got_content, got_calls = streamed(fmt, text, step)
        assert got_content == content, step
        assert [(name, json.loads(args)) for name, args in got_calls] == calls, step


def test_named_call_streams_the_whole_text_as_arguments():
    content, calls = streamed("named", '{"city": "Paris"}', 3, function="get_weather")
    assert content == "" and calls == [["get_weather", '{"city": "Paris"}']]


def test_tool_choice_becomes_the_constraint():
    required = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(required.constraint().json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == closed(WEATHER["function"]["parameters"])
    assert required.parser_format("llama3_json") == "required"

    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}})
    assert json.loads(named.constraint().json_schema) == closed(WEATHER["function"]["parameters"])
    assert named.parser_format("hermes") == "named"

    auto = parse_tools({"tools": [WEATHER]})
    assert auto.choice == "auto" and auto.constraint() is None and auto.parser_format("mistral") == "mistral"
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert none.tools_json() == "" and none.parser_format("hermes") is None

    fmt = parse_response_format({"type": "json_schema", "json_schema": {
        "name": "city", "strict": True, "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}})
    assert fmt.constraint.strict and json.loads(fmt.constraint.json_schema)["properties"] == {"name": {"type": "string"}}
    assert parse_response_format({"type": "json_object"}).constraint.json_object


def test_objects_listing_their_properties_are_closed_for_the_grammar():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "free": {"type": "object"},
        "mixed": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]},
        "list": {"type": "array", "items": {"properties": {"c": {"type": "integer"}}}}},
        "$defs": {"D": {"properties": {"d": {}}}}}
    got = closed(schema)
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["open"]["additionalProperties"] is True and "additionalProperties" not in got["properties"]["free"]
    assert all("additionalProperties" not in s for s in got["properties"]["mixed"]["allOf"])
    assert got["properties"]["list"]["items"]["additionalProperties"] is False
    assert got["$defs"]["D"]["additionalProperties"] is False
    assert schema["properties"]["a"] == {"type": "object", "properties": {"b": {"type": "string"}}}   # untouched


def scripted(reply: str, **extra) -> dict:
    """A body whose model output (from the fake upstream) is `reply`."""
    return {"model": "fake-model", "messages": [{"role": "system", "content": reply},
                                                {"role": "user", "content": "[reply-system]"}], **extra}


def test_auto_tool_call_whole_and_streamed_through_the_sdk(gateway, client):
    reply = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    whole = client.chat.completions.create(**scripted(reply), tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    sent = gateway.fake.calls[-1].request
    assert json.loads(sent.chat.tools_json) == [WEATHER] and not sent.HasField("constraint")

    chunks = list(client.chat.completions.create(**scripted(reply), tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0][0]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    assert json.loads("".join(d[0].function.arguments for d in deltas)) == {"city": "Paris"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The SDK's stream helper assembles the same call from the deltas.
    with client.chat.completions.stream(**scripted(reply), tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_required_and_named_send_constraints_and_parse_calls(gateway, client):
    required = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    chunks = list(client.chat.completions.create(**scripted(required), tools=[WEATHER, TIME],
                                                 tool_choice="required", stream=True))
    schema = json.loads(gateway.fake.calls[-1].request.constraint.json_schema)
    assert schema["type"] == "array" and "maxItems" not in schema
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.id:
                calls[d.index] = [d.function.name, d.function.arguments]
            else:
                calls[d.index][1] += d.function.arguments
    assert {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == {0: ("get_time", {}),
                                                                       1: ("get_weather", {"city": "Oslo"})}
    named = client.chat.completions.create(**scripted('{"city": "Rome"}'), tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(gateway.fake.calls[-1].request.constraint.json_schema) == closed(WEATHER["function"]["parameters"])
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert named.choices[0].message.content is None


def test_history_with_tool_calls_and_results_goes_upstream(gateway, key):
    body = {"model": "fake-model", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]}]}
    assert post(gateway, key, body).status_code == 200
    sent = gateway.fake.calls[-1].request.chat.messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    assert (sent[1].tool_calls[0].id, sent[1].tool_calls[0].name) == ("call_1", "get_weather")
    assert (sent[2].tool_call_id, sent[2].content) == ("call_1", "18C")


def test_response_format_and_prompt_cache_key_and_logit_bias_go_upstream(gateway, key):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = scripted('{"answer": 4}', response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema, "strict": True}}, prompt_cache_key="user-42", logit_bias={"15": -100})
    reply = post(gateway, key, body)
    assert reply.status_code == 200 and json.loads(reply.json()["choices"][0]["message"]["content"]) == {"answer": 4}
    sent = gateway.fake.calls[-1].request
    assert json.loads(sent.constraint.json_schema) == {**schema, "additionalProperties": False}
    assert sent.constraint.strict
    assert sent.affinity_key == "user-42" and dict(sent.sampling.logit_bias) == {15: -100.0}


BAD_TOOLS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": -1}}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]},
     "tools[0].function.parameters", "invalid_json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]},
     "tools[0].function.parameters", "invalid_type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}},
     "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0]", "unsupported_value"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages[0].content[0]", "unsupported_value"),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "invalid_value"),
    ({"prompt_cache_key": 7}, "prompt_cache_key", "invalid_type"),
]


@pytest.mark.parametrize("patch, param, code", BAD_TOOLS)
def test_bad_tools_and_formats_name_the_param(gateway, key, patch, param, code):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **patch}
    error = assert_error(post(gateway, key, body), 400, code, param)
    if "image" in json.dumps(patch) or "audio" in json.dumps(patch):
        assert "text only" in error["message"]


def test_schema_refused_by_the_grammar_engine_names_the_param(gateway, key):
    """An unsupported keyword (strict) comes back from the worker as INVALID_ARGUMENT."""
    schema = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "[refuse-constraint]"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    error = assert_error(post(gateway, key, body), 400, "invalid_value", "response_format.json_schema.schema")
    assert "dependentSchemas" in error["message"]
    tools = {"model": "fake-model", "messages": [{"role": "user", "content": "[refuse-constraint]"}],
             "tools": [WEATHER], "tool_choice": "required", "stream": True}
    assert_error(post(gateway, key, tools), 400, "invalid_value", "tools")


def test_structured_outputs_extension_goes_upstream(gateway, key):
    cases = [({"choice": ["yes", "no"]}, lambda c: list(c.choice.choices) == ["yes", "no"]),
             ({"regex": "[0-9]{3}"}, lambda c: c.regex == "[0-9]{3}"),
             ({"grammar": 'start: "a"+'}, lambda c: c.grammar == 'start: "a"+'),
             ({"json": {"type": "object", "properties": {"a": {}}}}, lambda c: json.loads(c.json_schema)["properties"])]
    for spec, check in cases:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            reply = post(gateway, key, {"model": "fake-model", "structured_outputs": spec, **body}, path=path)
            assert reply.status_code == 200, reply.text
            assert check(gateway.fake.calls[-1].request.constraint), (spec, path)


@pytest.mark.parametrize("patch, param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_bad_structured_outputs_name_the_param(gateway, key, patch, param):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **patch}
    assert_error(post(gateway, key, body), 400, param=param)


def test_parallel_tool_calls_false_keeps_the_first_call(gateway, client):
    two = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>' \
          '<tool_call>{"name": "get_time", "arguments": {"city": "B"}}</tool_call>'
    assert [(c.name, c.arguments) for c in parse_whole("hermes", two, max_calls=1)[1]] == [
        ("get_weather", '{"city": "A"}')]
    whole = client.chat.completions.create(**scripted(two), tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]
    chunks = list(client.chat.completions.create(**scripted(two), tools=[WEATHER, TIME], parallel_tool_calls=False,
                                                 stream=True))
    indexes = {d.index for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []}
    assert indexes == {0}
    both = client.chat.completions.create(**scripted(two), tools=[WEATHER, TIME])
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "get_time"]
