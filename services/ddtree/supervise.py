"""Supervision of `ddtree up`'s children (torch-free): restarts with backoff, giving up, stop order.

A child that exits is restarted after a backoff (1 s, doubling, at most 30 s); one that exits
`max_restarts` times in a row (a run that served `stable_after_s` resets the count) is left down
when it is a peer (drafter, sidecar, HTTP API: the verify service serves degraded without it), and
makes `ddtree up` exit 1 when it is the verify service. The watching never blocks on a restart:
the restarted child's readiness is awaited in a thread, and one that does not become ready is
killed (which counts as its next exit). A dead child leaves no shared memory behind: the
transport's regions are memfds, freed with the last process that maps them.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

VERIFY = "verify"
FRONT = ("http", VERIFY)  # stopped first: the others serve them


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5          # exits in a row that are restarted
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0   # a child that ran this long starts its count afresh

    def backoff(self, restarts_so_far: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** restarts_so_far)


@dataclass
class _State:
    started: float
    restarts: int = 0
    restart_at: float | None = None
    given_up: bool = False


class Supervisor:
    """`poll()` every fraction of a second from `ddtree up`'s main loop; `children` (objects with
    .name and .proc) is updated in place as children are restarted."""

    def __init__(self, children: list, start: Callable, wait_ready: Callable, policy: RestartPolicy,
                 say: Callable[[str], None]):
        self.children, self._start, self._wait_ready, self.policy, self._say = children, start, wait_ready, policy, say
        now = time.monotonic()
        self._state = {c.name: _State(started=now) for c in children}

    def poll(self) -> str:
        """Handles exits and due restarts; returns "" to go on, else why `ddtree up` must exit."""
        now = time.monotonic()
        for i, child in enumerate(self.children):
            state = self._state[child.name]
            if state.given_up:
                continue
            if state.restart_at is not None:
                if now >= state.restart_at:
                    state.restart_at, state.started = None, now
                    self.children[i] = self._start(child)
                    threading.Thread(target=self._await_ready, args=(self.children[i],), daemon=True).start()
                continue
            code = child.proc.poll()
            if code is None:
                continue
            if now - state.started >= self.policy.stable_after_s:
                state.restarts = 0
            if state.restarts >= self.policy.max_restarts:
                if child.name == VERIFY:
                    return (f"verify exited with code {code} after {state.restarts} restarts in a row; "
                            "stopping the others")
                state.given_up = True
                self._say(f"{child.name} exited with code {code} and keeps crashing ({state.restarts} restarts); "
                          f"leaving it down (the verify service serves without it)")
                continue
            delay = self.policy.backoff(state.restarts)
            state.restarts += 1
            state.restart_at = now + delay
            self._say(f"{child.name} exited with code {code}; restarting it in {delay:g}s "
                      f"({state.restarts}/{self.policy.max_restarts})")
        return ""

    def _await_ready(self, child) -> None:
        try:
            self._wait_ready(child)
        except RuntimeError as exc:
            self._say(f"{exc}; killing it")
            if child.proc.poll() is None:
                child.proc.kill()
            return
        self._say(f"{child.name:9s} (pid {child.proc.pid}) restarted and serving")


def stop_all(children: list, drain_s: float, grace_s: float, say: Callable[[str], None]) -> None:
    """SIGTERM the HTTP API and the verify service, wait for them (their drain, then grace_s),
    then the drafter and the sidecar (grace_s); SIGKILL whatever is left; unlink the shared
    memory of every child."""
    front = [c for c in children if c.name in FRONT]
    back = [c for c in children if c.name not in FRONT]
    for group, wait_s in ((front, drain_s + grace_s), (back, grace_s)):
        for child in group:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        for child in group:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{child.name} did not stop in {wait_s:.0f}s; killing it")
                child.proc.kill()
                child.proc.wait()
