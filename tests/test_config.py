"""libs/llmserve/config.py: YAML plus environment into typed dataclasses, with clear errors."""

from dataclasses import dataclass, field

import pytest

from llmserve.config import ConfigError, load_config


@dataclass
class Inner:
    port: int = 1
    ratio: float = 0.5
    names: list[str] = field(default_factory=list)


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    mode: str = "a"
    enabled: bool = False
    optional: int | None = None


@dataclass
class NeedsName:
    name: str


def test_yaml_then_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  port: 5\n  names: [x, y]\nmode: b\n")
    env = {"APP__INNER__RATIO": "2", "APP__ENABLED": "true", "APP__OPTIONAL": "7", "OTHER__MODE": "z"}
    cfg = load_config(Outer, path, "APP", environ=env)
    assert cfg == Outer(Inner(5, 2.0, ["x", "y"]), "b", True, 7)


@pytest.mark.parametrize("text,message", [
    ("inner:\n  port: five\n", "inner.port: expected int"),
    ("nope: 1\n", "unknown keys ['nope']"),
    ("enabled: 3\n", "expected true/false"),
    ("inner: 4\n", "expected a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
])
def test_bad_values_say_where(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(Outer, path)


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match="missing required keys \\['name'\\]"):
        load_config(NeedsName, None, "X", environ={})
