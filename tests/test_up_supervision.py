"""Issue 40 item 7: `ddtree up`'s supervision (ddtree.supervise, up.wait_serving) over real child
processes: a peer that keeps crashing is restarted with backoff, then left down while verify runs
on; a verify that keeps crashing ends the supervision with a one-line reason; the stop order is
front (HTTP, verify) then peers; readiness is the
child's own "listening" line, not a health answer from another server on its port."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from ddtree.rpc.server import GrpcServer, ServerConfig
from ddtree.supervise import RestartPolicy, Supervisor, stop_all
from ddtree.up import Child, wait_serving
from ddtree.waiting import wait_until

FAST = RestartPolicy(max_restarts=2, first_backoff_s=0.2, max_backoff_s=1.0, stable_after_s=30.0)
CRASH = "import sys\nsys.exit(3)\n"  # a child that exits with code 3
SERVE = "import time\nprint('up', flush=True)\ntime.sleep(60)\n"


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    code: str
    starts: list = field(default_factory=list)


def _start(name: str, code: str) -> _Child:
    return _Child(name, subprocess.Popen([sys.executable, "-c", code]), code)


def _run(supervisor: Supervisor, until, timeout: float) -> str:
    def done():
        reason = supervisor.poll()
        return [reason] if reason or until() else None   # boxed: "" (no reason) is an answer too
    found = wait_until(done, timeout, poll_s=0.05)
    if found is None:
        raise AssertionError("timed out")
    return found[0]


def test_a_crashing_peer_is_restarted_with_backoff_then_left_down_and_verify_runs_on():
    said: list[tuple[float, str]] = []
    children = [_start("drafter", CRASH), _start("verify", SERVE)]
    pids = []

    def start(child):
        pids.append(child.proc.pid)
        return _start(child.name, child.code)
    supervisor = Supervisor(children, start, lambda c: None, FAST, lambda line: said.append((time.monotonic(), line)))
    try:
        reason = _run(supervisor, lambda: any("leaving it down" in line for _, line in said), 20)
        assert reason == ""
        lines = [line for _, line in said if "drafter exited" in line]
        assert lines[0] == "drafter exited with code 3; restarting it in 0.2s (1/2)"
        assert lines[1] == "drafter exited with code 3; restarting it in 0.4s (2/2)"
        assert lines[2].startswith("drafter exited with code 3 and keeps crashing (2 restarts); leaving it down")
        times = [t for t, line in said if "drafter exited" in line]
        assert times[2] - times[1] >= 0.4  # the backoff doubled
        pids.append(children[0].proc.pid)
        for _ in range(10):  # left down: no more restarts, and verify untouched
            assert supervisor.poll() == ""
            time.sleep(0.05)
        assert len(pids) == 3 and children[1].proc.poll() is None
    finally:
        for c in children:
            c.proc.kill()
            c.proc.wait()


def test_a_verify_that_keeps_crashing_ends_supervision_with_one_line():
    children = [_start("verify", CRASH)]
    said: list[str] = []
    supervisor = Supervisor(children, lambda c: _start(c.name, c.code), lambda c: None, FAST, said.append)
    reason = _run(supervisor, lambda: False, 20)
    assert reason == "verify exited with code 3 after 2 restarts in a row; stopping the others"


def test_a_child_that_never_becomes_ready_is_killed_and_counts_as_an_exit():
    children = [_start("drafter", SERVE)]
    said: list[str] = []

    def never_ready(child):
        raise RuntimeError(f"{child.name} did not become SERVING within 0s")
    children[0].proc.kill()
    supervisor = Supervisor(children, lambda c: _start(c.name, c.code), never_ready, FAST, said.append)
    _run(supervisor, lambda: any("leaving it down" in line for line in said), 20)
    assert "drafter did not become SERVING within 0s; killing it" in said
    children[0].proc.wait()


def test_stop_order_front_first_then_peers(tmp_path):
    # Each child writes the time it got SIGTERM, then exits after `linger` seconds.
    code = ("import os, signal, sys, time\n"
            "def on_term(*_):\n"
            "    open(sys.argv[1], 'w').write(repr(time.time()))\n"
            "    time.sleep(float(sys.argv[2]))\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    linger = {"treebuild": 0.0, "drafter": 0.0, "verify": 1.0, "http": 0.2}
    children = []
    for name, wait in linger.items():
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / name), str(wait)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "up\n"
        children.append(_Child(name, proc, code))
    said: list[str] = []
    stop_all(children, drain_s=5.0, grace_s=5.0, say=said.append)
    got = {name: float((tmp_path / name).read_text()) for name in linger}
    assert max(got["verify"], got["http"]) + 0.9 < min(got["drafter"], got["treebuild"])  # after verify exited
    assert all(c.proc.returncode == 0 for c in children) and not said


def test_ready_means_the_child_itself_serves_not_another_server_on_its_port(monkeypatch):
    monkeypatch.setattr("ddtree.up.OWN_LINE_WAIT_S", 0.5)
    other = GrpcServer(ServerConfig(name="other", port=0))
    port = other.start()
    other.set_serving(True)
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    child = Child("drafter", f"127.0.0.1:{port}", proc, [])
    threading.Thread(target=lambda: child.lines.extend(proc.stdout), daemon=True).start()
    try:
        with pytest.raises(RuntimeError, match="answered health but drafter .* never said it listens there"):
            wait_serving(child, 5)
    finally:
        proc.kill()
        proc.wait()
        other.stop(0)
