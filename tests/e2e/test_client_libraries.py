"""The client libraries people build on, pinned, against the real platform (SmolLM2 workers):
the openai SDK, LangChain, the OpenAI Agents SDK and pydantic-ai. SmolLM2-135M is far too small to
choose tools reliably, so the tool loops force the call (tool_choice required / named: the grammar
engine constrains the output) and auto mode's parsers are tested on fixed outputs in
tests/gateway/test_tools.py. Every constrained output must validate against its schema."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.platform import MODELS, Platform

MODEL = MODELS[0]
GREEDY = dict(temperature=0)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    """A city and its country."""
    name: str = Field(max_length=24)
    country: Literal["France", "Italy", "Spain", "Germany"]
    capital: bool


def schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


def check_calls(calls, tools: list[dict]) -> None:
    """Each call names one of the tools and its arguments validate against that tool's schema."""
    schemas = {t["function"]["name"]: schema_of(t) for t in tools}
    assert calls
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# -- the openai SDK ---------------------------------------------------------------------------------

def test_openai_tools_required_named_and_auto(platform: Platform):
    with platform.openai(max_retries=0) as client:
        required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                  tool_choice="required", max_completion_tokens=120, **GREEDY)
        assert required.choices[0].finish_reason == "tool_calls"
        check_calls(required.choices[0].message.tool_calls, [WEATHER, TIME])

        named = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_completion_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
        [call] = named.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        check_calls([call], [TIME])

        # auto: the model may answer or call; either way the reply is well formed
        auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_completion_tokens=60,
                                              **GREEDY)
        choice = auto.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls, [WEATHER])
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_openai_streamed_tool_calls_assembled_by_the_sdk(platform: Platform):
    with platform.openai(max_retries=0) as client:
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            max_completion_tokens=120, **GREEDY) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_completion()
        assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events
        assert final.choices[0].finish_reason == "tool_calls"
        check_calls(final.choices[0].message.tool_calls, [WEATHER, TIME])
        whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                               tool_choice="required", max_completion_tokens=120, **GREEDY)
        streamed_calls = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
        assert streamed_calls == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_openai_parse_with_a_pydantic_model_and_json_object(platform: Platform):
    with platform.openai(max_retries=0) as client:
        for prompt in ("Describe Paris.", "Describe Rome.", "Tell me about Madrid."):
            parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                   response_format=City, max_completion_tokens=100, **GREEDY)
            assert isinstance(parsed.choices[0].message.parsed, City)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer yes as a JSON object with the key answer."}],
            response_format={"type": "json_object"}, max_completion_tokens=100, **GREEDY)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_openai_completions_whole_and_streamed(platform: Platform):
    with platform.openai(max_retries=0) as client:
        body = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, **GREEDY)
        whole = client.completions.create(**body)
        [choice] = whole.choices
        assert choice.text.strip() and choice.finish_reason in ("stop", "length")
        assert whole.usage.completion_tokens <= 6 and whole.usage.prompt_tokens > 0
        chunks = list(client.completions.create(**body, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        echoed = client.completions.create(**body, echo=True)
        assert echoed.choices[0].text == "The capital of France is" + choice.text


def test_openai_responses_streamed_and_not_and_a_previous_response_chain(platform: Platform):
    with platform.openai(max_retries=0) as client:
        # Greedy SmolLM2 answers this in a word and stops (the SDK's stream helper wants response.completed,
        # which a reply cut at max_output_tokens does not end with: it ends with response.incomplete).
        body = dict(model=MODEL, input="Reply with one word: yes or no?", max_output_tokens=16, **GREEDY)
        whole = client.responses.create(**body)
        assert whole.output_text and whole.status == "completed"
        with client.responses.stream(**body) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert deltas == final.output_text == whole.output_text
        assert client.responses.retrieve(whole.id).output_text == whole.output_text

        follow = client.responses.create(model=MODEL, input="Why?", previous_response_id=whole.id,
                                         max_output_tokens=24, **GREEDY)
        assert follow.previous_response_id == whole.id and follow.output_text
        # the first turn's input and output are the second's context
        assert follow.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
        client.responses.delete(follow.id)


def test_choice_and_regex_constraints_through_the_sdk(platform: Platform):
    """vLLM's structured_outputs extension (extra_body), on chat and text completions."""
    with platform.openai(max_retries=0) as client:
        for _ in range(2):
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_completion_tokens=8,
                extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, **GREEDY)
            assert chat.choices[0].message.content in ("yes", "no", "maybe")
        text = client.completions.create(model=MODEL, prompt="The year the Berlin wall fell:", max_tokens=8,
                                         extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}}, **GREEDY)
        assert re.fullmatch("[12][0-9]{3}", text.choices[0].text), text.choices[0].text


