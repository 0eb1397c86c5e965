"""MLA's two attention forms in torch over the paged latent cache, and how a step's
sequences are grouped for them (engine/ops/mla.py decides which form each sequence takes).

Legend: docs/shapes.md (T tokens, B sequences, Q queries per sequence, H heads,
R kv_lora_rank, P qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim, L context length).

- expanded form: k_nope, v = kv_b(c) for every context token, then ordinary attention.
  Cheap when many queries share a context (long prefill).
- absorbed form: W_UK is folded into the query (q_lat = q_nope W_UK, [H, R]) and W_UV is
  applied after attention on the latent average (o = (sum p c) W_UV^T). No per-token
  expansion: what decode does.

Scores and softmax run in float32 (the expanded form's keys, values and attention may run
in a lower dtype where the backend asks for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.ops.attention_context import AttentionContext
from kernels.cpu import batch_invariant


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


def pack_to_device(parts: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors to `device` in one copy, asynchronous from pinned memory on CUDA."""
    packed = torch.cat([p.long().flatten() for p in parts])
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    return list(packed.split([p.numel() for p in parts]))
