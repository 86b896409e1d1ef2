from ddtree.v1 import tensor_pb2 as _tensor_pb2
from ddtree.v1 import transport_pb2 as _transport_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftItem(_message.Message):
    __slots__ = ("request_id", "bonus_token", "position", "context_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bonus_token: int
    position: int
    context_features: _tensor_pb2.TensorRef
    def __init__(self, request_id: _Optional[str] = ..., bonus_token: _Optional[int] = ..., position: _Optional[int] = ..., context_features: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("step_id", "items", "top_k", "traceparent", "release_request_ids", "time_gpu")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TIME_GPU_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    top_k: int
    traceparent: str
    release_request_ids: _containers.RepeatedScalarFieldContainer[str]
    time_gpu: bool
    def __init__(self, step_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ..., top_k: _Optional[int] = ..., traceparent: _Optional[str] = ..., release_request_ids: _Optional[_Iterable[str]] = ..., time_gpu: _Optional[bool] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("top_logprobs", "top_ids", "timing")
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    top_logprobs: _tensor_pb2.TensorRef
    top_ids: _tensor_pb2.TensorRef
    timing: _transport_pb2.ServerTiming
    def __init__(self, top_logprobs: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., top_ids: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., timing: _Optional[_Union[_transport_pb2.ServerTiming, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
