"""The shared gRPC server scaffold: health lifecycle, bind checks, SIGTERM shutdown."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.rpc.options import channel_options
from ddtree.rpc.server import BindError, GrpcServer, ServerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_goes_not_serving_to_serving_on_port_zero():
    server = GrpcServer(ServerConfig(name="test", port=0, grace_s=0.5))
    port = server.start()
    try:
        assert port > 0 and server.port == port
        assert _health(port) == NOT_SERVING
        server.set_serving(True)
        assert _health(port) == SERVING
        server.set_serving(False)
        assert _health(port) == NOT_SERVING
    finally:
        server.stop()
    assert server.wait(0)


def test_binding_a_taken_port_fails_clearly():
    first = GrpcServer(ServerConfig(name="first", port=0, grace_s=0.1))
    port = first.start()
    try:
        second = GrpcServer(ServerConfig(name="second", port=port, grace_s=0.1))
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}"):
            second.start()
    finally:
        first.stop()


def test_tls_needs_certificate_and_key(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    server = GrpcServer(ServerConfig(name="tls", port=0, tls_cert=str(cert)))
    with pytest.raises(BindError, match="both a certificate and a key"):
        server.start()


SERVER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from ddtree.logs import setup_logging
    from ddtree.rpc.server import GrpcServer, ServerConfig
    from ddtree.telemetry import setup_tracing

    setup_logging("scaffold")
    server = GrpcServer(ServerConfig(name="scaffold", port=0, grace_s=2.0), setup_tracing("ddtree-scaffold"))
    server.install_signal_handlers()
    port = server.start()
    server.set_serving(True)
    if "--main-blocks-sigterm" in sys.argv:  # gRPC's threads do not: the signal lands on one of them
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print(port, flush=True)
    server.wait()
    sys.exit(0)
    """
)


@pytest.mark.parametrize("args", [[], ["--main-blocks-sigterm"]], ids=["plain", "main-thread-blocks-sigterm"])
def test_sigterm_stops_a_server_process_within_the_grace_period(subprocess_env, args):
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env)
    try:
        port = int(proc.stdout.readline())
        assert _health(port) == SERVING
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 2.0 + 2.0  # grace + tracer flush margin
        log = proc.stderr.read()
        assert '"service": "scaffold"' in log and "received SIGTERM" in log and "stopped" in log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_undecodable_requests_get_invalid_argument():
    """Bytes that are not the method's message, or a string field that is not UTF-8, get
    INVALID_ARGUMENT naming the method (grpcio alone answers INTERNAL "Exception deserializing
    request!"), for unary, server-streaming and bidi methods; good requests still work."""
    from ddtree.v1 import generation_pb2_grpc

    calls = []

    class Generation(generation_pb2_grpc.GenerationServicer):
        def Generate(self, request, context):
            calls.append(request)
            yield from ()

    def chat(requests, context):
        for request in requests:
            yield health_pb2.HealthCheckResponse(status=SERVING if request.service == "ok" else NOT_SERVING)

    server = GrpcServer(ServerConfig(name="decode", port=0, grace_s=0.1))
    server.add(generation_pb2_grpc.add_GenerationServicer_to_server, Generation(), "ddtree.v1.Generation")
    server.add_generic(grpc.method_handlers_generic_handler("test.Chat", {"Chat": grpc.stream_stream_rpc_method_handler(
        chat, request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}), "test.Chat")
    port = server.start()
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (a string in both messages), two bytes that are not UTF-8
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            generate = ch.unary_stream("/ddtree.v1.Generation/Generate")
            bidi = ch.stream_stream("/test.Chat/Chat")
            for name, call in (("Check", lambda b: check(b, timeout=5)),
                               ("Generate", lambda b: list(generate(b, timeout=5))),
                               ("Chat", lambda b: list(bidi(iter([health_pb2.HealthCheckRequest(service="ok")
                                                                  .SerializeToString(), b]), timeout=5)))):
                for bad in (b"\xff\xff\xff\xff", not_utf8):
                    with pytest.raises(grpc.RpcError) as err:
                        call(bad)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
                    assert name in err.value.details() and "does not decode" in err.value.details()
            assert not calls  # the servicer never saw them
            server.set_serving(True)
            assert _health(port) == SERVING
            responses = list(bidi(iter([health_pb2.HealthCheckRequest(service="ok").SerializeToString()]), timeout=5))
            assert len(responses) == 1
    finally:
        server.stop()


def test_request_checks_and_the_receive_limit_refuse_before_decoding():
    """A method's request check sees the wire bytes before the deserializer: its reason is
    INVALID_ARGUMENT naming the method, and the message is never parsed; past `max_receive_bytes`
    grpc refuses with RESOURCE_EXHAUSTED at the transport. Other requests decode as before."""
    decoded = []

    def decode(data: bytes):
        decoded.append(data)
        return health_pb2.HealthCheckRequest.FromString(data)

    def echo(request, context):
        return health_pb2.HealthCheckResponse(status=SERVING)

    server = GrpcServer(ServerConfig(name="checks", port=0, grace_s=0.1, max_receive_bytes=4096),
                        request_checks={"/test.Echo/Echo": lambda data: "too long" if len(data) > 100 else None})
    server.add_generic(grpc.method_handlers_generic_handler("test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(
        echo, request_deserializer=decode, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}),
        "test.Echo")
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as ch:
            call = ch.unary_unary("/test.Echo/Echo", response_deserializer=health_pb2.HealthCheckResponse.FromString)
            small = health_pb2.HealthCheckRequest(service="x" * 10).SerializeToString()
            assert call(small, timeout=5).status == SERVING and decoded == [small]
            with pytest.raises(grpc.RpcError) as err:
                call(health_pb2.HealthCheckRequest(service="x" * 200).SerializeToString(), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "/test.Echo/Echo: too long (refused before decoding)"
            with pytest.raises(grpc.RpcError) as err:
                call(health_pb2.HealthCheckRequest(service="x" * 5000).SerializeToString(), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details() and "4096" in err.value.details()
            assert decoded == [small]   # neither refusal reached the deserializer
            assert call(small, timeout=5).status == SERVING
    finally:
        server.stop()
