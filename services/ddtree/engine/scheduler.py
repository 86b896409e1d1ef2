"""Admission control: a bounded queue, running-request and KV-page limits, continuous batching.

Every request reserves, when admitted, the KV pages of its worst case (prompt + max new tokens +
its largest tree tail), so the cache can never run out mid-generation: a request that does not
fit now waits in the queue (FIFO, no overtaking, so large requests are not starved), a request
that could never fit is refused at once, and a full queue refuses new requests (backpressure,
RESOURCE_EXHAUSTED). Finished or cancelled requests give their pages back immediately.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Generic, Hashable, TypeVar

from ddtree.engine.request import Overloaded

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 8      # requests decoded together in one step
    max_queue: int = 64       # waiting requests before RESOURCE_EXHAUSTED
    num_pages: int = 1024     # KV pages of the target cache
    page_size: int = 64       # tokens per page

    def __post_init__(self):
        for name in ("max_running", "num_pages", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


class Scheduler(Generic[T]):
    """Thread-safe: `submit`/`cancel` from RPC threads, `admit`/`finish` from the engine loop."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._lock = threading.Lock()
        self._queue: deque[tuple[T, int]] = deque()
        self._running: dict[T, int] = {}  # request -> reserved pages
        self.free_pages = config.num_pages

    def submit(self, request: T, worst_case_tokens: int) -> None:
        pages = self.config.pages_for(worst_case_tokens)
        if pages > self.config.num_pages:
            raise Overloaded(f"request needs {pages} KV pages ({worst_case_tokens} tokens) but the cache has "
                             f"{self.config.num_pages}; lower max_tokens or the prompt length")
        with self._lock:
            if len(self._queue) >= self.config.max_queue:
                raise Overloaded(f"server busy: {len(self._queue)} requests queued "
                                 f"(limit {self.config.max_queue}); retry later")
            self._queue.append((request, pages))

    def admit(self) -> list[T]:
        """Moves queued requests to running while slots and pages allow (FIFO)."""
        admitted = []
        with self._lock:
            while self._queue and len(self._running) < self.config.max_running:
                request, pages = self._queue[0]
                if pages > self.free_pages:
                    break
                self._queue.popleft()
                self._running[request] = pages
                self.free_pages -= pages
                admitted.append(request)
        return admitted

    def finish(self, request: T) -> None:
        """Releases a running request's pages (idempotent)."""
        with self._lock:
            self.free_pages += self._running.pop(request, 0)

    def drop_queued(self, request: T) -> bool:
        """Removes a request that is still waiting; True if it was."""
        with self._lock:
            for i, (queued, _) in enumerate(self._queue):
                if queued == request:
                    del self._queue[i]
                    return True
        return False

    @property
    def running(self) -> list[T]:
        with self._lock:
            return list(self._running)

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)
