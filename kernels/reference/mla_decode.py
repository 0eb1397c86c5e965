"""Torch twin of kernels/triton/mla_decode.py: gather each sequence's cache, softmax, sum."""

from __future__ import annotations

import torch


def mla_decode_reference(
    q_c: torch.Tensor,  # [B, H, KVL]
    q_rope: torch.Tensor,  # [B, H, R]
    kv_cache: torch.Tensor,  # [num_blocks, BS, KVL + R]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:
    kvl = q_c.shape[-1]
    bs = kv_cache.shape[1]
    out = torch.empty_like(q_c)
    for b, n in enumerate(context_lens.tolist()):
        t = torch.arange(n, device=kv_cache.device)
        slots = block_tables[b, t // bs].long() * bs + t % bs
        entries = kv_cache.reshape(-1, kv_cache.shape[-1])[slots].float()  # [n, KVL + R]
        c, k_rot = entries[:, :kvl], entries[:, kvl:]
        scores = (q_c[b].float() @ c.t() + q_rope[b].float() @ k_rot.t()) * scale  # [H, n]
        out[b] = (scores.softmax(-1) @ c).to(q_c.dtype)
    return out
