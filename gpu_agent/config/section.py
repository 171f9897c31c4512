"""What every config section shares: strictness, and the value types with their bounds.

The sections are frozen stdlib dataclasses, the daemon's runtime types. pydantic validates them (see
config/loader.py), but only the validating process imports it: the bounds are field metadata (pydantic
passes a dataclass field's metadata to its Field) or `Bounds`, and `Bounds` and `Check` are metadata whose
pydantic hook imports what it needs when a schema is built, never at class creation (annotated_types alone
costs 10 ms of the daemon's start)."""
from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Callable, ClassVar, Optional

from gpu_agent.config.text import shown

PATH_MAX = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Section:
    """A config section (each one a frozen dataclass): unknown keys are errors, no inf or NaN, and no
    value is coerced from another type ("5" is not a number). Only the section itself may be given as a
    mapping, which pydantic's strict mode refuses for a dataclass; the hook below allows that alone."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {
        "extra": "forbid", "strict": True, "allow_inf_nan": False, "populate_by_name": True}

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        schema = handler(source)
        handler.resolve_ref_schema(schema)["strict"] = False
        return schema


@dataclasses.dataclass(frozen=True)
class Check:
    """Annotated metadata: `check(value)` after pydantic validated the type; a ValueError is the error."""

    check: Callable[[Any], Any]
    before: bool = False  # run on the input, before the type is validated

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        if self.before:
            return core_schema.no_info_before_validator_function(self.check, handler(source))
        return core_schema.no_info_after_validator_function(self.check, handler(source))


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Annotated metadata: the bounds of a value inside a list or dict (a field's own go in `setting`)."""

    ge: Optional[int] = None
    le: Optional[int] = None
    max_length: Optional[int] = None

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        import annotated_types as at

        kinds = {"ge": at.Ge, "le": at.Le, "max_length": at.MaxLen}
        given = [kind(getattr(self, name)) for name, kind in kinds.items() if getattr(self, name) is not None]
        constrained = (source, *given)
        return handler.generate_schema(Annotated[constrained])


@dataclasses.dataclass(frozen=True)
class AllOr:
    """Annotated metadata of `Union[Literal["all"], T]`: the word `all`, or what `of` (T) takes, with an
    error about T alone (not one per branch of the union)."""

    of: Any

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        def validate(value: Any, validate_other: Callable[[Any], Any]) -> Any:
            if value == "all":
                return value
            if isinstance(value, str):
                raise ValueError(f"{shown(value)} is neither all nor a list")
            return validate_other(value)

        return core_schema.no_info_wrap_validator_function(validate, handler.generate_schema(self.of))


def setting(default: Any = dataclasses.MISSING, description: str = "", **bounds: Any) -> Any:
    """A field: its default (a list or dict copied for each instance), its description for the shipped
    config (config/defaults.py), and bounds pydantic checks (gt, ge, le, min_length, max_length, alias)."""
    metadata = {"description": description, **bounds} if description else dict(bounds)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory: Callable[[], Any] = (lambda: type(default)(default)) if isinstance(default, (list, dict)) \
            else type(default)
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def absolute_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {shown(value)}")
    if _CONTROL.search(value):
        raise ValueError(f"contains a control character: {shown(value)}")
    return value


# A host path, resolved under --root by whoever uses it.
AbsolutePath = Annotated[str, Bounds(max_length=PATH_MAX), Check(absolute_path)]


def seconds(default: float, most: float, description: str = "") -> Any:
    """A duration in seconds: more than 0 and at most `most` (which the description states)."""
    return setting(float(default), f"{description} At most {most:g} s.".lstrip(), gt=0, le=most)
