"""Second process of the transport self-test (run as a script: no torch, no ddtree import).

Reads one JSON line {kind, handle (hex), nbytes, slot_bytes, event (hex), device_uuid} on stdin,
maps the region the way a peer would, checks slot 0 against the sha256 it was given, writes
slot 0 XOR 0x5A into slot 1, and prints one JSON line {ok, error}.
"""
import fcntl
import hashlib
import json
import mmap
import os
import sys


def _xor(data: bytes) -> bytes:
    return bytes(b ^ 0x5A for b in data)


def _shm(req: dict) -> None:
    # handle: memfd:<pidns>:<pid>:<fd>:<dev>:<ino>; the producer's fd, opened through /proc
    _, _, pid, fdnum, dev, ino = bytes.fromhex(req["handle"]).decode().split(":")
    fd = os.open(f"/proc/{int(pid)}/fd/{int(fdnum)}", os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (int(dev), int(ino)):
            raise RuntimeError("the handle's fd is another file")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != \
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            raise RuntimeError("the region is not sealed against shrinking and growing")
        mm = mmap.mmap(fd, req["nbytes"])
    finally:
        os.close(fd)
    n = req["slot_bytes"]
    data = mm[:n]
    if hashlib.sha256(data).hexdigest() != req["sha256"]:
        raise RuntimeError("slot 0 does not hold what the producer wrote")
    mm[n:2 * n] = _xor(data)
    mm.close()


def _cuda(req: dict) -> None:
    from cuda_driver import driver  # sibling module, torch-free

    d = driver()
    ordinal = d.ordinal_of(req["device_uuid"])
    if ordinal is None:
        raise RuntimeError(f"device {req['device_uuid']} not visible to the peer process")
    n = req["slot_bytes"]
    with d.context(ordinal):
        ptr = d.ipc_open(bytes.fromhex(req["handle"]))
        event = d.ipc_open_event(bytes.fromhex(req["event"]))
        d.wait_event_on_null_stream(event)  # the producer's per-slot event orders our read
        data = d.copy_to_host(ptr, n)
        if hashlib.sha256(data).hexdigest() != req["sha256"]:
            raise RuntimeError("slot 0 does not hold what the producer wrote")
        d.copy_to_device(ptr + n, _xor(data))
        d.synchronize()
        d.event_destroy(event)
        d.ipc_close(ptr)


def main() -> None:
    req = json.loads(sys.stdin.readline())
    try:
        {"shm": _shm, "cuda_ipc": _cuda}[req["kind"]](req)
        print(json.dumps({"ok": True}))
    except Exception as exc:  # reported to the parent, which raises it loudly
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))


if __name__ == "__main__":
    main()
