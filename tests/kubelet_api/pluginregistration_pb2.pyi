from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class PluginInfo(_message.Message):
    __slots__ = ["endpoint", "name", "supported_versions", "type"]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    name: str
    supported_versions: _containers.RepeatedScalarFieldContainer[str]
    type: str
    def __init__(self, type: _Optional[str] = ..., name: _Optional[str] = ..., endpoint: _Optional[str] = ..., supported_versions: _Optional[_Iterable[str]] = ...) -> None: ...

class RegistrationStatus(_message.Message):
    __slots__ = ["error", "plugin_registered"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    error: str
    plugin_registered: bool
    def __init__(self, plugin_registered: bool = ..., error: _Optional[str] = ...) -> None: ...

class RegistrationStatusResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...
