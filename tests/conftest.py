"""Shared test fixtures."""
from __future__ import annotations

import os
import sys

import pytest

# Tiny models on small machines: intra-op threads only contend with the tests' own service
# processes (a 30-token generation ran 20x slower with 2 threads on a loaded 2-core box).
# Set before torch is imported here or in any child process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Services and helper processes started by tests run with the same interpreter.
PYTHON = sys.executable


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def subprocess_env():
    """Environment for child processes: unbuffered, no exporter unless a test sets one."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DDTREE_TRACE_FILE"):
        env.pop(key, None)
    return env
