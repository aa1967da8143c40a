"""The generic engine under dspark.config: dotted keys into nested dataclasses, values checked
and converted against the annotated field types, override texts read as Python literals, and
dataclasses rebuilt from JSON objects. It knows nothing of dspark's own sections."""

from __future__ import annotations

import ast
import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, Union, get_args, get_origin, get_type_hints

def get_key(config: Any, key: str) -> Any:
    obj = config
    for part in key.split(".") if key else []:
        obj = getattr(obj, part)
    return obj


def field_types(obj: Any) -> dict[str, Any]:
    """The annotated types of a dataclass instance's fields, resolved in its own module."""
    return get_type_hints(type(obj))


def keys_of(obj: Any, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += keys_of(value, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def coerce(key: str, raw: Any, annotation: Any) -> Any:
    """Check/convert `raw` (already a Python value) to the field's annotated type."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if raw is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(key, raw, option)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: bad value {raw!r}")
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        if isinstance(raw, tuple):
            raw = list(raw)
        if not isinstance(raw, list):
            raise ValueError(f"{key} expects a list, got {raw!r}; write e.g. {key}=[1,2,3]")
        return [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(raw)]
    if annotation is Any:
        return raw
    if origin is dict or annotation is dict:
        if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
            raise ValueError(f"{key} expects a dict with string keys, got {raw!r}; write e.g. {key}={{'name': 1}}")
        return dict(raw)
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ValueError(f"{key} expects true/false, got {raw!r}")
    if annotation is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"{key} expects an integer, got {raw!r}")
        return raw
    if annotation is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"{key} expects a number, got {raw!r}")
        return float(raw)
    if annotation is str:
        if not isinstance(raw, str):
            raise ValueError(f"{key} expects a string, got {raw!r}")
        return raw
    raise ValueError(f"{key}: unsupported field type {annotation}")


def from_text(raw: Any, annotation: Any) -> Any:
    """An override text (or a list of them) as a Python value: a literal, except that a
    string field takes an unquoted text as it is."""
    if isinstance(raw, list):
        (item,) = get_args(annotation) or (Any,)
        return [from_text(v, item) for v in raw]
    if not isinstance(raw, str) or (annotation is str and raw[:1] not in ("'", '"')):
        return raw
    return _parse_literal(raw)


def _parse_literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        lowered = text.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered in ("none", "null"):
            return None
        return text  # a bare string


def replace_path(obj: Any, parts: list[str], value: Any) -> Any:
    """A copy of `obj` with the field at `parts` set to value (the original is not mutated)."""
    if len(parts) == 1:
        return dataclasses.replace(obj, **{parts[0]: value})
    child = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: replace_path(child, parts[1:], value)})


def build_dataclass(cls: type, data: Any, where: str, prefix: str = "",
                    upgrades: Mapping[type, Callable[[dict[str, Any], str], dict[str, Any]]] | None = None) -> Any:
    """A (nested) dataclass from a JSON object, each value type-checked against its field; an unknown
    key is an error naming it. ``upgrades[cls](data, where)`` first rewrites a section's deprecated keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {prefix.rstrip('.') or 'the config'} must be a JSON object, got {data!r}")
    if upgrades and cls in upgrades:
        data = upgrades[cls](data, where)
    types_ = get_type_hints(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ValueError(f"{where}: unknown config key(s) {', '.join(prefix + k for k in unknown)}")
    kwargs = {}
    for name, value in data.items():
        hint = types_[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, value, where, f"{prefix}{name}.", upgrades)
        else:
            try:
                kwargs[name] = coerce(f"{prefix}{name}", value, hint)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    return cls(**kwargs)
