"""DeepSeek-V4's hyper-connections (mHC) on the GPU: the mixes, Sinkhorn and the collapse
before a sublayer (`hc_pre`), the mix of its output back into the streams (`hc_post`), and
the head's collapse (`hc_head`). Torch twin and the arithmetic in full:
kernels/reference/hyper_connections.py. Legend: docs/shapes.md (T tokens, C streams, D
hidden); K = C * D, M = the rows of fn. The @triton.jit bodies are in
_hyper_connections_kernels.py.

`hc_pre` is two launches, both sized for decode (T <= 16) without a T-dependent path.
The projection (grid cdiv(T, BLOCK_T) x SPLITS, SPLITS = K / K_PER_SPLIT: 128 for V4-Flash)
reads BLOCK_T tokens' flattened streams against one 128-wide K slice of fn (12 KiB of the
1.5 MiB) and writes the split's M dot products, with the sum of squares in the spare column
M. At T = 1 that is 128 programs, about one per SM, each with its whole slice in flight at
once (4 BLOCK_K steps, PROJECT_STAGES deep): fn arrives at copy speed in about one memory
latency. The mix kernel (grid T x (cdiv(D, BLOCK_D) + 1), one warp per program) adds the
splits in a fixed order (SPLIT_CHUNK per load, the loads in split order). A token's first
programs take the pre mixes and the rsqrt (project first, scale after: the twin's order, a
few ulps from the torch ops' normalise-then-project) and collapse BLOCK_D columns each; its
last takes post and exactly `sinkhorn_iters` Sinkhorn rounds beside them, so the serial
Sinkhorn delays no collapse, and on one warp its 2 * sinkhorn_iters [C, C] sums are
register shuffles. The split count depends on K alone, BLOCK_T is fixed, and no program's
sums depend on another token, so a token's results are the same bits in any batch. One
launch (the last-arriving split reducing, as _arrival_counters.py allows) would put the
Sinkhorn and the collapse of a whole token block on one program: fine at T = 1, ~100 us at
T = 256.

The floor (V4-Flash: C = 4, D = 4096, K = 16384, M = 24, bf16 streams), bytes per token:
  hc_pre   streams C*D*2 = 32 KiB read for the projection and again for the collapse (from
           L2 at decode: 256 tokens are 8 MiB); x D*2 = 8 KiB written; partials
           SPLITS*32*4 = 16 KiB written and read back (from L2; the price of 128 splits);
           plus fn 24*16384*4 = 1.5 MiB per launch, read from memory once (cdiv(T, BLOCK_T)
           times from L2), so amortised over T: 1.5 MiB / T (6 KiB at T = 256).
  hc_post  streams 32 KiB + y 8 KiB read, next streams 32 KiB written.
At T = 1 hc_pre's ~1.6 MiB is 0.35 us at 4.8 TB/s (H200), below the launches' latency
chains (a memory round trip each, then 2 * sinkhorn_iters dependent [C, C] sums): ~2 us a
launch is the practical floor there. At T = 256, counting each tensor once, that is
~15.5 MiB for hc_pre and 18 MiB for hc_post: ~3.4 us and ~3.9 us. The projection's flops
(T * M * K, tf32x3 on tensor cores) are far below.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._hyper_connections_kernels import (
    hc_mix_collapse_kernel,
    hc_post_kernel,
    hc_project_kernel,
)

BLOCK_T = 64  # tokens per projection program: fn is read once per 64 tokens
BLOCK_K = 32  # 4 steps per split, all in flight at once (PROJECT_STAGES); 64 spills on sm_90
PROJECT_STAGES = 5
K_PER_SPLIT = 128  # K per projection program: V4-Flash's K = 16384 is 128 splits
SPLIT_CHUNK = 128  # splits the mix kernel adds per load: V4-Flash's all in one
BLOCK_D = 512  # collapse columns per mix program
POST_BLOCK_D = 256
# The projection's float32 dot on tensor cores with ~float32 accuracy (three tf32 products;
# the bf16 streams are exact in tf32, so only fn's split rounds)
DOT_PRECISION = "tf32x3"


def _flat_streams(streams: torch.Tensor) -> torch.Tensor:
    """streams [..., C, D] -> [T, C, D] with every token's C * D values contiguous."""
    C, D = streams.shape[-2:]
    assert streams.stride(-1) == 1 and streams.stride(-2) == D, (
        f"streams must have contiguous [C, D] rows per token, got strides {streams.stride()}"
    )
    return streams.reshape(-1, C, D)


