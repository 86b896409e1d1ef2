"""Waiting until a condition holds: the one polling loop of the services, tests and benchmarks
(torch-free, standard library only)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, *, poll_s: float = 0.1,
               give_up: Callable[[], bool] | None = None) -> T | None:
    """Calls `condition()` every `poll_s` seconds and returns its first truthy result. Returns
    None once `timeout_s` has passed, or at once when `give_up()` is true after a look (the
    process that would make it hold has exited, say). Callers turn None into their own error."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if (give_up is not None and give_up()) or time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)
