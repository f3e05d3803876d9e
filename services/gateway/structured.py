"""What the client asks the output to be, validated once at the edge: `response_format` /
`text.format`, `tools` + `tool_choice` + `parallel_tool_calls`, `logit_bias`. Each becomes a
worker Constraint (or sampling field) and, for tools, the way the reply is parsed.

tool_choice to constraint (as vLLM does it):
  none      no tools rendered, no calls parsed
  auto      tools rendered, calls parsed from free text by the model's format (tool_calls.py)
  required  a JSON array of at least one {"name": one of the tools, "arguments": its parameters}
  named     the named function's parameters schema; the output is its arguments object
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from llmserve.v1 import worker_pb2
from services.gateway.errors import invalid

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def check_schema(schema: Any, param: str) -> dict:
    """A JSON schema (an object that is itself a valid schema, by the 2020-12 metaschema)."""
    if not isinstance(schema, dict):
        raise invalid(f"{param} must be a JSON schema (an object)", param, "invalid_type")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise invalid(f"{param} is not a valid JSON schema: {e.message} at {where}", param,
                      "invalid_json_schema") from None
    return schema


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """The schema with every object that lists its properties closed to others (additionalProperties
    false where it says nothing about them), as xgrammar's strict mode (vLLM's default) reads schemas.
    Output valid under it is valid under the original; without it a small model fills an open object
    with invented keys until max_tokens. allOf branches stay open (closing them would conflict)."""
    if isinstance(schema, list):
        return [closed(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value, key == "allOf") for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and not in_all_of and not (
            {"additionalProperties", "unevaluatedProperties", "patternProperties", "allOf"} & set(schema)):
        out["additionalProperties"] = False
    return out


def _json_schema_constraint(schema: dict, strict: bool) -> worker_pb2.Constraint:
    return worker_pb2.Constraint(json_schema=_dumps(closed(schema)), strict=strict)


@dataclass
class OutputFormat:
    """response_format (chat) or text.format (responses) as a constraint, None for plain text."""
    constraint: worker_pb2.Constraint | None = None
    param: str = "response_format"


def parse_response_format(value: Any, param: str = "response_format", flat: bool = False) -> OutputFormat:
    """Chat Completions nests the schema ({"type": "json_schema", "json_schema": {name, schema, strict}});
    the Responses API's text.format is flat ({"type": "json_schema", name, schema, strict})."""
    if value is None:
        return OutputFormat(param=param)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(f"{param} must be an object with a type", param, "invalid_type")
    kind = value["type"]
    if kind == "text":
        return OutputFormat(param=param)
    if kind == "json_object":
        return OutputFormat(worker_pb2.Constraint(json_object=True), param)
    if kind != "json_schema":
        raise invalid(f"{param}.type must be one of text, json_object, json_schema; got {kind!r}",
                      f"{param}.type", "invalid_value")
    spec, where = _section(value, flat, "json_schema", param, "an object with name and schema")
    _name(spec, where)
    schema = check_schema(spec.get("schema", {"type": "object"}), f"{where}.schema")
    return OutputFormat(_json_schema_constraint(schema, _strict(spec, where)), f"{where}.schema")


def _section(value: dict, flat: bool, key: str, param: str, what: str) -> tuple[dict, str]:
    """The nested object (chat completions' form) or the value itself (the Responses API's flat form)."""
    spec, where = (value, param) if flat else (value.get(key), f"{param}.{key}")
    if not isinstance(spec, dict):
        raise invalid(f"{where} is required ({what})", where, "missing_required_parameter")
    return spec, where


def _name(spec: dict, where: str) -> str:
    name = spec.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise invalid(f"{where}.name is required: 1-64 letters, digits, _ . or -", f"{where}.name", "invalid_value")
    return name


def _strict(spec: dict, where: str) -> bool:
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict must be a boolean", f"{where}.strict", "invalid_type")
    return bool(strict)


MAX_CHOICES = 256


def parse_structured_outputs(value: Any, param: str = "structured_outputs") -> OutputFormat:
    """vLLM's extension, for what response_format cannot say: exactly one of json (a schema),
    regex, choice (a list of strings) or grammar (Lark)."""
    if value is None:
        return OutputFormat(param=param)
    kinds = {"json", "regex", "choice", "grammar"}
    if not isinstance(value, dict) or len(set(value) & kinds) != 1 or set(value) - kinds:
        raise invalid(f"{param} must be an object with exactly one of {sorted(kinds)}", param, "invalid_value")
    [(kind, spec)] = value.items()
    where = f"{param}.{kind}"
    if kind == "json":
        return OutputFormat(_json_schema_constraint(check_schema(spec, where), False), where)
    if kind == "choice":
        if not isinstance(spec, list) or not 0 < len(spec) <= MAX_CHOICES or \
                not all(isinstance(c, str) and c for c in spec):
            raise invalid(f"{where} must be 1 to {MAX_CHOICES} non-empty strings", where, "invalid_value")
        return OutputFormat(worker_pb2.Constraint(choice=worker_pb2.ChoiceList(choices=spec)), where)
    if not isinstance(spec, str) or not spec:
        raise invalid(f"{where} must be a non-empty string", where, "invalid_type")
    if kind == "regex":
        try:
            re.compile(spec)
        except re.error as e:
            raise invalid(f"{where} is not a valid regular expression: {e}", where, "invalid_value") from None
        return OutputFormat(worker_pb2.Constraint(regex=spec), where)
    return OutputFormat(worker_pb2.Constraint(grammar=spec), where)


