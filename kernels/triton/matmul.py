"""A matmul whose result for a row does not depend on how many rows it is computed with.

  fixed_linear(x [..., K], w [N, K])      -> x @ w^T  [..., N]
  fixed_bmm(a [S, M, K], b [S, K, N])     -> a @ b    [S, M, N]

cuBLAS picks its algorithm (and split-K) by the problem's shape, M included, so a row's
bits change with its batch. Here BLOCK_K, the K split and the order the split partials are
added in are chosen from N and K alone (fixed_config), every program accumulates its K
range in BLOCK_K steps in order, and the splits are summed in split order: a row's
arithmetic is the same at every M. Only the tiles, and whether a program sums its own
splits, follow M (launch_config), which no row's bits depend on. float32 operands multiply in float32
(IEEE), others on the tensor cores with a float32 accumulator. Legend: docs/shapes.md.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton import configs
from kernels.triton._common import check_device, interpreting, sm_count
from kernels.triton._matmul_kernels import fixed_matmul_kernel, split_sum_kernel

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Rows from which a call takes LARGE_TILES with its K splits summed in the program.
LARGE_M = 512
LARGE_TILES = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)

TABLE = "fixed_linear"  # kernels/triton/configs/fixed_linear.json, by shape_key


def shape_key(n: int, k: int, dtype: torch.dtype) -> str:
    return f"matmul_{str(dtype).removeprefix('torch.')}_N{n}_K{k}"


def fixed_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The launch config of every call on an [N, K] operand: the tuned one for this device
    (kernels/tune/invariant_linear.py), else heuristic_config. Never a function of M."""
    return configs.lookup(TABLE, shape_key(n, k, dtype), device) or heuristic_config(
        n, k, dtype, device
    )


def heuristic_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tiles of 64 rows (a decode step's few rows waste MMA lanes, not bandwidth: the weight
    is read once per row tile) and 64 columns; K split until the column tiles x splits
    give every SM a program, each split keeping >= 4 steps of BLOCK_K."""
    block_k = 32 if dtype == torch.float32 else 64
    n_tiles = triton.cdiv(n, 64)
    steps = triton.cdiv(k, block_k)
    split = max(1, min(triton.cdiv(sm_count(device), n_tiles), steps // 4))
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=3)


def launch_config(cfg: dict, m: int, dtype: torch.dtype) -> dict:
    """The launch of `cfg` (fixed_config's) for an M-row call. A row's bits depend only on
    BLOCK_K and the K split (see _k_range), so below LARGE_M rows the tiles are the ones
    the tuner measured at the nearest row count (the entry's "TILES", configs.with_row_tiles),
    and at LARGE_M rows and more, where the row tiles alone fill the GPU, they grow to
    LARGE_TILES and each program sums its row tile's K splits itself (INLINE), in the order
    split_sum_kernel would: the same bits without the float32 partials' write and read.
    float32 (the IEEE dot, no tensor cores) keeps its row-count tiles at every M."""
    if cfg.get("INLINE"):
        return cfg
    cfg = configs.with_row_tiles(cfg, m)
    if m < LARGE_M or dtype == torch.float32:
        return cfg
    return {**cfg, **LARGE_TILES, "INLINE": int(cfg["SPLIT_K"] > 1)}


def fixed_bmm(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """a [S, M, K] @ b [S, K, N] -> [S, M, N] in out_dtype (default a's). Any strides."""
    assert a.dim() == 3 and b.dim() == 3, (
        f"a and b must be [S, M, K], [S, K, N]: {a.shape}, {b.shape}"
    )
    s, m, k = a.shape
    assert b.shape[0] == s and b.shape[1] == k, f"b {list(b.shape)} vs a {list(a.shape)}"
    return _launch(a, b.transpose(1, 2), out_dtype or a.dtype)


def fixed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
):
    """x [..., K] @ weight [N, K]^T -> [..., N] in out_dtype (default x's). `config`
    overrides launch_config (the tuner's candidates)."""
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], (
        f"x [..., {x.shape[-1]}] vs weight {list(weight.shape)}"
    )
    lead = x.shape[:-1]
    y = _launch(x.reshape(1, -1, x.shape[-1]), weight[None], out_dtype or x.dtype, config)
    return y.reshape(*lead, weight.shape[0])


def _launch(
    a: torch.Tensor, b_nk: torch.Tensor, out_dtype: torch.dtype, config: dict | None = None
) -> torch.Tensor:
    """a [S, M, K] @ b_nk [S, N, K]^T."""
    assert a.dtype in DTYPES and b_nk.dtype == a.dtype, (
        f"operands must share one of {DTYPES}: {a.dtype}, {b_nk.dtype}"
    )
    check_device(a, b_nk)
    s, m, k = a.shape
    n = b_nk.shape[1]
    out = torch.empty((s, m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if config is not None:
        cfg = configs.with_row_tiles(config, m)
    else:
        cfg = launch_config(fixed_config(n, k, a.dtype, a.device), m, a.dtype)
    split, inline = cfg["SPLIT_K"], cfg.get("INLINE", 0)
    separate = split > 1 and not inline  # the partials summed by split_sum_kernel
    part = torch.empty((split, s, m, n), dtype=torch.float32, device=a.device) if separate else out
    grid = (
        triton.cdiv(n, cfg["BLOCK_N"]),
        triton.cdiv(m, cfg["BLOCK_M"]),
        s * (split if separate else 1),
    )
    fixed_matmul_kernel[grid](
        a, b_nk, part, m, n, k,
        a.stride(0), a.stride(1), a.stride(2), b_nk.stride(0), b_nk.stride(1), b_nk.stride(2),
        part.stride(0) if separate else 0, part.stride(-3), part.stride(-2),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split,
        INLINE=int(inline),
        IEEE=a.dtype == torch.float32 and not interpreting(), F32_DOT=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if separate:
        numel = out.numel()
        split_sum_kernel[(triton.cdiv(numel, 1024),)](part, out, numel, SPLIT=split, BLOCK=1024)
    return out
