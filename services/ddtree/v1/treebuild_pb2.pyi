from ddtree.v1 import tensor_pb2 as _tensor_pb2
from ddtree.v1 import transport_pb2 as _transport_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BuildRequest(_message.Message):
    __slots__ = ("step_id", "top_logprobs", "top_ids", "budgets", "traceparent", "time_gpu")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TIME_GPU_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    top_logprobs: _tensor_pb2.TensorRef
    top_ids: _tensor_pb2.TensorRef
    budgets: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    time_gpu: bool
    def __init__(self, step_id: _Optional[int] = ..., top_logprobs: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., top_ids: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., budgets: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ..., time_gpu: _Optional[bool] = ...) -> None: ...

class TreeRefs(_message.Message):
    __slots__ = ("tokens", "depths", "parents", "num_nodes", "mask")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    tokens: _tensor_pb2.TensorRef
    depths: _tensor_pb2.TensorRef
    parents: _tensor_pb2.TensorRef
    num_nodes: _tensor_pb2.TensorRef
    mask: _tensor_pb2.TensorRef
    def __init__(self, tokens: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., depths: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., parents: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., num_nodes: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., mask: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...

class BuildReply(_message.Message):
    __slots__ = ("trees", "timing")
    TREES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    trees: TreeRefs
    timing: _transport_pb2.ServerTiming
    def __init__(self, trees: _Optional[_Union[TreeRefs, _Mapping]] = ..., timing: _Optional[_Union[_transport_pb2.ServerTiming, _Mapping]] = ...) -> None: ...

class AcceptRequest(_message.Message):
    __slots__ = ("step_id", "posterior", "trees", "traceparent", "time_gpu")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TIME_GPU_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    posterior: _tensor_pb2.TensorRef
    trees: TreeRefs
    traceparent: str
    time_gpu: bool
    def __init__(self, step_id: _Optional[int] = ..., posterior: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., trees: _Optional[_Union[TreeRefs, _Mapping]] = ..., traceparent: _Optional[str] = ..., time_gpu: _Optional[bool] = ...) -> None: ...

class AcceptReply(_message.Message):
    __slots__ = ("path", "length", "bonus", "keep", "timing")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    path: _tensor_pb2.TensorRef
    length: _tensor_pb2.TensorRef
    bonus: _tensor_pb2.TensorRef
    keep: _tensor_pb2.TensorRef
    timing: _transport_pb2.ServerTiming
    def __init__(self, path: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., length: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., bonus: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., keep: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., timing: _Optional[_Union[_transport_pb2.ServerTiming, _Mapping]] = ...) -> None: ...
