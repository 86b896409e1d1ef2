from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_CUDA_IPC: _ClassVar[RegionKind]
    REGION_KIND_SHM: _ClassVar[RegionKind]
    REGION_KIND_INLINE: _ClassVar[RegionKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT64: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_CUDA_IPC: RegionKind
REGION_KIND_SHM: RegionKind
REGION_KIND_INLINE: RegionKind

class RegionHandle(_message.Message):
    __slots__ = ("name", "kind", "host_id", "device_uuid", "handle", "handle_offset", "byte_size", "slot_count", "slot_bytes", "event_handles", "producer_pid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PID_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    host_id: str
    device_uuid: str
    handle: bytes
    handle_offset: int
    byte_size: int
    slot_count: int
    slot_bytes: int
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    producer_pid: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., handle_offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., slot_count: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., producer_pid: _Optional[int] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("region", "slot", "offset", "dtype", "shape", "inline_data")
    REGION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    region: str
    slot: int
    offset: int
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    inline_data: bytes
    def __init__(self, region: _Optional[str] = ..., slot: _Optional[int] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., inline_data: _Optional[bytes] = ...) -> None: ...
