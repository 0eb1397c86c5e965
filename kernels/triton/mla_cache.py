"""MLA decode prologue in one launch: rope on the query's rope slice (in place), and the
new token's latent cache entry [RMSNorm(c) | rope(k_rot)] written straight into its slot;
optionally also the absorption of the query's nope slice through kv_b's key half.

Legend: T tokens, H heads, KVL = kv_lora_rank, R = rope dim.
  q_rope [T, H, R]   a view of the query's rope slice; rotated in place
  kv     [T, KVL+R]  kv_a_proj_with_mqa's output: c (not yet normalised), then k_rot
  cache  [slots, KVL+R] (any dtype); entry t goes to row slot_mapping[t]
This replaces five launches per MLA layer (the contiguous copy of c, its RMSNorm, rope,
the cat of the entry and the index_copy into the cache); the unfused code rounds c after
the norm and k_rot after rope to the activation dtype, and so does this kernel, so the
cache holds the same values. kv itself is left as it was.

mla_decode_prologue_ also computes q_c [T, H, KVL] = q_nope [T, H, N] @ w_uk [H, N, KVL]
(per head) in extra programs of the same launch, one per (head, KVL block), each holding
its [N, BLOCK_L] slice of w_uk and multiplying every token's q_nope by it (a tensor-core
dot over 16-token tiles). At batch 1 that replaces cuBLAS's batched GEMM, a launch of its
own of ~3.3 us on the H200 for 2 MB, with 128 programs of 16 KB each. The weight is read
once per launch whatever T is, but each program walks the tokens in turn, so large T
(prefill-sized, or batch 256) belongs to the batched GEMM (ABSORB_MAX_TOKENS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_device, interpreting, mma, next_pow2
from kernels.triton.rope import _rope_heads

# Tokens up to which mla_decode_prologue_ absorbs q_nope itself (see the module docstring).
ABSORB_MAX_TOKENS = 32
ABSORB_BLOCK_L = 64  # latent columns per absorption program
ABSORB_BLOCK_T = 16  # tokens per dot (tl.dot's smallest M)


@triton.jit
def mla_rope_cache_kernel(
    # pointers
    q_ptr,  # [T, H, R] rope slice of the query (in place)
    kv_ptr,  # [T, KVL + R]
    pos_ptr,  # [T]
    cos_ptr,  # [max_pos, R/2] float32
    sin_ptr,
    norm_w_ptr,  # [KVL] kv_a_layernorm weight
    cache_ptr,  # [slots, KVL + R]
    slot_ptr,  # [T]
    qn_ptr,  # [T, H, N] nope slice of the query (ABSORB)
    w_uk_ptr,  # [H, N, KVL] kv_b's key half (ABSORB)
    qc_ptr,  # [T, H, KVL] out: q_nope @ w_uk per head (ABSORB)
    # sizes
    T,
    n_heads,
    KVL,
    n_nope,
    eps,
    # strides
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_cos,
    stride_cache,
    stride_wh,
    stride_wn,
    stride_ct,
    stride_ch,
    # meta-parameters
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ABSORB: tl.constexpr,
    NOPE: tl.constexpr,  # next_pow2(n_nope) (ABSORB)
    BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    if ABSORB:  # noqa: SIM102 (a compile-time branch: without ABSORB no absorption code)
        if pid >= T:  # programs T.. absorb: one (head, latent block) each
            _absorb_block(qn_ptr, w_uk_ptr, qc_ptr, pid - T, T, KVL, n_nope, stride_qt, stride_qh,
                          stride_wh, stride_wn, stride_ct, stride_ch,
                          NOPE, BLOCK_L, BLOCK_T, F32_DOT)  # fmt: skip
            return
    tok = pid.to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_j, mask=mask_j, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_j, mask=mask_j, other=0.0)
    _rope_heads(q_ptr, stride_qt, stride_qh, n_heads, tok, cos[None, :], sin[None, :],
                tl.arange(0, BLOCK_H), offs_j, HALF, INTERLEAVED)  # fmt: skip
    act = kv_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    row = cache_ptr + slot * stride_cache
    # latent: RMSNorm in float32, rounded to the activation dtype as the layer would
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KVL
    c = tl.load(kv_ptr + tok * stride_kvt + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / KVL + eps)
    w = tl.load(norm_w_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    c = (c * rstd * w).to(act)
    tl.store(row + offs_c, c.to(cache_ptr.dtype.element_ty), mask=mask_c)
    # k_rot: one shared head, rotated into the cache (kv keeps its input values)
    k = kv_ptr + tok * stride_kvt + KVL
    if INTERLEAVED:
        ia = 2 * offs_j
        ib = ia + 1
    else:
        ia = offs_j
        ib = offs_j + HALF
    a = tl.load(k + ia, mask=mask_j, other=0.0).to(tl.float32)
    b = tl.load(k + ib, mask=mask_j, other=0.0).to(tl.float32)
    ra = (a * cos - b * sin).to(act)
    rb = (a * sin + b * cos).to(act)
    tl.store(row + KVL + ia, ra.to(cache_ptr.dtype.element_ty), mask=mask_j)
    tl.store(row + KVL + ib, rb.to(cache_ptr.dtype.element_ty), mask=mask_j)


@triton.jit
def _absorb_block(qn_ptr, w_uk_ptr, qc_ptr, blk, T, KVL, n_nope, stride_qt, stride_qh,
                  stride_wh, stride_wn, stride_ct, stride_ch,
                  NOPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
                  F32_DOT: tl.constexpr):  # fmt: skip
    """q_c[:, h, l0:l0 + BLOCK_L] = q_nope[:, h, :] @ w_uk[h, :, l0:l0 + BLOCK_L] for every
    token, the weight slice loaded once."""
    lat_blocks = tl.cdiv(KVL, BLOCK_L)
    h = (blk // lat_blocks).to(tl.int64)
    offs_l = (blk % lat_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_l = offs_l < KVL
    offs_n = tl.arange(0, NOPE)
    mask_n = offs_n < n_nope
    w = tl.load(w_uk_ptr + h * stride_wh + offs_n[:, None] * stride_wn + offs_l[None, :],
                mask=mask_n[:, None] & mask_l[None, :], other=0.0)  # fmt: skip
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        qn = tl.load(qn_ptr + offs_t[:, None].to(tl.int64) * stride_qt + h * stride_qh
                     + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        qc = mma(qn, w.to(qn.dtype), tl.zeros((BLOCK_T, BLOCK_L), tl.float32), F32_DOT)
        # Rounded to the query's dtype as the batched GEMM's output is, then to the cache's.
        qc = qc.to(qn_ptr.dtype.element_ty).to(qc_ptr.dtype.element_ty)
        tl.store(qc_ptr + offs_t[:, None].to(tl.int64) * stride_ct + h * stride_ch
                 + offs_l[None, :], qc, mask=mask_t[:, None] & mask_l[None, :])  # fmt: skip


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
    """Rotate q_rope [T, H, R] in place and write [rmsnorm(kv[:, :KVL]) | rope(kv[:, KVL:])]
    into cache rows slot_mapping [T] (cache viewed as [slots, KVL + R])."""
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
    """mla_rope_cache_write_ on q [T, H, N + rope_dim]'s rope slice, and in the same launch
    q_c [T, H, KVL] = q[..., :N] @ w_uk [H, N, KVL] per head, returned in the cache's dtype
    (rounded to q's dtype first, as the batched GEMM it replaces)."""
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [T, H, N + R], last dim dense"
    t, h, width = q.shape
    n = width - rope_dim
    kvl = kv.shape[-1] - rope_dim
    assert w_uk.shape == (h, n, kvl) and w_uk.stride(-1) == 1, (
        f"w_uk must be [{h}, {n}, {kvl}] with a dense last dim, got {list(w_uk.shape)}"
    )
    assert t <= ABSORB_MAX_TOKENS, f"{t} tokens: absorb above {ABSORB_MAX_TOKENS} with a GEMM"
    check_device(w_uk)
    q_c = torch.empty((t, h, kvl), dtype=cache.dtype, device=q.device)
    _launch(q[..., n:], kv, positions, cos, sin, interleaved, norm_weight, eps, cache,
            slot_mapping, absorb=(q[..., :n], w_uk.to(q.dtype), q_c))  # fmt: skip
    return q_c


def _launch(q_rope, kv, positions, cos, sin, interleaved, norm_weight, eps, cache, slot_mapping,
            absorb=None) -> None:  # fmt: skip
    assert q_rope.dim() == 3 and q_rope.stride(-1) == 1, "q_rope must be [T, H, R], last dim dense"
    t, h, r = q_rope.shape
    assert kv.dim() == 2 and kv.shape[0] == t and kv.stride(-1) == 1, (
        f"kv must be [{t}, KVL + {r}] with a dense last dim, got {list(kv.shape)}"
    )
    kvl = kv.shape[1] - r
    assert r % 2 == 0, f"rope dim must be even, got {r}"
    assert norm_weight.shape == (kvl,), f"norm weight must be [{kvl}]"
    assert cache.shape[-1] == kvl + r and cache.is_contiguous(), (
        f"cache must be contiguous with rows of {kvl + r}, got {list(cache.shape)}"
    )
    assert positions.shape == (t,) and slot_mapping.shape == (t,), "positions/slots must be [T]"
    assert cos.dtype == torch.float32 and cos.shape[-1] == r // 2 and sin.stride() == cos.stride()
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
        programs = t + h * triton.cdiv(kvl, ABSORB_BLOCK_L)
    mla_rope_cache_kernel[(programs,)](
        q_rope, kv, positions, cos, sin, norm_weight, cache, slot_mapping, q_nope, w_uk, q_c,
        t, h, kvl, nope, float(eps),
        q_rope.stride(0), q_rope.stride(1), kv.stride(0), cos.stride(0), kvl + r,
        w_uk.stride(0), w_uk.stride(1), q_c.stride(0), q_c.stride(1),
        HALF=r // 2, INTERLEAVED=interleaved, BLOCK_H=next_pow2(h),
        BLOCK_J=next_pow2(r // 2), BLOCK_C=next_pow2(kvl),
        ABSORB=absorb is not None, NOPE=max(16, next_pow2(nope)), BLOCK_L=ABSORB_BLOCK_L, BLOCK_T=ABSORB_BLOCK_T,
        F32_DOT=interpreting(), num_warps=4,
    )  # fmt: skip
