"""Constrained decoding and tools through a real worker process over real gRPC: json_schema and
json_object outputs that parse and validate, a choice, logit_bias, tools rendered into the
prompt, the model's tool-call format, and each kind of bad input as INVALID_ARGUMENT naming
its field, with nothing left running."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from tests.procs import worker
from tests.worker.test_worker_grpc import MODEL, chat, wait_idle

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    with worker(tmp_path_factory.mktemp("worker")) as w, grpc.insecure_channel(w.address) as channel:
        yield worker_pb2_grpc.GenerationStub(channel)


def generate(stub, request: pb.GenerateRequest) -> tuple[str, int]:
    responses = list(stub.Generate(request, timeout=120))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def test_json_schema_output_validates(stub):
    request = chat("Describe a person called Ada who is 36, as JSON.", 48)
    request.constraint.json_schema = json.dumps(PERSON)
    request.constraint.strict = True
    text, finish = generate(stub, request)
    assert finish == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), PERSON)


def test_speculation_keeps_the_constrained_greedy_output(stub):
    request = chat("List three fruits with a quantity each, as JSON.", 64)
    request.constraint.json_schema = json.dumps({"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"fruit": {"type": "string", "maxLength": 10}, "qty": {"type": "integer"}},
        "required": ["fruit", "qty"], "additionalProperties": False}})
    plain = list(stub.Generate(request, timeout=120))
    request.sampling.num_speculative_tokens = 4
    speculated = list(stub.Generate(request, timeout=120))
    assert [t for r in speculated for t in r.token_ids] == [t for r in plain for t in r.token_ids]
    assert speculated[-1].usage.spec_accepted_tokens > 0
    json.loads("".join(r.text for r in plain))


def test_json_object_output_parses(stub):
    request = chat("Give me a JSON object with the name of a cat, and nothing else.", 96)
    request.constraint.json_object = True
    text, finish = generate(stub, request)
    assert finish == pb.FINISH_REASON_STOP
    assert isinstance(json.loads(text), dict)


def test_choice_output_is_one_of_them(stub):
    request = chat("Is the sky green? Answer yes or no.", 8)
    request.constraint.choice.choices.extend(["yes", "no", "maybe"])
    text, finish = generate(stub, request)
    assert text in {"yes", "no", "maybe"} and finish == pb.FINISH_REASON_STOP


def test_logit_bias_forces_a_token(stub):
    forced = stub.Tokenize(pb.TokenizeRequest(text=" banana")).token_ids
    assert len(forced) == 1
    request = chat("What is the capital of France?", 3)
    request.sampling.logit_bias[forced[0]] = 100.0
    text, _ = generate(stub, request)
    assert text == " banana" * 3


def test_tools_are_rendered_into_the_prompt(stub):
    messages = [pb.ChatMessage(role="user", content="What is the weather in Paris?")]
    plain = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=messages)))
    with_tools = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatPrompt(messages=messages,
                                                                     tools_json=json.dumps([WEATHER_TOOL]))))
    assert with_tools.count > plain.count + 40   # the fallback system prompt and the tool's schema
    assert stub.ListModels(pb.ListModelsRequest()).models[0].tool_call_format == "hermes"


def test_tool_history_renders(stub):
    """An assistant turn that called a tool and the tool's result, then a constrained answer."""
    messages = [pb.ChatMessage(role="user", content="What is the weather in Paris?"),
                pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather",
                                                                        arguments='{"city": "Paris"}')]),
                pb.ChatMessage(role="tool", tool_call_id="call_1", name="get_weather", content='{"temp_c": 21}')]
    request = pb.GenerateRequest(model=MODEL, chat=pb.ChatPrompt(messages=messages, tools_json=json.dumps([WEATHER_TOOL])),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=24))
    request.constraint.json_schema = json.dumps({"type": "object", "properties": {"temp_c": {"type": "integer"}},
                                                 "required": ["temp_c"], "additionalProperties": False})
    text, finish = generate(stub, request)
    assert finish == pb.FINISH_REASON_STOP and isinstance(json.loads(text)["temp_c"], int)


def bad(stub, request: pb.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.details()


@pytest.mark.parametrize("field, value, strict, message", [
    ("json_schema", "{not json", False, "constraint.json_schema is not valid JSON"),
    ("json_schema", json.dumps({"type": "nonsense"}), False, "constraint.json_schema"),
    ("json_schema", json.dumps({"type": "array", "uniqueItems": True}), True, "uniqueItems"),
    ("json_schema", "[1, 2]", False, "must be a JSON object"),
    ("regex", "[a-", False, "constraint.regex"),
    ("grammar", "start: undefined_rule", False, "constraint.grammar"),
])
def test_bad_constraints_are_invalid_argument(stub, field, value, strict, message):
    request = chat("hi", 4)
    setattr(request.constraint, field, value)
    request.constraint.strict = strict
    assert message in bad(stub, request)


def test_unsupported_keyword_is_ignored_without_strict(stub):
    request = chat("Give me a JSON list of two numbers.", 24)
    request.constraint.json_schema = json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                                                 "maxItems": 3})
    text, _ = generate(stub, request)
    assert text.startswith("[")


@pytest.mark.parametrize("bias, message", [({7: 150.0}, "logit_bias[7] must be in [-100, 100]"),
                                           ({10**6: 1.0}, "token id 1000000 is not in the vocabulary")])
def test_bad_logit_bias_is_invalid_argument(stub, bias, message):
    request = chat("hi", 4)
    request.sampling.logit_bias.update(bias)
    assert message in bad(stub, request)


@pytest.mark.parametrize("tools_json, message", [
    ("{", "chat.tools_json is not valid JSON"),
    (json.dumps({"type": "function"}), "must be a JSON array"),
    (json.dumps([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "chat.tools_json[0].function.parameters must be a JSON schema object"),
    (json.dumps([{"type": "retrieval"}]), "chat.tools_json[0] must be"),
    (json.dumps([WEATHER_TOOL, WEATHER_TOOL]), "chat.tools_json[1].function.name 'get_weather' is not unique"),
])
def test_bad_tools_are_invalid_argument(stub, tools_json, message):
    request = chat("hi", 4)
    request.chat.tools_json = tools_json
    assert message in bad(stub, request)
    assert wait_idle(stub).kv_blocks_used == 0
