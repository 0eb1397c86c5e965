"""Fused MoE for routed experts (and optionally the shared expert) in three or four
launches:

Legend: docs/shapes.md (T tokens, D hidden, I expert intermediate, E experts, K experts
per token; T*K (token, expert) pairs). Torch twin: kernels/reference/fused_moe.py.

  1. moe_align groups the T*K pairs by expert, padded to BLOCK_M tiles (one Triton launch
     for one chunk of pairs, two above; no sync), and zeroes the float32 accumulator
     y [T, D] in the same launch. At decode sizes the caller may instead pass
     moe_prologue's result, whose one launch also routed the tokens (`prologue=`).
  2. gate+up: one GEMM over the stacked [E, 2I, D] weight (gate rows first, then up),
     SiLU(gate) * up fused in the epilogue -> h [T*K, I]; with a `swiglu_limit` (V4) gate
     is clamped from above and up to [-limit, limit] before it.
  3. down: h @ W2[e]^T over [E, D, I], times the pair's routing weight, atomically added
     into the token's row of y (the combine, no [T*K, D] buffer and no reduction launch;
     optionally split along K, the splits meeting in the same atomics).
  4. y -> x's dtype, unless the caller takes the float32 y (out_dtype), as the engine does:
     its next step is the fused RMSNorm's residual add.
A shared expert (DeepSeek's, unweighted) adds two launches of the same kernels in DENSE
mode (every row is one token, one expert, no alignment), accumulating into the same y, so
`routed + shared` costs no add either.

Weights: "bf16" (or fp16) stacked tensors; "fp8": E4M3 codes with 128x128 block scales per
expert ([E, ceil(N/128), ceil(K/128)], float32 or E8M0 uint8); "mxfp4": packed uint8
[E, N, K/2] with E8M0 scales [E, N, K/32]. Codes are decoded in registers. MXFP4 decodes
each nibble to bf16 with its group scale folded in (exact for E8M0 scales up to 2^1, i.e.
|w| <= 12, which every real checkpoint's experts are far inside; a larger scale is clamped
to 2^1, and the engine refuses such checkpoints at load) and multiplies bf16 activations
(fp16 ones are rounded to bf16 first).

MXFP4 experts also have an int8 path for 1-8 tokens (config "KERNEL": "int8",
_moe_int8_kernels.py): the codes become exact int8 through a byte-permute table and meet
the activations, quantized to int8 per 32 (x by one extra launch, h by the gate+up
epilogue), in dp4a; ~3 instructions per weight against the MMA kernels' ~8.4, where those
are issue-bound. Only a tuned table entry selects it (the H200's table does at 1-8 tokens).

At prefill sizes MXFP4 experts may instead be decoded to bf16 once per call, into a
scratch the bf16 kernels then read (config "KERNEL": "dequant", with the bf16 kernels'
tile; mxfp4_dequant.py says why), where every token tile decoding them again costs more.
Only a tuned table entry selects it, and only for bf16 activations while the scratch fits
DEQUANT_MAX_BYTES.

Decode shapes (few pairs per expert) use BLOCK_M=16 and narrow N tiles so the few touched
experts' weights are spread over every SM; prefill shapes use larger BLOCK_M. Configs come
from configs/fused_moe.json when tuned for the device, else the heuristic below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.triton import configs
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._fused_moe_kernels import (
    moe_down_kernel,
    moe_gate_up_kernel,
    ordered_pair_sum_kernel,
)
from kernels.triton._moe_int8_kernels import (
    INT8_QUANT_BLOCK,
    act_quant_int8_kernel,
    moe_down_int8_kernel,
    moe_gate_up_int8_kernel,
)
from kernels.triton.moe_align import moe_align
from kernels.triton.moe_prologue import MoePrologue

OP = "fused_moe"
# The largest E8M0 scale byte (2^1) the MXFP4 decode is exact for; callers check their
# checkpoint's scales against it once at load (engine/backends/cuda.py).
MXFP4_MAX_EXACT_SCALE = 128
WEIGHT_FORMATS = {"bf16": 0, "fp8": 1, "mxfp4": 3}
# The largest bf16 scratch a "dequant" config may take (both projections of a layer's
# experts; Moonlight's: 1.1 GB); above it the MXFP4 kernels run with the heuristic's tile.
DEQUANT_MAX_BYTES = 2 << 30


@dataclass
class SharedExpert:
    """A dense SwiGLU MLP added unweighted to every token's routed output.
    w13 [2Is, D(/2)] gate rows then up rows; w2 [D, Is(/2)]; formats as fused_moe's."""

    fmt: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    swiglu_limit: float | None = None  # its activation's clamp, as fused_moe's


