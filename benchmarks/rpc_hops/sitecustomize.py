"""Hop timestamps for benchmarks/bench_rpc_hops.py, loaded into each service process through
PYTHONPATH (Python imports `sitecustomize` at start-up); inert unless RPC_HOPS_DIR is set.

Wraps the step-stream client call (ddtree.rpc.step_stream.StepStream) and server loop
(serve_each) before the services import them, and appends CLOCK_MONOTONIC stamps (one clock for
every process of the host) to RPC_HOPS_DIR/<pid>.txt every half second:
  C <rpc> <call> <picked> <reply>            client: call entered, request taken by gRPC's
                                             request-consuming thread, reply returned
  S <rpc> <received> <start> <done> <yield> <next>
                                             server: request out of gRPC's iterator, handler
                                             start and end, reply handed to gRPC, gRPC back for
                                             the next request (the reply sent)
"""
import os

if os.environ.get("RPC_HOPS_DIR"):
    import queue
    import threading
    import time

    import ddtree.rpc.step_stream as _ss

    _rows: list = []
    _lock = threading.Lock()

    def _record(*row) -> None:
        with _lock:
            _rows.append(row)

    def _writer() -> None:
        path = os.path.join(os.environ["RPC_HOPS_DIR"], f"{os.getpid()}.txt")
        while True:
            time.sleep(0.5)
            with _lock:
                rows, _rows[:] = list(_rows), []
            if rows:
                with open(path, "a") as f:
                    f.writelines(" ".join(map(str, r)) + "\n" for r in rows)

    threading.Thread(target=_writer, daemon=True, name="rpc-hops writer").start()
    _serve_each, _call = _ss.serve_each, _ss.StepStream.call

    def serve_each(unary, requests, context, **kw):
        stamps = {}

        def received():
            for request in requests:
                stamps["received"] = time.monotonic()
                yield request

        def handler(request, ctx):
            stamps["start"] = time.monotonic()
            try:
                return unary(request, ctx)
            finally:
                stamps["done"] = time.monotonic()

        for reply in _serve_each(handler, received(), context, **kw):
            handed = time.monotonic()
            yield reply
            _record("S", kw["span_name"], stamps["received"], stamps["start"], stamps["done"], handed,
                    time.monotonic())

    def call(self, request):
        entered = time.monotonic()
        reply = _call(self, request)
        _record("C", self._span_name, entered, getattr(self, "_picked", 0.0), time.monotonic())
        return reply

    def _open(self):  # as StepStream._open, with the request iterator stamping the pick-up
        self._requests = queue.SimpleQueue()

        def requests():
            for request in iter(self._requests.get, _ss._CLOSE):
                self._picked = time.monotonic()
                yield request

        self._replies = self._method(requests(), metadata=self._metadata)
        threading.Thread(target=self._watch, args=(self._replies,), daemon=True,
                         name=f"{self._span_name} watchdog").start()

    _ss.serve_each, _ss.StepStream.call, _ss.StepStream._open = serve_each, call, _open