# -- LangChain --------------------------------------------------------------------------------------

def _chat_openai(platform: Platform):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=f"{platform.gateway}/v1", api_key=platform.api_key, model=MODEL, temperature=0,
                      max_tokens=120, max_retries=0)


def test_langchain_bind_tools_and_structured_output(platform: Platform):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "18C"

    llm = _chat_openai(platform)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["args"]["city"]
    required = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Rome?")
    assert required.tool_calls and required.tool_calls[0]["name"] == "get_weather"
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(city, City), method


# -- OpenAI Agents SDK ------------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["chat_completions", "responses"])
async def test_agents_sdk_two_turn_tool_loop(platform: Platform, api: str):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is 18C and sunny in {city}."

    async with platform.async_openai(max_retries=0) as client:
        kind = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
        # tool_choice required for the first turn; the SDK resets it to auto after the call
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                      model=kind(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(seen) >= 1 and all(city for city in seen)
    assert len(result.raw_responses) >= 2            # the call, then an answer after the tool's result
    assert isinstance(result.final_output, str) and result.final_output


# -- pydantic-ai ------------------------------------------------------------------------------------

async def test_pydantic_ai_structured_output_agent(platform: Platform):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{platform.gateway}/v1",
                                                           api_key=platform.api_key))
    agent = Agent(model, output_type=City)   # the output comes back as a forced tool call
    result = await agent.run("Describe Berlin.", model_settings={"temperature": 0, "max_tokens": 100})
    assert isinstance(result.output, City)


# -- bad input through the real workers ---------------------------------------------------------------

def test_a_schema_keyword_the_grammar_engine_cannot_enforce(platform: Platform):
    """strict: refused by the worker's grammar engine, a 400 naming the param and the keyword;
    not strict: the keyword is ignored and the rest of the schema still holds."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "dependentSchemas": {"a": {"required": ["b"]}}}
    ask = [{"role": "user", "content": "Give a JSON object with a number a."}]

    def answer(client, strict: bool):
        return client.chat.completions.create(
            model=MODEL, messages=ask, max_completion_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": strict}})

    with platform.openai() as client:   # default retries: a 503 while a worker is busy is retried
        with pytest.raises(openai.BadRequestError) as refused:
            answer(client, strict=True)
        error = refused.value.body
        assert error["param"] == "response_format.json_schema.schema" and "dependentSchemas" in error["message"]
        lenient = answer(client, strict=False)
        jsonschema.validate(json.loads(lenient.choices[0].message.content),
                            {k: v for k, v in schema.items() if k != "dependentSchemas"})
        tool = {"type": "function", "function": {"name": "f", "strict": True,
                                                 "parameters": {"type": "object", "not": {"required": ["x"]}}}}
        with pytest.raises(openai.BadRequestError) as refused:
            list(client.chat.completions.create(model=MODEL, messages=ask, tools=[tool], tool_choice="required",
                                                stream=True))
        assert refused.value.body["param"] == "tools"


def test_another_organizations_previous_response_is_not_found(platform: Platform):
    with platform.openai(max_retries=0) as client:
        mine = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, **GREEDY)
    with platform.http(platform.admin_token) as admin:
        org = admin.post("/admin/v1/organizations", json={"name": "e2e-responses-other"})
        assert org.status_code == 201, org.text
        secret = admin.post(f"/admin/v1/organizations/{org.json()['id']}/keys", json={"name": "e2e"}).json()["key"]
    with platform.http(secret) as other:
        reply = other.post("/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": mine.id})
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "previous_response_id", reply.text
        assert other.get(f"/v1/responses/{mine.id}").status_code == 404
    with platform.openai(max_retries=0) as client:
        assert client.responses.retrieve(mine.id).id == mine.id