@dataclass
class PendingSharedExpert:
    """A shared expert whose gate+up runs on a side stream (start_shared_expert); passed
    to fused_moe as `shared`, its down adds into the accumulator on the same stream."""

    shared: SharedExpert
    stream: torch.cuda.Stream
    h: torch.Tensor  # its gate+up output [T, Is], on `stream`

    def join(self) -> None:
        """The caller's stream waits for the side stream (idempotent)."""
        torch.cuda.current_stream(self.h.device).wait_stream(self.stream)


def start_shared_expert(
    x: torch.Tensor, shared: SharedExpert, stream: torch.cuda.Stream
) -> PendingSharedExpert:
    """Launch the shared expert's gate+up on `stream` once x is ready, so that it runs
    beside whatever the caller launches next (the routing, the routed experts). The caller
    must join it (fused_moe does, or PendingSharedExpert.join) before x or the result is
    reused."""
    stream.wait_stream(torch.cuda.current_stream(x.device))  # x is ready
    with torch.cuda.stream(stream):
        h = _shared_gate_up(x, shared, x.shape[1], lane="shared_expert")
    return PendingSharedExpert(shared, stream, h)


def dense_config(num_tokens: int, d: int, i: int, fmt: str, device=None) -> dict:
    """Shared-expert launches at decode sizes (the caller keeps larger T on cuBLAS): the
    tuned entry for one expert taken by every token (`bench kernels` times it as a routed
    MoE of E=1, K=1: the same tiles), else narrow N tiles so a single expert's rows still
    spread over ~1 wave of programs."""
    tuned = configs.lookup(OP, shape_key(num_tokens, 1, 1, d, i, fmt), device)
    if tuned is not None:
        return tuned
    block_m, block_n = (16, 16) if num_tokens <= 16 else (32, 32)
    block_k = {"bf16": 64, "fp8": 128, "mxfp4": 128}[fmt]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)


