"""ddtree.rpc.limits.RpcLimits over a real grpc server, for each of the four kinds of handler:
the reply passes through, the RPC is counted while its handler runs and released after (also when
the handler raises or the caller cancels), and an RPC over the limit is refused at once."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from ddtree.rpc.limits import PEER_METADATA_KEY, RpcLimits
from ddtree.waiting import wait_until

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
IDENTITY = {"request_deserializer": bytes, "response_serializer": bytes}


@pytest.fixture
def served():
    limits = RpcLimits(max_rpcs=1)
    inside, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def body(first: bytes) -> bytes:
        seen.append(limits.open_rpcs)
        if first == b"hold":
            inside.set()
            release.wait(10)
        if first == b"raise":
            raise RuntimeError("handler failed")
        return first.upper()

    behaviors = {"unary_unary": lambda request, context: body(request),
                 "unary_stream": lambda request, context: iter([body(request), b"end"]),
                 "stream_unary": lambda requests, context: body(b"".join(requests)),
                 "stream_stream": lambda requests, context: iter([body(b"".join(requests)), b"end"])}
    handlers = {kind: getattr(grpc, f"{kind}_rpc_method_handler")(behaviors[kind], **IDENTITY) for kind in KINDS}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[limits])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Kinds", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    calls = {kind: getattr(channel, kind)(f"/test.Kinds/{kind}") for kind in KINDS}
    try:
        yield limits, calls, seen, inside, release
    finally:
        release.set()
        channel.close()
        server.stop(None)


def _call(calls, kind: str, payload: bytes, **kwargs):
    """The kind's reply: a unary reply, or the streamed replies as a list."""
    arg = iter([payload[:1], payload[1:]]) if kind.startswith("stream_") else payload
    reply = calls[kind](arg, timeout=10, metadata=[(PEER_METADATA_KEY, "p")], **kwargs)
    return list(reply) if kind.endswith("_stream") else reply


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_passes_through_counted_then_released(served, kind):
    limits, calls, seen, _, _ = served
    expected = [b"HI", b"end"] if kind.endswith("_stream") else b"HI"
    assert _call(calls, kind, b"hi") == expected
    assert seen == [1]                         # counted while the handler ran
    assert wait_until(lambda: limits.open_rpcs == 0, 5, poll_s=0.01)
    with pytest.raises(grpc.RpcError) as err:
        _call(calls, kind, b"raise")
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert wait_until(lambda: limits.open_rpcs == 0, 5, poll_s=0.01)   # released after a failure too
    assert _call(calls, kind, b"ok") == ([b"OK", b"end"] if kind.endswith("_stream") else b"OK")


@pytest.mark.parametrize("kind", KINDS)
def test_over_the_limit_is_refused_at_once_then_admitted_again(served, kind):
    limits, calls, _, inside, release = served
    holder = calls["unary_unary"].future(b"hold", timeout=10)
    assert inside.wait(5) and limits.open_rpcs == 1
    with pytest.raises(grpc.RpcError) as err:
        _call(calls, kind, b"no")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 calls in progress, this server's limit" in err.value.details()
    release.set()
    assert holder.result() == b"HOLD"
    assert wait_until(lambda: limits.open_rpcs == 0, 5, poll_s=0.01)
    assert _call(calls, kind, b"ok") in (b"OK", [b"OK", b"end"])


def test_a_cancelled_server_stream_is_released(served):
    limits, calls, _, inside, release = served
    stream = calls["unary_stream"](b"hold", timeout=10)
    assert inside.wait(5) and limits.open_rpcs == 1
    stream.cancel()
    release.set()
    assert wait_until(lambda: limits.open_rpcs == 0, 5, poll_s=0.01)
