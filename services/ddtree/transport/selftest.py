"""Start-up self-test: proves a region kind works with a real round trip through a second process
(a process cannot open its own CUDA IPC handle, so the peer side runs in a child)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import torch

from ddtree.transport.region import CUDA_IPC, INLINE, Region, decode_inline, kind_name

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_selftest_child.py")
SLOT_BYTES = 4096


def round_trip(kind: int, device: torch.device, timeout_s: float = 60.0) -> None:
    """Raises RuntimeError naming what failed; returns when `kind` demonstrably works."""
    region = Region("selftest", kind, slot_count=2, slot_bytes=SLOT_BYTES, device=device)
    try:
        gen = torch.Generator().manual_seed(os.getpid())
        pattern = torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=gen)
        ref = region.put(0, pattern.to(region.device))
        if kind == INLINE:
            back = decode_inline(ref, "selftest", 2, region.slot_bytes, torch.device("cpu"))
            if not torch.equal(back, pattern):
                raise RuntimeError("inline round trip corrupted the data")
            return
        region.record(0)
        if kind == CUDA_IPC:
            torch.cuda.current_stream(region.device).synchronize()  # the child's event wait covers it too
        req = {"kind": kind_name(kind), "handle": region.memory.handle.hex(), "nbytes": region.byte_size,
               "slot_bytes": region.slot_bytes, "sha256": hashlib.sha256(pattern.numpy().tobytes()).hexdigest(),
               "device_uuid": region.device_uuid,
               "event": region._event_handles[0].hex() if region.events else ""}
        proc = subprocess.run([sys.executable, _CHILD], input=json.dumps(req) + "\n", capture_output=True,
                              text=True, timeout=timeout_s)
        try:
            answer = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise RuntimeError(f"{kind_name(kind)} self-test peer died (rc {proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}") from None
        if not answer["ok"]:
            raise RuntimeError(f"{kind_name(kind)} self-test peer failed: {answer['error']}")
        echoed = region.view(1, torch.uint8, (SLOT_BYTES,)).cpu()
        if not torch.equal(echoed, pattern ^ 0x5A):
            raise RuntimeError(f"{kind_name(kind)} self-test: the peer's write did not arrive intact")
    finally:
        region.close()
