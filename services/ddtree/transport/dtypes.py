"""Wire dtypes (tensor_pb2.DType) <-> torch dtypes."""
from __future__ import annotations

import torch

from ddtree.v1 import tensor_pb2

TORCH_OF = {
    tensor_pb2.DTYPE_FLOAT32: torch.float32,
    tensor_pb2.DTYPE_FLOAT16: torch.float16,
    tensor_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    tensor_pb2.DTYPE_INT32: torch.int32,
    tensor_pb2.DTYPE_INT64: torch.int64,
    tensor_pb2.DTYPE_UINT64: torch.uint64,
    tensor_pb2.DTYPE_UINT8: torch.uint8,
    tensor_pb2.DTYPE_BOOL: torch.bool,
}
WIRE_OF = {v: k for k, v in TORCH_OF.items()}


def to_wire(dtype: torch.dtype) -> int:
    try:
        return WIRE_OF[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire form; supported: {sorted(map(str, WIRE_OF))}") from None
