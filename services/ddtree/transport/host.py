"""Host and process identity, used to refuse handles from another machine and reap dead peers."""
from __future__ import annotations

import functools
import os
import socket


@functools.cache
def host_id() -> str:
    """Boot id + hostname; DDTREE_HOST_ID overrides it (e.g. containers sharing one host's IPC)."""
    override = os.environ.get("DDTREE_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{socket.gethostname()}"


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead: it will never touch its memory again)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
