"""Tools in chat templates: a template with tool support renders exactly as transformers renders it
(tools in its context, assistant tool_calls with argument objects, tool results); SmolLM2's,
which has none, gets the Hermes fallback; the tool-call format is chosen from the template; bad
tool lists are refused naming the field."""

from __future__ import annotations

import json

import pytest

from services.worker.model.chat_template import ChatTemplate, parse_tools, tool_call_format

# Qwen2.5-Instruct's template (tools in a system prompt, calls and results in <tool_call> and
# <tool_response> blocks): the shape most Hermes-style models use.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# The OpenAI wire shape: arguments are JSON text.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "14:05"},
]


def with_argument_objects(messages):
    """transformers' convention: a call's arguments are an object."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def test_a_template_with_tools_renders_as_transformers_does(hf_smollm2_tokenizer):
    ours = ChatTemplate(QWEN25_TEMPLATE, {}).render(CONVERSATION, tools=[WEATHER, TIME])
    theirs = hf_smollm2_tokenizer.apply_chat_template(with_argument_objects(CONVERSATION), tools=[WEATHER, TIME],
                                                      chat_template=QWEN25_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True)
    assert ours == theirs
    assert '"arguments": {"city": "Paris"}' in ours   # an object, not JSON text quoted again


def test_a_template_without_tools_gets_the_hermes_fallback(smollm2_tokenizer):
    template = ChatTemplate(smollm2_tokenizer.chat_template, {})
    assert not template.supports_tools and template.tool_call_format == "hermes"
    text = template.render(CONVERSATION, tools=[WEATHER, TIME])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")
    assert json.dumps(WEATHER["function"]) in system and json.dumps(TIME["function"]) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>') in text
    # Both results in one user turn, then the generation prompt.
    assert text.endswith('<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n'
                         '<tool_response>\n14:05\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_fallback_without_a_system_message_adds_one(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert text.count("<|im_start|>system") == 1   # SmolLM2's default system message gives way
    plain = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "function calling" not in plain


def test_history_with_calls_but_no_tools_still_renders(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template(CONVERSATION[1:])
    assert "<tool_call>" in text and "<tool_response>" in text and "<|im_start|>tool" not in text


def test_arguments_that_are_not_a_json_object_are_kept_as_written(smollm2_tokenizer):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]
    assert '{"name": "f", "arguments": "not json"}' in smollm2_tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("source, fmt", [
    (QWEN25_TEMPLATE, "hermes"),
    ("{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}", "mistral"),
    ("{% if tools %}Environment: ipython{% endif %}<|python_tag|>", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
])
def test_tool_call_format_follows_the_template(source, fmt):
    assert tool_call_format(source) == fmt


def test_parse_tools_accepts_openai_function_tools():
    assert parse_tools(json.dumps([WEATHER, TIME])) == [WEATHER, TIME]
    assert parse_tools("") is None


@pytest.mark.parametrize("tools, message", [
    ("[", "chat.tools_json is not valid JSON"),
    ("{}", "chat.tools_json must be a JSON array"),
    (json.dumps([{"type": "function", "function": {"name": ""}}]), r"chat.tools_json\[0\].function.name"),
    (json.dumps([{"type": "function", "function": {"name": "f", "parameters": []}}]),
     r"chat.tools_json\[0\].function.parameters must be a JSON schema object"),
    (json.dumps([TIME, {"type": "code_interpreter"}]), r"chat.tools_json\[1\] must be"),
])
def test_parse_tools_refuses_bad_tools(tools, message):
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)
