"""Renders a model's Jinja chat template exactly as transformers' apply_chat_template does.

Same environment: sandboxed, trim_blocks and lstrip_blocks, loop controls, a non-escaping tojson,
raise_exception and strftime_now globals, and the {% generation %} tag (rendered as its body).
The template also sees the tokenizer's special tokens (bos_token, eos_token, ...), as there.

Tools: a template that uses `tools` gets them in its context, with assistant tool_calls (their
arguments as objects, as transformers passes them) and tool results as they are. A template with
no tool support (SmolLM2's) gets the Hermes convention instead, in plain messages: the tools in a
system prompt, calls as <tool_call> JSON in the assistant's text, results as <tool_response>
blocks in a user turn (roles such templates accept). tool_call_format says which convention the
model writes its calls in, for the gateway's parser.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks; it renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")

HERMES_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags, as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def parse_tools(tools_json: str) -> list[dict] | None:
    """The OpenAI function tools of a chat prompt, checked; ValueError naming the field."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"chat.tools_json is not valid JSON: {e}") from None
    if not isinstance(tools, list):
        raise ValueError("chat.tools_json must be a JSON array of tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"chat.tools_json[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is not unique")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
    return tools


def tool_call_format(source: str) -> str:
    """How a model with this template writes tool calls (Hermes for templates without tools)."""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"invalid chat template: {e}") from e
        self.source = source
        self._special_tokens = special_tokens
        self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.tool_call_format = tool_call_format(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """messages in the OpenAI shape (assistant tool_calls with JSON-text arguments, tool results
        with tool_call_id). Raises ValueError when the template rejects the conversation."""
        if self.supports_tools:
            messages = [_with_argument_objects(m) for m in messages]
        elif tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages, tools = hermes_messages(messages, tools), None
        try:
            return self._template.render(messages=messages, tools=tools or None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except Exception as e:  # the template is code run on the caller's messages: any failure is theirs
            raise ValueError(f"chat template rejected the messages: {type(e).__name__}: {e}") from e


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation in plain system/user/assistant messages, tools and calls written the Hermes way."""
    out: list[dict] = []
    previous_role = None
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if previous_role == "tool":   # parallel calls' results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m.get("tool_calls"):
            calls = [f"<tool_call>\n{_call_json(c)}\n</tool_call>" for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(([m["content"]] if m.get("content") else []) + calls)})
        else:
            out.append(dict(m))
        previous_role = m.get("role")
    if tools:
        prompt = HERMES_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False)
                                                             for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content', '')}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_json(call: dict) -> str:
    function = call.get("function", {})
    return json.dumps({"name": function.get("name", ""), "arguments": _arguments(function.get("arguments", {}))},
                      ensure_ascii=False)


def _arguments(arguments):
    """A call's arguments as an object when they are JSON text of one (else as written)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c.get("function", {}), "arguments": _arguments(c.get("function", {}).get("arguments", {}))}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}
