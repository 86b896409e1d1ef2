"""What the HTTP front adds per token: the same greedy generation streamed straight from the gRPC
Generation API and through the OpenAI-compatible HTTP API in front of it, alternated.

Both are streamed and timed on this side: TTFT = send to first token, per-token = (last token -
first token) / (tokens - 1), medians over --repeats requests each. Greedy with ignore_eos, so
both paths generate the same tokens (checked). ar mode streams one token per chunk: the most
chunks, so the most hop cost per token; ddtree streams a decode step's tokens per chunk. The HTTP
process's own CPU time per token (its process_cpu_seconds_total over the HTTP runs) is the cost
that stays when the machine is not shared with the model (on 2 cores, every process competes).

    ddtree up --demo --demo-keep --http-port 8000 &     # the bundled pair on CPU
    python benchmarks/bench_http_hop.py --grpc 127.0.0.1:50051 --http http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from urllib.parse import urlsplit

from ddtree.cli import RawDescriptionDefaultsHelpFormatter
from ddtree.demo import prompt_ids
from ddtree.bundled import DEMO_PROMPTS, bundled_paths
from ddtree.v1 import generation_pb2_grpc
from ddtree_client.channel import open_channel
from ddtree_client.generate import GenerateOptions, build_request, stream_generate


def via_grpc(stub, prompt: list[int], mode: str, tokens: int) -> tuple[float, float, str]:
    record = stream_generate(stub, build_request(prompt, GenerateOptions(max_tokens=tokens, mode=mode,
                                                                        ignore_eos=True)))
    assert not record.error, record.error
    return record.ttft_s, record.tpot_s, record.text


def via_http(url: str, prompt: str, mode: str, tokens: int) -> tuple[float, float, str]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "mode": mode,
            "stream": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    first = last = None
    text = ""
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        piece = json.loads(line[6:])["choices"]
        if piece and piece[0]["text"]:
            last = time.perf_counter()
            first = first or last
            text += piece[0]["text"]
    conn.close()
    return first - start, (last - first) / (tokens - 1), text


def http_cpu_s(url: str) -> float:
    """The HTTP process's CPU seconds so far, from its /metrics."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("process_cpu_seconds_total")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("--grpc", default="127.0.0.1:50051")
    p.add_argument("--http", default="http://127.0.0.1:8000")
    p.add_argument("--target", default=str(bundled_paths().target), help="the checkpoint the stack serves")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--modes", default="ar,ddtree")
    args = p.parse_args(argv)
    prompt = DEMO_PROMPTS[0]
    ids = prompt_ids(args.target, prompt)  # what the HTTP path sends: BOS + the prompt's ids
    print(f"{args.tokens} tokens, {args.repeats} requests per path, alternated; medians in ms")
    print(f"{'mode':8s} {'path':5s} {'ttft':>8s} {'per token':>10s} {'http cpu/token':>15s}")
    with open_channel(args.grpc) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for mode in args.modes.split(","):
            runs = {"grpc": [], "http": []}
            cpu_s = 0.0
            for _ in range(args.repeats):
                g = via_grpc(stub, ids, mode, args.tokens)
                cpu_before = http_cpu_s(args.http)
                h = via_http(args.http, prompt, mode, args.tokens)
                cpu_s += http_cpu_s(args.http) - cpu_before
                assert g[2] == h[2], "the two paths generated different text"
                runs["grpc"].append(g)
                runs["http"].append(h)
            med = {k: (statistics.median(r[0] for r in v) * 1e3, statistics.median(r[1] for r in v) * 1e3)
                   for k, v in runs.items()}
            for path, (ttft, tpot) in med.items():
                print(f"{mode:8s} {path:5s} {ttft:8.2f} {tpot:10.3f}")
            print(f"{mode:8s} {'diff':5s} {med['http'][0] - med['grpc'][0]:8.2f} "
                  f"{med['http'][1] - med['grpc'][1]:10.3f} {cpu_s / (args.repeats * args.tokens) * 1e3:15.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
