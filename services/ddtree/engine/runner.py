"""CUDA-graph replay of the target's tree verify, one graph per (batch bucket, nodes bucket).

Why: a verify of the bundled pair is ~500 small kernel launches; launched one by one from Python
the host takes 7-20x the GPU's time (benchmarks/results/h200/step_graphs.txt). A replayed graph
launches them all at once.

How (the pattern of nano-vllm's and SGLang's decode graphs, for trees):
- A step of B requests whose trees have T rows each (root included; the engine pads trees to the
  widest) runs the graph of the smallest bucket (B', T') with B' >= B and T' >= T.
- Padding: the extra nodes of a real request and every node of an idle request see only
  themselves (mask), write their latents to the cache's scratch page (slots) and read a block
  table that names only pages they may read. Their outputs are dropped; real rows never see them,
  so the real rows compute what an unpadded verify computes (bit for bit in float32; in bf16 up
  to the rounding of GEMMs of other shapes: docs/step_graphs.md).
- All per-step inputs (tokens, positions, cache slots, prefix lengths, block table, mask) are
  computed on the host from what the host already knows and packed into ONE pinned int64 buffer,
  copied to the device in one copy; each bucket's graph reads its views of the device buffer in
  place (a graph replays fixed addresses: inputs are written into them, never passed as new
  tensors). Outputs land in static buffers (posterior, hidden, features) valid until the next
  verify.
- Graphs are captured at start-up, largest first, into one shared memory pool. Prefill stays
  eager. Tensor parallel: rank 0 announces the runner and each replay through the model's
  follow protocol (TargetModel extensions); followers (follow_graphs) capture and replay the
  same buckets on rank 0's packed inputs.

`mode="padded"` runs the same padded, packed path without capturing (CPU tests of the padding
logic); `mode="graph"` captures (CUDA only).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.models.deepseek import StepOutput, unique_seq_ids

log = logging.getLogger(__name__)

MODES = ("graph", "padded")


def default_batches(max_running: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 below max_running, and max_running itself."""
    batches = {b for b in (1, 2, 4, 8) if b < max_running} | set(range(16, max_running, 16)) | {max_running}
    return tuple(sorted(batches))


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma list of bucket sizes (a flag) -> ascending distinct ints."""
    try:
        return tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError as exc:
        raise ValueError(f"graph buckets must be comma-separated integers: {exc}") from None


@dataclass(frozen=True)
class GraphBuckets:
    """Batch sizes and rows per request (root included) that get a graph; both ascending."""

    batches: tuple[int, ...]
    nodes: tuple[int, ...]

    def __post_init__(self):
        for name, values in (("batch", self.batches), ("nodes", self.nodes)):
            if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"graph {name} buckets must be ascending distinct integers >= 1; got {values}")

    @staticmethod
    def default(max_running: int, max_budget: int, block_size: int = 0) -> "GraphBuckets":
        """Batches 1, 2, 4, 8, then every 16 up to max_running (and max_running itself); rows 1
        (ar), 2^k + 1 for every power-of-two budget up to max_budget (the budget policy's sizes),
        block_size (a chain) and max_budget + 1."""
        batches = default_batches(max_running)
        nodes = {1, max_budget + 1} | {(1 << k) + 1 for k in range(max_budget.bit_length()) if 1 << k <= max_budget}
        if block_size > 1:
            nodes.add(block_size)
        return GraphBuckets(batches, tuple(sorted(nodes)))

    @staticmethod
    def parse(batches: str, nodes: str) -> "GraphBuckets":
        """From comma lists (flags), e.g. '1,2,4,8,16' and '1,5,9,17'."""
        return GraphBuckets(parse_sizes(batches), parse_sizes(nodes))

    def pick(self, batch: int, rows: int) -> tuple[int, int] | None:
        """The smallest bucket holding `batch` requests of `rows` rows, or None (eager)."""
        b = next((v for v in self.batches if v >= batch), None)
        t = next((v for v in self.nodes if v >= rows), None)
        return None if b is None or t is None else (b, t)

    def all(self) -> list[tuple[int, int]]:
        return [(b, t) for b in self.batches for t in self.nodes]


GRAPHS_INIT, GRAPHS_RUN = "verify_graphs.init", "verify_graphs.run"  # TargetModel extensions


def _encode_init(buckets: GraphBuckets, max_context: int, mode: str) -> torch.Tensor:
    return torch.tensor([len(buckets.batches), *buckets.batches, len(buckets.nodes), *buckets.nodes, max_context,
                         MODES.index(mode)], dtype=torch.int64)


def _decode_init(codes: list[int]) -> tuple[GraphBuckets, int, str]:
    nb = codes[0]
    batches, rest = tuple(codes[1:1 + nb]), codes[1 + nb:]
    nodes = tuple(rest[1:1 + rest[0]])
    max_context, mode = rest[1 + rest[0]:]
    return GraphBuckets(batches, nodes), max_context, MODES[mode]


def follow_graphs(model) -> None:
    """Tensor-parallel ranks > 0, before model.follow(): build the verify runner when rank 0
    builds its own, and replay each bucket rank 0 replays, on rank 0's packed inputs (the same
    collectives in the same order, so NCCL collectives inside the graphs pair up)."""
    state: dict[str, VerifyGraphs] = {}

    def init(args: list[torch.Tensor]) -> None:
        buckets, max_context, mode = _decode_init(args[0].tolist())
        state["graphs"] = VerifyGraphs(model, buckets, max_context=max_context, mode=mode)

    def run(args: list[torch.Tensor]) -> None:
        graphs, (bb, tt, t, logits, *seq_ids) = state["graphs"], args[0].tolist()
        model.cache.reserve(seq_ids, t)  # page lists stay identical to rank 0's
        graphs._run((bb, tt), args[1])
        if logits:
            model.full_logits(graphs.hidden[:bb * tt])

    model.register_extension(GRAPHS_INIT, init)
    model.register_extension(GRAPHS_RUN, run)


def _words(t: int) -> int:
    return (t + 63) // 64


def self_only_mask(b: int, t: int) -> np.ndarray:
    """[b, t, words] int64: row i sees only itself (the padding rule)."""
    mask = np.zeros((b, t, _words(t)), dtype=np.uint64)
    i = np.arange(t)
    mask[:, i, i // 64] = np.uint64(1) << (i % 64).astype(np.uint64)
    return mask.view(np.int64)


class BucketGraphs:
    """What the verify and draft runners share: the pinned host buffer and its device copy (each
    bucket's inputs packed from the start), one copy and one replay a step, and the capture of
    every bucket, largest first, into one memory pool. Subclasses give `_shapes(b, x)` (the
    bucket's inputs, packed in that order), `_fill_idle(b, x)` (inputs of a batch of idle rows) and
    `_forward(b, x)` (the captured work: reads the device buffer, writes the static outputs)."""

    what = "bucketed"

    def _shapes(self, b: int, x: int) -> list[tuple[int, ...]]:
        """The shapes of a bucket's inputs, in their order in the packed buffer."""
        raise NotImplementedError

    def _size(self, b: int, x: int) -> int:
        """int64 words of a bucket's packed inputs."""
        return sum(math.prod(shape) for shape in self._shapes(b, x))

    def _split(self, buf, b: int, x: int) -> list:
        """Views of buf (host numpy or device tensor), one per input, packed from its start."""
        views, start = [], 0
        for shape in self._shapes(b, x):
            n = math.prod(shape)
            views.append(buf[start:start + n].reshape(shape))
            start += n
        return views

    @staticmethod
    def _check_mode(mode: str, device: torch.device) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if mode == "graph" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use mode='padded' (or --eager) on CPU")

    def _init_buffers(self, device: torch.device, size: int, mode: str) -> None:
        self._check_mode(mode, device)
        self.mode, self.device = mode, device
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_s, self.capture_bytes = 0.0, 0
        self.replays = self.fallbacks = 0

    def _run(self, bucket: tuple[int, int], packed: torch.Tensor | None = None) -> None:
        """Copies the bucket's packed inputs (the host buffer, or `packed`: a follower's copy of
        rank 0's) in one non-blocking copy and replays (or runs) the bucket."""
        used = self._size(*bucket)
        self.dev[:used].copy_(self.host[:used] if packed is None else packed, non_blocking=True)
        if self.mode == "graph":
            self.graphs[bucket].replay()
        else:
            self._forward(*bucket)
        self.replays += 1

    def _load_idle(self, bucket: tuple[int, int]) -> None:
        """A batch of idle rows in the bucket's device inputs (what capture and timing run on)."""
        self._fill_idle(*bucket)
        used = self._size(*bucket)
        self.dev[:used].copy_(self.host[:used])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Two eager runs per bucket (Triton JIT, library heuristics) then its capture, on one side
        stream, largest bucket first, all into the first graph's pool."""
        start = time.monotonic()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool, stream = None, torch.cuda.Stream(self.device)
        for bucket in sorted(self.buckets.all(), key=lambda k: (k[0] * k[1], k), reverse=True):
            self._load_idle(bucket)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(*bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(*bucket)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.monotonic() - start
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured %d %s graphs (buckets %s x %s) in %.1f s, %.0f MiB", len(self.graphs), self.what,
                 list(self.buckets.batches), list(self.buckets.nodes), self.capture_s, self.capture_bytes / 2**20,
                 extra={"graphs": len(self.graphs), "capture_s": round(self.capture_s, 2)})


    @torch.inference_mode()
    def _time_replays(self, reps: int = 2) -> dict[tuple[int, int], float]:
        """GPU ms of one replay of each bucket on idle rows: the budget policy's start-up cost table
        (live steps refresh it; idle rows hit fewer MoE experts than real ones)."""
        out = {}
        for bucket, graph in self.graphs.items():
            self._load_idle(bucket)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            out[bucket] = start.elapsed_time(end) / reps
        return out


class VerifyGraphs(BucketGraphs):
    """Bucketed verify over a TargetModel with an allocated cache."""

    what = "verify"

    def __init__(self, model, buckets: GraphBuckets, *, max_context: int, mode: str = "graph"):
        """Tensor parallel: build it on rank 0 only; the followers (follow_graphs) build theirs
        when it is announced, capture in step with rank 0 and replay rank 0's inputs."""
        self.model, self.buckets = model, buckets
        self._check_mode(mode, model.device)
        cache = model._need_cache()
        # the followers build the same runner before anything is captured
        model.announce_extension(GRAPHS_INIT, [_encode_init(buckets, max_context, mode)])
        self.cache, self.page_size = cache, cache.page_size
        self.scratch = cache.scratch_page
        self.width = -(-(max_context + max(buckets.nodes)) // self.page_size)  # block-table pages per request
        bmax, tmax = max(buckets.batches), max(buckets.nodes)
        self._init_buffers(model.device, self._size(bmax, tmax), mode)
        n, hidden = bmax * tmax, model.cfg.hidden_size
        self.posterior = torch.zeros(n, dtype=torch.int64, device=model.device)
        self.hidden = torch.zeros(n, hidden, dtype=model.dtype, device=model.device)
        fw = len(model.feature_layers) * hidden
        self.features = torch.zeros(n, fw, dtype=model.dtype, device=model.device) if fw else None
        self._masks = {t: self_only_mask(bmax, t) for t in buckets.nodes}
        self.replay_ms: dict[tuple[int, int], float] = {}
        if mode == "graph":
            self._capture_all()
            if not model.tp.enabled:  # tensor-parallel followers replay only what rank 0 announces
                self.replay_ms = self._time_replays()

    # ---- layout: one int64 buffer, each bucket's inputs packed from its start ---------------------
    def _shapes(self, b: int, t: int) -> list[tuple[int, ...]]:
        """tokens, positions, slots [b, t], prefix [b], block table [b, width], mask [b, t, words]."""
        return [(b, t), (b, t), (b, t), (b,), (b, self.width), (b, t, _words(t))]

    # ---- per step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, seq_ids, roots: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
               mask: torch.Tensor, *, return_logits: bool = False) -> StepOutput | None:
        """Like TargetModel.verify (greedy posterior), or None when no bucket fits (call it then).

        Host tensors in (the trees as built); posterior [B, N+1] and features [B, N+1, F] are views
        of static device buffers, valid until the next call.
        """
        seq_ids = unique_seq_ids(seq_ids)
        b, t = len(seq_ids), tokens.shape[1] + 1
        bucket = self.buckets.pick(b, t)
        cache = self.cache
        if bucket is None or any(-(-(cache.length(s) + t) // self.page_size) > self.width for s in seq_ids):
            self.fallbacks += 1
            return None
        self._fill(seq_ids, roots, tokens, depths, mask, *bucket)
        if self.model.tp.enabled:  # the followers replay the same bucket on rank 0's inputs
            meta = torch.tensor([*bucket, t, int(return_logits), *seq_ids], dtype=torch.int64)
            self.model.announce_extension(GRAPHS_RUN, [meta, self.host[:self._size(*bucket)]])
        self._run(bucket)
        bb, tt = bucket
        posterior = self.posterior[:bb * tt].view(bb, tt)[:b, :t]
        features = None if self.features is None else self.features[:bb * tt].view(bb, tt, -1)[:b, :t]
        logits = None
        if return_logits:
            logits = self.model.full_logits(self.hidden[:bb * tt]).view(bb, tt, -1)[:b, :t]
        return StepOutput(posterior, logits, features)

    def _fill(self, seq_ids, roots, tokens, depths, mask, bb: int, tt: int) -> None:
        """Writes the padded inputs of `bucket` into the pinned host buffer (checks them first)."""
        b, t = len(seq_ids), tokens.shape[1] + 1
        root = roots.reshape(-1).to(torch.int64).numpy()
        toks = tokens.to(torch.int64).numpy()
        deps = depths.to(torch.int64).numpy()
        words = mask.view(torch.int64).numpy() if mask.dtype == torch.uint64 else mask.to(torch.int64).numpy()
        if root.shape != (b,) or deps.shape != toks.shape or words.shape != (b, t, _words(t)):
            raise ValueError(f"expected root_tokens [{b}], tree_tokens/tree_depths [{b}, {t - 1}], mask "
                             f"[{b}, {t}, {_words(t)}]; got {tuple(roots.shape)}, {tuple(tokens.shape)}, "
                             f"{tuple(depths.shape)}, {tuple(mask.shape)}")
        vocab = self.model.cfg.vocab_size
        real = toks >= 0
        if (root < 0).any() or (root >= vocab).any() or (toks[real] >= vocab).any():
            raise ValueError(f"tree has token ids outside 0..{vocab - 1}")
        if (deps[real] < 1).any() or (deps[real] >= t).any():
            raise ValueError("tree_depths of real nodes must be in 1..N")
        self.cache.reserve(list(seq_ids), t)  # raises CacheFullError before anything is written
        tok_v, pos_v, slot_v, prefix_v, table_v, mask_v = self._split(self.host_np, bb, tt)
        ps, scratch = self.page_size, self.scratch
        lengths = np.zeros(bb, dtype=np.int64)
        table_v[:] = scratch
        for i, (length, pages) in enumerate(self.cache.lengths_and_pages(seq_ids)):
            lengths[i] = length
            table_v[i, :len(pages)] = pages
        prefix_v[:] = lengths
        tok_v[:] = 0
        tok_v[:b, 0] = root
        tok_v[:b, 1:t] = np.where(real, toks, 0)
        pos_v[:] = lengths[:, None]
        pos_v[:b, 1:t] += np.where(real, deps, 0)
        rows = lengths[:, None] + np.arange(tt)
        page_col = np.minimum(rows // ps, self.width - 1)
        slot_v[:] = table_v[np.arange(bb)[:, None], page_col] * ps + rows % ps
        slot_v[:, t:] = scratch * ps + np.arange(t, tt) % ps  # padding nodes write the scratch page
        slot_v[b:] = scratch * ps + np.arange(tt) % ps
        mask_v[:] = self._masks[tt][:bb]
        mask_v[:b, :t, :] = 0
        mask_v[:b, :t, :words.shape[2]] = words

    def _forward(self, b: int, t: int) -> None:
        tokens, positions, slots, prefix, table, mask = self._split(self.dev, b, t)
        x, feats = self.model.forward_tail(tokens, positions, slots, table, prefix, mask)
        n = b * t
        self.posterior[:n].copy_(self.model.argmax_head(x))
        self.hidden[:n].copy_(x)
        if self.features is not None:
            self.features[:n].copy_(feats.reshape(n, -1))

    def _fill_idle(self, bb: int, tt: int) -> None:
        empty = torch.empty(0, 0, dtype=torch.int64)
        self._fill([], torch.empty(0, dtype=torch.int64), empty, empty, torch.empty(0, 1, 1, dtype=torch.int64), bb, tt)
