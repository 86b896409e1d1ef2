from ddtree.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("peer_id", "token", "regions", "host_id", "accepted_kinds", "peer_secret")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_KINDS_FIELD_NUMBER: _ClassVar[int]
    PEER_SECRET_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    token: str
    regions: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.RegionHandle]
    host_id: str
    accepted_kinds: _containers.RepeatedScalarFieldContainer[_tensor_pb2.RegionKind]
    peer_secret: str
    def __init__(self, peer_id: _Optional[str] = ..., token: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[_tensor_pb2.RegionHandle, _Mapping]]] = ..., host_id: _Optional[str] = ..., accepted_kinds: _Optional[_Iterable[_Union[_tensor_pb2.RegionKind, str]]] = ..., peer_secret: _Optional[str] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("peer_id", "regions", "kind", "fallback_reason")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    regions: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.RegionHandle]
    kind: _tensor_pb2.RegionKind
    fallback_reason: str
    def __init__(self, peer_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[_tensor_pb2.RegionHandle, _Mapping]]] = ..., kind: _Optional[_Union[_tensor_pb2.RegionKind, str]] = ..., fallback_reason: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("peer_id", "token")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    token: str
    def __init__(self, peer_id: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class DetachReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransportStatusRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class RegionStatus(_message.Message):
    __slots__ = ("name", "kind", "owned", "ref_count", "pending_release", "byte_size", "slot_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    PENDING_RELEASE_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: _tensor_pb2.RegionKind
    owned: bool
    ref_count: int
    pending_release: bool
    byte_size: int
    slot_count: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[_tensor_pb2.RegionKind, str]] = ..., owned: _Optional[bool] = ..., ref_count: _Optional[int] = ..., pending_release: _Optional[bool] = ..., byte_size: _Optional[int] = ..., slot_count: _Optional[int] = ...) -> None: ...

class TransportStatusReply(_message.Message):
    __slots__ = ("regions", "peers")
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegionStatus]
    peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegionStatus, _Mapping]]] = ..., peers: _Optional[_Iterable[str]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("step_id", "input", "echo")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    input: _tensor_pb2.TensorRef
    echo: bool
    def __init__(self, step_id: _Optional[int] = ..., input: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., echo: _Optional[bool] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("step_id", "output", "checksum", "timing")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    output: _tensor_pb2.TensorRef
    checksum: int
    timing: ServerTiming
    def __init__(self, step_id: _Optional[int] = ..., output: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., checksum: _Optional[int] = ..., timing: _Optional[_Union[ServerTiming, _Mapping]] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("server_ms", "gpu_ms")
    SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    GPU_MS_FIELD_NUMBER: _ClassVar[int]
    server_ms: float
    gpu_ms: float
    def __init__(self, server_ms: _Optional[float] = ..., gpu_ms: _Optional[float] = ...) -> None: ...