def default_config(num_pairs: int, num_experts: int, fmt: str) -> dict:
    """Heuristic: BLOCK_M follows the expected pairs per expert."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif per_expert <= 64:
        block_m, block_n, warps, stages = 32, 64, 4, 3
    else:
        block_m, block_n, warps, stages = 64, 128, 8, 3
    block_k = {"bf16": 64, "fp8": 128, "mxfp4": 128}[fmt]
    # Prefill sizes: token tiles in launch-order groups (_tile_ids), as the tuned H200
    # winners at 4K and 16K tokens have them (GROUP_M 4-8; not measured below 4K).
    group = {"GROUP_M": 8} if per_expert > 64 else {}
    if fmt == "mxfp4":
        # Weights on wgmma's register side (SWAP_AB): the tuned winner at every Moonlight
        # decode size on the H200, 1 to 256 tokens. 64 weight rows per tile (one warpgroup).
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True,
                    num_warps=4, num_stages=3, **group)  # fmt: skip
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=warps, num_stages=stages, **group)  # fmt: skip


def shape_key(num_tokens: int, top_k: int, num_experts: int, d: int, i: int, fmt: str) -> str:
    return f"T{configs.m_bucket(num_tokens)}_A{top_k}_E{num_experts}_D{d}_I{i}_{fmt}"


def _check_weight(name, w, scale, fmt, e, n, k):
    if fmt == "bf16":
        assert w.dtype in (torch.bfloat16, torch.float16), f"{name} must be bf16/fp16 for 'bf16'"
        assert w.shape == (e, n, k), f"{name} must be [{e}, {n}, {k}], got {list(w.shape)}"
    elif fmt == "fp8":
        assert w.dtype == torch.float8_e4m3fn, f"{name} must be float8_e4m3fn, got {w.dtype}"
        assert w.shape == (e, n, k), f"{name} must be [{e}, {n}, {k}], got {list(w.shape)}"
        want = (e, triton.cdiv(n, 128), triton.cdiv(k, 128))
        assert scale is not None and scale.shape == want, (
            f"{name} scale must be {list(want)}, got {None if scale is None else list(scale.shape)}"
        )
        assert scale.dtype in (torch.float32, torch.uint8), f"{name} scale: float32 or E8M0 uint8"
    elif fmt == "mxfp4":
        assert k % 32 == 0, f"{name}: MXFP4 needs K divisible by 32, got {k}"
        assert w.dtype == torch.uint8, f"{name} must be packed uint8 for 'mxfp4', got {w.dtype}"
        assert w.shape == (e, n, k // 2), (
            f"{name} must be [{e}, {n}, {k // 2}], got {list(w.shape)}"
        )
        assert scale is not None and scale.dtype == torch.uint8, f"{name} scale must be E8M0 uint8"
        assert scale.shape == (e, n, k // 32), (
            f"{name} scale must be [{e}, {n}, {k // 32}], got {list(scale.shape)}"
        )
    else:
        raise ValueError(
            f"unknown expert weight format {fmt!r}; expected one of {list(WEIGHT_FORMATS)}"
        )
    assert w.stride(-1) == 1 and w.stride(-2) == w.shape[-1], (
        f"{name} must be contiguous per expert"
    )
    if scale is not None:
        assert scale.stride(-1) == 1, f"{name} scale must be row-major"


def _wfmt(fmt: str, scale: torch.Tensor | None) -> int:
    if fmt == "fp8" and scale is not None and scale.dtype == torch.uint8:
        return 2  # FP8 with E8M0 block scales
    return WEIGHT_FORMATS[fmt]


def _scale_args(w: torch.Tensor, scale: torch.Tensor | None, expert_dim: bool):
    """(scale pointer, expert stride, row stride); the weight stands in for absent scales."""
    if scale is None:
        return w, 0, 0
    if expert_dim:
        return scale, scale.stride(0), scale.stride(1)
    return scale, 0, scale.stride(0)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fmt: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: dict | None = None,
    shared: SharedExpert | PendingSharedExpert | None = None,
    out_dtype: torch.dtype | None = None,
    shared_stream: torch.cuda.Stream | None = None,
    prologue: MoePrologue | None = None,
    ordered_combine: bool = False,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """x [T, D] bf16/fp16; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I];
    topk_weights [T, K] float32; topk_ids [T, K] int. Returns [T, D] in out_dtype (default
    x's dtype): sum_k topk_weights[t, k] * down(silu(gate(x_t)) * up(x_t)) of expert
    topk_ids[t, a], plus shared(x_t) when a shared expert is given. out_dtype float32
    returns the combine's accumulator itself (no cast launch). swiglu_limit: the routed
    experts' clamp, min(gate, limit) and up within [-limit, limit] before the SiLU (the
    shared expert's is its own SharedExpert.swiglu_limit); None computes no clamp.

    shared_stream: the shared expert's two launches run there, at the same time as the
    routed experts' (both add into the accumulator with atomics once moe_align has zeroed
    it). At a few tokens every launch here is latency-bound, far under the bandwidth, so
    the two chains overlap; the caller's stream waits for the side stream before return.
    A PendingSharedExpert (start_shared_expert's) as `shared`: its gate+up already runs on
    its stream, from before the caller's routing; its down joins the accumulator here.

    ordered_combine: each (token, slot) pair's output is written to a row of its own and
    the slots are summed in order by one more launch, instead of atomically added in the
    order the expert tiles finish; with the config left to invariant_config (config None)
    a token's result then depends on nothing but its own routing. Takes no prologue, no
    shared expert, no int8 or dequant config and no K split.

    prologue: moe_prologue's launch already routed (topk_weights and topk_ids are then
    its own), grouped the pairs for `config` (choose_config's), quantized x if that is an
    int8 config and zeroed the accumulator, which is then the result's storage."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be a row-major [T, D], got {list(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16/fp16, got {x.dtype}"
    t, d = x.shape
    e = w13.shape[0]
    i = w2.shape[-1] * (2 if fmt == "mxfp4" else 1)
    _check_weight("w13", w13, w13_scale, fmt, e, 2 * i, d)
    _check_weight("w2", w2, w2_scale, fmt, e, d, i)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (
        f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must be [T={t}, K]"
    )
    check_device(x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.empty_like(x)
    if ordered_combine and config is None:
        cfg = invariant_config(t, top_k, e, d, i, fmt, x.device)
    else:
        cfg = choose_config(t, top_k, e, d, i, fmt, x.device, config)
    if cfg.get("KERNEL") == "dequant":
        assert prologue is None, "a dequant config is for prefill sizes, not the prologue's"
        scratch = 2 * (w13.numel() + w2.numel()) * 2  # bf16, two weights per code byte
        # bf16 activations only: the bf16 kernels multiply x by the weights as they are,
        # and fp16 x against bf16 weights is no dot Triton compiles
        if scratch <= DEQUANT_MAX_BYTES and x.dtype == torch.bfloat16:
            from kernels.triton.mxfp4_dequant import dequant_mxfp4

            return fused_moe(
                x, dequant_mxfp4(w13, w13_scale), dequant_mxfp4(w2, w2_scale),
                topk_weights, topk_ids, "bf16",
                config={k: v for k, v in cfg.items() if k != "KERNEL"},
                shared=shared, out_dtype=out_dtype, shared_stream=shared_stream,
                swiglu_limit=swiglu_limit,
            )  # fmt: skip
        cfg = default_config(t * top_k, e, fmt)
    int8 = cfg.get("KERNEL") == "int8"
    if ordered_combine:
        assert prologue is None and shared is None and not int8, (
            "ordered_combine takes no prologue, no shared expert and no int8 config"
        )
        assert down_config(cfg).get("SPLIT_K", 1) == 1 and cfg.get("GU_SPLIT_K", 1) == 1, (
            "ordered_combine takes no K split"
        )
        return _ordered_moe(x, w13, w2, topk_weights, topk_ids, fmt, w13_scale, w2_scale, cfg,
                            out_dtype, swiglu_limit)  # fmt: skip
    if prologue is None:
        y = torch.empty((t, d), dtype=torch.float32, device=x.device)  # zeroed by moe_align
        align = moe_align(topk_ids, e, cfg["BLOCK_M"], zero=y)
        x_int8 = None  # quantized below, once the shared expert's stream has forked
    else:
        y, align, x_int8 = prologue.acc, prologue.alignment, prologue.x_int8
        assert align.block_m == cfg["BLOCK_M"] and (x_int8 is not None) == int8, (
            "the prologue was launched for another config than this call's"
        )
        assert topk_ids is prologue.topk_ids and topk_weights is prologue.topk_weights, (
            "topk_ids and topk_weights must be the prologue's own"
        )
        assert y.shape == (t, d), f"a prologue for {list(y.shape)}, not [{t}, {d}]"
    p = align.num_pairs
    max_blocks = align.block_expert.numel()
    route_w = topk_weights.reshape(-1)
    if route_w.dtype != torch.float32 or not route_w.is_contiguous():
        route_w = route_w.to(torch.float32).contiguous()
    h = None if int8 else torch.empty((p, i), dtype=x.dtype, device=x.device)
    s13, *s13_strides = _scale_args(w13, w13_scale, expert_dim=True)
    s2, *s2_strides = _scale_args(w2, w2_scale, expert_dim=True)
    meta = _launch_meta(cfg) if cfg.get("KERNEL") != "int8" else {}
    down = down_config(cfg)
    pairs, groups = align.sorted_pairs, align.block_expert
    pending = shared if isinstance(shared, PendingSharedExpert) else None
    assert pending is None or pending.h.shape[0] == t, "a shared expert started for another x"
    inline = shared if pending is None and shared_stream is None else None  # on this stream
    try:  # the join runs even if a launch raises: y must outlive the side stream's atomics
        if pending is None and shared is not None and shared_stream is not None:
            pending = start_shared_expert(x, shared, shared_stream)
        if pending is not None:
            # y is zeroed (moe_align or the prologue, launched before on this stream)
            pending.stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(pending.stream):
                _shared_down(pending.h, pending.shared, y)
        if int8:
            xq, xs = x_int8 if x_int8 is not None else _act_quant_int8(x)
            hq = torch.empty((p, i // 4), dtype=torch.int32, device=x.device)
            hs = torch.empty((p, i // 32), dtype=torch.float32, device=x.device)
            w13_words, w2_words = w13.view(torch.int32), w2.view(torch.int32)
            moe_gate_up_int8_kernel[(max_blocks, triton.cdiv(i, cfg["BLOCK_N"]))](
                xq, xs, w13_words, s13, hq, hs, pairs, groups,
                p, d, i, d // 8,
                xq.stride(0), xs.stride(0), w13_words.stride(0), w13_words.stride(1), *s13_strides,
                hq.stride(0), hs.stride(0),
                TOPK=top_k, SWIGLU_LIMIT=_limit(swiglu_limit), **_int8_meta(cfg),
            )  # fmt: skip
        else:
            moe_gate_up_kernel[(max_blocks, _gate_up_tiles(i, cfg), cfg.get("GU_SPLIT_K", 1))](
                x, w13, s13, h, pairs, groups, *_gate_up_split_buffers(max_blocks, i, cfg, h),
                p, d, i,
                x.stride(0), w13.stride(0), w13.stride(1), *s13_strides, h.stride(0),
                TOPK=top_k, WFMT=_wfmt(fmt, w13_scale), DENSE=False,
                GU_SPLIT_K=cfg.get("GU_SPLIT_K", 1), SWIGLU_LIMIT=_limit(swiglu_limit), **meta,
            )  # fmt: skip
        if inline is not None:
            h_shared = _shared_gate_up(x, inline, d)
        if int8:
            moe_down_int8_kernel[(max_blocks, triton.cdiv(d, down["BLOCK_N"]))](
                hq, hs, w2_words, s2, route_w, y, pairs, groups,
                p, d, i, i // 8,
                hq.stride(0), hs.stride(0), w2_words.stride(0), w2_words.stride(1), *s2_strides,
                y.stride(0),
                TOPK=top_k, **_int8_meta(down),
            )  # fmt: skip
        else:
            # The down GEMM may split K (its partials meet in the atomic combine anyway): at a
            # few tokens its D / BLOCK_N tiles of the few touched experts fill too few SMs.
            split = down.get("SPLIT_K", 1)
            moe_down_kernel[(max_blocks, triton.cdiv(d, down["BLOCK_N"]), split)](
                h, w2, s2, route_w, y, pairs, groups,
                p, d, i,
                h.stride(0), w2.stride(0), w2.stride(1), *s2_strides, y.stride(0),
                TOPK=top_k, WFMT=_wfmt(fmt, w2_scale), DENSE=False, SPLIT_K=split,
                **_launch_meta(down),
            )  # fmt: skip
        if inline is not None:
            _shared_down(h_shared, inline, y)
    finally:
        if pending is not None:
            pending.join()
    return y if out_dtype == torch.float32 else y.to(out_dtype or x.dtype)


def _ordered_moe(
    x, w13, w2, topk_weights, topk_ids, fmt, w13_scale, w2_scale, cfg, out_dtype, swiglu_limit
):
    """fused_moe with ordered_combine: gate+up as usual, the down launch writing pair rows
    (TOPK 1 makes each pair its own "token"), then the in-order slot sum."""
    t, d = x.shape
    top_k = topk_ids.shape[1]
    e = w13.shape[0]
    i = w2.shape[-1] * (2 if fmt == "mxfp4" else 1)
    pair_rows = torch.empty((t * top_k, d), dtype=torch.float32, device=x.device)
    align = moe_align(topk_ids, e, cfg["BLOCK_M"], zero=pair_rows)
    p, max_blocks = align.num_pairs, align.block_expert.numel()
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty((p, i), dtype=x.dtype, device=x.device)
    s13, *s13_strides = _scale_args(w13, w13_scale, expert_dim=True)
    s2, *s2_strides = _scale_args(w2, w2_scale, expert_dim=True)
    pairs, groups = align.sorted_pairs, align.block_expert
    moe_gate_up_kernel[(max_blocks, _gate_up_tiles(i, cfg), 1)](
        x, w13, s13, h, pairs, groups, *_gate_up_split_buffers(max_blocks, i, cfg, h),
        p, d, i,
        x.stride(0), w13.stride(0), w13.stride(1), *s13_strides, h.stride(0),
        TOPK=top_k, WFMT=_wfmt(fmt, w13_scale), DENSE=False, GU_SPLIT_K=1,
        SWIGLU_LIMIT=_limit(swiglu_limit), **_launch_meta(cfg),
    )  # fmt: skip
    down = down_config(cfg)
    moe_down_kernel[(max_blocks, triton.cdiv(d, down["BLOCK_N"]), 1)](
        h, w2, s2, route_w, pair_rows, pairs, groups,
        p, d, i,
        h.stride(0), w2.stride(0), w2.stride(1), *s2_strides, pair_rows.stride(0),
        TOPK=1, WFMT=_wfmt(fmt, w2_scale), DENSE=False, SPLIT_K=1, **_launch_meta(down),
    )  # fmt: skip
    y = torch.empty((t, d), dtype=torch.float32, device=x.device)
    block_d = min(1024, next_pow2(d))
    ordered_pair_sum_kernel[(t, triton.cdiv(d, block_d))](pair_rows, y, d, TOPK=top_k,
                                                          BLOCK_D=block_d)  # fmt: skip
    return y if out_dtype == torch.float32 else y.to(out_dtype or x.dtype)


def fixed_config(fmt: str) -> dict:
    """The decode heuristic's config, whose K step and orientation fix a token's bits under
    ordered_combine (see invariant_config)."""
    return default_config(1, 1, fmt)


# What a token's bits depend on under ordered_combine, in each launch: the K step and which
# operand is on wgmma's register side (a tl.dot's row of results does not depend on the
# tile's rows or columns, its warps or stages, nor on the order the tiles run in: checked
# on the H200 in bf16, FP8 and MXFP4, docs/batch-invariance.md), and that neither launch
# splits K.
BITS_KEYS = {"BLOCK_K": None, "SWAP_AB": False, "SPLIT_K": 1, "GU_SPLIT_K": 1, "KERNEL": None}


def invariant_config(t: int, top_k: int, e: int, d: int, i: int, fmt: str, device) -> dict:
    """The ordered_combine config of a T-token call whose every token gets fixed_config's
    bits: the tuned entry for the shape when it keeps fixed_config's BITS_KEYS in both
    launches, else the heuristic's tiles for T (which keep them by construction). Only the
    tiles follow T: at 16K tokens 128-token tiles are ~3x faster than the decode tiles."""
    fixed = fixed_config(fmt)

    def same_bits(cfg: dict) -> bool:
        return all(
            a.get(key, unset) == b.get(key, unset)
            for a, b in ((cfg, fixed), (down_config(cfg), down_config(fixed)))
            for key, unset in BITS_KEYS.items()
        )

    tuned = configs.lookup(OP, shape_key(t, top_k, e, d, i, fmt), device)
    if tuned is not None and same_bits(tuned):
        return dict(tuned)
    cfg = default_config(t * top_k, e, fmt)
    assert same_bits(cfg), f"the {fmt} heuristic at {t} tokens changes a token's bits: {cfg}"
    return cfg


def choose_config(
    t: int, top_k: int, e: int, d: int, i: int, fmt: str, device, config: dict | None = None
) -> dict:
    """The launch config of a fused_moe call: `config` if given, else the tuned table's
    entry for the shape on this device, else the heuristic; checked for the format."""
    cfg = config or configs.lookup(OP, shape_key(t, top_k, e, d, i, fmt), device)
    cfg = dict(cfg) if cfg is not None else default_config(t * top_k, e, fmt)
    _check_config(cfg, fmt)
    return cfg


# What a config's "DOWN" entry may set for the down launch alone (its tile along D and K,
# its warps and stages, its orientation, its K split); the token tiles (BLOCK_M) are the
# grouping's and stay shared.
DOWN_KEYS = {
    "mma": {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SWAP_AB", "SPLIT_K"},
    "int8": {"BLOCK_N", "BLOCK_K", "num_warps", "PREFETCH"},
}


def down_config(cfg: dict) -> dict:
    """The config of the down launch: `cfg` with its DOWN overrides applied (and without
    GU_SPLIT_K, a gate+up option). The two projections differ in shape (2I x D against
    D x I), so a tile that suits one may leave the other too few programs or too short a
    K loop."""
    down = {k: v for k, v in cfg.items() if k not in ("DOWN", "GU_SPLIT_K")}
    down.update(cfg.get("DOWN", {}))
    return down


def _check_config(cfg: dict, fmt: str) -> None:
    """A config (given, tuned or heuristic) the kernels can run for this weight format."""
    if "DOWN" in cfg:
        kind = "int8" if cfg.get("KERNEL") == "int8" else "mma"
        unknown = set(cfg["DOWN"]) - DOWN_KEYS[kind]
        assert not unknown, (
            f"DOWN may set {sorted(DOWN_KEYS[kind])} of the {kind} kernels, not {unknown}"
        )
        _check_config(down_config(cfg), fmt)
    if cfg.get("KERNEL") == "dequant":
        assert fmt == "mxfp4", f"a dequant config decodes MXFP4 experts, not {fmt!r}"
        _check_config({k: v for k, v in cfg.items() if k != "KERNEL"}, "bf16")
        return
    if cfg.get("KERNEL") == "int8":
        assert fmt == "mxfp4", f"the int8 kernels take MXFP4 experts, not {fmt!r}"
        assert cfg["BLOCK_K"] % 32 == 0, (
            f"int8 needs BLOCK_K a multiple of 32, got {cfg['BLOCK_K']}"
        )
        assert cfg["BLOCK_M"] == 1, f"the int8 kernels take one pair per tile, got {cfg['BLOCK_M']}"
        for key in ("BLOCK_N", "BLOCK_K"):
            assert cfg[key] & (cfg[key] - 1) == 0, (
                f"int8 {key} must be a power of 2, got {cfg[key]}"
            )
        assert cfg["BLOCK_N"] % 32 == 0, (
            "int8 needs BLOCK_N a multiple of 32 (gate+up quantizes whole 32-unit blocks of "
            f"h), got {cfg['BLOCK_N']}"
        )
        others = {"SWAP_AB", "GU_SPLIT_K", "SPLIT_K", "GROUP_M"}
        others &= set(cfg)
        assert not others, f"options of the MMA kernels do not apply to the int8 ones: {others}"
        return
    if fmt == "fp8":
        assert 128 % cfg["BLOCK_K"] == 0, f"FP8 needs BLOCK_K dividing 128, got {cfg['BLOCK_K']}"
    if fmt == "mxfp4":
        assert cfg["BLOCK_K"] % 32 == 0, (
            f"MXFP4 needs BLOCK_K a multiple of 32, got {cfg['BLOCK_K']}"
        )
    assert cfg.get("GU_SPLIT_K", 1) == 1 or cfg.get("SWAP_AB"), "GU_SPLIT_K needs SWAP_AB"
    assert isinstance(cfg.get("GROUP_M", 1), int) and cfg.get("GROUP_M", 1) >= 1, (
        f"GROUP_M must be a positive int, got {cfg.get('GROUP_M')!r}"
    )


def _gate_up_tiles(i: int, cfg: dict) -> int:
    """N tiles of the gate+up launch: SWAP_AB tiles hold BLOCK_N/2 units' gate and up rows."""
    return triton.cdiv(i, cfg["BLOCK_N"] // 2 if cfg.get("SWAP_AB") else cfg["BLOCK_N"])


def _gate_up_split_buffers(
    tiles_m: int, i: int, cfg: dict, stand_in: torch.Tensor, lane: str = "main"
) -> tuple:
    """(partials, arrival counters of `lane`) for a gate+up launch split along D
    (GU_SPLIT_K > 1, a SWAP_AB config's option), else the stand-in twice (never read)."""
    split = cfg.get("GU_SPLIT_K", 1)
    if split == 1:
        return stand_in, stand_in
    device = stand_in.device
    part = torch.empty((split, tiles_m * cfg["BLOCK_M"], 2 * i), dtype=torch.float32,
                       device=device)  # fmt: skip
    return part, arrival_counters(device, tiles_m * _gate_up_tiles(i, cfg), lane)


def _limit(swiglu_limit: float | None) -> float | None:
    """The SWIGLU_LIMIT meta-parameter: a float (one compiled variant per value), or None."""
    return None if swiglu_limit is None else float(swiglu_limit)


def _launch_meta(cfg: dict) -> dict:
    """A config's meta-parameters and launch options, as every launch here passes them."""
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                F32_DOT=interpreting(), SWAP_AB=cfg.get("SWAP_AB", False),
                GROUP_M=cfg.get("GROUP_M", 1),
                num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))  # fmt: skip


def _act_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> int8 x 4 words [T, D/4] and float32 scales [T, D/32] (per 32 columns,
    halved for the decode table's x 2), as the int8 kernels read their activations."""
    t, d = x.shape
    xq = torch.empty((t, d // 4), dtype=torch.int32, device=x.device)
    xs = torch.empty((t, d // 32), dtype=torch.float32, device=x.device)
    act_quant_int8_kernel[(t, triton.cdiv(d, INT8_QUANT_BLOCK))](
        x, xq, xs, d, x.stride(0), xq.stride(0), xs.stride(0), BLOCK_K=INT8_QUANT_BLOCK
    )
    return xq, xs


def _int8_meta(cfg: dict) -> dict:
    """An int8 config's meta-parameters and launch options. INT8_ASM False runs the plain
    integer decode and dp4a on a GPU too (a cross-check); the interpreter always does."""
    return dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                ASM=cfg.get("INT8_ASM", True) and not interpreting(),
                PREFETCH=cfg.get("PREFETCH", True), num_warps=cfg.get("num_warps", 4))  # fmt: skip


def _check_shared(shared: SharedExpert, d: int) -> int:
    """The shared expert's intermediate size, after checking its layout."""
    packed = 2 if shared.fmt == "mxfp4" else 1
    i = shared.w2.shape[-1] * packed
    assert shared.w13.dim() == 2 and shared.w2.dim() == 2, "shared w13/w2 must be 2-D"
    _check_weight("shared w13", shared.w13[None], _expert(shared.w13_scale), shared.fmt, 1,
                  2 * i, d)  # fmt: skip
    _check_weight("shared w2", shared.w2[None], _expert(shared.w2_scale), shared.fmt, 1, d, i)
    return i


def _expert(scale: torch.Tensor | None) -> torch.Tensor | None:
    return scale[None] if scale is not None else None


def _shared_gate_up(
    x: torch.Tensor, shared: SharedExpert, d: int, lane: str = "main"
) -> torch.Tensor:
    """h [T, Is] = SiLU(gate) * up of the shared expert."""
    t = x.shape[0]
    i = _check_shared(shared, d)
    cfg = dense_config(t, d, i, shared.fmt, x.device)
    _check_config(cfg, shared.fmt)
    h = torch.empty((t, i), dtype=x.dtype, device=x.device)
    s13, *s13_strides = _scale_args(shared.w13, shared.w13_scale, expert_dim=False)
    tiles_m = triton.cdiv(t, cfg["BLOCK_M"])
    moe_gate_up_kernel[(tiles_m, _gate_up_tiles(i, cfg), cfg.get("GU_SPLIT_K", 1))](
        x, shared.w13, s13, h, h, h, *_gate_up_split_buffers(tiles_m, i, cfg, h, lane),
        t, d, i,
        x.stride(0), 0, shared.w13.stride(0), *s13_strides, h.stride(0),
        TOPK=1, WFMT=_wfmt(shared.fmt, shared.w13_scale), DENSE=True,
        GU_SPLIT_K=cfg.get("GU_SPLIT_K", 1), SWIGLU_LIMIT=_limit(shared.swiglu_limit),
        **_launch_meta(cfg),
    )  # fmt: skip
    return h


def _shared_down(h: torch.Tensor, shared: SharedExpert, y: torch.Tensor) -> None:
    t, d = y.shape
    i = shared.w2.shape[-1] * (2 if shared.fmt == "mxfp4" else 1)
    full = dense_config(t, d, i, shared.fmt, y.device)
    _check_config(full, shared.fmt)
    cfg = down_config(full)  # its DOWN tile: beside the routed kernels it wants its own
    split = cfg.get("SPLIT_K", 1)
    s2, *s2_strides = _scale_args(shared.w2, shared.w2_scale, expert_dim=False)
    moe_down_kernel[(triton.cdiv(t, cfg["BLOCK_M"]), triton.cdiv(d, cfg["BLOCK_N"]), split)](
        h, shared.w2, s2, y, y, h, h,
        t, d, i,
        h.stride(0), 0, shared.w2.stride(0), *s2_strides, y.stride(0),
        TOPK=1, WFMT=_wfmt(shared.fmt, shared.w2_scale), DENSE=True, SPLIT_K=split,
        **_launch_meta(cfg),
    )  # fmt: skip
