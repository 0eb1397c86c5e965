"""Dense GEMV for decode-sized M: y [M, N] = x [M, K] @ W[N, K]^T with bf16/fp16 weights
and M <= GEMV_MAX_M = 8 (the engine's decode steps), one launch.

At M <= 8 the product is bandwidth-bound: each weight is used M times. cuBLAS's small-M
kernels on the H200 stream Moonlight's q_proj / o_proj at ~2.2 TB/s and kv_a at 0.4 TB/s
(docs/notes-gpu-kernels.md); this kernel follows the FP8 GEMV's design
(kernels/triton/_fp8_linear_kernels.py `fp8_gemv_kernel`): no tensor cores, each thread
streams 16 contiguous bytes (8 weights) of one row per load and multiplies them into the
few activation rows with float32 FMAs. When N alone gives too few programs to keep every
SM streaming it also splits K, and the last program of each row block sums the float32
partials in split order in the same launch (kernels/triton/_arrival_counters.py).

The config (tuned table kernels/triton/configs/dense_gemv.json, else `default_config`):
BLOCK_N weight rows x BLOCK_K weights per step, SPLIT_K, num_warps.

Not on the engine's path: measured on the H200 (bench kernels, over-L2 chains in one
graph) it lost to cuBLAS at every Moonlight shape but kv_a at M <= 2 (q_proj M=1 9.5 us vs
7.2, lm_head 209 vs 163), and a batch-1 step routed through it was no faster. It stays as
the measured baseline `bench kernels` compares cuBLAS against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import configs
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, next_pow2

OP = "dense_gemv"
# Largest M the kernel takes: the float32 accumulators grow with M (as in the FP8 GEMV,
# whose sm_90 build spills at 16), and at M = 8 a bf16 weight already costs 4 FMAs per
# byte, a quarter of the H200's float32 FMA rate at full bandwidth.
GEMV_MAX_M = 8
VEC = 8  # weights per thread per load: 16 bytes of bf16/fp16
# Offline sm_90 builds (triton 3.9) at 4 warps: a [BLOCK_N, BLOCK_K] tile up to 8192 weights
# at M <= 4 and 4096 at M = 8 fits in registers (<= 212 per thread; 32 x 128 at M = 8: 149),
# the next size up spills; below 1024 weights 4 warps have fewer than 8 weights per thread
# and the build drops the 16-byte loads.
TILE_MIN_WEIGHTS = 1024


@triton.jit
def dense_gemv_kernel(
    # pointers
    x_ptr,  # [M, K] bf16/fp16, M <= M_PAD
    w_ptr,  # [N, K] bf16/fp16, row-major
    y_ptr,  # [M, N] out, x's dtype
    part_ptr,  # [split_k, M, N] float32 partial sums (USE_SPLIT only)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 arrival counters, zero on entry and on exit
    # sizes
    M,
    N,
    K,
    split_k,  # runtime (grid axis 1), so the tune sweep does not compile one kernel per split
    # strides
    stride_xm,
    stride_wn,
    stride_ym,
    # meta-parameters
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    USE_SPLIT: tl.constexpr,
):
    """A program owns BLOCK_N weight rows and 1/split_k of K. Each step it loads a
    [BLOCK_N, BLOCK_K] tile viewed as [BLOCK_N, CHUNKS, VEC]: a thread holds VEC contiguous
    weights of one row (one 16-byte load at VEC = 8), so the sum over the last axis stays in
    the thread and the cross-thread reduction over the chunks runs once, after the loop."""
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CHUNKS) * VEC
    offs_v = tl.arange(0, VEC)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, split_k)
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, k_steps)

    # The product is 4-D [M_PAD, BLOCK_N, CHUNKS, VEC]; the weights are loaded 4-D with a
    # unit M axis and the activations 3-D, then expanded, so the weight load's layout (VEC
    # contiguous weights per thread) is the one the product uses and only the small
    # activation tile moves between layouts (the FP8 GEMV's finding on sm_90).
    w_rows = w_ptr + offs_n[None, :, None, None].to(tl.int64) * stride_wn  # [1, BLOCK_N, 1, 1]
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm  # [M_PAD, 1, 1]
    offs_kw = offs_c[None, None, :, None] + offs_v[None, None, None, :]  # [1, 1, CHUNKS, VEC]
    mask_wn = mask_n[None, :, None, None]
    k_next = step_lo * BLOCK_K + offs_kw
    w_next = tl.load(w_rows + k_next, mask=mask_wn & (k_next < K), other=0.0)
    acc = tl.zeros((M_PAD, BLOCK_N, CHUNKS), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        w = w_next
        # The next step's weights are requested before this step's math: two tiles in
        # flight per program (Triton pipelines only loads that feed tl.dot). The last step
        # reloads its own tile (an L1 hit): masking on the runtime step_hi instead would
        # lose the 16-byte vector loads, which need masks constant over 8 weights.
        k_next = tl.minimum(step + 1, step_hi - 1) * BLOCK_K + offs_kw
        w_next = tl.load(w_rows + k_next, mask=mask_wn & (k_next < K), other=0.0)
        kx = step * BLOCK_K + offs_c[None, :, None] + offs_v[None, None, :]  # [1, CHUNKS, VEC]
        xk = tl.load(x_rows + kx, mask=mask_m[:, None, None] & (kx < K), other=0.0)
        xk = xk.to(tl.float32)[:, None, :, :]  # [M_PAD, 1, CHUNKS, VEC]
        acc += tl.sum(w.to(tl.float32) * xk, axis=3)  # [M_PAD, BLOCK_N, CHUNKS]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]

    mask_y = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if USE_SPLIT:
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + mn, y, mask=mask_y)
        # Every thread's partial is stored before the one atomic that publishes them
        # (release); the last arriver's acquire makes all split_k partials visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for split in range(split_k):  # split order, not arrival order: deterministic
                total += tl.load(
                    part_ptr + split * M * N + mn, mask=mask_y, other=0.0, cache_modifier=".cg"
                )
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_y)
            tl.store(count_ptr + pid_n, 0)  # zero again for the next launch on this stream
    else:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_y)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Heuristic: 32 rows x 128 weights per step (8 KB, 64 B per thread at 4 warps; two
    steps in flight per program), 16 rows when N alone gives fewer tiles than SMs (kv_a's
    576 rows), and K split until there are ~4 programs per SM, each still streaming at
    least 2 steps (the second one overlaps the first's latency)."""
    sms = _sm_count(device)
    block_n, block_k = 32, 128
    if triton.cdiv(n, block_n) < sms:
        block_n = 16
    n_tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split = max(1, min(triton.cdiv(4 * sms, n_tiles), k_steps // 2))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)


def tile_fits(m: int, block_n: int, block_k: int) -> bool:
    """Whether a BLOCK_N x BLOCK_K tile at 4 warps keeps 16-byte loads and no spills at M."""
    weights = block_n * block_k
    return TILE_MIN_WEIGHTS <= weights <= (4096 if next_pow2(m) >= 8 else 8192)


def shape_key(m: int, n: int, k: int) -> str:
    return f"M{configs.m_bucket(m)}_N{n}_K{k}"


def choose_config(m: int, n: int, k: int, device: torch.device) -> dict:
    cfg = configs.lookup(OP, shape_key(m, n, k), device)
    return cfg if cfg is not None else default_config(m, n, k, device)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], x and weight both bf16 or both fp16, at
    most GEMV_MAX_M rows of x. float32 accumulation, one rounding to x's dtype."""
    assert weight.dtype in (torch.bfloat16, torch.float16), (
        f"weight must be bf16/fp16, got {weight.dtype}"
    )
    assert x.dtype == weight.dtype, f"x is {x.dtype} but weight is {weight.dtype}"
    assert weight.dim() == 2 and weight.stride(-1) == 1, "weight must be a row-major [N, K]"
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has K={x.shape[-1]} but weight is [N={n}, K={k}]"
    check_device(x, weight)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= GEMV_MAX_M, f"dense_gemv takes at most {GEMV_MAX_M} rows, got {m}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if k == 0:
        return y.zero_().reshape(*lead, n)
    cfg = config if config is not None else choose_config(m, n, k, x.device)
    block_n, block_k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    assert block_k % VEC == 0, f"BLOCK_K must be a multiple of {VEC}, got {block_k}"
    n_tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    # Splits take cdiv(k_steps, split) steps each; drop the ones that would get none.
    split = triton.cdiv(k_steps, triton.cdiv(k_steps, max(1, min(cfg["SPLIT_K"], k_steps))))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters(x.device, n_tiles)
    else:
        part = counts = y  # unused without a split
    dense_gemv_kernel[(n_tiles, split)](
        x2, weight, y, part, counts,
        m, n, k, split,
        x2.stride(0), weight.stride(0), y.stride(0),
        M_PAD=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, VEC=VEC,
        USE_SPLIT=split > 1,
        num_warps=cfg.get("num_warps", 4),
    )  # fmt: skip
    return y.reshape(*lead, n)
