"""The config dataclasses from the JSON a validation already accepted (config/validate.py, config/cache.py),
with no pydantic: the types are checked against the dataclasses' annotations, the bounds are not (that is
the validator's work), so this only ever reads JSON that pydantic validated and this agent wrote."""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, TypeVar, Union

T = TypeVar("T")
_PLAIN = {bool: (bool,), str: (str,), int: (int,), float: (float,), type(None): (type(None),)}


class NotAConfig(ValueError):
    """The JSON does not have the shape of the config (a damaged or foreign file)."""


def build(cls: type[T], data: Any, where: str = "") -> T:
    """An instance of the dataclass `cls` from `data`, which must give every field, each of its type."""
    if not isinstance(data, dict):
        raise NotAConfig(f"{where or '(top level)'}: expected an object")
    hints = _hints(cls)  # type: ignore[arg-type]  # a class is hashable
    if set(data) != set(hints):
        raise NotAConfig(f"{where or '(top level)'}: keys {sorted(set(data) ^ set(hints))} differ from the schema")
    values = {name: _value(hint, data[name], f"{where}.{name}".lstrip(".")) for name, hint in hints.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise NotAConfig(f"{where or '(top level)'}: {exc}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The dataclass's fields and their types, annotations resolved (they are strings here)."""
    resolved = typing.get_type_hints(cls)
    return {field.name: resolved[field.name] for field in dataclasses.fields(cls)}


def _value(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if hint is Any or hint is object:
        return value
    if origin is typing.Literal:
        if not any(value == choice and type(value) is type(choice) for choice in args):
            raise NotAConfig(f"{where}: {value!r} is not one of {args}")
        return value
    if origin is Union:
        for member in args:
            try:
                return _value(member, value, where)
            except NotAConfig:
                continue
        raise NotAConfig(f"{where}: {value!r} is not a {hint}")
    if origin is list:
        if not isinstance(value, list):
            raise NotAConfig(f"{where}: expected a list")
        return [_value(args[0], item, f"{where}[{index}]") for index, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise NotAConfig(f"{where}: expected an object")
        return {_value(args[0], key, where): _value(args[1], item, f"{where}.{key}") for key, item in value.items()}
    if hint in _PLAIN:
        if type(value) not in _PLAIN[hint]:
            raise NotAConfig(f"{where}: {value!r} is not a {hint.__name__}")
        return value
    raise NotAConfig(f"{where}: no reader for {hint}")
