"""Constraints compiled to llguidance grammars, once per distinct constraint.

A compiled grammar is a prototype matcher in its start state; every request (every one of n
choices) gets its own deep copy, which is cheap, so compiling is paid once per schema. The cache
is bounded (least recently used out) and locked: the gRPC layer compiles in its tokenizer threads
to validate a request, and the engine thread looks the same constraint up again when it is added.

JSON is generated compact with a space after ',' and ':' and no other whitespace: a grammar that
allowed free whitespace would let a small model pad forever instead of closing the object.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

from services.worker.engine.sampling_params import Constraint
from services.worker.model.tokenizer import Tokenizer

if TYPE_CHECKING:   # matcher.py pulls in torch; a worker's front end only compiles, to validate
    from services.worker.engine.structured.matcher import GrammarMatcher

log = logging.getLogger("llmserve.worker")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CONSTRAINT_CHARS = 256 * 1024


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = 256) -> None:
        """vocab_size: the model's (its logits' width), which may exceed the tokenizer's."""
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._tokenizer = tokenizer
        self._lltokenizer: llguidance.LLTokenizer | None = None   # warm_up() or first use
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0   # cache misses that built a grammar

    def warm_up(self) -> None:
        """Builds the vocabulary's grammar tokenizer now. It holds the GIL for ~0.2 s (seconds on a
        busy machine): done lazily, the first constrained request stalled the worker's health checks."""
        try:
            with self._lock:
                self._grammar_tokenizer()
        except ValueError as e:   # e.g. a test model whose logits are narrower than its tokenizer
            log.warning("constrained decoding unavailable for this model: %s", e)

    def compile(self, constraint: Constraint) -> None:
        """Compile (or find) the constraint's grammar; ValueError naming the field if it is bad."""
        self._prototype(constraint)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher in the grammar's start state."""
        from services.worker.engine.structured.matcher import GrammarMatcher
        return GrammarMatcher(self._prototype(constraint).deep_copy(), self.vocab_size)

    def _prototype(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
                return found
            tokenizer = self._grammar_tokenizer()
        grammar = grammar_text(constraint)
        prototype = llguidance.LLMatcher(tokenizer, grammar, log_level=0)   # drops the GIL while it builds
        if prototype.is_error():
            raise ValueError(f"constraint.{constraint.kind}: {_first_line(prototype.get_error())}")
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint] = prototype
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return prototype


    def _grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """Under the lock."""
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=self._tokenizer.eos_token_ids)
        return self._lltokenizer


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked against the tokenizer)."""
    kind, value = constraint.kind, constraint.value
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"constraint.{kind} is longer than {MAX_CONSTRAINT_CHARS} characters")
    if kind == "json_object":
        return _json_grammar({"type": "object"}, lenient=False)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"constraint.json_schema is not valid JSON: {e}") from None
        if schema is True:   # the schema that admits every value
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("constraint.json_schema must be a JSON object (a schema) or true, "
                             f"got {json.dumps(schema)[:40]}")
        return _json_grammar(schema, lenient=not constraint.strict)
    if kind == "regex":   # \d means an ASCII digit, as callers of JSON APIs expect (not any Unicode Nd)
        return llguidance.LLMatcher.grammar_from_regex(llguidance.regex_to_lark(value, "d"))
    if kind == "choice":
        choices = json.loads(value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("constraint.choice needs at least one non-empty string")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def _json_grammar(schema: dict, lenient: bool) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={**JSON_OPTIONS, "lenient": lenient})
    except ValueError as e:
        raise ValueError(f"constraint.json_schema: {e}") from None


def _first_line(error: str) -> str:
    """llguidance errors end with a dump of the parser state; the caller needs the first lines."""
    return error.split("\n<state>")[0].strip()
