"""DeepSeek-V3 building blocks with tensor-parallel shards: RMSNorm, MLA, dense MLP, MoE.

Every block returns its rank's partial output; the decoder layer all-reduces once after
attention and once after the MLP/MoE (the only per-layer communication).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TargetConfig
from .glue import glue_for
from .kv_cache import LatentKVCache
from .mla_attention import mla_verify_attention
from .parallel import TensorParallel
from .qlinear import BF16, Linear, QuantWeight, WeightFormats
from .rope import RotaryEmbedding


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.weight = _weight(dim, dtype=dtype, device=device)
        self.eps = eps
        self.glue = glue_for(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.glue.rms_norm(x, self.weight, self.eps)


class MLA(nn.Module):
    """Multi-head latent attention; this rank owns heads [tp.shard(num_attention_heads)].

    The projections are stored in `formats.dense`, except kv_b_proj: the absorbed form slices it
    per head into W_UK / W_UV, so it stays in the model dtype (1/64 of a Kimi-K2 layer's weights).
    """

    def __init__(self, cfg: TargetConfig, tp: TensorParallel, dtype, device, formats: WeightFormats = BF16):
        super().__init__()
        self.cfg = cfg
        sl = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.heads = sl.stop - sl.start
        fmt = formats.dense
        lin = lambda o, i: Linear(o, i, fmt=fmt, dtype=dtype, device=device, block=formats.block(fmt),  # noqa: E731
                                  group=formats.int4_group)
        if cfg.q_lora_rank is None:
            self.q_proj = lin(self.heads * cfg.qk_head_dim, cfg.hidden_size)
        else:
            self.q_a_proj = lin(cfg.q_lora_rank, cfg.hidden_size)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, device)
            self.q_b_proj = lin(self.heads * cfg.qk_head_dim, cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = lin(cfg.latent_dim, cfg.hidden_size)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, device)
        self.kv_b_proj = _weight(self.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                                 dtype=dtype, device=device)
        self.o_proj = lin(cfg.hidden_size, self.heads * cfg.v_head_dim)
        self.glue = glue_for(device)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: RotaryEmbedding):
        """x [S, H] -> q_nope [S, h, nope], q_rope [S, h, R] (roped), latent [S, C + R] (normed, roped)."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        norm = self.kv_a_layernorm
        return self.glue.mla_rope_latent(q, self.kv_a_proj_with_mqa(x), cos, sin, norm.weight, norm.eps, self.heads,
                                         cfg.qk_nope_head_dim, rotary.interleave)

    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, C] and W_UV [h, v, C] (views of kv_b_proj)."""
        cfg = self.cfg
        w = self.kv_b_proj.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def forward_causal(self, x, cos, sin, rotary) -> torch.Tensor:
        """Expanded form (K/V per head from the latent), causal over x alone; no cache."""
        cfg = self.cfg
        q_nope, q_rope, latent = self._project(x, cos, sin, rotary)
        c_kv, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = F.linear(c_kv, self.kv_b_proj).view(x.shape[0], self.heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [h, S, d]
        k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1).transpose(0, 1)
        scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * cfg.softmax_scale
        s = x.shape[0]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).to(x.dtype)
        out = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1).reshape(s, -1)
        return self.o_proj(out)

    def forward_paged(self, x, cos, sin, rotary, cache: LatentKVCache, layer: int, slots, block_table,
                      prefix_lens, mask) -> torch.Tensor:
        """Absorbed form: writes the tail latents into the cache, attends in latent space.

        x [B*T, H]; slots [B, T] cache slots of the tail rows; mask [B, T, words].
        """
        q_nope, q_rope, latent = self._project(x, cos, sin, rotary)
        cache.write(layer, slots, latent)
        w_uk, w_uv = self._w_kv()
        q_latent = torch.einsum("shd,hdc->shc", q_nope, w_uk)
        out_latent, _ = mla_verify_attention(
            q_latent, q_rope, cache.layer(layer), block_table, prefix_lens, mask, self.cfg.softmax_scale
        )
        out = torch.einsum("shc,hvc->shv", out_latent, w_uv).reshape(x.shape[0], -1)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU; this rank owns intermediate columns [tp.shard(intermediate)] (gate|up fused)."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel, dtype, device, formats: WeightFormats = BF16):
        super().__init__()
        sl = tp.shard(intermediate, "intermediate size")
        self.local = sl.stop - sl.start
        fmt = formats.dense
        kw = dict(fmt=fmt, dtype=dtype, device=device, block=formats.block(fmt), group=formats.int4_group)
        self.gate_up = Linear(2 * self.local, hidden, gate_up=True, **kw)
        self.down = Linear(hidden, self.local, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up.silu_mul(x))


class MoE(nn.Module):
    """Sigmoid-scored, group-limited top-k routing (noaux_tc) over routed experts, plus shared experts.

    The router is replicated (float32, as transformers keeps it); this rank computes only its
    experts [tp.shard(n_routed_experts)] (stored in `formats.experts`: w13 = [gate; up] [E, 2I, H],
    w2 [E, H, I]) and a shard of the shared experts. How the routed experts run is chosen once,
    here: `routed_int4_mma` (INT4 on CUDA in bf16 where kernels.int4_moe takes the shapes: the CUDA
    tensor-core kernel), `routed_fused` (FP8, and INT4 otherwise, on CUDA: Triton), `routed_grouped`
    (bf16 on sm90+), else `routed_loop`.
    """

    def __init__(self, cfg: TargetConfig, tp: TensorParallel, dtype, device, formats: WeightFormats = BF16):
        super().__init__()
        self.cfg = cfg
        e = tp.shard(cfg.n_routed_experts, "n_routed_experts")
        self.first_expert, self.num_local = e.start, e.stop - e.start
        self.gate = _weight(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, device=device)
        self.e_score_correction_bias = _weight(cfg.n_routed_experts, dtype=torch.float32, device=device)
        i, h, fmt = cfg.moe_intermediate_size, cfg.hidden_size, formats.experts
        cuda = torch.device(device).type == "cuda"
        mma = False
        if fmt == "int4" and cuda and dtype == torch.bfloat16:
            from ddtree.kernels.int4_moe import int4_mma_supported  # Triton: only where a GPU runs it

            mma = int4_mma_supported(h, i, formats.int4_group)
        kw = dict(fmt=fmt, dtype=dtype, device=device, stack=self.num_local, block=formats.block(fmt),
                  group=formats.int4_group, int4_layout="mma" if mma else None)
        self.w13 = QuantWeight((i, i), h, **kw)
        self.w2 = QuantWeight((h,), i, **kw)
        self.shared = (
            MLP(h, i * cfg.n_shared_experts, tp, dtype, device, formats) if cfg.n_shared_experts else None
        )
        self.glue = glue_for(device)
        self._fused_moe = None
        if mma:  # INT4 experts on the CUDA tensor-core kernel
            from ddtree.kernels.int4_moe import fused_moe_int4

            self._fused_moe = fused_moe_int4
            self.routed = self.routed_int4_mma
        elif fmt != "bf16" and cuda:
            from ddtree.kernels.quant_gemm import fused_moe  # Triton: only where a GPU runs it

            self._fused_moe = fused_moe
            self.routed = self.routed_fused
        elif fmt == "bf16" and grouped_mm_available(torch.empty(0, dtype=dtype, device=device)):
            self.routed = self.routed_grouped
        else:
            self.routed = self.routed_loop

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, H] -> (weights [S, k] float32, expert ids [S, k])."""
        cfg = self.cfg
        return self.glue.route_noaux_tc(x, self.gate, self.e_score_correction_bias, cfg.n_group, cfg.topk_group,
                                        cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.routed(x, weights, ids)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's routed experts, one GEMM pair per expert hit (reads the counts on the host;
        quantized experts are dequantized a tile at a time: the CPU reference)."""
        k = ids.shape[1]
        flat = ids.reshape(-1) - self.first_expert
        mine = ((flat >= 0) & (flat < self.num_local)).nonzero().squeeze(-1)
        mine = mine[flat[mine].argsort(stable=True)]  # grouped by expert, token order inside
        tokens, token_weights = mine // k, weights.reshape(-1)[mine]
        xs, out, start = x[tokens], torch.empty(mine.shape[0], x.shape[1], dtype=x.dtype, device=x.device), 0
        for expert, n in enumerate(torch.bincount(flat[mine], minlength=self.num_local).tolist()):
            if n:
                gate, up = self.w13.reference_linear(xs[start : start + n], expert).chunk(2, dim=-1)
                out[start : start + n] = self.w2.reference_linear(F.silu(gate) * up, expert)
                start += n
        return torch.zeros_like(x).index_add_(0, tokens, (out * token_weights[:, None]).to(x.dtype))

    def routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same as two grouped GEMMs (CUDA bf16, sm90+) on fixed-size buffers: all S*k
        (token, expert) pairs sorted by local expert, pairs of other ranks' experts in a last
        group the GEMMs skip; counts and offsets stay on the device (no host sync: capturable)."""
        k = ids.shape[1]
        flat = ids.reshape(-1) - self.first_expert
        local = (flat >= 0) & (flat < self.num_local)
        key = torch.where(local, flat, self.num_local)
        order = key.argsort(stable=True)  # grouped by expert, token order inside
        counts = torch.zeros(self.num_local + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, key, torch.ones_like(key, dtype=torch.int32))
        offs = counts[:-1].cumsum(0).to(torch.int32)
        tokens, mine = order // k, local[order]  # pair i belongs to token i // k
        gate, up = torch._grouped_mm(x[tokens], self.w13.weight.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2.weight.transpose(1, 2), offs=offs)
        # rows past offs[-1] (other ranks' experts) are never written by the GEMMs: select, not multiply
        y = torch.where(mine[:, None], y * weights.reshape(-1)[order][:, None], 0.0)
        # back to (token, choice) order and summed over the k choices in float32: deterministic (an
        # index_add_ of the k rows would add them in atomic order, which changes the bf16 result)
        pairs = torch.empty_like(y)
        pairs[order] = y
        return pairs.view(x.shape[0], k, -1).sum(1).to(x.dtype)

    def routed_fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """FP8 / INT4 experts through the fused-MoE Triton kernels (sync-free, capturable)."""
        w13, w2 = self.w13, self.w2
        return self._fused_moe(x, weights, ids, w13.fmt, w13.data(), w13.scale(), w2.data(), w2.scale(),
                               first_expert=self.first_expert, num_local=self.num_local,
                               intermediate=w13.parts[0], group_size=w13.block[1])


    def routed_int4_mma(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """INT4 experts through the CUDA tensor-core MoE kernel (kernels.int4_moe; sync-free, capturable)."""
        w13, w2 = self.w13, self.w2
        return self._fused_moe(x, weights, ids, w13.data(), w13.scale(), w2.data(), w2.scale(),
                               first_expert=self.first_expert, num_local=self.num_local, intermediate=w13.parts[0])


def grouped_mm_available(x: torch.Tensor) -> bool:
    """torch's grouped GEMM runs bf16 on Hopper or newer."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int, tp: TensorParallel, dtype, device,
                 formats: WeightFormats = BF16):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MLA(cfg, tp, dtype, device, formats)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (
            MoE(cfg, tp, dtype, device, formats) if cfg.is_moe_layer(layer)
            else MLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype, device, formats)
        )

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        """attend(normed x) -> this rank's attention partial (causal or paged)."""
        norm = self.post_attention_layernorm
        x, h = norm.glue.add_rms_norm(x, self.tp.all_reduce(attend(self.input_layernorm(x))), norm.weight, norm.eps)
        return x + self.tp.all_reduce(self.mlp(h))
