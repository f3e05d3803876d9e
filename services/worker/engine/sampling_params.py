"""Per-request sampling parameters, validated once at admission.

Values follow the OpenAI API and vLLM: temperature 0 is greedy; top_k 0 and min_p 0 are off;
penalties 0 (and repetition_penalty 1) are off. `validate` raises ValueError with a message
meant for the caller (the gRPC layer turns it into INVALID_ARGUMENT). A constraint's grammar is
checked by the engine, which compiles it (engine/structured/compiler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_LOGIT_BIAS = 100.0
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What the output must match; hashable, so compiled grammars are cached by it.

    value: the JSON schema text (json_schema), the regex, the Lark grammar, or the choices as a
    JSON list (choice); empty for json_object. strict (json_schema): refuse a schema keyword the
    grammar engine cannot enforce instead of ignoring it."""
    kind: str
    value: str = ""
    strict: bool = False


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None          # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    num_speculative_tokens: int | None = None  # None: the worker's default
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not 0.0 <= self.temperature <= 2.0:
            bad(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            bad("stop strings must not be empty")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad(f"stop_token_ids must be in [0, {vocab_size})")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            bad("top_logprobs needs logprobs")
        if not 1 <= self.n <= MAX_N:
            bad(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            bad(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                bad(f"logit_bias: token id {token} is not in the vocabulary [0, {vocab_size})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bad(f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        if self.constraint is not None and self.constraint.kind not in CONSTRAINT_KINDS:
            bad(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.constraint.kind!r}")
