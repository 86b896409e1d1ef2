"""The target model (ddtree.models.TargetModel) as the engine drives it, with position-keyed sampling.

Sampling at T > 0 uses the Gumbel-max trick with noise keyed by (request seed, absolute position):
the token at position p is argmax(log q(. | prefix) + G[seed, p]), q the target's distribution
after temperature / top-k / top-p. Every node of a tree at depth d uses the noise of its position,
so along the path the accept walk takes, each position's noise is used exactly once and is
independent of how the path was chosen (drafts never see the noise). Hence:
- lossless: each committed token is an exact sample of q given the committed prefix;
- reproducible: a seed gives the same output whatever the batch, the budget and the mode; the
  speculative output at T > 0 equals the ar output token for token (the tests check exactly that).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from ddtree.tree.structures import Trees
from ddtree.engine.runner import GraphBuckets, VerifyGraphs
from ddtree.kernels.dispatch import kernel_verify_supported
from ddtree.models.sampling import SamplingParams, target_probs

log = logging.getLogger(__name__)

_MIX = 0x9E3779B97F4A7C15


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int, device) -> torch.Tensor:
    """[len(positions), vocab] float32 Gumbel(0, 1) noise, a pure function of (seed, position)."""
    gen = torch.Generator(device=device)
    rows = []
    for p in positions:
        gen.manual_seed((seed * _MIX + int(p) + 1) % (1 << 63))
        u = torch.rand(vocab, generator=gen, device=device, dtype=torch.float32)
        rows.append(-torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7))))
    return torch.stack(rows) if rows else torch.empty(0, vocab, device=device)


def sample_at_positions(logits: torch.Tensor, params: SamplingParams, seed: int, positions: Sequence[int]) -> torch.Tensor:
    """logits [n, V] of the rows at `positions` -> tokens [n] int64 (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(-1)
    logq = torch.log(target_probs(logits.float(), params))  # zeros (cut by top-k/top-p) -> -inf
    return (logq + gumbel_noise(seed, positions, logits.shape[-1], logits.device)).argmax(-1)


class LocalTarget:
    """Implements ddtree.engine.engine.TargetRunner over a TargetModel with an allocated cache."""

    def __init__(self, model, *, name: str, max_context: int, graphs=None):
        self.model = model
        self.graphs = graphs  # ddtree.engine.runner.VerifyGraphs, or None: every verify eager
        self.device = model.device
        cfg = model.cfg
        self.name, self.model_type = name, cfg.model_type
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.max_context = max_context
        self.tp_size = model.tp.size if model.tp.enabled else 1
        self.feature_width = len(model.feature_layers) * cfg.hidden_size

    @classmethod
    def load(cls, path: str | Path, *, dtype: torch.dtype, device, num_pages: int, page_size: int,
             max_context: int | None = None, feature_layers: Sequence[int] = (), process_group=None,
             graph_buckets: GraphBuckets | None = None) -> "LocalTarget":
        """graph_buckets: capture CUDA graphs of the verify for these buckets (CUDA)."""
        from ddtree.models import sources

        model = sources.load_target(path, dtype=dtype, device=device, process_group=process_group,
                                    feature_layers=feature_layers)
        resident = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("target weights: %s dense linears, %s routed experts; %.2f GiB on this rank",
                 model.formats.dense, model.formats.experts, resident / 2**30)
        model.allocate_cache(num_pages, page_size)
        ctx = max_context or model.cfg.max_position_embeddings
        graphs = None
        if graph_buckets is not None and model.device.type == "cuda":  # followers: runner.follow_graphs
            cfg = model.cfg
            if kernel_verify_supported(model.dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim):
                graphs = VerifyGraphs(model, graph_buckets, max_context=ctx)
            else:  # capturing would fail mid-graph and leave the CUDA context unusable
                log.warning("verify attention at latent %d, rope %d (%s) has no GPU kernel: the torch reference "
                            "syncs, so the verify runs eager (no CUDA graphs)", cfg.kv_lora_rank,
                            cfg.qk_rope_head_dim, model.dtype)
        return cls(model, name=sources.name(path), max_context=ctx, graphs=graphs)

    # ---- TargetRunner ------------------------------------------------------------------------
    def prefill(self, seq_id, chunk, sampler, *, start, final):
        tokens = torch.tensor(chunk, dtype=torch.int64)
        if start == 0:
            self.model.add_sequence(seq_id)
        params, seed = sampler
        end = start + tokens.numel()  # the position of the token the final chunk samples
        if not final or params.greedy or tokens.numel() == 1:
            out = self.model.prefill(seq_id, tokens, return_logits=final and not params.greedy)
            first = None
            if final:
                first = int(out.posterior.view(-1)[0]) if params.greedy else \
                    int(sample_at_positions(out.logits[0, -1:], params, seed, [end])[0])
            return first, (out.features[0] if out.features is not None else None)
        # sampled: logits of the last prompt token only (a one-node verify), not of the whole chunk
        head = self.model.prefill(seq_id, tokens[:-1])
        last = self.model.verify([seq_id], tokens[-1:], torch.empty(1, 0, dtype=torch.int64),
                                 torch.empty(1, 0, dtype=torch.int64), torch.ones(1, 1, 1, dtype=torch.int64),
                                 return_logits=True)
        self.model.commit([seq_id], torch.zeros(1, 1, dtype=torch.int64))
        first = int(sample_at_positions(last.logits[0], params, seed, [end])[0])
        return first, (None if head.features is None else torch.cat([head.features[0], last.features[0]]))

    def verify(self, seq_ids, roots, trees: Trees, samplers):
        sampled = [not p.greedy for p, _ in samplers]
        out = None
        if self.graphs is not None:  # None when no bucket fits: eager
            out = self.graphs.verify(seq_ids, roots, trees.tokens, trees.depths, trees.mask, return_logits=any(sampled))
        if out is None:
            out = self.model.verify(seq_ids, roots, trees.tokens, trees.depths, trees.mask, return_logits=any(sampled))
        posterior = out.posterior.cpu().clone()
        if any(sampled):
            lengths = [self.model.cache.length(s) for s in seq_ids]
            for b, (params, seed) in enumerate(samplers):
                if sampled[b]:
                    t = int(trees.num_nodes[b]) + 1
                    depth = torch.cat([torch.zeros(1, dtype=torch.int64), trees.depths[b, :t - 1].to(torch.int64)])
                    positions = (lengths[b] + 1 + depth).tolist()  # node at depth d predicts position len+d+1
                    posterior[b, :t] = sample_at_positions(out.logits[b, :t], params, seed, positions).cpu()
        return posterior, out.features

    def commit(self, seq_ids, keep):
        self.model.commit(seq_ids, keep)

    def release(self, seq_id):
        self.model.release(seq_id)
