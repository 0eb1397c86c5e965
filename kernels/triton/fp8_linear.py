"""FP8 block-scaled linear: y [M, OUT] = x [M, IN] @ W^T, W stored as E4M3 codes [OUT, IN]
with one scale per 128x128 block (DeepSeek V3 `weight_scale_inv` float32, or V4 E8M0
uint8). Legend: docs/shapes.md (the code's n, k and the kernels' N, K are OUT and IN).
Torch twins: kernels/reference/fp8_linear.py; @triton.jit bodies: _fp8_linear_kernels.py.

The default path loads the 1-byte codes, converts them to bf16 in registers (exact) and
never writes a bf16 weight to memory; it runs on any GPU Triton supports (Ampere too).
`native_fp8=True` (Hopper and newer) quantizes the activations per token per 128 block and
multiplies E4M3 x E4M3 on the tensor cores, behind the same call.

A GEMV kernel (M <= GEMV_MAX_M = 8): no tensor cores, each thread streams 16 contiguous
code bytes per row and multiplies them into the few activation rows with float32 FMAs.
When N alone gives too few programs to keep every SM streaming it also splits K, and the
last program of each row block sums the float32 partials in the same launch (arrival
counters). On the H200 (chains over weight copies larger than the L2, one graph) it beats
the dot kernel only for one row of a small matrix (Moonlight's q/kv_a/o_proj: 5.2-7.2 us
against 6.6-7.9); its FMAs grow with M, and large matrices stream faster through the dot
kernel, so by default it runs only there (`GEMV_DEFAULT_MAX_WEIGHTS`,
docs/notes-gpu-kernels.md). Everything else uses the tl.dot kernel; its split-K partials
are summed by one small launch.

The config (tuned table, else `default_config`) picks the kernel: "KERNEL": "gemv" or
"dot" (an entry without the key means "dot").

`fp8_gemv` is the GEMV on its own; `fp8_gemv_rmsnorm` takes RMSNorm(x + residual) as its
input instead (a decoder layer's input norm and first projection in one launch).
"""

from __future__ import annotations

import torch
import triton

from kernels.triton import configs
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, interpreting, next_pow2, sm_count
from kernels.triton._fp8_linear_kernels import (
    act_quant_kernel,
    fp8_block_linear_kernel,
    fp8_gemv_kernel,
    splitk_reduce_kernel,
)

OP = "fp8_linear"
FIXED_TABLE = "fixed_linear"  # the invariant configs, keyed by N and K alone
# Largest M the GEMV kernel takes: its registers grow with M (sm_90 build: ~245 per thread
# at M=8 with 32-row tiles, spills at 16), and at 8 FMAs per weight byte it is near the
# float32 FMA rate, where a 16-row MMA tile wastes little.
GEMV_MAX_M = 8
# The heuristic takes the GEMV for a single row of a matrix up to this many weights (the
# module docstring says why); a tuned table entry may choose it elsewhere.
GEMV_DEFAULT_MAX_WEIGHTS = 8 << 20


