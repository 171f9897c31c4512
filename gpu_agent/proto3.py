"""Proto3 messages on the wire without the protobuf runtime.

The agent speaks small kubelet gRPC APIs: the device plugin's, pod-resources', DRA's and the plugin
watcher's registration. protobuf's
runtime would add about 5 MiB to the daemon's resident memory for them, so their messages are
declared as dataclasses whose fields carry their proto numbers, and are encoded here by the proto3
wire rules (protobuf.dev/programming-guides/encoding): fields in number order, zero values and unset
messages left out, maps as repeated key/value entries. Decoding keeps what protobuf keeps: unknown
fields and fields of an unexpected wire type are skipped, the last value of a singular scalar wins,
repeated occurrences of a singular message merge, and strings must be valid UTF-8. Anything else
malformed raises DecodeError. tests/test_proto3.py and tests/test_dra.py hold each declaration to the
APIs' .proto files (tests/kubelet_api) and each encoding to protobuf's own.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple, Optional, TypeVar, Union

from grpclib.encoding.base import CodecBase

STRING = "string"
BOOL = "bool"
INT32 = "int32"
INT64 = "int64"
MESSAGE = "message"
STRING_MAP = "map<string, string>"
MESSAGE_MAP = "map<string, message>"

_VARINT, _FIXED64, _LENGTH, _GROUP_START, _GROUP_END, _FIXED32 = 0, 1, 2, 3, 4, 5
LENGTH_DELIMITED = _LENGTH
_WIRE_TYPE = {STRING: _LENGTH, BOOL: _VARINT, INT32: _VARINT, INT64: _VARINT, MESSAGE: _LENGTH, STRING_MAP: _LENGTH,
              MESSAGE_MAP: _LENGTH}
_RANGE = {INT32: 1 << 31, INT64: 1 << 63}
_MASK64 = (1 << 64) - 1
_MAX_FIELD_NUMBER = (1 << 29) - 1
_MAX_DEPTH = 100  # protobuf's own recursion limit

Data = Union[bytes, bytearray, memoryview]
M = TypeVar("M", bound="Message")


class DecodeError(ValueError):
    """The bytes are not an encoding of the message: the text says which message and why."""


class _Wire(NamedTuple):
    number: int
    kind: str
    repeated: bool = False
    message: Optional[type[Message]] = None


class _Field(NamedTuple):
    name: str
    number: int
    kind: str
    repeated: bool
    message: Optional[type[Message]]
    wire_type: int


_WIRE = "proto3"


def _declared(wire: _Wire, **default: Any) -> Any:
    if wire.repeated and wire.kind not in (STRING, MESSAGE):
        raise TypeError(f"repeated {wire.kind} fields are not supported")  # none of the kubelet APIs we speak
    return dataclasses.field(metadata={_WIRE: wire}, **default)


def string(number: int) -> Any:
    return _declared(_Wire(number, STRING), default="")


def strings(number: int) -> Any:
    return _declared(_Wire(number, STRING, True), default_factory=list)


def boolean(number: int) -> Any:
    return _declared(_Wire(number, BOOL), default=False)


def int32(number: int) -> Any:
    return _declared(_Wire(number, INT32), default=0)


def int64(number: int) -> Any:
    return _declared(_Wire(number, INT64), default=0)


def message(number: int, kind: type[Message]) -> Any:
    return _declared(_Wire(number, MESSAGE, False, kind), default=None)


def messages(number: int, kind: type[Message]) -> Any:
    return _declared(_Wire(number, MESSAGE, True, kind), default_factory=list)


def string_map(number: int) -> Any:
    return _declared(_Wire(number, STRING_MAP), default_factory=dict)


def message_map(number: int, kind: type[Message]) -> Any:
    """map<string, kind>: an entry whose value is absent decodes as an empty `kind`, as protobuf's does."""
    return _declared(_Wire(number, MESSAGE_MAP, False, kind), default_factory=dict)


class Message:
    """Base of a declared message: a dataclass whose fields are made by the functions above."""

    _fields: ClassVar[tuple[_Field, ...]]
    _by_number: ClassVar[dict[int, _Field]]

    @classmethod
    def fields(cls) -> tuple[_Field, ...]:
        """The declared fields in number order."""
        if "_fields" not in cls.__dict__:
            found = []
            for declared in dataclasses.fields(cls):  # type: ignore[arg-type]
                wire = declared.metadata[_WIRE]
                found.append(_Field(declared.name, wire.number, wire.kind, wire.repeated, wire.message,
                                    _WIRE_TYPE[wire.kind]))
            cls._fields = tuple(sorted(found, key=lambda field: field.number))
            cls._by_number = {field.number: field for field in cls._fields}
        return cls._fields

    def encode(self) -> bytes:
        out = bytearray()
        _encode(self, out)
        return bytes(out)

    @classmethod
    def decode(cls: type[M], data: Data) -> M:
        return _decode(cls, memoryview(data), 0)