def _mixes_and_collapse(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    has_comb: bool,
    k_per_split: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    x3 = _flat_streams(streams)  # [T, C, D]
    T, C, D = x3.shape
    K, M = C * D, fn.shape[0]
    rows = (2 + C) * C if has_comb else C
    assert rows == M, f"fn has {M} rows; {C} streams need {rows}"
    assert fn.shape == (M, K) and fn.dtype == torch.float32 and fn.stride(-1) == 1, (
        f"fn must be float32 [{M}, {K}] with contiguous rows, got {fn.dtype} {list(fn.shape)}"
    )
    assert base.shape == (M,) and scale.shape == ((3,) if has_comb else (1,))
    assert k_per_split % BLOCK_K == 0, f"k_per_split must be a multiple of {BLOCK_K}"
    check_device(streams, fn, base, scale)
    base, scale = base.float().contiguous(), scale.float().contiguous()
    out = torch.empty((T, D), dtype=streams.dtype, device=streams.device)
    post = torch.empty((T, C), dtype=torch.float32, device=streams.device) if has_comb else None
    comb = torch.empty((T, C, C), dtype=torch.float32, device=streams.device) if has_comb else None
    if T:
        m_pad = max(16, next_pow2(M + 1))  # tl.dot's smallest N; column M holds sum(x^2)
        splits = triton.cdiv(K, k_per_split)
        part = torch.empty((splits, T, m_pad), dtype=torch.float32, device=streams.device)
        hc_project_kernel[(triton.cdiv(T, BLOCK_T), splits)](
            x3, fn, part,
            T, K, M, k_per_split,
            x3.stride(0), fn.stride(0),
            BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, M_PAD=m_pad,
            PRECISION=DOT_PRECISION, SUM_DOT=interpreting(), num_warps=4,
            num_stages=PROJECT_STAGES,
        )  # fmt: skip
        hc_mix_collapse_kernel[(T, triton.cdiv(D, BLOCK_D) + has_comb)](
            x3, part, base, scale, out,
            post if has_comb else out, comb if has_comb else out,
            T, C, D, K, M, splits, sinkhorn_iters, hc_eps, norm_eps,
            x3.stride(0), x3.stride(1), out.stride(0),
            M_PAD=m_pad, C_PAD=next_pow2(C), P_PAD=next_pow2(C + 1), SPLIT_CHUNK=SPLIT_CHUNK,
            BLOCK_D=BLOCK_D, HAS_COMB=has_comb, num_warps=1,
        )  # fmt: skip
    lead = streams.shape[:-2]
    return (
        out.reshape(*lead, D),
        post.reshape(*lead, C) if has_comb else None,
        comb.reshape(*lead, C, C) if has_comb else None,
    )


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    k_per_split: int = K_PER_SPLIT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [..., C, D] (bf16/fp16/float32), fn [(2 + C) * C, C * D] float32, base
    [(2 + C) * C], scale [3] -> (x [..., D] streams' dtype, post [..., C] float32, comb
    [..., C, C] float32). `k_per_split` is part of a token's rounding: keep it fixed (a
    multiple of BLOCK_K; K / k_per_split programs per BLOCK_T tokens read fn)."""
    x, post, comb = _mixes_and_collapse(
        streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, True, k_per_split
    )
    return x, post, comb


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    k_per_split: int = K_PER_SPLIT,
) -> torch.Tensor:
    """streams [..., C, D], fn [C, C * D] float32, base [C], scale [1] -> [..., D] (sigmoid
    pre weights, no Sinkhorn)."""
    x, _, _ = _mixes_and_collapse(streams, fn, base, scale, 1, hc_eps, norm_eps, False, k_per_split)
    return x


def hc_post(
    y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """y [..., D], streams [..., C, D], post [..., C] float32, comb [..., C, C] float32 ->
    the next streams [..., C, D] in streams' dtype: post_k * y + sum_j comb[j, k] streams_j."""
    x3 = _flat_streams(streams)  # [T, C, D]
    T, C, D = x3.shape
    y2 = y.reshape(-1, D)
    assert y2.shape[0] == T and y2.stride(-1) == 1, f"y {list(y.shape)} for streams of {T} tokens"
    post2 = post.reshape(T, C).float().contiguous()
    comb3 = comb.reshape(T, C, C).float().contiguous()
    check_device(y, streams, post, comb)
    out = torch.empty((T, C, D), dtype=streams.dtype, device=streams.device)
    if T:
        hc_post_kernel[(T, triton.cdiv(D, POST_BLOCK_D))](
            y2, x3, post2, comb3, out,
            C, D,
            y2.stride(0), x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            C_PAD=next_pow2(C), BLOCK_D=POST_BLOCK_D, num_warps=4,
        )  # fmt: skip
    return out.reshape(streams.shape)
