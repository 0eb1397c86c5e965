"""MLA decode prologue in one launch: rope on the query's rope slice (in place), and the
new token's latent cache entry [RMSNorm(c) | rope(k_rot)] written straight into its slot;
optionally also the absorption of the query's nope slice through kv_b's key half.

Legend: docs/shapes.md (T tokens, H heads, N qk_nope, P qk_rope, R kv_lora_rank).
  q_rope [T, H, P]   a view of the query's rope slice; rotated in place
  kv     [T, R+P]    kv_a_proj_with_mqa's output: c (not yet normalised), then k_rot
  cache  [slots, R+P] (any dtype); entry t goes to row slot_mapping[t]
This replaces five launches per MLA layer (the contiguous copy of c, its RMSNorm, rope,
the cat of the entry and the index_copy into the cache); the unfused code rounds c after
the norm and k_rot after rope to the activation dtype, and so does this kernel, so the
cache holds the same values. kv itself is left as it was.

mla_decode_prologue_ also computes q_c [T, H, R] = q_nope [T, H, N] @ w_uk [H, N, R]
(per head) in extra programs of the same launch, one per (head, block of R), each holding
its [N, BLOCK_L] slice of w_uk and multiplying every token's q_nope by it (a tensor-core
dot over 16-token tiles). At batch 1 that replaces cuBLAS's batched GEMM, a launch of its
own of ~3.3 us on the H200 for 2 MB, with 128 programs of 16 KB each. The weight is read
once per launch whatever T is, but each program walks the tokens in turn, so large T
(prefill-sized, or batch 256) belongs to the batched GEMM (ABSORB_MAX_TOKENS).

The @triton.jit bodies are in _mla_cache_kernels.py; the torch twin (the values the cache
and q_c must hold) is kernels/reference/mla_cache.py.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._mla_cache_kernels import mla_rope_cache_kernel

# Tokens up to which mla_decode_prologue_ absorbs q_nope itself (see the module docstring).
ABSORB_MAX_TOKENS = 32
ABSORB_BLOCK_L = 64  # latent columns per absorption program
ABSORB_BLOCK_T = 16  # tokens per dot (tl.dot's smallest M)


def mla_rope_cache_write_(
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
) -> None:
    """Rotate q_rope [T, H, P] in place and write [rmsnorm(kv[:, :R]) | rope(kv[:, R:])]
    into cache rows slot_mapping [T] (cache viewed as [slots, R + P])."""
    _launch(q_rope, kv, positions, cos, sin, interleaved, norm_weight, eps, cache, slot_mapping)


def mla_decode_prologue_(
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
) -> torch.Tensor:
    """mla_rope_cache_write_ on q [T, H, N + P]'s rope slice (P = rope_dim), and in the same
    launch q_c [T, H, R] = q[..., :N] @ w_uk [H, N, R] per head, returned in the cache's
    dtype (rounded to q's dtype first, as the batched GEMM it replaces)."""
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [T, H, N + P], last dim dense"
    t, h, width = q.shape
    n = width - rope_dim
    r = kv.shape[-1] - rope_dim
    assert w_uk.shape == (h, n, r) and w_uk.stride(-1) == 1, (
        f"w_uk must be [{h}, {n}, {r}] with a dense last dim, got {list(w_uk.shape)}"
    )
    assert t <= ABSORB_MAX_TOKENS, f"{t} tokens: absorb above {ABSORB_MAX_TOKENS} with a GEMM"
    check_device(w_uk)
    q_c = torch.empty((t, h, r), dtype=cache.dtype, device=q.device)
    _launch(q[..., n:], kv, positions, cos, sin, interleaved, norm_weight, eps, cache,
            slot_mapping, absorb=(q[..., :n], w_uk.to(q.dtype), q_c))  # fmt: skip
    return q_c


def _launch(q_rope, kv, positions, cos, sin, interleaved, norm_weight, eps, cache, slot_mapping,
            absorb=None) -> None:  # fmt: skip
    assert q_rope.dim() == 3 and q_rope.stride(-1) == 1, "q_rope must be [T, H, P], last dim dense"
    t, h, p = q_rope.shape
    assert kv.dim() == 2 and kv.shape[0] == t and kv.stride(-1) == 1, (
        f"kv must be [{t}, R + {p}] with a dense last dim, got {list(kv.shape)}"
    )
    r = kv.shape[1] - p
    assert p % 2 == 0, f"rope dim must be even, got {p}"
    assert norm_weight.shape == (r,), f"norm weight must be [{r}]"
    assert cache.shape[-1] == r + p and cache.is_contiguous(), (
        f"cache must be contiguous with rows of {r + p}, got {list(cache.shape)}"
    )
    assert positions.shape == (t,) and slot_mapping.shape == (t,), "positions/slots must be [T]"
    assert cos.dtype == torch.float32 and cos.shape[-1] == p // 2 and sin.stride() == cos.stride()
    check_device(q_rope, kv, positions, cos, sin, norm_weight, cache, slot_mapping)
    if t == 0:
        return
    if absorb is None:
        q_nope = w_uk = q_c = q_rope  # never read
        nope, programs = 0, t
    else:
        q_nope, w_uk, q_c = absorb
        assert q_nope.stride(0) == q_rope.stride(0) and q_nope.stride(1) == q_rope.stride(1)
        nope = q_nope.shape[-1]
        programs = t + h * triton.cdiv(r, ABSORB_BLOCK_L)
    mla_rope_cache_kernel[(programs,)](
        q_rope, kv, positions, cos, sin, norm_weight, cache, slot_mapping, q_nope, w_uk, q_c,
        t, h, r, nope, float(eps),
        q_rope.stride(0), q_rope.stride(1), kv.stride(0), cos.stride(0), r + p,
        w_uk.stride(0), w_uk.stride(1), q_c.stride(0), q_c.stride(1),
        HALF=p // 2, INTERLEAVED=interleaved, BLOCK_H=next_pow2(h),
        BLOCK_J=next_pow2(p // 2), BLOCK_C=next_pow2(r),
        ABSORB=absorb is not None, NOPE=max(16, next_pow2(nope)), BLOCK_L=ABSORB_BLOCK_L, BLOCK_T=ABSORB_BLOCK_T,
        F32_DOT=interpreting(), num_warps=4,
    )  # fmt: skip