@dataclasses.dataclass
class _MapEntry(Message):
    key: str = string(1)
    value: str = string(2)


def _varint(value: int, out: bytearray) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _length_delimited(number: int, payload: bytes, out: bytearray) -> None:
    _varint(number << 3 | _LENGTH, out)
    _varint(len(payload), out)
    out += payload


def _text(value: Any, where: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a str, not {type(value).__name__}")
    return value.encode("utf-8")


def _encode(message: Message, out: bytearray) -> None:
    name = type(message).__name__
    for field in message.fields():
        value = getattr(message, field.name)
        where = f"{name}.{field.name}"
        if field.kind == MESSAGE:
            for item in (value if field.repeated else () if value is None else (value,)):
                if not isinstance(item, field.message):  # type: ignore[arg-type]
                    raise TypeError(f"{where} must be a {field.message.__name__}, "  # type: ignore[union-attr]
                                    f"not {type(item).__name__}")
                _length_delimited(field.number, item.encode(), out)
        elif field.kind == STRING:
            for item in (value if field.repeated else (value,) if value else ()):
                _length_delimited(field.number, _text(item, where), out)
        elif field.kind == STRING_MAP:
            for key in sorted(value):  # each entry with its key and value, even empty ones, as protobuf writes them
                entry = bytearray()
                _length_delimited(1, _text(key, where), entry)
                _length_delimited(2, _text(value[key], where), entry)
                _length_delimited(field.number, bytes(entry), out)
        elif field.kind == MESSAGE_MAP:
            for key in sorted(value):
                item = value[key]
                if not isinstance(item, field.message):  # type: ignore[arg-type]
                    raise TypeError(f"{where}[{key!r}] must be a {field.message.__name__}, "  # type: ignore[union-attr]
                                    f"not {type(item).__name__}")
                entry = bytearray()
                _length_delimited(1, _text(key, where), entry)
                _length_delimited(2, item.encode(), entry)
                _length_delimited(field.number, bytes(entry), out)
        elif field.kind == BOOL:
            if value:
                _varint(field.number << 3 | _VARINT, out)
                out.append(1)
        elif value:  # INT32, INT64
            if not isinstance(value, int) or not -_RANGE[field.kind] <= value < _RANGE[field.kind]:
                raise ValueError(f"{where}: {value!r} is not an {field.kind}")
            _varint(field.number << 3 | _VARINT, out)
            _varint(value & _MASK64, out)


def _read_varint(data: memoryview, pos: int, where: str) -> tuple[int, int]:
    result = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise DecodeError(f"{where}: the data ends inside a varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
        if shift >= 70:
            raise DecodeError(f"{where}: a varint longer than 10 bytes")
    if result > _MASK64:
        raise DecodeError(f"{where}: a varint overflows 64 bits")
    return result, pos


def _read_length(data: memoryview, pos: int, where: str) -> tuple[memoryview, int]:
    size, pos = _read_varint(data, pos, where)
    if size > len(data) - pos:
        raise DecodeError(f"{where}: a length of {size} bytes runs past the end of the data")
    return data[pos:pos + size], pos + size


def _skip(data: memoryview, pos: int, number: int, wire_type: int, depth: int, where: str) -> int:
    """Past the value of an unknown field, as protobuf skips it."""
    if wire_type == _VARINT:
        return _read_varint(data, pos, where)[1]
    if wire_type == _LENGTH:
        return _read_length(data, pos, where)[1]
    if wire_type in (_FIXED64, _FIXED32):
        pos += 8 if wire_type == _FIXED64 else 4
        if pos > len(data):
            raise DecodeError(f"{where}: the data ends inside a fixed-size field")
        return pos
    if wire_type == _GROUP_START:
        if depth >= _MAX_DEPTH:
            raise DecodeError(f"{where}: groups nested deeper than {_MAX_DEPTH}")
        while True:
            key, pos = _read_varint(data, pos, where)
            if key & 7 == _GROUP_END:
                if key >> 3 != number:
                    raise DecodeError(f"{where}: group {number} ends with the end of group {key >> 3}")
                return pos
            pos = _skip(data, pos, key >> 3, key & 7, depth + 1, where)
    if wire_type == _GROUP_END:
        raise DecodeError(f"{where}: the end of group {number}, which never started")
    raise DecodeError(f"{where}: field {number} has the invalid wire type {wire_type}")


def _scalar(field: _Field, raw: int) -> Union[bool, int]:
    if field.kind == BOOL:
        return raw != 0
    bits = 32 if field.kind == INT32 else 64
    raw &= (1 << bits) - 1
    return raw - (1 << bits) if raw >> (bits - 1) else raw


def _string(chunk: memoryview, where: str) -> str:
    try:
        return str(chunk, "utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"{where}: a string that is not valid UTF-8") from None


def _decode(kind: type[M], data: memoryview, depth: int) -> M:
    if depth > _MAX_DEPTH:
        raise DecodeError(f"{kind.__name__}: messages nested deeper than {_MAX_DEPTH}")
    kind.fields()
    by_number = kind._by_number
    values: dict[str, Any] = {}
    singular_messages: dict[_Field, list[memoryview]] = {}
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos, kind.__name__)
        number, wire_type = key >> 3, key & 7
        if not 0 < number <= _MAX_FIELD_NUMBER:
            raise DecodeError(f"{kind.__name__}: the invalid field number {number}")
        field = by_number.get(number)
        if field is None or wire_type != field.wire_type:
            pos = _skip(data, pos, number, wire_type, depth, kind.__name__)
            continue
        where = f"{kind.__name__}.{field.name}"
        if wire_type == _VARINT:
            raw, pos = _read_varint(data, pos, where)
            values[field.name] = _scalar(field, raw)
            continue
        chunk, pos = _read_length(data, pos, where)
        if field.kind == STRING:
            text = _string(chunk, where)
            if field.repeated:
                values.setdefault(field.name, []).append(text)
            else:
                values[field.name] = text
        elif field.kind == STRING_MAP:
            entry = _decode(_MapEntry, chunk, depth + 1)
            values.setdefault(field.name, {})[entry.key] = entry.value
        elif field.kind == MESSAGE_MAP:
            entry_key, item = _map_entry(field, chunk, depth + 1)
            values.setdefault(field.name, {})[entry_key] = item
        elif field.repeated:
            values.setdefault(field.name, []).append(_decode(field.message, chunk, depth + 1))  # type: ignore[arg-type]
        else:
            singular_messages.setdefault(field, []).append(chunk)
    for field, chunks in singular_messages.items():
        merged = chunks[0] if len(chunks) == 1 else memoryview(b"".join(chunks))  # concatenation merges
        values[field.name] = _decode(field.message, merged, depth + 1)  # type: ignore[arg-type]
    return kind(**values)


def _map_entry(field: _Field, data: memoryview, depth: int) -> tuple[str, Message]:
    """One entry of a map<string, message>: its key (field 1) and its value (field 2; the last seen wins,
    repeated occurrences merge, an absent one is the empty message). Other fields in the entry are skipped
    and the entry kept, as Go's protobuf (the kubelet's) keeps it."""
    where = f"{field.name} entry"
    if depth > _MAX_DEPTH:
        raise DecodeError(f"{where}: messages nested deeper than {_MAX_DEPTH}")
    key, chunks = "", []
    for number, _, value in fields_of(data, where):
        if isinstance(value, memoryview) and number == 1:
            key = _string(value, f"{where}.key")
        elif isinstance(value, memoryview) and number == 2:
            chunks.append(value)
    merged = memoryview(b"".join(chunks)) if len(chunks) != 1 else chunks[0]
    return key, _decode(field.message, merged, depth + 1)  # type: ignore[arg-type]


def fields_of(data: Data, where: str) -> Iterator[tuple[int, int, Union[int, memoryview]]]:
    """(number, wire type, value) of each field of an encoded message, in order, for a reader that keeps
    only part of a large one: a varint's value, a length-delimited field's bytes as a view (nothing is
    copied); fixed-size fields and groups skipped. Raises DecodeError as decode() does, `where` naming
    the message."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        key, pos = _read_varint(view, pos, where)
        number, wire_type = key >> 3, key & 7
        if not 0 < number <= _MAX_FIELD_NUMBER:
            raise DecodeError(f"{where}: the invalid field number {number}")
        if wire_type == _VARINT:
            value, pos = _read_varint(view, pos, where)
            yield number, wire_type, value
        elif wire_type == _LENGTH:
            chunk, pos = _read_length(view, pos, where)
            yield number, wire_type, chunk
        else:
            pos = _skip(view, pos, number, wire_type, 0, where)


class Codec(CodecBase):
    """grpclib's codec for these messages, in place of its protobuf one (same content subtype)."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if not isinstance(message, message_type):
            raise TypeError(f"the message must be a {message_type.__name__}, not {type(message).__name__}")
        return message.encode()

    def decode(self, data: bytes, message_type: Any) -> Any:
        return message_type.decode(data)
