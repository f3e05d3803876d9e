"""Typed configuration: dataclasses filled from a YAML file, then from the environment.

Every service defines its configuration as nested dataclasses with defaults (the embedded,
run-on-a-laptop values) and loads it once at start with `load_config`, then passes it down.
Environment overrides name the path with double underscores under the service's prefix:
LLMSERVE_WORKER__ENGINE__BLOCK_SIZE=32 sets WorkerConfig.engine.block_size. Values are parsed as
YAML scalars, so "true", "3" and "[a, b]" become bool, int and list.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that does not fit its field."""


def load_config(cls: type[T], path: str | os.PathLike | None = None, env_prefix: str | None = None,
                environ: Mapping[str, str] | None = None) -> T:
    data: dict[str, Any] = {}
    if path:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    if env_prefix:
        _merge_env(data, env_prefix, os.environ if environ is None else environ)
    return from_dict(cls, data)


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown keys {sorted(unknown)}")
    missing = [f.name for f in fields.values() if f.init and f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where or cls.__name__}: missing required keys {missing}")
    kwargs = {name: _coerce(hints[name], value, f"{where}.{name}".lstrip("."))
              for name, value in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(kt, k, where): _coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {list(args)}, got {value!r}")
        return value
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def _merge_env(data: dict[str, Any], prefix: str, environ: Mapping[str, str]) -> None:
    head = prefix.upper().rstrip("_") + "__"
    for key, raw in environ.items():
        if not key.startswith(head):
            continue
        path = [p.lower() for p in key[len(head):].split("__") if p]
        if not path:
            continue
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[path[-1]] = yaml.safe_load(raw) if raw != "" else ""
