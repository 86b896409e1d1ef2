"""The verify service's public gRPC API as the HTTP front uses it: Generate streams and health
over one grpc.aio channel (made inside the server's event loop), GetModelInfo once at start."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.rpc.options import open_channel
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc

HEALTH_TIMEOUT_S = 2.0


def fetch_model_info(target: str, timeout_s: float = 10.0, tls_ca: str | None = None) -> pb.ModelInfo:
    """GetModelInfo over a short-lived blocking channel (before the event loop starts)."""
    with open_channel(target, tls_ca) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)


class VerifyClient:
    def __init__(self, target: str, request_timeout_s: float | None, tls_ca: str | None = None):
        self._channel = open_channel(target, tls_ca, aio=True)
        self._generation = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout_s = request_timeout_s

    def generate(self, request: pb.GenerateRequest, metadata: tuple[tuple[str, str], ...] = ()):
        """The Generate stream (a grpc.aio call: iterate it; `cancel()` ends it on the server too)."""
        return self._generation.Generate(request, timeout=self._timeout_s, metadata=metadata)

    async def serving(self) -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()
