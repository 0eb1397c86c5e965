"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Legend: T = tokens in the step, H = heads, R = kv_lora_rank, P = qk_rope_head_dim,
N = qk_nope_head_dim, V = v_head_dim, L = context length of one sequence.

Per token the cache holds only c = kv_a_layernorm(first R of kv_a_proj_with_mqa(x)) and the
roped shared key k_rope (P values): R + P values per token per layer (576 for V3), the
`CacheSpec` shape. Keys and values are recovered through kv_b_proj [H*(N+V), R]:

- expanded form: k_nope, v = kv_b(c) for every context token, then ordinary attention.
  Cheap when many queries share a context (long prefill).
- absorbed form: W_UK is folded into the query (q_lat = q_nope W_UK, [H, R]) and W_UV is
  applied after attention on the latent average (o = (sum p c) W_UV^T). No per-token
  expansion: what decode does.

`MultiLatentAttention.mode` picks "auto" (the cheaper form per sequence by a flop count),
"absorbed" or "expanded". Scores and softmax run in float32 (the expanded form's keys,
values and attention may run in the model's dtype on CUDA: `expanded_dtype`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.ops.attention_context import AttentionContext
from engine.quant.base import QuantConfig
from kernels.cpu import batch_invariant

# DeepSeek's and transformers' MLA norms use the RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
MODES = ("auto", "absorbed", "expanded")
# Keys and values one batched expanded-form call may hold (its group's padded contexts;
# in float32 Moonlight: ~18K tokens, V3 with 128 heads: ~2K; twice that in bf16).
EXPANDED_GROUP_BYTES = 512 << 20


@dataclass(frozen=True)
class MlaDims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def prefer_expanded(self, query_len: int, context_len: int) -> bool:
        """Whether expanding the context through kv_b costs fewer flops than absorbing."""
        R, P, N, V = (
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.qk_nope_head_dim,
            self.v_head_dim,
        )
        expanded = context_len * R * (N + V) + query_len * context_len * (N + P + V)
        absorbed = query_len * (N * R + R * V) + query_len * context_len * (2 * R + P)
        return expanded < absorbed


def write_latent_cache(
    cache: torch.Tensor, ctx: AttentionContext, latent: torch.Tensor, k_rope: torch.Tensor
) -> None:
    """Store [c | k_rope] of each new token at its slot. cache [blocks, block_size, R+P]."""
    flat = cache.view(-1, cache.shape[-1])
    flat[ctx.slot_mapping] = torch.cat((latent, k_rope), dim=-1).to(cache.dtype)


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of tokens 0..length-1 of one sequence (block_table [..., blocks])."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[..., pos // block_size].long() * block_size + pos % block_size


def attend_expanded_batched(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    dims: MlaDims,
    scale: float,
    max_context: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """B sequences in the expanded form, queries padded as in attend_absorbed_batched:
    q [B, Q, H, N+P] (rope applied), q_pos [B, Q], block_tables [B, blocks],
    context_lens [B] -> out [B, Q, H, V] float32. One batched expansion and one fused
    attention call for the whole group, so a many-prompt prefill's launches (and the
    host's time issuing them) do not grow with its prompt count. Keys, values and
    the attention are computed in `dtype` (bf16: tensor-core GEMMs and flash attention
    on a GPU, with its float32 softmax)."""
    N, R = dims.qk_nope_head_dim, dims.kv_lora_rank
    H = q.shape[2]
    lmax = int(context_lens.max()) if max_context is None else max_context
    entries = _context_entries(cache, block_tables, lmax, dtype)  # [B, L, R+P]
    latent, k_rope = entries[..., :R], entries[..., R:]
    kv = torch.einsum("blr,hkr->bhlk", latent, kv_b_weight.to(dtype))  # [B, H, L, N+V]
    k = torch.cat((kv[..., :N], k_rope[:, None].expand(-1, H, -1, -1)), dim=-1)
    q = q.to(dtype).transpose(1, 2)  # [B, H, Q, N+P]
    keys = torch.arange(entries.shape[1], device=cache.device)
    visible = keys[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]; past the end is future
    out = F.scaled_dot_product_attention(q, k, kv[..., N:], attn_mask=visible[:, None], scale=scale)
    return out.transpose(1, 2).float()


def attend_absorbed_batched(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    dims: MlaDims,
    scale: float,
    max_context: int | None = None,
) -> torch.Tensor:
    """B sequences with up to Q queries each (decode: Q = 1; speculative verify: K + 1),
    padded and batched. q [B, Q, H, N+P] with rope applied (any float dtype; the math is
    float32), q_pos [B, Q] absolute positions (padding rows: any valid position,
    their output is discarded), block_tables [B, blocks], context_lens [B] -> out
    [B, Q, H, V] float32. max_context, the longest of context_lens when the caller knows
    it on the host, saves a device sync."""
    N, R = dims.qk_nope_head_dim, dims.kv_lora_rank
    B, Q, H, _ = q.shape
    lmax = int(context_lens.max()) if max_context is None else max_context
    if cache.device.type == "cpu":  # gathered at the padded length: no copy to pad it later
        lmax = batch_invariant.padded_keys(lmax)
    entries = _context_entries(cache, block_tables, lmax)  # [B, L, R+P]
    q_nope = q[..., :N].float().permute(2, 0, 1, 3).reshape(H, B * Q, N)
    q_lat = batch_invariant.batched_matmul(q_nope, kv_b_weight[:, :N].contiguous())  # [H, BQ, R]
    q_lat = q_lat.view(H, B, Q, R).permute(1, 2, 0, 3)  # [B, Q, H, R]
    # One latent "head" shared by all H query heads (MQA): the rows of one problem are
    # its (query, head) pairs, the keys [c | k_rope], the values c.
    q_full = torch.cat((q_lat, q[..., N:].float()), dim=-1).reshape(B, Q * H, -1)
    keys = torch.arange(lmax, device=cache.device)
    visible = keys[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]; past the end is future
    visible = visible[:, :, None].expand(B, Q, H, lmax).reshape(B, Q * H, lmax)
    o_lat = batch_invariant.attention(q_full, entries, entries[..., :R], visible, scale)
    o_lat = o_lat.view(B, Q, H, R).permute(2, 0, 1, 3).reshape(H, B * Q, R)
    w_uv = kv_b_weight[:, N:].transpose(1, 2).contiguous()  # [H, R, V]
    out = batch_invariant.batched_matmul(o_lat, w_uv)  # [H, BQ, V]
    return out.view(H, B, Q, -1).permute(1, 2, 0, 3)  # [B, Q, H, V]


def _context_entries(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    length: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[c | k_rope] of tokens 0..length-1 of each sequence as [B, length, R+P] in dtype."""
    flat = cache.view(-1, cache.shape[-1])
    bs = cache.shape[1]
    covered = block_tables.shape[-1] * bs
    if length > covered:  # positions past the table read block 0: finite, never visible
        pad = block_tables.new_zeros(*block_tables.shape[:-1], -(-(length - covered) // bs))
        block_tables = torch.cat((block_tables, pad), dim=-1)
    return flat[context_slots(block_tables, length, bs)].to(dtype)


def expanded_groups(
    seqs: list[int], context_lens: list[int], query_lens: list[int], max_tokens: int
) -> list[list[int]]:
    """Sequences for attend_expanded_batched, shortest context first, grouped so that a
    group's padded contexts (count x its longest) stay within max_tokens, and its longest
    context and query chunk are at most 1.5x those of the sequence that opened it
    (padding is computed too). A sequence longer than max_tokens forms its own group."""

    def close(a: int, b: int) -> bool:  # a, b: the newcomer's and the opener's length
        return 2 * a <= 3 * b and 2 * b <= 3 * a

    groups: list[list[int]] = []
    for b in sorted(seqs, key=lambda b: context_lens[b]):
        g = groups[-1] if groups else None
        if (
            g is not None
            and (len(g) + 1) * context_lens[b] <= max_tokens
            and close(context_lens[b], context_lens[g[0]])
            and close(query_lens[b], query_lens[g[0]])
        ):
            g.append(b)
        else:
            groups.append([b])
    return groups


def _to_device(parts: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors to `device` in one copy, asynchronous from pinned memory on CUDA."""
    packed = torch.cat([p.long().flatten() for p in parts])
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    return list(packed.split([p.numel() for p in parts]))


class MultiLatentAttention(nn.Module):
    def __init__(
        self,
        dims: MlaDims,
        rotary: RotaryEmbedding,
        softmax_scale: float,
        quant: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.dims, self.rotary, self.scale = dims, rotary, softmax_scale
        D, H = dims.hidden_size, dims.num_heads
        qk_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        bias = dims.attention_bias
        if dims.q_lora_rank:
            self.q_a_proj = Linear(D, dims.q_lora_rank, bias, quant, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(dims.q_lora_rank, H * qk_dim, False, quant, f"{prefix}.q_b_proj")
        else:
            self.q_proj = Linear(D, H * qk_dim, False, quant, f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = Linear(
            D, dims.cache_width, bias, quant, f"{prefix}.kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            dims.kv_lora_rank,
            H * (dims.qk_nope_head_dim + dims.v_head_dim),
            False,
            quant,
            f"{prefix}.kv_b_proj",
        )
        self.o_proj = Linear(H * dims.v_head_dim, D, bias, quant, f"{prefix}.o_proj")
        self.kv_cache: torch.Tensor | None = None  # [blocks, block_size, R+P], bound by runner
        self.mode = "auto"
        # What the expanded form (prefill) computes keys, values and attention in: float32,
        # or on CUDA the model's dtype (EngineConfig.mla_expanded_float32 = False).
        self.expanded_dtype = torch.float32

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight as float32 [H, N+V, R] (a view when stored in float32)."""
        d = self.dims
        w = self.kv_b_proj.format.dequantize(self.kv_b_proj)
        return w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        if self.mode not in MODES:
            raise ValueError(f"MLA mode {self.mode!r}: expected one of {MODES}")
        if self.kv_cache is None:
            raise RuntimeError("MLA layer has no KV cache: call model.bind_kv_cache first")
        if x.is_cuda and ctx.is_decode and self.mode != "expanded":
            # GPU backend: rope + absorbed decode kernels, no host sync (engine/backends/cuda.py)
            from engine.backends.cuda import mla_decode_forward

            return mla_decode_forward(self, x, positions, ctx)
        d = self.dims
        T, H, N, R = x.shape[0], d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
        if x.is_cuda and getattr(self, "cuda_state", None) is not None:
            # GPU backend: q and kv_a in one GEMM, rope + norm + cache write in one launch
            from engine.backends.cuda import mla_prefill_inputs

            q = mla_prefill_inputs(self, x, positions, ctx)
        else:
            if d.q_lora_rank:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            else:
                q = self.q_proj(x)
            q = q.view(T, H, N + d.qk_rope_head_dim)
            kv = self.kv_a_proj_with_mqa(x)  # [T, R+P]
            latent = self.kv_a_layernorm(kv[:, :R].contiguous())
            q_rope, k_rope = self.rotary(positions, q[..., N:], kv[:, None, R:])
            q[..., N:] = q_rope  # one q [T, H, N+P] for the attention forms to gather once
            write_latent_cache(self.kv_cache, ctx, latent, k_rope[:, 0])
        out = self._attend(q, positions, ctx)  # [T, H, V] in x's dtype
        return self.o_proj(out.reshape(T, H * d.v_head_dim))

    def _attend(self, q, positions, ctx: AttentionContext) -> torch.Tensor:
        """q [T, H, N+P], rope applied. Sequences that take the absorbed form run batched
        (padded to the longest query chunk among them); the rest run in the expanded form,
        batched in groups of similar context length (expanded_groups)."""
        d = self.dims
        w = self.kv_b_weight().float()
        # In the model's dtype: the forms compute in float32 (or expanded_dtype) and their
        # rows are rounded once, as they are copied in; q is cast only where a form needs it.
        out = q.new_empty(q.shape[0], d.num_heads, d.v_head_dim)
        q_lens, c_lens = ctx.query_lens_host, ctx.context_lens_host
        starts = [0, *itertools.accumulate(q_lens)]  # the host's copy of cu_query_lens

        def expanded(b: int) -> bool:
            if self.mode != "auto":
                return self.mode == "expanded"
            # Batch-invariant, the CPU takes the absorbed form for every query: a query's
            # result is then the same in a prefill chunk of any size as in a decode step.
            invariant = ctx.batch_invariant and not q.is_cuda
            return not invariant and d.prefer_expanded(q_lens[b], c_lens[b])

        def indices(seqs: list[int]) -> tuple[torch.Tensor, ...]:
            # The index tensors are built on the host by a few vectorized ops and sent in
            # one asynchronous copy, and the longest context is passed from the host:
            # every blocking copy or .max() makes the host wait for the GPU.
            lens = torch.tensor([q_lens[b] for b in seqs])
            steps = torch.arange(int(lens.max()))
            first = torch.tensor([starts[b] for b in seqs])
            # row of each (sequence, query) pair; padding repeats the last real row
            rows = first[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)  # [B', Q]
            real = steps[None, :] < lens[:, None]
            picked = real.flatten().nonzero().squeeze(1)  # the real pairs among the rows
            parts = (torch.tensor(seqs), rows.flatten(), picked, rows[real])
            on, rows_d, picked_d, dest = _to_device(parts, q.device)
            rows_d = rows_d.view(rows.shape)
            tables, lens_d = ctx.block_tables[on], ctx.context_lens[on].long()
            return rows_d, positions[rows_d], tables, lens_d, picked_d, dest

        def run(attend, seqs: list[int], **options) -> None:
            # Every layer of the step groups the same sequences alike: the indices are built
            # and copied once per step (per layer, the copy through pinned memory was the
            # top host wait in a profiled 128-prompt prefill step on the H200). A context
            # is one step's: its positions, tables and lengths are the same for each layer.
            rows_d, pos, tables, lens_d, picked_d, dest = ctx.shared(
                ("mla-rows", tuple(seqs)), lambda: indices(seqs)
            )
            o = attend(q[rows_d], pos, self.kv_cache, tables, lens_d, w, d, self.scale,
                       max_context=max(c_lens[b] for b in seqs), **options)  # fmt: skip
            out.index_copy_(0, dest, o.flatten(0, 1).index_select(0, picked_d).to(out.dtype))

        absorbed = [b for b in range(ctx.num_seqs) if not expanded(b)]
        if absorbed:
            run(attend_absorbed_batched, absorbed)
        rest = [b for b in range(ctx.num_seqs) if expanded(b)]
        # keys and values of every context token: ~(2N+P+V) H elements each
        per_token = (
            self.expanded_dtype.itemsize
            * d.num_heads
            * (2 * d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim)
        )
        budget = max(1, EXPANDED_GROUP_BYTES // per_token)
        for group in expanded_groups(rest, c_lens, q_lens, budget):
            run(attend_expanded_batched, group, dtype=self.expanded_dtype)
        return out
