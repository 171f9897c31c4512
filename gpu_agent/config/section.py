"""What every config section shares: strictness, and the value types with their bounds."""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gpu_agent.config.text import shown

PATH_MAX = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Section(BaseModel):
    """A config section: unknown keys are errors, values are immutable once loaded, no inf or NaN."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


def absolute_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {shown(value)}")
    if _CONTROL.search(value):
        raise ValueError(f"contains a control character: {shown(value)}")
    return value


# A host path, resolved under --root by whoever uses it.
AbsolutePath = Annotated[str, Field(max_length=PATH_MAX), AfterValidator(absolute_path)]


def seconds(default: float, most: float, description: str = "") -> Any:
    """A duration in seconds: more than 0 and at most `most` (which the description states)."""
    return Field(float(default), gt=0, le=most, description=f"{description} At most {most:g} s.".lstrip())
