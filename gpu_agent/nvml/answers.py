"""Recorded NVML answers: how a pynvml call and its answer are written to a capture and read back.

A call is keyed by its pynvml function name and its arguments bound to pynvml's own signature
(defaults filled in), so `nvmlDeviceGetMemoryInfo(h)` and `nvmlDeviceGetMemoryInfo(h, None)` are one
call. Device handles are written as references that name how they were obtained: `gpu0` (by index 0),
`gpu0/mig1` (its MIG device 1), `gpu0/gi3` (its GPU instance 3), `gpu0/gi3/ci0` (that instance's
compute instance 0). An answer is a JSON value: numbers and
strings as they are, pynvml structures as {"struct": class name, "fields": {...}}, pynvml's friendly
objects (process lists) as {"object": {...}}, handles as {"handle": ref}, and an NVMLError as its
name and code.
"""
from __future__ import annotations

import ctypes
import inspect
import json
from typing import Any, Callable, Optional

import pynvml

# The out-parameter calls the agent makes: (device, profileId, placementsRef, countRef). Recorded
# by their first two arguments; the answer is the list of (start, size) placements filled in, or of
# the GPU instances (`gpu0/gi3`) and compute instances (`gpu0/gi3/ci0`) of one profile.
PLACEMENTS_CALL = "nvmlDeviceGetGpuInstancePossiblePlacements"
GPU_INSTANCES_CALL = "nvmlDeviceGetGpuInstances"
COMPUTE_INSTANCES_CALL = "nvmlGpuInstanceGetComputeInstances"
_IN_ARGUMENTS = {PLACEMENTS_CALL: 2, GPU_INSTANCES_CALL: 2, COMPUTE_INSTANCES_CALL: 2}


class Handle:
    """A handle reference in a call's arguments or answer."""

    def __init__(self, ref: str) -> None:
        self.ref = ref

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.ref == self.ref

    def __hash__(self) -> int:
        return hash(self.ref)

    def __repr__(self) -> str:
        return f"Handle({self.ref!r})"


def call_key(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             ref_of: Callable[[Any], Optional[str]]) -> str:
    """The canonical key of a call: its name and its encoded arguments in pynvml's parameter order."""
    if name in _IN_ARGUMENTS:
        values = list(args[:_IN_ARGUMENTS[name]])
    else:
        values = _bound(name, args, kwargs)
    return json.dumps([name, [_encode_argument(v, ref_of) for v in values]], sort_keys=True)


def _bound(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments in pynvml's parameter order with its defaults filled in; as given when pynvml
    lacks the function or its signature does not take them."""
    as_given = list(args) + [kwargs[key] for key in sorted(kwargs)]
    function = getattr(pynvml, name, None)
    if not inspect.isfunction(function):
        return as_given
    signature = inspect.signature(function)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return as_given
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return as_given
    bound.apply_defaults()
    return list(bound.arguments.values())


def _encode_argument(value: Any, ref_of: Callable[[Any], Optional[str]]) -> Any:
    if isinstance(value, Handle):
        return {"handle": value.ref}
    ref = ref_of(value)
    if ref is not None:
        return {"handle": ref}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, ctypes._SimpleCData):
        return value.value
    if isinstance(value, (list, tuple)):  # nvmlDeviceGetFieldValues' field ids, or (id, scope) pairs
        return [_encode_argument(item, ref_of) for item in value]
    raise TypeError(f"cannot record an NVML argument of type {type(value).__name__}")


def encode(value: Any, ref_of: Callable[[Any], Optional[str]]) -> Any:
    """An answer as JSON."""
    ref = ref_of(value)
    if ref is not None:
        return {"handle": ref}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [encode(item, ref_of) for item in value]
    if isinstance(value, ctypes._SimpleCData):
        return encode(value.value, ref_of)
    if isinstance(value, (ctypes.Structure, ctypes.Union)):  # a union: every member, read from the same bytes
        fields = {}
        for name, kind, *_ in value._fields_:
            if issubclass(kind, ctypes._Pointer):
                continue  # a handle inside a structure: the caller holds it already
            fields[name] = encode(getattr(value, name), ref_of)
        return {"struct": type(value).__name__, "fields": fields}
    if isinstance(value, ctypes.Array):
        return [encode(item, ref_of) for item in value]
    if isinstance(value, pynvml.nvmlFriendlyObject):
        return {"object": {key: encode(item, ref_of) for key, item in vars(value).items()}}
    raise TypeError(f"cannot record an NVML answer of type {type(value).__name__}")


def decode(value: Any, handle_of: Callable[[str], Any]) -> Any:
    """An answer as pynvml returns it: its own structure classes, lists, numbers and strings."""
    if isinstance(value, list):
        return [decode(item, handle_of) for item in value]
    if not isinstance(value, dict):
        return value
    if "handle" in value:
        return handle_of(value["handle"])
    if "object" in value:
        return pynvml.nvmlFriendlyObject({k: decode(v, handle_of) for k, v in value["object"].items()})
    if "struct" in value:
        return _structure(value["struct"], value["fields"], handle_of)
    raise ValueError(f"unknown recorded value {json.dumps(value)[:80]}")


def _structure(name: str, fields: dict[str, Any], handle_of: Callable[[str], Any]) -> Any:
    kind = getattr(pynvml, name, None)
    if not (isinstance(kind, type) and issubclass(kind, (ctypes.Structure, ctypes.Union))):
        raise TypeError(f"pynvml has no structure {name!r}")
    structure = kind()
    types = {field[0]: field[1] for field in kind._fields_}
    for key, item in fields.items():
        if key not in types:
            raise ValueError(f"pynvml's {name} has no field {key!r}")
        item = decode(item, handle_of)
        if issubclass(types[key], ctypes.Array) and isinstance(item, list):
            array = getattr(structure, key)
            for index, element in enumerate(item):
                array[index] = element
        elif isinstance(item, str):
            # pynvml's own structures encode str on assignment; plain ctypes ones need bytes
            setattr(structure, key, item.encode())
        else:
            setattr(structure, key, item)
    return structure


def error_of(exc: BaseException) -> dict[str, Any]:
    """An NVMLError as recorded: its class name without the NVMLError_ prefix, and its code."""
    return {"error": type(exc).__name__.removeprefix("NVMLError_"), "code": getattr(exc, "value", None)}


def raise_recorded(answer: dict[str, Any]) -> None:
    """Raise the NVMLError a recorded answer holds, as pynvml raises it for that code."""
    code = answer.get("code")
    if isinstance(code, int):
        raise pynvml.NVMLError(code)
    name = str(answer["error"])
    kind = getattr(pynvml, f"NVMLError_{name}", None)
    raise kind() if isinstance(kind, type) else pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
