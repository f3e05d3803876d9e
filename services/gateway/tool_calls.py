"""Tool calls out of a model's text, incrementally: each text delta in, content and tool-call
deltas out, exactly as OpenAI streams them (one index per call; id, type and name first, then
argument fragments, every fragment the model's own JSON text).

The formats a choice's text can take:
  named        the whole text is the arguments object of a known function (tool_choice named)
  required     a JSON array of {"name", "arguments"} objects (tool_choice required)
  hermes       content with <tool_call>{"name", "arguments"}</tool_call> blocks (Qwen, Hermes, SmolLM2 fallback)
  llama3_json  a text starting with {"name", "parameters"} (optionally after <|python_tag|>), calls split by ;
  mistral      content, then [TOOL_CALLS] and a JSON array of {"name", "arguments"} objects
Required and named come out of the grammar engine, so they always parse; the others come from a
free-running model, so text that is not a call stays content.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")
FORMATS = ("hermes", "llama3_json", "mistral")


def new_call_id() -> str:
    return "call_" + secrets.token_urlsafe(18)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def message_entry(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """One streamed tool_calls entry. `name` is set on a call's first delta only (with its id)."""
    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def entry(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class _Calls:
    """The calls found so far; arguments before a call's name are held until the name is known.
    Calls past max_calls (parallel_tool_calls false) are read and dropped."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.calls: list[ToolCall] = []
        self.max_calls = max_calls
        self._pending_args: str = ""
        self._named = False       # the current call's header went out
        self._dropped = False     # the current call is past max_calls

    def begin(self) -> None:
        self._named, self._dropped, self._pending_args = False, False, ""

    def name(self, name: str, out: Parsed) -> None:
        if self._named or self._dropped:
            return
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._dropped, self._pending_args = True, ""
            return
        self._named = True
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        out.calls.append(CallDelta(len(self.calls) - 1, "", name, call.id))
        if self._pending_args:
            self.arguments(self._pending_args, out)
            self._pending_args = ""

    def arguments(self, text: str, out: Parsed) -> None:
        if not text or self._dropped:
            return
        if not self._named:
            self._pending_args += text
            return
        call = self.calls[-1]
        call.arguments += text
        index = len(self.calls) - 1
        if out.calls and out.calls[-1].index == index:
            out.calls[-1].arguments += text
        else:
            out.calls.append(CallDelta(index, text))

    def end(self) -> None:
        self._pending_args = ""   # arguments of a call that never named its function


class CallScanner:
    """Reads JSON call objects ({"name": ..., "arguments": {...}}), one bare or a whole array of
    them, character by character. It tracks only what it needs: strings, nesting depth, the keys
    of a call object and the extent of its arguments value (whose characters are passed on as
    they come; an arguments value written as a JSON string is decoded when it ends)."""

    def __init__(self, calls: _Calls, in_array: bool):
        self.calls = calls
        self.in_array = in_array
        self.call_depth = 2 if in_array else 1    # depth inside a call object
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.token = ""                            # the call-level string being read (a key or the name)
        self.key: str | None = None                # the call-level key whose value is being read
        self.expect = "key"                        # key | value, at call level
        self.args: str | None = None               # None, "" (value not started), container | string | primitive
        self.args_depth = 0
        self._fragment = ""                        # arguments characters not yet passed on
        self._string_args = ""
        self.failed = False                        # the text is not a call: the rest is content
        self.done = False                          # the bare call object or the array ended

    def feed(self, text: str, out: Parsed) -> int:
        """Consumes text; returns how many characters it took (fewer than len(text) once done or failed)."""
        for i, ch in enumerate(text):
            if self.done or self.failed:
                self._flush(out)
                return i
            self._char(ch, out)
            if self.failed:
                self._flush(out)
                return i
        self._flush(out)
        return len(text)

    def _flush(self, out: Parsed) -> None:
        if self._fragment:
            self.calls.arguments(self._fragment, out)
            self._fragment = ""

    def _arg(self, ch: str, out: Parsed, end: bool = False) -> None:
        if self.args == "string":
            self._string_args += ch
            if end:
                try:
                    decoded = json.loads(self._string_args)
                except json.JSONDecodeError:
                    decoded = self._string_args
                self._string_args = ""
                self._fragment += decoded if isinstance(decoded, str) else json.dumps(decoded)
        else:
            self._fragment += ch
        if end:
            self.args = None

    def _char(self, ch: str, out: Parsed) -> None:
        if self.args is not None and self._args_char(ch, out):
            return
        if self.in_string:
            if self._string_ends(ch):
                self._string_done(out)
            else:
                self.token += ch
            return
        if ch.isspace():
            return
        if self.depth == 0 and ch != ("[" if self.in_array else "{"):
            self.failed = True
            return
        if ch == '"':
            self.in_string, self.token = True, ""
        elif ch in "{[":
            self.depth += 1
            if ch == "{" and self.depth == self.call_depth:
                self._flush(out)
                self.calls.begin()
                self.expect, self.key = "key", None
        elif ch in "}]":
            self.depth -= 1
            if ch == "}" and self.depth == self.call_depth - 1:
                self._flush(out)
                self.calls.end()
                self.done = not self.in_array
            elif self.depth == 0:
                self.done = True
        elif self.depth == self.call_depth and ch == ":":
            self.expect = "value"
            if self.key in ARGUMENT_KEYS:
                self.args = ""
        elif self.depth == self.call_depth and ch == ",":
            self.expect, self.key = "key", None

    def _args_char(self, ch: str, out: Parsed) -> bool:
        """One character while the arguments value is read; False: it is not the value's (handle it at call level)."""
        if self.args == "":
            if ch.isspace():
                return True
            self.args = "container" if ch in "{[" else "string" if ch == '"' else "primitive"
            self.args_depth = 1 if ch in "{[" else 0
            self.in_string = ch == '"'
            self._arg(ch, out)
            return True
        if self.args == "primitive":
            if ch in ",}":
                self.args = None
                return False
            self._arg(ch, out)
            return True
        if self.in_string:
            self._arg(ch, out, end=self._string_ends(ch) and self.args == "string")
            return True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.args_depth += 1
        elif ch in "}]":
            self.args_depth -= 1
            if self.args_depth == 0:
                self._arg(ch, out, end=True)
                return True
        self._arg(ch, out)
        return True

    def _string_ends(self, ch: str) -> bool:
        """Advances the lexer inside a string; True when ch is its closing quote."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _string_done(self, out: Parsed) -> None:
        if self.depth != self.call_depth:
            return
        text = _decoded(self.token)
        if self.expect == "key":
            self.key = text
        elif self.key == "name":
            self._flush(out)
            self.calls.name(text, out)


def _decoded(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw


class ToolCallParser:
    """One choice's text through one format. feed() per delta, finish() at the end."""

    def __init__(self, fmt: str, function: str | None = None, max_calls: int | None = None):
        self.format = fmt
        self._calls = _Calls(max_calls)
        self._held = ""                  # text that may be the start of a marker
        self._scanner: CallScanner | None = None
        self._decided = False            # llama3_json: whether the text is a call at all
        if fmt == "named":
            self._calls.begin()
            self._named_function = function
        elif fmt == "required":
            self._scanner = CallScanner(self._calls, in_array=True)

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls.calls

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self.format == "named":
            self._calls.name(self._named_function, out)
            self._calls.arguments(text, out)
        elif self.format == "required":
            self._scanner.feed(text, out)
        elif self.format == "hermes":
            self._tagged(text, out, "<tool_call>", "</tool_call>", in_array=False)
        elif self.format == "mistral":
            self._tagged(text, out, "[TOOL_CALLS]", None, in_array=True)
        elif self.format == "llama3_json":
            self._llama3(text, out)
        else:
            out.content = text
        return out

    def finish(self) -> Parsed:
        """The held-back text, as content (a marker that never completed)."""
        out = Parsed(content=self._held if self._scanner is None else "")
        self._held = ""
        return out

    def _tagged(self, text: str, out: Parsed, start: str, end: str | None, in_array: bool) -> None:
        text = self._held + text
        self._held = ""
        while text:
            if self._scanner is None:
                at = text.find(start)
                if at < 0:
                    keep = _partial_suffix(text, start)
                    out.content += text[:len(text) - keep]
                    self._held = text[len(text) - keep:]
                    return
                out.content += text[:at]
                text = text[at + len(start):]
                self._scanner = CallScanner(self._calls, in_array)
                continue
            if self._scanner.done:        # after the call object: skip to the end tag, if the format has one
                if end is not None:
                    at = text.find(end)
                    if at < 0:
                        self._held = text[len(text) - _partial_suffix(text, end):]
                        return
                    text = text[at + len(end):]
                self._scanner = None
                continue
            text = text[self._scanner.feed(text, out):]
            if self._scanner.failed:      # not a call after all: the rest is content
                out.content += start + text
                self._scanner, self.format = None, "content"
                return

    def _llama3(self, text: str, out: Parsed) -> None:
        if not self._decided:
            text = self._held + text
            stripped = text.lstrip()
            if stripped.startswith("<|python_tag|>"):
                stripped = stripped[len("<|python_tag|>"):].lstrip()
            elif "<|python_tag|>".startswith(stripped):
                self._held = text
                return
            if not stripped:
                self._held = text
                return
            self._held = ""
            self._decided = True
            if not stripped.startswith("{"):
                self.format = "content"
                out.content = text
                return
            text = stripped
        while text:
            if self._scanner is None or self._scanner.done:
                text = text.lstrip().lstrip(";").lstrip()
                if not text:
                    return
                self._scanner = CallScanner(self._calls, in_array=False)
            text = text[self._scanner.feed(text, out):]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of text that is a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_whole(fmt: str, text: str, function: str | None = None, max_calls: int | None = None
                ) -> tuple[str, list[ToolCall]]:
    """A finished text: its content and calls (the non-streamed response)."""
    parser = ToolCallParser(fmt, function, max_calls)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls
