"""Typed configs from plain data: dataclass construction with checked keys and types, dotted overrides.

Generic machinery behind :mod:`stabledrl_mcore.config.schema` (which defines the sections):
unknown keys name the closest valid ones, wrong types name the field and the expected
type, and ``"a.b=value"`` overrides are parsed as YAML scalars or lists.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Dict, List, Sequence, Tuple

import yaml

from stabledrl_mcore.common.errors import ConfigError


def _type_name(tp: Any) -> str:
    """``int``, ``float``, ...; a Union lists its options (``int or null``), never ``Optional``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if option is type(None) else _type_name(option) for option in typing.get_args(tp))
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _hint(value: Any, tp: Any) -> str:
    """How to write an integral number an ``int`` field refuses (YAML reads ``1e9`` as text, ``1.0e+9``
    as a float), else ''."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if int not in options or isinstance(value, bool) or not isinstance(value, (str, float)):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not number.is_integer():
        return ""
    if isinstance(value, str):
        return f" (YAML reads {value} as text; write the integer in full: {int(number)})"
    return f" (write the integer without a decimal point: {int(number)})"


def _wrong_type(value: Any, tp: Any, where: str) -> ConfigError:
    return ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}{_hint(value, tp)}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                if not str(err).startswith(f"{where}: "):  # a field inside the value: name that one
                    raise
        raise _wrong_type(value, tp, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if origin in (tuple, Tuple):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or (args and args[-1] is not Ellipsis and len(value) != len(args)):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        inner = args if args and args[-1] is not Ellipsis else (args[0],) * len(value)
        return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, inner)))
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - every annotation in this module is handled above
        raise ConfigError(f"{where}: unsupported annotation {tp}")
    raise _wrong_type(value, tp, where)


def _unknown_key(key: str, valid: Sequence[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
    return ConfigError(f"unknown config key {prefix}{key}{hint} (valid: {', '.join(valid)})")


def from_dict(cls: type, data: Dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (nested) mapping, checking keys and types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in (data or {}).items():
        if key not in names:
            raise _unknown_key(str(key), names, prefix)
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def to_dict(cfg: Any) -> Dict[str, Any]:
    """Plain nested dict (tuples become lists) suitable for YAML/JSON."""

    def plain(value):
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(cfg))


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``"algo.eps=0.1"`` -> (["algo", "eps"], 0.1); the value is parsed as a YAML scalar/list."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: cannot parse value: {err}") from None
    return key.split("."), value


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply dotted overrides to a nested mapping (keys are checked later by :func:`from_dict`)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def get_dotted(cfg: Any, dotted: str) -> Any:
    """``get_dotted(cfg, "algo.eps")``."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
