"""Torch twin of kernels/triton/mla_cache.py: the MLA decode prologue out of place.

Legend: docs/shapes.md (T tokens, H heads, N qk_nope, P qk_rope, R kv_lora_rank).
  q_rope [T, H, P]   the query's rope slice, rotated
  kv [T, R + P]      kv_a_proj_with_mqa's output: c (not yet normalised), then k_rot
  cache [..., R + P] a token's entry [RMSNorm(c) | rope(k_rot)] at row slot_mapping[t] of
                     the cache viewed as [slots, R + P]; other rows unchanged
The normalised c and the roped k_rot are rounded to kv's dtype, as the unfused layer
rounds them, before they are stored in the cache's dtype.
"""

from __future__ import annotations

import torch

from kernels.reference.rmsnorm import rmsnorm_reference
from kernels.reference.rope import rope_reference


def mla_rope_cache_reference(
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q_rope rotated [T, H, P], a copy of cache with the T entries written); what
    mla_rope_cache_write_ leaves in its q_rope and cache."""
    p = q_rope.shape[-1]
    r = kv.shape[-1] - p
    latent = rmsnorm_reference(kv[:, :r], norm_weight, eps)  # [T, R] in kv's dtype
    k_rot = rope_reference(kv[:, None, r:], positions, cos, sin, interleaved)[:, 0]  # [T, P]
    entry = torch.cat((latent, k_rot), dim=-1)  # [T, R + P]
    out = cache.clone()
    out.view(-1, r + p)[slot_mapping.long()] = entry.to(cache.dtype)
    return rope_reference(q_rope, positions, cos, sin, interleaved), out


def mla_decode_prologue_reference(
    q: torch.Tensor,
    rope_dim: int,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    w_uk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, N + P] (P = rope_dim), w_uk [H, N, R] -> (q with its rope slice rotated,
    the cache as mla_rope_cache_reference writes it, q_c [T, H, R]). q_c = q_nope @ w_uk
    per head in float32 from w_uk in q's dtype, rounded to q's dtype (as the batched GEMM
    the kernel replaces), returned in the cache's dtype."""
    n = q.shape[-1] - rope_dim
    q_rope, out_cache = mla_rope_cache_reference(
        q[..., n:], kv, positions, cos, sin, interleaved, norm_weight, eps, cache, slot_mapping
    )
    w = w_uk.to(q.dtype).float()  # [H, N, R]
    q_c = torch.einsum("thn,hnr->thr", q[..., :n].float(), w).to(q.dtype).to(cache.dtype)
    return torch.cat((q[..., :n], q_rope), dim=-1), out_cache, q_c