def default_gemv_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """GEMV heuristic: 32 rows x 256 bytes per step (8 KB, 64 B per thread at 4 warps), and
    split K until there are ~4 programs per SM, each still streaming at least 2 steps."""
    block_n, block_k = 32, 256
    n_tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split = max(1, min(triton.cdiv(4 * sm_count(device), n_tiles), k_steps // 2))
    return dict(
        KERNEL="gemv",
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        VEC=16,
        SPLIT_K=split,
        BIT_DECODE=False,
        num_warps=4,
    )


def default_config(m: int, n: int, k: int, device: torch.device, native_fp8: bool = False) -> dict:
    """Heuristic used when the tuned table has no entry for this shape."""
    if m == 1 and n * k <= GEMV_DEFAULT_MAX_WEIGHTS and not native_fp8:
        return default_gemv_config(m, n, k, device)
    if m <= 32:
        block_m, block_n, block_k = 16, 64, 128
        n_tiles = triton.cdiv(n, block_n)
        k_steps = triton.cdiv(k, block_k)
        # Enough programs for ~4 waves of one per SM; each split still streams >= 4 steps.
        split = max(1, min(triton.cdiv(4 * sm_count(device), n_tiles), k_steps // 4))
        return dict(
            KERNEL="dot",
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=split,
            num_warps=4,
            num_stages=4,
        )
    # Prefill and large decode batches: 128x128 tiles when the matrix gives enough of
    # them; the engine's matrices are small (N 576..3072 at hidden 2048), where 128x128
    # tiles leave most SMs idle (q_proj at M=256: 48 programs for 132 SMs), so narrower
    # tiles, then split-K, until every SM has a program.
    sms = sm_count(device)
    block_m, block_n = (64 if m <= 64 else 128), 128

    def programs() -> int:
        return triton.cdiv(n, block_n) * triton.cdiv(m, block_m)

    if programs() < sms:
        block_n = 64
    if programs() < sms and block_m == 128:
        block_m = 64
    split = max(1, min(triton.cdiv(sms, programs()), triton.cdiv(k, 128) // 4))
    return dict(
        KERNEL="dot",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=128,
        SPLIT_K=split,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4,
        num_stages=3,
    )


def fixed_config(n: int, k: int, device: torch.device) -> dict:
    """A config chosen from N and K alone, for callers that need a row's bits not to depend
    on how many rows it is computed with: the tuned one for this device
    (kernels/tune/invariant_linear.py), else heuristic_fixed_config. Its "TILES" (tiles
    by row count, which no row's bits depend on) are applied by fp8_block_linear."""
    return configs.lookup(FIXED_TABLE, f"fp8_N{n}_K{k}", device) or heuristic_fixed_config(
        n, k, device
    )


def heuristic_fixed_config(n: int, k: int, device: torch.device) -> dict:
    """Always the bf16-decode dot kernel (no GEMV, no native FP8, which are picked by M),
    16-row tiles, and a K split fixed per shape (the partials are summed in split order)."""
    block_n, block_k = 64, 128
    split = max(1, min(triton.cdiv(4 * sm_count(device), triton.cdiv(n, block_n)),
                       triton.cdiv(k, block_k) // 4))  # fmt: skip
    return dict(KERNEL="dot", BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                num_warps=4, num_stages=4)  # fmt: skip


def shape_key(m: int, n: int, k: int, native_fp8: bool) -> str:
    return f"M{configs.m_bucket(m)}_N{n}_K{k}" + ("_native" if native_fp8 else "")


def choose_config(m: int, n: int, k: int, device: torch.device, native_fp8: bool) -> dict:
    cfg = configs.lookup(OP, shape_key(m, n, k, native_fp8), device)
    if cfg is not None and (cfg.get("KERNEL") != "gemv" or m <= GEMV_MAX_M):
        return cfg
    return default_config(m, n, k, device, native_fp8)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 codes [M, K], float32 scales [M, ceil(K/128)]), per token per 128."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"act_quant needs a row-major [M, K], got {x.shape}"
    check_device(x)
    m, k = x.shape
    nkb = triton.cdiv(k, 128)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, nkb), dtype=torch.float32, device=x.device)
    if m:
        rows = min(16, next_pow2(m))
        act_quant_kernel[(triton.cdiv(m, rows), nkb)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_ROWS=rows, BLOCK=128
        )
    return q, s


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    native_fp8: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """x [..., K] bf16/fp16; weight [N, K] float8_e4m3fn; scale [ceil(N/128), ceil(K/128)]
    float32 (V3) or uint8 E8M0 (V4). Returns [..., N] in x's dtype."""
    assert weight.dtype == torch.float8_e4m3fn, f"weight must be float8_e4m3fn, got {weight.dtype}"
    assert weight.dim() == 2 and weight.stride(-1) == 1, "weight must be a row-major [N, K]"
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has K={x.shape[-1]} but weight is [N={n}, K={k}]"
    assert x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16/fp16, got {x.dtype}"
    nkb, nnb = triton.cdiv(k, 128), triton.cdiv(n, 128)
    assert scale.shape == (nnb, nkb), f"scale must be [{nnb}, {nkb}], got {list(scale.shape)}"
    assert scale.dtype in (torch.float32, torch.uint8), (
        f"scale must be float32 or uint8 (E8M0), got {scale.dtype}"
    )
    assert scale.stride(-1) == 1, "scale must be row-major"
    check_device(x, weight, scale)

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    cfg = dict(config) if config is not None else choose_config(m, n, k, x.device, native_fp8)
    cfg = configs.with_row_tiles(cfg, m)
    if cfg.get("KERNEL", "dot") == "gemv":
        assert not native_fp8, "the GEMV kernel multiplies in float32: no native FP8 path"
        return fp8_gemv(x2, weight, scale, cfg).reshape(*lead, n)
    assert 128 % cfg["BLOCK_K"] == 0, f"BLOCK_K must divide 128, got {cfg['BLOCK_K']}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)

    if native_fp8:
        xin, xs = act_quant(x2)
    else:
        xin, xs = x2, x2  # xs is unused when NATIVE_FP8 is off
    split = cfg["SPLIT_K"]
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    fp8_block_linear_kernel[grid](
        xin, xs, weight, scale, out,
        m, n, k,
        xin.stride(0), weight.stride(0), scale.stride(0), xs.stride(0),
        out.stride(0) if split > 1 else 0, n, split,
        SCALE_E8M0=scale.dtype == torch.uint8,
        NATIVE_FP8=native_fp8,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        F32_DOT=interpreting(), SWAP_AB=cfg.get("SWAP_AB", False),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )  # fmt: skip
    if split > 1:
        numel = m * n
        splitk_reduce_kernel[(triton.cdiv(numel, 1024),)](
            out, y, numel, SPLIT=split, BLOCK=1024, num_warps=4
        )
    return y.reshape(*lead, n)


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: dict
) -> torch.Tensor:
    """[M, N] = x [M, K] @ dequant(weight)^T in x's dtype, through fp8_gemv_kernel
    (M <= GEMV_MAX_M). `config`: a GEMV config (default_gemv_config's keys)."""
    k = weight.shape[1]
    assert x.shape[1] == k, f"x has {x.shape[1]} columns; weight [N={weight.shape[0]}, K={k}]"
    return _gemv(x, weight, scale, config)


def fp8_gemv_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale: torch.Tensor,
    config: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ dequant(weight)^T, x + residual) in one launch, the pair
    kernels/triton/rmsnorm.py and fp8_gemv give in two: x [M, K] float32 or the residual's
    dtype, residual [M, K] bf16/fp16, norm_weight [K]. Both results in the residual's
    dtype. Torch twin: kernels/reference/fp8_linear.fp8_gemv_rmsnorm_reference."""
    m, k = x.shape
    assert residual.shape == (m, k) and residual.stride(-1) == 1, (
        f"residual must be a row-major [{m}, {k}], got {list(residual.shape)}"
    )
    assert residual.dtype in (torch.bfloat16, torch.float16), (
        f"residual must be bf16/fp16, got {residual.dtype}"
    )
    assert x.dtype in (residual.dtype, torch.float32), (
        f"x must be the residual's dtype ({residual.dtype}) or float32, got {x.dtype}"
    )
    assert norm_weight.shape == (k,) and weight.shape[1] == k, (
        f"norm weight {list(norm_weight.shape)} and weight {list(weight.shape)} vs K={k}"
    )
    new_residual = torch.empty_like(residual)
    out = _gemv(x, weight, scale, config, (residual, norm_weight, eps, new_residual))
    return out, new_residual


def _gemv(x, weight, scale, config, norm=None) -> torch.Tensor:
    """fp8_gemv_kernel's launch; `norm` (residual, weight, eps, residual out) or None."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "x and weight must be row-major"
    assert m <= GEMV_MAX_M, f"the GEMV kernel takes M <= {GEMV_MAX_M}, got {m}"
    dtype = norm[0].dtype if norm is not None else x.dtype
    out = torch.empty((m, n), dtype=dtype, device=x.device)
    block_n, block_k, vec = config["BLOCK_N"], config["BLOCK_K"], config.get("VEC", 16)
    assert 128 % vec == 0 and block_k % vec == 0, (
        f"VEC must divide 128 and BLOCK_K, got VEC={vec}, BLOCK_K={block_k}"
    )
    n_tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    # Splits take cdiv(k_steps, SPLIT_K) steps each; drop the ones that would get none.
    split = triton.cdiv(k_steps, triton.cdiv(k_steps, max(1, min(config["SPLIT_K"], k_steps))))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters(x.device, n_tiles)
    else:
        part = counts = out  # unused: one split writes out directly
    residual, norm_weight, eps, new_residual = norm if norm is not None else (out, out, 0.0, out)
    bit_decode = bool(config.get("BIT_DECODE", False))
    codes = weight.view(torch.int8) if bit_decode else weight
    m_pad = next_pow2(m)
    fp8_gemv_kernel[(n_tiles, split)](
        x, codes, scale, out, part, counts, residual, norm_weight, new_residual,
        m, n, k, float(eps),
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0), residual.stride(0),
        SCALE_E8M0=scale.dtype == torch.uint8,
        M_PAD=m_pad,
        BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec,
        SPLIT_K=split,
        BIT_DECODE=bit_decode,
        PRENORM=norm is not None,
        # the rms pass's row chunk: ~2K values per array in flight over the M rows
        NORM_BLOCK=max(128, min(next_pow2(k), 2048 // m_pad)),
        num_warps=config.get("num_warps", 4),
    )  # fmt: skip
    return out
