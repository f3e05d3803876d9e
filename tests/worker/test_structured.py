"""Constrained decoding in the engine with the real SmolLM2 on the CPU, through its public
interface: constrained rows beside free rows, speculative decoding on and off, preemption in the
middle of a JSON answer, n choices each with its own matcher, a length finish with a valid prefix,
stop strings, logprobs and prefix caching alongside, abort, and the grammar cache."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema
import pytest

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sampling_params import Constraint, SamplingParams
from tests.worker.test_engine import chat_ids, make_engine

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
BASKET = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 3, "maxItems": 3,
    "items": {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 10},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["fruit", "qty"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird", "fish"]},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                                        "name": {"type": "string", "maxLength": 8}},
       "required": ["kind", "legs", "name"], "additionalProperties": False}


def schema(s: dict, strict: bool = True) -> Constraint:
    return Constraint("json_schema", json.dumps(s), strict=strict)


@dataclass
class Out:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    logprobs: list = field(default_factory=list)
    cached: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Out]:
    """Runs the requests together; -> per choice ('id' or 'id#i' for n > 1) what the caller saw."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs: dict[str, Out] = {}
    while engine.has_work():
        for o in engine.step():
            key = o.request_id if requests[o.request_id][1].n == 1 else f"{o.request_id}#{o.index}"
            out = outs.setdefault(key, Out())
            out.tokens += o.token_ids
            out.text += o.text
            out.logprobs += o.logprobs or []
            out.cached, out.spec_proposed, out.spec_accepted = o.num_cached_tokens, o.spec_proposed, o.spec_accepted
            if o.finished:
                out.finish = o.finish_reason
    return outs


def greedy(max_tokens: int, constraint: Constraint | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint, **kw)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {"person": chat_ids(tokenizer, "Describe Ada Lovelace, who died at 36, as JSON with her name and age."),
            "basket": chat_ids(tokenizer, "List three fruits with a quantity each, as JSON."),
            "pet": chat_ids(tokenizer, "Invent a pet and describe it as JSON."),
            "free": chat_ids(tokenizer, "Write a haiku about the sea.")}


@pytest.fixture(scope="module")
def basket_alone(smollm2, prompts):
    """The BASKET answer alone in a roomy engine, no speculation: the reference of several tests."""
    return run(make_engine(smollm2), {"b": (prompts["basket"], greedy(80, schema(BASKET)))})["b"]


def test_constrained_rows_beside_free_rows_in_one_batch(smollm2, prompts, basket_alone):
    free_alone = run(make_engine(smollm2), {"f": (prompts["free"], greedy(24))})["f"]
    batch = {"f": (prompts["free"], greedy(24)),
             "b": (prompts["basket"], greedy(80, schema(BASKET))),
             "p": (prompts["person"], greedy(40, schema(PERSON))),
             "o": (prompts["pet"], greedy(60, Constraint("json_object"))),
             "c": (prompts["free"], greedy(8, Constraint("choice", json.dumps(["sea", "sky", "sand"])))),
             "r": (prompts["free"], greedy(12, Constraint("regex", r"[A-Z][a-z]+ \d{2}")))}
    outs = run(make_engine(smollm2), batch)
    assert outs["f"].tokens == free_alone.tokens          # a free row is untouched by its neighbours' masks
    assert outs["b"].tokens == basket_alone.tokens
    jsonschema.validate(json.loads(outs["b"].text), BASKET)
    jsonschema.validate(json.loads(outs["p"].text), PERSON)
    assert isinstance(json.loads(outs["o"].text), dict)
    assert outs["c"].text in {"sea", "sky", "sand"}
    assert outs["r"].finish == "stop" and outs["r"].text[0].isupper() and outs["r"].text[-2:].isdigit()
    assert all(outs[k].finish == "stop" for k in "bpoc")


def test_speculative_decoding_gives_the_same_constrained_greedy_output(smollm2, prompts, basket_alone):
    ngram = run(make_engine(smollm2), {"b": (prompts["basket"], greedy(80, schema(BASKET), num_speculative_tokens=4))})
    draft = build_engine(ModelSourceConfig(), EngineConfig(num_blocks=256, speculative_method="draft_model",
                                                           num_speculative_tokens=3), loaded=smollm2, draft=smollm2)
    drafted = run(draft.engine, {"b": (prompts["basket"], greedy(80, schema(BASKET)))})
    for out in (ngram["b"], drafted["b"]):
        assert out.tokens == basket_alone.tokens
        assert out.spec_accepted > 0
    # The draft model drafts under the grammar too, so as its own draft almost every draft holds.
    assert drafted["b"].spec_accepted / drafted["b"].spec_proposed > 0.9
    # Sampled: drafts from the masked draft distribution, verified by rejection sampling under the mask.
    sampled = run(draft.engine, {"p": (prompts["pet"], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=60,
                                                                      constraint=schema(PET)))})
    for out in sampled.values():
        assert out.finish == "stop" and out.spec_accepted > 0
        jsonschema.validate(json.loads(out.text), PET)


