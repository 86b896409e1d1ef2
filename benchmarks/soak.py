"""A bounded soak of a default `ddtree up` on CPU (issue 40): minutes, not part of the test run.

    python benchmarks/soak.py [--minutes 4] [--clients 4] [--out benchmarks/results/cpu/soak.txt]

Starts `ddtree up` (the bundled pair, --device cpu, no HTTP API), takes the greedy ar output of a
few prompts as the reference, then runs `--clients` threads that mix good requests (ddtree, chain,
ar: output must equal the reference), bad ones (empty prompt, a token id out of the vocabulary,
bytes that are not protobuf: INVALID_ARGUMENT), cancelled ones (two chunks read, then cancelled)
and oversized ones (a prompt past the context, 200,000 stop strings: INVALID_ARGUMENT). The
drafter is SIGKILLed at a third of the run and the sidecar at two thirds (`ddtree up` restarts
them; verify degrades meanwhile). The verify service's RSS is read after the warm-up and at the
end. Then each service is SIGKILLed once more (verify too: `ddtree up` restarts it) and the stack
is stopped with SIGTERM. Reported: greedy mismatches, unexpected status codes, the RSS change,
and that no process of the stack outlives it (its shared-memory regions are memfds, freed with
them; named ddtree-* segments in /dev/shm, which older versions made, are counted too).
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from ddtree.up import free_port
from ddtree.v1 import generation_pb2 as pb
from ddtree.v1 import generation_pb2_grpc
from ddtree.waiting import wait_until

PROMPTS = [list(b"def fib(n):\n    "), list(b"import os\nimport "), list(b"class Stack:\n    def "),
           list(b"for i in range("), list(b"    return self.")]
TOKENS = 48


class Up:
    def __init__(self, port: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "up", "--device", "cpu", "--port", str(port), "--no-http",
             "--verify-arg=--max-running=8", "--grace-s", "20", "--drain-s", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        m = wait_until(lambda: re.search(pattern, "".join(self.lines[after:])), timeout,
                       give_up=lambda: self.proc.poll() is not None)
        if m is None:
            raise SystemExit(f"soak: {pattern!r} not seen:\n{self.text()[-4000:]}")
        return m

    def pids(self) -> dict[str, int]:
        """The latest pid of each child, from "NAME listening on" lines ([name] prefixed) and the ready table."""
        out = {m.group(1): int(m.group(2)) for m in re.finditer(r"ddtree up: (\w+)\s+\S+\s+\(pid (\d+)\)", self.text())}
        out.update({m.group(1): int(m.group(2)) for m in
                    re.finditer(r"ddtree up: (\w+)\s+\(pid (\d+)\) restarted and serving", self.text())})
        return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def segments() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("ddtree-"))


def request(prompt, mode=pb.MODE_AR, n=TOKENS, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), speculation=pb.SpeculationParams(mode=mode),
                              sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True, **sampling))


def tokens(stub, req, timeout=120) -> list[int]:
    return [t for c in stub.Generate(req, timeout=timeout) for t in c.token_ids]


class Soak:
    def __init__(self, channel, vocab: int, max_context: int, reference: list[list[int]]):
        self.stub = generation_pb2_grpc.GenerationStub(channel)
        self.raw = channel.unary_stream("/ddtree.v1.Generation/Generate", request_serializer=lambda b: b)
        self.vocab, self.max_context, self.reference = vocab, max_context, reference
        self.counts: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []
        self.mismatches = 0
        self.lock = threading.Lock()

    def note(self, kind: str, code: str, expected: tuple[str, ...]) -> None:
        with self.lock:
            self.counts[f"{kind}:{code}"] += 1
            if code not in expected:
                self.unexpected.append(f"{kind}: {code}")

    def one(self, rng: random.Random) -> None:
        kind = rng.choice(["good", "good", "good", "bad", "cancelled", "oversized"])
        try:
            if kind == "good":
                i = rng.randrange(len(PROMPTS))
                mode = rng.choice([pb.MODE_DDTREE, pb.MODE_CHAIN, pb.MODE_AR])
                got = tokens(self.stub, request(PROMPTS[i], mode))
                if got != self.reference[i]:
                    with self.lock:
                        self.mismatches += 1
            elif kind == "bad":
                which = rng.randrange(3)
                if which == 0:
                    list(self.stub.Generate(request([]), timeout=30))
                elif which == 1:
                    list(self.stub.Generate(request([1, self.vocab + 7]), timeout=30))
                else:
                    list(self.raw(b"\xff\xfe\x00garbage", timeout=30))
            elif kind == "cancelled":
                it = self.stub.Generate(request(PROMPTS[0], pb.MODE_DDTREE, n=400), timeout=120)
                next(it), next(it)
                it.cancel()
                self.note(kind, "CANCELLED", ("CANCELLED",))
                return
            else:
                if rng.randrange(2):
                    list(self.stub.Generate(request([1] * (self.max_context + 1)), timeout=60))
                else:
                    list(self.stub.Generate(request(PROMPTS[0], stop_strings=["x"] * 200_000), timeout=60))
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        expected = {"good": ("OK",), "bad": ("INVALID_ARGUMENT",), "oversized": ("INVALID_ARGUMENT",)}[kind]
        self.note(kind, code, expected)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args()
    report: list[str] = [f"# python benchmarks/soak.py {' '.join(sys.argv[1:])}",
                         f"# {time.strftime('%Y-%m-%d %H:%M:%S')} on {os.cpu_count()} cores; bundled pair, ddtree up "
                         "--device cpu --no-http --verify-arg=--max-running=8 --drain-s 5"]

    def say(line: str) -> None:
        print(line, flush=True)
        report.append(line)

    before = segments()
    port = free_port()
    up = Up(port)
    seen_pids: set[int] = set()
    try:
        up.wait_for(r"ddtree up: ready", 600)
        seen_pids |= set(up.pids().values())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 256 << 20),
                                                                      ("grpc.max_send_message_length", 256 << 20)])
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        stub = generation_pb2_grpc.GenerationStub(channel)
        reference = [tokens(stub, request(prompt)) for prompt in PROMPTS]
        soak = Soak(channel, info.vocab_size, info.max_context, reference)
        say(f"model {info.model}: vocab {info.vocab_size}, max_context {info.max_context}; {len(PROMPTS)} prompts, "
            f"{TOKENS} greedy tokens each; {args.clients} clients for {args.minutes:g} min")

        run_s = args.minutes * 60
        start = time.monotonic()
        stop = threading.Event()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                soak.one(rng)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(min(20.0, run_s / 6))  # warm: allocator and caches settle
        verify_pid = up.pids()["verify"]
        rss_start = rss_kib(verify_pid)
        say(f"verify pid {verify_pid}: RSS after warm-up {rss_start / 1024:.1f} MiB")
        for frac, name in ((1 / 3, "drafter"), (2 / 3, "treebuild")):
            time.sleep(max(0.0, start + frac * run_s - time.monotonic()))
            pid = up.pids()[name]
            mark = len(up.lines)
            os.kill(pid, signal.SIGKILL)
            say(f"t={time.monotonic() - start:.0f}s: SIGKILL {name} (pid {pid})")
            up.wait_for(rf"{name}\s+\(pid \d+\) restarted and serving", 300, after=mark)
            seen_pids |= set(up.pids().values())
        time.sleep(max(0.0, start + run_s - time.monotonic()))
        stop.set()
        for t in threads:
            t.join(180)
        rss_end = rss_kib(verify_pid)
        change = (rss_end - rss_start) / rss_start * 100
        say(f"t={time.monotonic() - start:.0f}s: clients stopped; verify RSS {rss_end / 1024:.1f} MiB ({change:+.1f}%)")
        for key in sorted(soak.counts):
            say(f"  {key:28s} {soak.counts[key]}")

        # kill -9 of each service: up restarts each (verify too); the output is still the reference
        for name in ("drafter", "treebuild", "verify"):
            pid = up.pids()[name]
            mark = len(up.lines)
            os.kill(pid, signal.SIGKILL)
            up.wait_for(rf"{name}\s+\(pid \d+\) restarted and serving", 600, after=mark)
            seen_pids |= set(up.pids().values())
        after_kills = [tokens(stub, request(PROMPTS[i], pb.MODE_DDTREE)) == reference[i] for i in range(len(PROMPTS))]
        say(f"SIGKILL of drafter, treebuild, verify, each restarted: ddtree output == ar reference for "
            f"{sum(after_kills)}/{len(after_kills)} prompts")
        channel.close()
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)
            try:
                code = up.proc.wait(120)
            except subprocess.TimeoutExpired:
                up.proc.kill()
                code = up.proc.wait()
        else:
            code = up.proc.returncode
    seen_pids |= set(up.pids().values())
    left = [n for n in segments() if n not in before]
    ours = [n for n in left if n.split("-")[2] in {str(p) for p in seen_pids}]
    alive = [p for p in seen_pids if pid_alive(p)]
    # shm regions are sealed memfds: they have no name and are freed with the last process that
    # maps them, so none is left once every process of the stack is gone (named ddtree-* segments
    # in /dev/shm are only made by older versions)
    say(f"ddtree up exited with {code} after SIGTERM; of this stack's {len(seen_pids)} processes {len(alive)} "
        f"alive (shm regions are memfds, freed with them); new ddtree segments in /dev/shm: {len(left)} "
        f"(of these pids: {len(ours)})")
    ok = (soak.mismatches == 0 and not soak.unexpected and abs(change) <= 5.0 and not ours and not alive
          and all(after_kills) and code == 0)
    good = sum(v for k, v in soak.counts.items() if k.startswith("good:"))
    say(f"summary: {'PASS' if ok else 'FAIL'}: {sum(soak.counts.values())} requests ({good} good), "
        f"{soak.mismatches} greedy mismatches vs ar, {len(soak.unexpected)} unexpected status codes"
        f"{' (' + ', '.join(sorted(set(soak.unexpected))) + ')' if soak.unexpected else ''}, "
        f"verify RSS {change:+.1f}% start to end, drafter and sidecar SIGKILLed mid-run, each service "
        f"SIGKILLed after, {len(alive)} stack processes and {len(ours)} named segments left")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(report) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