def output_format(body: dict) -> OutputFormat:
    """response_format or structured_outputs (one of them)."""
    given = parse_response_format(body.get("response_format"))
    extension = parse_structured_outputs(body.get("structured_outputs"))
    if given.constraint is not None and extension.constraint is not None:
        raise invalid("response_format and structured_outputs cannot both constrain the output", "structured_outputs",
                      "invalid_value")
    return extension if extension.constraint is not None else given


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict
    strict: bool

    def definition(self) -> dict:
        """The OpenAI chat form, as the chat template receives it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if not self.description:
            del function["description"]
        return {"type": "function", "function": function}


@dataclass
class ToolUse:
    """Tools and how they may be called; `choice` is none | auto | required | a function name."""
    tools: list[Tool] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True
    named: bool = False          # choice names a function

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def tools_json(self) -> str:
        return _dumps([t.definition() for t in self.tools]) if self.active else ""

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def parser_format(self, model_format: str) -> str | None:
        """How the reply is parsed: named | required | the model's own format; None: no tools."""
        if not self.active:
            return None
        if self.named:
            return "named"
        return "required" if self.choice == "required" else (model_format or "hermes")

    def constraint(self) -> worker_pb2.Constraint | None:
        if not self.active or self.choice == "auto":
            return None
        if self.named:
            tool = next(t for t in self.tools if t.name == self.choice)
            return _json_schema_constraint(tool.parameters, tool.strict)
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                   "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return _json_schema_constraint(array, all(t.strict for t in self.tools))


def _tool(i: int, value: Any, flat: bool) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise invalid(f"{where} must be a function tool ({{\"type\": \"function\", ...}})", f"{where}.type",
                      "unsupported_value" if isinstance(value, dict) else "invalid_type")
    function, fwhere = _section(value, flat, "function", where, "an object with name and parameters")
    name = _name(function, fwhere)
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{fwhere}.description must be a string", f"{fwhere}.description", "invalid_type")
    parameters = function.get("parameters")
    parameters = {"type": "object", "properties": {}} if parameters is None else \
        check_schema(parameters, f"{fwhere}.parameters")
    return Tool(name, description, parameters, _strict(function, fwhere))


def parse_tools(body: dict, flat: bool = False) -> ToolUse:
    """Chat Completions nests each function ({"type": "function", "function": {...}}); the
    Responses API's tools are flat ({"type": "function", "name", "parameters", ...})."""
    raw = body.get("tools")
    if raw is None or raw == []:
        tools: list[Tool] = []
    elif not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid(f"tools must be an array of at most {MAX_TOOLS} function tools", "tools", "invalid_type")
    else:
        tools = [_tool(i, t, flat) for i, t in enumerate(raw)]
        names = [t.name for t in tools]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise invalid(f"tools has functions named alike: {dupes}", "tools", "invalid_value")
    use = ToolUse(tools, choice="auto" if tools else "none")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
        use.parallel = parallel
    choice = body.get("tool_choice")
    if choice is None:
        return use
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice must be none, auto, required or a function; got {choice!r}",
                          "tool_choice", "invalid_value")
        if choice != "none" and not tools:
            raise invalid(f"tool_choice {choice!r} needs tools", "tool_choice", "invalid_value")
        use.choice = choice
        return use
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice if flat or "name" in choice else choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice", "invalid_type")
    if name not in {t.name for t in tools}:
        raise invalid(f"tool_choice names the function {name!r}, which is not among the tools "
                      f"({', '.join(t.name for t in tools) or 'none given'})", "tool_choice", "invalid_value")
    use.choice, use.named = name, True
    return use


def parse_logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias",
                      "invalid_type")
    bias = {}
    for token, amount in value.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise invalid(f"logit_bias key {token!r} is not a token id", "logit_bias", "invalid_value") from None
        if token_id < 0 or (vocab_size and token_id >= vocab_size):
            raise invalid(f"logit_bias token {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                          "logit_bias", "invalid_value")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise invalid(f"logit_bias[{token}] must be a number in [-100, 100]", "logit_bias", "invalid_value")
        bias[token_id] = float(amount)
    return bias


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    """Once the model is known: every biased token is in its vocabulary."""
    if vocab_size and bias and max(bias) >= vocab_size:
        raise invalid(f"logit_bias token {max(bias)} is outside the vocabulary (0..{vocab_size - 1})",
                      "logit_bias", "invalid_value")
