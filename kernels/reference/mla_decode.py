"""Torch twin of kernels/triton/mla_decode.py: absorbed MLA decode attention over the paged
latent cache. The one torch copy of it: the kernel's tests and the engine's torch paths
(dtypes or dims the kernel does not take) call this.

Legend: docs/shapes.md (T query rows, H heads, R kv_lora_rank, P qk_rope, L context).
  q_c [T, H, R]       q_nope absorbed through kv_b's key half
  q_rope [T, H, P]    roped
  kv_cache [num_blocks, block_size, R + P]: per token the normalised latent c, then k_rot
  block_tables [T, max_blocks] int32, context_lens [T] on the device (>= 1)
  out [T, H, R] = softmax(scale * (q_c . c_l + q_rope . k_rot_l)) @ c over l < context_lens
Each row reads `max_context` slots (known on the host, >= every context length), those
past its own length masked, so nothing is read back from the device: no host sync, and it
captures into a CUDA graph. A sequence with several queries (speculative verify) passes
one row per query: its block-table row repeated, context length = position + 1.
"""

from __future__ import annotations

import torch


def mla_decode_reference(
    q_c: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int | None = None,
) -> torch.Tensor:
    """-> [T, H, R] in q_c's dtype, the math in float32. max_context None reads the longest
    of context_lens back (a host sync: tests only)."""
    r = q_c.shape[-1]
    bs = kv_cache.shape[1]
    if max_context is None:
        max_context = int(context_lens.max())
    pos = torch.arange(max_context, device=kv_cache.device)  # [L]
    # Positions past a row's block table read its last page; every slot past the row's
    # length is masked, and its entry zeroed: a stale NaN there must not reach the output
    # through 0 * NaN.
    page = (pos // bs).clamp(max=block_tables.shape[-1] - 1)
    slots = block_tables[:, page].long() * bs + pos % bs  # [T, L]
    pad = pos[None, :] >= context_lens[:, None]  # [T, L]
    entries = kv_cache.view(-1, kv_cache.shape[-1])[slots].float()  # [T, L, R + P]
    entries = entries.masked_fill(pad[..., None], 0.0)
    latent, k_rot = entries[..., :r], entries[..., r:]
    scores = torch.einsum("thr,tlr->thl", q_c.float(), latent)
    scores = (scores + torch.einsum("thp,tlp->thl", q_rope.float(), k_rot)) * scale  # [T, H, L]
    probs = scores.masked_fill(pad[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("thl,tlr->thr", probs, latent).to(q_c.dtype)
