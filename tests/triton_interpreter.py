"""Triton kernels in the CPU tests: Triton's interpreter, chosen once per process, and its quirks.

Import this module before triton: without a GPU, and while triton is not imported yet, it turns the
interpreter on (triton reads TRITON_INTERPRET when it decorates its own functions, at its first
import). If an earlier module already imported triton, `IN_PROCESS` is False and a test module
runs its kernels again in a fresh process (`rerun_in_fresh_process`).
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
IN_PROCESS = CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not CUDA and IN_PROCESS:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def interpreter_index_fix():
    """Triton 3.6's interpreter turns loop bounds into ints with int(array of shape (1,)), which
    numpy >= 2.4 refuses; reshape to a 0-d array first. Compiled kernels are not affected."""
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:  # another triton version: nothing to patch
        yield
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interp._patch_lang_tensor = patched
    try:
        yield
    finally:
        interp._patch_lang_tensor = original


@contextlib.contextmanager
def kernels_here(request, fresh_process_test, *interpreter_patches):
    """The body of a module's autouse fixture: the fresh-process test runs as it is; every other
    test is skipped when the interpreter cannot be used in this process (that test reruns them),
    and under the interpreter runs with the index fix and `interpreter_patches` (context managers)."""
    if request.function is fresh_process_test:
        yield
        return
    if not IN_PROCESS:
        pytest.skip("triton was imported before TRITON_INTERPRET=1: test_kernels_in_a_fresh_process runs these")
    if CUDA:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(interpreter_index_fix())
        for patch in interpreter_patches:
            stack.enter_context(patch())
        yield


def rerun_in_fresh_process(path: str, skipped: int) -> None:
    """Runs the test module `path` under the interpreter in a new process; expects all its tests
    to pass but `skipped` ones."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"\d+ passed, {skipped} skipped in .*", summary), summary
