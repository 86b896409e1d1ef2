"""TargetModel: DeepSeek-V3 / Kimi-K2 (MLA + MoE) for tree speculative decoding.

Paths: `logits` (plain causal forward, expanded MLA, no cache: the contract and the test oracle);
`prefill` and `verify` (absorbed MLA over the paged latent cache: a chain or a tree tail written
after each sequence's committed tokens); `commit` (keep the accepted tail rows).

Tensor parallel: every public method is collective. Rank 0 drives: it validates the inputs, then
broadcasts the call (see parallel.broadcast_call) and runs it; ranks > 0 sit in `follow()` and
replay each call, so all ranks run the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import TargetConfig
from .kv_cache import LatentKVCache
from .layers import MLA, MLP, DecoderLayer, MoE, RMSNorm, _weight
from .mla_attention import causal_bitmask
from .parallel import TensorParallel, broadcast_call, receive_call
from .qlinear import BF16, WeightFormats
from .rope import RotaryEmbedding
from .sampling import GREEDY, SamplingParams, sample_tokens

_OPS = ("stop", "logits", "allocate_cache", "add_sequence", "release", "prefill", "verify", "commit", "extension")


@dataclass(frozen=True)
class StepOutput:
    """posterior [B, T] int64: the target's token at each row (argmax or sample); only rank 0's is meaningful.

    logits [B, T, vocab] float32 when asked; features [B, T, len(feature_layers) * hidden] (hidden
    states after each feature layer, concatenated, as transformers' hidden_states[layer + 1]: the
    last layer's is the final-normed output) when the model has feature layers.
    """

    posterior: torch.Tensor
    logits: torch.Tensor | None = None
    features: torch.Tensor | None = None

    def kept_features(self, keep: torch.Tensor) -> list[torch.Tensor]:
        """Features of the kept rows per request (keep [B, K], -1 padding): the drafter's next context."""
        if self.features is None:
            raise ValueError("the model was built without feature_layers")
        keep = keep.to(self.features.device, torch.int64)
        return [self.features[b, row[row >= 0]] for b, row in enumerate(keep)]


class TargetModel(nn.Module):
    """The target on one tensor-parallel rank. Build it with `from_pretrained` (the constructor
    leaves weights uninitialized); `allocate_cache` before prefill/verify/commit."""

    def __init__(self, cfg: TargetConfig, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 tp: TensorParallel | None = None, feature_layers: Sequence[int] = (),
                 formats: WeightFormats = BF16):
        super().__init__()
        self.cfg, self.dtype, self.device, self.formats = cfg, dtype, torch.device(device), formats
        self.tp = tp or TensorParallel()
        bad = [i for i in feature_layers if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"feature layer ids {bad} outside 0..{cfg.num_hidden_layers - 1}")
        self.feature_layers = tuple(feature_layers)
        vocab = self.tp.shard(cfg.vocab_size, "vocab_size")
        self.vocab_start, self.vocab_local = vocab.start, vocab.stop - vocab.start
        self.embed_tokens = _weight(self.vocab_local, cfg.hidden_size, dtype=dtype, device=self.device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.tp, dtype, self.device, formats)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, self.device)
        self.lm_head = (
            self.embed_tokens if cfg.tie_word_embeddings
            else _weight(self.vocab_local, cfg.hidden_size, dtype=dtype, device=self.device)
        )
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave).to(self.device)
        self.cache: LatentKVCache | None = None
        self._following = False
        self._extensions: dict[str, Callable[[list[torch.Tensor]], None]] = {}

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
                        tp: TensorParallel | None = None, process_group=None,
                        feature_layers: Sequence[int] = ()) -> "TargetModel":
        """Builds the model and streams the checkpoint into it tensor by tensor, each rank keeping its shard.

        FP8 and INT4 weights stay in their format (see `weight_formats`); plain ones are cast to
        `dtype`. Tensor parallel: pass `tp`, or `process_group` (an initialized torch.distributed
        group). Raises CheckpointError naming missing/unexpected/mis-shaped tensors, formats the
        model cannot keep, and shards that would split a quantization block.
        """
        from .checkpoint import CheckpointError, CheckpointIndex, check_names

        if tp is None and process_group is not None:
            tp = TensorParallel.from_process_group(process_group)
        cfg = TargetConfig.from_pretrained(path)
        mtp = tuple(f"model.layers.{cfg.num_hidden_layers + i}." for i in range(cfg.num_nextn_predict_layers))
        index = CheckpointIndex(path, cfg.weight_prefix, cfg.ignored_prefixes + mtp)
        formats = weight_formats(index)
        try:
            model = cls(cfg, dtype=dtype, device=device, tp=tp, feature_layers=feature_layers, formats=formats)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {index.root}: {e}") from None
        specs = model.weight_specs()
        check_names({name: spec[0] for name, spec in specs.items() if spec[0] is not None}, index)
        wanted = [name for name, spec in specs.items() if spec[1] is not None]
        router = [n for n in wanted if n.endswith((".mlp.gate.weight", ".e_score_correction_bias"))]
        other = [n for n in wanted if n not in set(router)]
        keep = {n for n in other if index.format(n) != "plain" and _quantized_role(n) is not None}
        with torch.no_grad():
            for names, load_dtype in ((router, torch.float32), (other, dtype)):
                for name, tensor in index.iter_tensors(load_dtype, names, device, keep_quantized=keep):
                    try:
                        specs[name][1](tensor)
                    except ValueError as e:
                        raise CheckpointError(f"{name}: {e}") from None
        return model.eval()

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], None] | None]]:
        """HF name -> (full logical shape, loader that copies this rank's slice; None = not on this rank)."""
        cfg, tp = self.cfg, self.tp
        specs: dict = {}

        def whole(dst):
            return lambda t: dst.copy_(t)

        def rows(dst, sl):
            return lambda t: dst.copy_(t[sl])

        def linear(dst, **where):  # a Linear / QuantWeight: copies (or keeps quantized) its shard
            return lambda t: dst.load(t, **where)

        def heads(per_head: int) -> slice:
            sl = tp.shard(cfg.num_attention_heads, "num_attention_heads")
            return slice(sl.start * per_head, sl.stop * per_head)

        vocab = slice(self.vocab_start, self.vocab_start + self.vocab_local)
        specs["model.embed_tokens.weight"] = ((cfg.vocab_size, cfg.hidden_size), rows(self.embed_tokens, vocab))
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), rows(self.lm_head, vocab))
        specs["model.norm.weight"] = ((cfg.hidden_size,), whole(self.norm.weight))
        h = cfg.hidden_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            specs[p + "input_layernorm.weight"] = ((h,), whole(layer.input_layernorm.weight))
            specs[p + "post_attention_layernorm.weight"] = ((h,), whole(layer.post_attention_layernorm.weight))
            a: MLA = layer.self_attn
            n_heads, qk = cfg.num_attention_heads, cfg.qk_head_dim
            if cfg.q_lora_rank is None:
                specs[p + "self_attn.q_proj.weight"] = ((n_heads * qk, h), linear(a.q_proj, rows=heads(qk)))
            else:
                r = cfg.q_lora_rank
                specs[p + "self_attn.q_a_proj.weight"] = ((r, h), linear(a.q_a_proj))
                specs[p + "self_attn.q_a_layernorm.weight"] = ((r,), whole(a.q_a_layernorm.weight))
                specs[p + "self_attn.q_b_proj.weight"] = ((n_heads * qk, r), linear(a.q_b_proj, rows=heads(qk)))
            specs[p + "self_attn.kv_a_proj_with_mqa.weight"] = ((cfg.latent_dim, h), linear(a.kv_a_proj_with_mqa))
            specs[p + "self_attn.kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), whole(a.kv_a_layernorm.weight))
            kvb = cfg.qk_nope_head_dim + cfg.v_head_dim
            specs[p + "self_attn.kv_b_proj.weight"] = ((n_heads * kvb, cfg.kv_lora_rank), rows(a.kv_b_proj, heads(kvb)))
            specs[p + "self_attn.o_proj.weight"] = ((h, n_heads * cfg.v_head_dim), linear(a.o_proj, cols=heads(cfg.v_head_dim)))
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                e, i_moe = cfg.n_routed_experts, cfg.moe_intermediate_size
                specs[p + "mlp.gate.weight"] = ((e, h), whole(mlp.gate))
                specs[p + "mlp.gate.e_score_correction_bias"] = ((e,), whole(mlp.e_score_correction_bias))
                for x in range(e):
                    local = x - mlp.first_expert
                    mine = 0 <= local < mlp.num_local
                    ep = f"{p}mlp.experts.{x}."
                    specs[ep + "gate_proj.weight"] = ((i_moe, h), linear(mlp.w13, expert=local, part=0) if mine else None)
                    specs[ep + "up_proj.weight"] = ((i_moe, h), linear(mlp.w13, expert=local, part=1) if mine else None)
                    specs[ep + "down_proj.weight"] = ((h, i_moe), linear(mlp.w2, expert=local) if mine else None)
                if mlp.shared is not None:
                    self._mlp_specs(specs, p + "mlp.shared_experts.", mlp.shared, i_moe * cfg.n_shared_experts)
            else:
                self._mlp_specs(specs, p + "mlp.", mlp, cfg.intermediate_size)
        return specs

    def _mlp_specs(self, specs: dict, p: str, mlp: MLP, intermediate: int) -> None:
        sl, h = self.tp.shard(intermediate, "intermediate size"), self.cfg.hidden_size
        specs[p + "gate_proj.weight"] = ((intermediate, h), lambda t: mlp.gate_up.load(t, part=0, rows=sl))
        specs[p + "up_proj.weight"] = ((intermediate, h), lambda t: mlp.gate_up.load(t, part=1, rows=sl))
        specs[p + "down_proj.weight"] = ((h, intermediate), lambda t: mlp.down.load(t, cols=sl))

    # ---- shared pieces ------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids it owns, zeros elsewhere, then all-reduce.
        A shard without collectives (`TensorParallel.communicate` False: a one-rank stand-in) looks
        every id up in its own rows, id modulo the shard, in place of the all-reduce's result."""
        local = ids - self.vocab_start
        if not self.tp.enabled:
            return F.embedding(local.remainder(self.vocab_local), self.embed_tokens)
        owned = (local >= 0) & (local < self.vocab_local)
        x = F.embedding(local.clamp(0, self.vocab_local - 1), self.embed_tokens)
        return self.tp.all_reduce(x * owned.unsqueeze(-1).to(x.dtype))

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"{what} has token ids outside 0..{self.cfg.vocab_size - 1}")

    def _announce(self, op: str, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """Rank 0 tells the followers which call comes next; a rank > 0 must be inside follow().
        `tensors` makes the call's arguments, only where there are followers: without tensor
        parallelism a call builds no device tensor for them (each one a host-to-device copy)."""
        if not self.tp.enabled:
            return
        if self.tp.rank != 0:
            if not self._following:
                raise RuntimeError("ranks > 0 do not drive the model; run follow() there")
            return
        broadcast_call(self.tp, _OPS.index(op), tensors(), self.device)

    # ---- plain causal forward -----------------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [1, S] -> logits [1, S, vocab] (model dtype); causal, no cache."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, S]; got {tuple(input_ids.shape)}")
        input_ids = input_ids.to(self.device, torch.int64)
        self._check_ids(input_ids, "input_ids")
        self._announce("logits", lambda: [input_ids])
        return self._logits(input_ids)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0]
        cos, sin = self.rotary.cos_sin(torch.arange(ids.shape[0], device=self.device), self.dtype)
        x = self._embed(ids)
        for layer in self.layers:
            x = layer(x, lambda h, a=layer.self_attn: a.forward_causal(h, cos, sin, self.rotary))
        local = F.linear(self.norm(x), self.lm_head)
        return self.tp.all_gather_last(local).unsqueeze(0)

    # ---- the paged cache ----------------------------------------------------------------
    def allocate_cache(self, num_pages: int, page_size: int = 64) -> LatentKVCache:
        self._announce("allocate_cache", lambda: [torch.tensor([num_pages, page_size], device=self.device)])
        self.cache = LatentKVCache(self.cfg.num_hidden_layers, self.cfg.latent_dim, num_pages, page_size,
                                   self.dtype, self.device)
        return self.cache

    def _need_cache(self) -> LatentKVCache:
        if self.cache is None:
            raise ValueError("no KV cache; call allocate_cache() first")
        return self.cache

    def add_sequence(self, seq_id: int) -> None:
        if self._need_cache().has(seq_id):
            raise ValueError(f"sequence {seq_id} already exists")
        self._announce("add_sequence", lambda: [torch.tensor([seq_id], device=self.device)])
        self.cache.add_sequence(seq_id)

    def release(self, seq_id: int) -> None:
        self._need_cache()._seq(seq_id)
        self._announce("release", lambda: [torch.tensor([seq_id], device=self.device)])
        self.cache.release(seq_id)

    # ---- prefill / verify / commit ------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq_id: int, tokens: torch.Tensor, *, sampling: SamplingParams = GREEDY,
                generator: torch.Generator | None = None, chunk_size: int = 2048,
                return_logits: bool = False) -> StepOutput:
        """Appends tokens [S] to a sequence (causal), committing them; chunked to bound memory.

        Returns the target's token after the last one (posterior [1, 1]), and features
        [1, S, F*H] / logits [1, S, V] for all S tokens.
        """
        cache = self._need_cache()
        tokens = tokens.reshape(-1).to(self.device, torch.int64)
        if tokens.numel() == 0:
            raise ValueError("prefill needs at least one token")
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self._check_ids(tokens, "tokens")
        cache.reserve([seq_id], tokens.numel())  # raises (before any broadcast) if it cannot fit
        # what the head computes (all ranks must agree): 0 argmax of the last row, 1 full logits of
        # the last row (to sample), 2 full logits of every row (asked for)
        head = 2 if return_logits else int(not sampling.greedy)
        self._announce("prefill", lambda: [torch.tensor([seq_id, chunk_size, head], device=self.device), tokens])
        return self._prefill(seq_id, tokens, chunk_size, head, sampling, generator)

    def _prefill(self, seq_id, tokens, chunk_size, head, sampling=GREEDY, generator=None):
        outs = []
        for start in range(0, tokens.numel(), chunk_size):
            chunk = tokens[start : start + chunk_size]
            n = chunk.numel()
            prefix = self.cache.length(seq_id)
            positions = (prefix + torch.arange(n, device=self.device))[None]
            x, feats = self._forward_paged([seq_id], chunk[None], positions, causal_bitmask(n, self.device))
            self.cache.advance(seq_id, n)
            outs.append((x, feats))
        x = torch.cat([o[0] for o in outs])
        feats = None if outs[0][1] is None else torch.cat([o[1] for o in outs], dim=1)
        logits = None
        if head == 0:
            token = self.argmax_head(x[-1:])
        else:
            rows = self.full_logits(x if head == 2 else x[-1:])
            token = sample_tokens(rows[-1:], sampling, generator)
            logits = rows.unsqueeze(0) if head == 2 else None
        return StepOutput(token.view(1, 1), logits, feats)

    @torch.inference_mode()
    def verify(self, seq_ids: Sequence[int], root_tokens: torch.Tensor, tree_tokens: torch.Tensor,
               tree_depths: torch.Tensor, mask: torch.Tensor, *,
               sampling: Sequence[SamplingParams] | None = None,
               generators: Sequence[torch.Generator | None] | None = None,
               return_logits: bool = False) -> StepOutput:
        """Scores a batch of trees in one forward pass.

        Per request b (tree format of treebuild.proto): root_tokens [B] (node 0, the previous bonus
        token), tree_tokens [B, N] (nodes 1..N, -1 padding), tree_depths [B, N], mask
        [B, N+1, ceil((N+1)/64)] uint64 ancestor bitmask. Node i sits at position
        length_b + depth_i and its latent is written to cache row length_b + i (uncommitted
        until `commit`). Returns posterior [B, N+1]: argmax, or a sample per node drawn with
        generators[b] under sampling[b]; logits [B, N+1, V] if asked.
        """
        cache = self._need_cache()
        seq_ids = unique_seq_ids(seq_ids)
        b = len(seq_ids)
        tokens = self._tree_inputs(b, root_tokens, tree_tokens, tree_depths, mask)
        sampling = list(sampling) if sampling is not None else [GREEDY] * b
        generators = list(generators) if generators is not None else [None] * b
        if len(sampling) != b or len(generators) != b:
            raise ValueError(f"sampling and generators need one entry per request ({b})")
        t = tokens[0].shape[1]
        cache.reserve(seq_ids, t)
        need_full = return_logits or any(not s.greedy for s in sampling)
        self._announce("verify", lambda: [torch.tensor(seq_ids + [int(need_full)], device=self.device), *tokens])
        return self._verify(seq_ids, *tokens, need_full, sampling, generators, return_logits)

    def _tree_inputs(self, b, root_tokens, tree_tokens, tree_depths, mask):
        root = root_tokens.reshape(-1).to(self.device, torch.int64)
        toks = tree_tokens.to(self.device, torch.int64)
        depths = tree_depths.to(self.device, torch.int64)
        if root.shape != (b,) or toks.dim() != 2 or toks.shape[0] != b or depths.shape != toks.shape:
            raise ValueError(f"expected root_tokens [{b}], tree_tokens/tree_depths [{b}, N]; got "
                             f"{tuple(root_tokens.shape)}, {tuple(tree_tokens.shape)}, {tuple(tree_depths.shape)}")
        t = toks.shape[1] + 1
        if tuple(mask.shape) != (b, t, (t + 63) // 64):
            raise ValueError(f"mask must be [{b}, {t}, {(t + 63) // 64}]; got {tuple(mask.shape)}")
        if mask.dtype not in (torch.uint64, torch.int64):
            raise ValueError(f"mask must be uint64 (or int64 with the same bits); got {mask.dtype}")
        self._check_ids(root, "root_tokens")
        real = toks >= 0
        self._check_ids(toks[real], "tree_tokens")
        if (depths[real] < 1).any() or (depths[real] >= t).any():
            raise ValueError("tree_depths of real nodes must be in 1..N")
        tokens = torch.cat([root[:, None], toks.clamp_min(0)], dim=1)
        depths = torch.cat([torch.zeros_like(root)[:, None], depths.clamp_min(0)], dim=1)
        return tokens, depths, mask.view(torch.int64).to(self.device)  # int64 view: uint64 has few kernels

    def _verify(self, seq_ids, tokens, depths, mask, need_full, sampling=None, generators=None, return_logits=False):
        b, t = tokens.shape
        self.cache.reserve(seq_ids, t)
        prefix = torch.tensor([self.cache.length(s) for s in seq_ids], device=self.device)
        x, feats = self._forward_paged(seq_ids, tokens, prefix[:, None] + depths, mask)
        posterior = self.argmax_head(x).view(b, t)
        logits = None
        if need_full:
            logits = self.full_logits(x).view(b, t, -1)
            if self.tp.rank == 0:
                for i in range(b):
                    if not sampling[i].greedy:
                        posterior[i] = sample_tokens(logits[i], sampling[i], generators[i])
        return StepOutput(posterior, logits if return_logits else None, feats)

    def commit(self, seq_ids: Sequence[int], keep: torch.Tensor) -> list[int]:
        """Keeps tail rows keep[b] (tree node indices, in order, -1 padding) of the last verify.

        Moves their latents to follow the committed tokens in every layer, frees the rest.
        Returns the new committed lengths.
        """
        self._need_cache()
        seq_ids = unique_seq_ids(seq_ids)
        keep = keep.to("cpu", torch.int64)  # the cache computes slots on the host: no device round trip
        if keep.dim() != 2 or keep.shape[0] != len(seq_ids):
            raise ValueError(f"keep must be [{len(seq_ids)}, K]; got {tuple(keep.shape)}")
        self._announce("commit", lambda: [torch.tensor(seq_ids, device=self.device), keep.to(self.device)])
        return self.cache.commit(seq_ids, keep)

    def _forward_paged(self, seq_ids, tokens, positions, mask):
        """tokens/positions [B, T]; tail rows written at length_b + i. -> normed hidden [B*T, H], features."""
        cache = self.cache
        b, t = tokens.shape
        lengths = torch.tensor([cache.length(s) for s in seq_ids])
        slots = cache.slots(seq_ids, lengths[:, None] + torch.arange(t))  # host positions: no device read
        return self.forward_tail(tokens, positions, slots, cache.block_table(seq_ids), lengths.to(self.device), mask)

    def forward_tail(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     block_table: torch.Tensor, prefix_lens: torch.Tensor, mask: torch.Tensor):
        """The paged forward on device tensors alone (no host reads: CUDA-graph capturable).

        tokens/positions/slots [B, T] (slots: flat cache rows the tail latents are written to),
        block_table [B, pages], prefix_lens [B] (cache rows before the tail), mask [B, T, words].
        -> normed hidden [B*T, H], features [B, T, F] (None without feature layers).
        """
        b, t = tokens.shape
        cos, sin = self.rotary.cos_sin(positions.reshape(-1), self.dtype)
        x = self._embed(tokens.reshape(-1))
        feats = []
        for i, layer in enumerate(self.layers):
            x = layer(x, lambda h, a=layer.self_attn, i=i: a.forward_paged(
                h, cos, sin, self.rotary, self.cache, i, slots, block_table, prefix_lens, mask))
            if i in self.feature_layers and i < len(self.layers) - 1:
                feats.append(x)
        x = self.norm(x)
        features = None
        if self.feature_layers:
            # like transformers' hidden_states: the last layer's entry is the normed output
            by_id = dict(zip(sorted(set(self.feature_layers) - {len(self.layers) - 1}), feats))
            by_id[len(self.layers) - 1] = x
            features = torch.cat([by_id[i] for i in self.feature_layers], dim=-1).view(b, t, -1)
        return x, features

    def argmax_head(self, x: torch.Tensor) -> torch.Tensor:
        """normed hidden [S, H] -> the target's greedy token per row [S] (vocab-parallel argmax)."""
        return self.tp.argmax_over_vocab(F.linear(x, self.lm_head), self.vocab_start)

    def full_logits(self, x: torch.Tensor) -> torch.Tensor:
        """normed hidden [S, H] -> float32 logits [S, vocab] (gathered over the vocab shards)."""
        return self.tp.all_gather_last(F.linear(x, self.lm_head).float())

    # ---- extensions: collective calls of code built on the model (e.g. a graph runner) ---------
    def register_extension(self, name: str, handler: Callable[[list[torch.Tensor]], None]) -> None:
        """Ranks > 0, before follow(): `handler(tensors)` runs when rank 0 calls
        announce_extension(name, tensors), in the same order as every other call."""
        self._extensions[name] = handler

    def announce_extension(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Rank 0: the followers run their handler of `name` with these tensors (int64 name codes
        travel first); a no-op without tensor parallelism or on a following rank."""
        self._announce("extension", lambda: [torch.tensor(list(name.encode()), dtype=torch.int64, device=self.device),
                                             *tensors])

    # ---- followers ----------------------------------------------------------------------
    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: replay rank 0's calls until it calls stop_followers()."""
        if not self.tp.enabled or self.tp.rank == 0:
            raise RuntimeError("follow() is for tensor-parallel ranks > 0")
        self._following = True
        try:
            while True:
                op, args = receive_call(self.tp, self.device)
                name = _OPS[op]
                if name == "stop":
                    return
                if name == "logits":
                    self._logits(args[0])
                elif name == "allocate_cache":
                    self.allocate_cache(int(args[0][0]), int(args[0][1]))
                elif name == "add_sequence":
                    self.cache.add_sequence(int(args[0][0]))
                elif name == "release":
                    self.cache.release(int(args[0][0]))
                elif name == "prefill":
                    seq_id, chunk, head = (int(v) for v in args[0])
                    self.cache.reserve([seq_id], args[1].numel())
                    self._prefill(seq_id, args[1], chunk, head)
                elif name == "verify":
                    ids = args[0].tolist()
                    self._verify(ids[:-1], args[1], args[2], args[3], bool(ids[-1]))
                elif name == "commit":
                    self.cache.commit(args[0].tolist(), args[1])
                elif name == "extension":
                    ext = bytes(args[0].tolist()).decode()
                    if ext not in self._extensions:
                        raise RuntimeError(f"rank {self.tp.rank}: no handler registered for extension {ext!r}")
                    self._extensions[ext](args[1:])
        finally:
            self._following = False

    def stop_followers(self) -> None:
        """Rank 0: releases the ranks blocked in follow()."""
        self._announce("stop", lambda: [])


def _quantized_role(name: str) -> str | None:
    """Which WeightFormats role keeps a checkpoint weight quantized: "experts" for the routed
    experts, "dense" for the other projections; None for the rest (kv_b_proj, embeddings, the
    vocab head and router, dequantized if a checkpoint quantizes them)."""
    if not name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or name.endswith("kv_b_proj.weight"):
        return None
    return "experts" if ".mlp.experts." in name else "dense"


def weight_formats(index) -> WeightFormats:
    """The storage a checkpoint's weights keep (`CheckpointIndex`): one format per role, or
    CheckpointError naming the weights that differ from the rest of their role."""
    from .checkpoint import CheckpointError

    by_role: dict[str, dict[str, list[str]]] = {"dense": {}, "experts": {}}
    for name in index.names():
        role = _quantized_role(name)
        if role is not None:
            fmt = {"plain": "bf16"}.get(index.format(name), index.format(name))
            by_role[role].setdefault(fmt, []).append(name)
    chosen = {}
    for role, groups in by_role.items():
        if len(groups) > 1:
            listing = "; ".join(f"{fmt}: {len(n)} ({', '.join(n[:3])}{', ...' if len(n) > 3 else ''})"
                                for fmt, n in sorted(groups.items()))
            raise CheckpointError(f"checkpoint {index.root}: the {role} weights must share one format, found {listing}")
        chosen[role] = next(iter(groups), "bf16")
    return WeightFormats(chosen["dense"], chosen["experts"], fp8_block=index.quant.fp8_block,
                         int4_group=index.quant.int4_group_size or WeightFormats.int4_group)


def unique_seq_ids(seq_ids: Sequence[int]) -> list[int]:
    ids = [int(s) for s in seq_ids]
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids must be non-empty and distinct; got {ids}")
    return ids