def test_preemption_in_the_middle_of_json(smollm2, prompts, basket_alone):
    engine = make_engine(smollm2, num_blocks=14)   # 208 tokens of cache for 4 x ~130
    outs = run(engine, {f"b{i}": (prompts["basket"], greedy(80, schema(BASKET))) for i in range(4)})
    assert engine.scheduler.num_preemptions > 0
    for out in outs.values():
        assert out.tokens == basket_alone.tokens and out.finish == "stop"
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_n_choices_each_follow_the_schema(smollm2, prompts):
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=60, constraint=schema(PET))
    outs = run(make_engine(smollm2), {"pet": (prompts["pet"], params)})
    assert len(outs) == 4
    for out in outs.values():
        assert out.finish == "stop"
        jsonschema.validate(json.loads(out.text), PET)
    assert len({out.text for out in outs.values()}) > 1   # each choice walks its own matcher


def test_a_schema_that_cannot_finish_ends_at_length_with_a_valid_prefix(smollm2, prompts, basket_alone):
    engine = make_engine(smollm2)
    out = run(engine, {"b": (prompts["basket"], greedy(12, schema(BASKET)))})["b"]
    assert out.finish == "length" and len(out.tokens) == 12
    assert basket_alone.text.startswith(out.text)
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    matcher = engine.grammars.matcher(schema(BASKET))   # the grammar accepts every token, and wants more
    assert all(matcher.accept(t) for t in out.tokens) and not matcher.is_finished


def test_stop_strings_logprobs_and_prefix_caching_compose(smollm2, prompts):
    engine = make_engine(smollm2)
    params = greedy(40, schema(PERSON), logprobs=True, top_logprobs=2)
    first = run(engine, {"a": (prompts["person"], params)})["a"]
    again = run(engine, {"b": (prompts["person"], params)})["b"]
    assert again.cached > 0 and again.tokens == first.tokens
    assert len(first.logprobs) == len(first.tokens)
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in first.logprobs)
    stopped = run(engine, {"c": (prompts["person"], greedy(40, schema(PERSON), stop=['"age"']))})["c"]
    assert stopped.finish == "stop" and '"age"' not in stopped.text
    assert first.text.startswith(stopped.text) and '"age"' in first.text[len(stopped.text):][:5]


def test_a_complete_grammar_stops_even_before_min_tokens(smollm2, prompts):
    out = run(make_engine(smollm2), {"c": (prompts["free"], greedy(
        8, Constraint("choice", json.dumps(["sea", "sky"])), min_tokens=6))})["c"]
    assert out.finish == "stop" and out.text in {"sea", "sky"}


def test_logit_bias_cannot_lift_a_token_out_of_the_grammar(smollm2, prompts, tokenizer):
    forced = tokenizer.encode(" banana")[0]
    free = run(make_engine(smollm2), {"f": (prompts["free"], greedy(3, logit_bias={forced: 100.0}))})["f"]
    assert free.tokens == [forced] * 3
    out = run(make_engine(smollm2), {"c": (prompts["free"], greedy(
        8, Constraint("choice", json.dumps(["sea", "sky"])), logit_bias={forced: 100.0}))})["c"]
    assert out.text in {"sea", "sky"}


def test_abort_frees_a_constrained_request(smollm2, prompts):
    engine = make_engine(smollm2)
    engine.add_request("a", prompts["basket"], SamplingParams(temperature=1.0, n=2, max_tokens=80,
                                                             constraint=schema(BASKET)))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free_blocks < engine.pool.num_usable_blocks
    outputs = engine.abort_request("a")
    assert [o.finish_reason for o in outputs] == ["abort", "abort"]
    assert not engine.has_work() and engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_a_grammar_is_compiled_once_per_constraint(smollm2, prompts):
    engine = make_engine(smollm2)
    for i in range(3):
        engine.add_request(f"r{i}", prompts["person"], greedy(4, schema(PERSON), n=2))
    engine.add_request("other", prompts["person"], greedy(4, schema(PERSON, strict=False)))
    assert engine.grammars.num_compiled == 2
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", "{"), "constraint.json_schema is not valid JSON"),
    (Constraint("json_schema", json.dumps({"type": "string", "format": "no-such-format"}), strict=True),
     "Unknown format"),
    (Constraint("json_schema", json.dumps({"type": "array", "uniqueItems": True}), strict=True), "uniqueItems"),
    (Constraint("json_schema", json.dumps({"$ref": "#/definitions/missing"})), "constraint.json_schema"),
    (Constraint("json_schema", "false"), "must be a JSON object (a schema) or true"),
    (Constraint("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 1})), "Unsatisfiable"),
    (Constraint("regex", "(unclosed"), "constraint.regex"),
    (Constraint("grammar", "start: nothing_here"), "constraint.grammar"),
    (Constraint("choice", "[]"), "constraint.choice"),
    (Constraint("xml"), "constraint kind must be one of"),
])
def test_bad_constraints_are_refused_before_queueing(smollm2, prompts, constraint, message):
    engine = make_engine(smollm2)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", prompts["person"], greedy(4, constraint))
    assert not engine.has_work()


@pytest.mark.parametrize("bias, message", [({5: float("nan")}, r"logit_bias\[5\]"), ({-1: 1.0}, "token id -1"),
                                           ({5: -101.0}, r"logit_bias\[5\] must be in \[-100, 100\]")])
def test_bad_logit_bias_is_refused(smollm2, prompts, bias, message):
    with pytest.raises(ValueError, match=message):
        make_engine(smollm2).add_request("bad", prompts["free"], greedy(4, logit_bias=bias))
