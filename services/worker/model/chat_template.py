"""Renders a model's Jinja chat template exactly as transformers' apply_chat_template does.

Same environment: sandboxed, trim_blocks and lstrip_blocks, loop controls, a non-escaping tojson,
raise_exception and strftime_now globals, and the {% generation %} tag (rendered as its body).
The template also sees the tokenizer's special tokens (bos_token, eos_token, ...), as there.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
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

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Raises ValueError when the template rejects the conversation (e.g. roles out of order)."""
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except Exception as e:  # the template is code run on the caller's messages: any failure is theirs
            raise ValueError(f"chat template rejected the messages: {type(e).__name__}: {e}") from e
