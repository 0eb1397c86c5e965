"""Triton bodies for fused_moe.py.

Each program owns one BLOCK_M tile of expert-grouped pairs (all of one expert, from
moe_align) and BLOCK_N output columns, and streams that expert's weight rows along K once.
Weight formats (WFMT): 0 bf16/fp16; 1 FP8 E4M3 with float32 128x128 block scales;
2 FP8 with E8M0 block scales; 3 MXFP4 (packed nibbles along K, E8M0 scale per 32 K;
BLOCK_K a multiple of 32).
Codes are decoded to the activation dtype in registers; nothing decoded is written back.

SWAP_AB (a config choice) turns the tile around: acc [BLOCK_N, BLOCK_M] = W @ A^T, the
weight rows as the MMA's M side and the few tokens as its N side. On Hopper that puts the
weights on wgmma's register operand (64 rows per warpgroup), so decoded MXFP4/FP8 tiles go
from registers straight into the MMA, where the A @ W^T orientation sends every decoded
tile through shared memory into mma.sync's operand layout (the bf16 round trip is 4x the
bytes of the codes it came from). The tokens side needs only 16 rows, which decode has.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import e8m0_to_f32, mma

# One 32-bit register holds four code bytes b0..b3 (8 weights). prmt spreads two bytes
# into the low bytes of two 16-bit lanes; then per pair of weights: mask the nibbles, one
# multiply by 2^6 + 2^12 (or 2^2 + 2^8) copies the E2M1 bits to 8..6 and the sign bit to 15
# (the two copies do not overlap, so the add is an or), mask, and one bf16x2 fma by the
# scale factor (fma with -0.0 rather than mul.bf16x2: sm_80 has it, so Ampere runs this too).
# 18 instructions per 8 weights, against ~60 for the plain Triton decode (which widens
# each byte to its own register and works on 16-bit lanes).
_MXFP4_DECODE_ASM = tl.constexpr("""
{
.reg .b32 t01, t23, u, nz;
mov.b32 nz, 0x80008000;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
and.b32 u, t01, 0x000F000F;
mul.lo.u32 u, u, 0x1040;
and.b32 u, u, 0x81C081C0;
fma.rn.bf16x2 $0, u, $5, nz;
and.b32 u, t23, 0x000F000F;
mul.lo.u32 u, u, 0x1040;
and.b32 u, u, 0x81C081C0;
fma.rn.bf16x2 $1, u, $6, nz;
and.b32 u, t01, 0x00F000F0;
mul.lo.u32 u, u, 0x104;
and.b32 u, u, 0x81C081C0;
fma.rn.bf16x2 $2, u, $5, nz;
and.b32 u, t23, 0x00F000F0;
mul.lo.u32 u, u, 0x104;
and.b32 u, u, 0x81C081C0;
fma.rn.bf16x2 $3, u, $6, nz;
}
""")


@triton.jit
def _mxfp4_plain(b, f, F32_DOT: tl.constexpr):
    """The decode in plain Triton ops, elementwise: codes b (uint8) and factors f (bf16
    2^(s-1), broadcastable to b) -> (low nibble's weight, high nibble's), bits as in
    _mxfp4_weights. F32_DOT: float32 results (the interpreter has no bf16 arithmetic, see
    _common, and flushes bf16 subnormals when it widens them; the bits shifted into a
    float32 are the same values)."""
    bi = b.to(tl.int32)
    lo = ((bi & 7) << 6) | ((bi & 8) << 12)
    hi = ((bi & 0x70) << 2) | ((bi & 0x80) << 8)
    if F32_DOT:
        w_lo = (lo << 16).to(tl.float32, bitcast=True) * f.to(tl.float32)
        w_hi = (hi << 16).to(tl.float32, bitcast=True) * f.to(tl.float32)
    else:
        w_lo = lo.to(tl.int16).to(tl.bfloat16, bitcast=True) * f
        w_hi = hi.to(tl.int16).to(tl.bfloat16, bitcast=True) * f
    return w_lo, w_hi


@triton.jit
def _mxfp4_weights(b, f, F32_DOT: tl.constexpr, ASM: tl.constexpr):
    """Codes b (uint8 [GROUPS, 16, BN]) and per-group factors f (bf16 2^(s-1), [GROUPS, 1, BN])
    -> the low and high nibbles' weights as bf16 [GROUPS * 16, BN], scale included.

    A nibble s|e e|m placed as bf16 bits s<<15 | eem<<6 is exactly E2M1 * 2^-126: e = 0
    lands on the bf16 subnormals (code 1 -> 0.5 * 2^-126), e > 0 on the normals. One bf16
    multiply by 2^(s-1) then gives E2M1 * 2^(s-127), exact (no rounding: a power of two
    times a 2-significant-bit value; bf16 arithmetic does not flush subnormals).
    ASM: the same bits and multiply in PTX on packed registers (GPU only)."""
    if ASM and not F32_DOT:
        w_lo, w_hi = tl.inline_asm_elementwise(
            _MXFP4_DECODE_ASM,
            "=r,=r,=r,=r,r,r,r",
            [b, tl.broadcast_to(f, b.shape)],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        w_lo, w_hi = _mxfp4_plain(b, f, F32_DOT)
    rows: tl.constexpr = b.shape[0] * b.shape[1]
    return tl.reshape(w_lo, (rows, b.shape[2])), tl.reshape(w_hi, (rows, b.shape[2]))


# SWAP_AB's decode of one code byte into the bf16x2 register the MMA operand wants (its
# low nibble's weight at even k in the low half, the high nibble's at odd k in the high
# half): b * 0x1001 puts b's high nibble at bits 16..19 beside the low one at 0..3, then the
# same spread, mask and scale fma as above. 6 instructions per 2 weights.
_MXFP4_PAIR_ASM = tl.constexpr("""
{
.reg .b32 v, f2, nz;
mov.b32 nz, 0x80008000;
mov.b32 f2, {$3, $3};
mul.lo.u32 v, $2, 0x1001;
and.b32 v, v, 0x000F000F;
mul.lo.u32 v, v, 0x1040;
and.b32 v, v, 0x81C081C0;
fma.rn.bf16x2 v, v, f2, nz;
mov.b32 {$0, $1}, v;
}
""")


@triton.jit
def _mxfp4_weight_rows(b, f, F32_DOT: tl.constexpr, ASM: tl.constexpr):
    """SWAP_AB decode: codes b (uint8 [BN, BK/2], row-major bytes along K) and per-group
    factors f (bf16 2^(s-1), [BN, BK/32]) -> weights bf16 [BN, BK] in natural K order (each
    byte's low nibble at even k, high at odd: joined along a new last axis, then merged).
    Bits and exactness as in _mxfp4_weights. One byte per asm call, not four: the compiler
    places each byte where the MMA operand wants its pair of k, and four bytes pinned to
    one thread would force a shuffle. ASM off (and under the interpreter): plain ops."""
    BN: tl.constexpr = b.shape[0]
    KB: tl.constexpr = b.shape[1]
    fb = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, KB // 16, 16)), (BN, KB))
    if ASM and not F32_DOT:
        w_lo, w_hi = tl.inline_asm_elementwise(
            _MXFP4_PAIR_ASM,
            "=h,=h,r,h",
            [b.to(tl.int32), fb],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=1,
        )
    else:
        w_lo, w_hi = _mxfp4_plain(b, fb, F32_DOT)
    return tl.reshape(tl.join(w_lo, w_hi), (BN, 2 * KB))


@triton.jit
def _mxfp4_factors(scales):
    """E8M0 scale bytes -> bf16 2^(s-1): the bits (s + 126) << 7. Exact for s <= 128
    (scales <= 2, |w| <= 12: every real checkpoint); beyond, the factor would overflow bf16
    (the engine refuses such checkpoints at load)."""
    f = ((tl.minimum(scales.to(tl.int32), 128) + 126) << 7).to(tl.int16)
    return f.to(tl.bfloat16, bitcast=True)


@triton.jit
def _load_weights(
    w_ptr,  # this expert's weight base
    ws_ptr,  # this expert's scale base
    rows,  # [BLOCK_N] weight rows (output columns)
    mask_n,
    k0,
    K,
    stride_wn,
    stride_wsn,
    WFMT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """One K step's stored weights for `rows`: (codes, scales) as stored, not decoded.
    bf16/FP8: codes [BLOCK_K, BLOCK_N] and (FP8) the [BLOCK_N] block scales of k0's 128-block;
    MXFP4: packed bytes [BLOCK_K/32, 16, BLOCK_N] (group, byte in group, row) and E8M0 scales
    [BLOCK_K/32, BLOCK_N]. SWAP_AB: rows first, [BLOCK_N, BLOCK_K] (MXFP4 [BLOCK_N, BLOCK_K/2]
    bytes and [BLOCK_N, BLOCK_K/32] scales). Steps past K load nothing (all masked)."""
    if SWAP_AB and WFMT == 3:
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_j = tl.multiple_of(k0 // 2, BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        offs_g = k0 // 32 + tl.arange(0, GROUPS)
        codes = tl.load(w_ptr + rows[:, None] * stride_wn + offs_j[None, :],
                        mask=mask_n[:, None] & (offs_j < K // 2)[None, :], other=0)  # fmt: skip
        scales = tl.load(ws_ptr + rows[:, None] * stride_wsn + offs_g[None, :],
                         mask=mask_n[:, None] & (offs_g < K // 32)[None, :], other=0)  # fmt: skip
    elif SWAP_AB:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :],
                        mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        if WFMT == 0:
            scales = mask_n  # unused
        else:
            scales = tl.load(ws_ptr + (rows // 128) * stride_wsn + k0 // 128,
                             mask=mask_n & (rows * 0 + k0 < K), other=0)  # fmt: skip
    elif WFMT == 3:
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_g = k0 // 32 + tl.arange(0, GROUPS)
        mask_g = offs_g < K // 32  # K is a multiple of 32: a group is wholly in or out
        offs_b = offs_g[:, None, None] * 16 + tl.arange(0, 16)[None, :, None]  # [G, 16, 1]
        codes = tl.load(w_ptr + rows[None, None, :] * stride_wn + offs_b,
                        mask=mask_g[:, None, None] & mask_n[None, None, :], other=0)  # fmt: skip
        scales = tl.load(ws_ptr + rows[None, :] * stride_wsn + offs_g[:, None],
                         mask=mask_g[:, None] & mask_n[None, :], other=0)  # fmt: skip
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + rows[None, :] * stride_wn + offs_k[:, None],
                        mask=mask_n[None, :] & (offs_k < K)[:, None], other=0.0)  # fmt: skip
        if WFMT == 0:
            scales = mask_n  # unused
        else:
            scales = tl.load(ws_ptr + (rows // 128) * stride_wsn + k0 // 128,
                             mask=mask_n & (rows * 0 + k0 < K), other=0)  # fmt: skip
    return codes, scales


@triton.jit
def _apply_weights(
    acc,
    a_ptr,  # [BLOCK_M] pointers to a[row, 0]
    mask_m,
    codes,
    scales,
    k0,
    K,
    WFMT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """acc [BLOCK_M, BLOCK_N] += a[:, k0:k0+BLOCK_K] @ W^T for one step's stored weights
    (from _load_weights), decoded in registers. SWAP_AB: acc [BLOCK_N, BLOCK_M] += W @ a^T,
    one dot per step whatever the format (the weights decoded in natural K order).

    MXFP4: two bf16 dots of depth BLOCK_K/2: even k (low nibbles) and odd k (high nibbles).
    The sum over k does not care about k's order, so the activations are split into even
    and odd columns in registers (one contiguous [BLOCK_M, BLOCK_K/2, 2] load, tl.split)
    instead of the weights being interleaved. The group scale is folded into each decoded
    weight (one bf16 multiply), so the dots accumulate straight into acc: no per-group
    partial or epilogue. The decode is the PTX one on a GPU, plain Triton ops under the
    interpreter (F32_DOT)."""
    if SWAP_AB:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_t = tl.load(a_ptr[None, :] + offs_k[:, None],
                      mask=mask_m[None, :] & (offs_k < K)[:, None], other=0.0)  # fmt: skip
        if WFMT == 3:
            w = _mxfp4_weight_rows(codes, _mxfp4_factors(scales), F32_DOT, True)
            acc = mma(w, a_t.to(tl.bfloat16), acc, F32_DOT)
        elif WFMT == 0:
            acc = mma(codes, a_t, acc, F32_DOT)
        else:
            part = mma(codes.to(a_t.dtype), a_t, tl.zeros(acc.shape, tl.float32), F32_DOT)
            acc += part * _fp8_block_scales(scales, WFMT)[:, None]
    elif WFMT == 3:
        HALF: tl.constexpr = BLOCK_K // 2
        offs_j = k0 // 2 + tl.arange(0, HALF)  # byte columns = pairs of k
        amask = mask_m[:, None, None] & (offs_j < K // 2)[None, :, None]
        parity = tl.arange(0, 2)
        a = tl.load(a_ptr[:, None, None] + 2 * offs_j[None, :, None] + parity[None, None, :],
                    mask=amask, other=0.0)  # fmt: skip
        a_even, a_odd = tl.split(a)  # [BLOCK_M, HALF] each
        w_lo, w_hi = _mxfp4_weights(codes, _mxfp4_factors(scales)[:, None, :], F32_DOT, True)
        acc = mma(a_even.to(tl.bfloat16), w_lo, acc, F32_DOT)
        acc = mma(a_odd.to(tl.bfloat16), w_hi, acc, F32_DOT)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr[:, None] + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        if WFMT == 0:
            acc = mma(a, codes, acc, F32_DOT)
        else:
            part = mma(a, codes.to(a.dtype), tl.zeros(acc.shape, tl.float32), F32_DOT)
            acc += part * _fp8_block_scales(scales, WFMT)[None, :]
    return acc


@triton.jit
def _fp8_block_scales(scales, WFMT: tl.constexpr):
    """FP8 block scales as float32: WFMT 1 stores them so, WFMT 2 as E8M0 bytes."""
    if WFMT == 2:
        scales = e8m0_to_f32(scales)
    return scales


@triton.jit
def _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, BLOCK_M: tl.constexpr,
                DENSE: tl.constexpr):  # fmt: skip
    """(expert, pairs [BLOCK_M]) of tile pid_m. DENSE (one expert that every row uses, e.g.
    the shared expert): pairs are the rows themselves, no alignment read."""
    if DENSE:
        expert = pid_m * 0
        pairs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.jit
def _tile_ids(GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program. The GPU starts programs in launch order, axis 0
    fastest: one N column of every token tile, then the next column. At prefill sizes one
    column's tiles gather more activation rows than the L2 holds (16K tokens: ~400 MB), so
    each column read them from HBM again (gate+up: 22 columns). GROUP_M > 1 renumbers the
    launch order into groups of GROUP_M consecutive token tiles (one to a few experts) that
    run all their columns before the next group: the group's activations and weights stay
    in the L2 while every column reads them."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUP_M > 1:
        num_m = tl.num_programs(0)
        per_group = GROUP_M * tl.num_programs(1)
        launch = pid_n * num_m + pid_m
        first_m = (launch // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (launch % per_group) % size_m
        pid_n = (launch % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def swiglu(gate, up, LIMIT: tl.constexpr):
    """silu(gate) * up in float32; with a LIMIT (V4's swiglu_limit) gate is clamped from
    above only and up to [-LIMIT, LIMIT] first, as the torch twin's swiglu. None compiles
    no clamp."""
    if LIMIT is not None:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def moe_gate_up_kernel(
    # pointers
    x_ptr,  # [T, D] activations
    w_ptr,  # [E, 2I, D] (MXFP4: [E, 2I, D/2] uint8)
    ws_ptr,  # scales: FP8 [E, ceil(2I/128), ceil(D/128)]; MXFP4 [E, 2I, D/32]; else unused
    h_ptr,  # [P, I] out: silu(gate) * up per pair
    sorted_pairs_ptr,  # [max_blocks * BLOCK_M] int32 (unused when DENSE)
    block_expert_ptr,  # [max_blocks] int32 (unused when DENSE)
    part_ptr,  # GU_SPLIT_K > 1: float32 [GU_SPLIT_K, tiles_m * BLOCK_M, 2I] partial sums
    counters_ptr,  # GU_SPLIT_K > 1: int32 [tiles_m * tiles_n], zero between launches
    # sizes
    num_pairs,
    D,
    I,
    # strides
    stride_xt,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_hp,
    # meta-parameters
    TOPK: tl.constexpr,
    WFMT: tl.constexpr,
    DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr = False,  # acc [BLOCK_N, BLOCK_M] = W @ x^T (module docstring)
    GU_SPLIT_K: tl.constexpr = 1,  # SWAP_AB only: grid axis 2 splits D; the last split to
    # arrive (arrival counter) sums the partials and applies SiLU * up
    GROUP_M: tl.constexpr = 1,  # token tiles per launch-order group (_tile_ids)
    SWIGLU_LIMIT: tl.constexpr = None,  # the activation's clamp (swiglu), None for none
):
    pid_m, pid_n = _tile_ids(GROUP_M)
    expert, pairs = _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, BLOCK_M, DENSE)
    if expert < 0:
        return
    mask_m = pairs < num_pairs
    a_rows = x_ptr + (pairs // TOPK).to(tl.int64) * stride_xt
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    if SWAP_AB:
        # One BLOCK_N-row tile holds BLOCK_N/2 gate rows then the same units' up rows, so a
        # program is one wgmma chain (>= 64 rows) for BLOCK_N/2 units: twice the programs
        # of separate gate and up tiles, which a few tokens need to fill the SMs.
        HALF: tl.constexpr = BLOCK_N // 2
        r = tl.arange(0, BLOCK_N)
        units = pid_n * HALF + r % HALF
        rows = units + (r >= HALF).to(tl.int32) * I
        mask_r = units < I
        steps_per_split = tl.cdiv(tl.cdiv(D, BLOCK_K), GU_SPLIT_K)
        k_lo = tl.program_id(2) * steps_per_split * BLOCK_K
        k_end = tl.minimum(D, k_lo + steps_per_split * BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_lo, k_end, BLOCK_K):  # loads inside the step: Triton stages codes
            w, s = _load_weights(w_e, ws_e, rows, mask_r, k0, k_end, stride_wn, stride_wsn,
                                 WFMT, BLOCK_K, SWAP_AB)  # fmt: skip
            acc = _apply_weights(acc, a_rows, mask_m, w, s, k0, k_end, WFMT, BLOCK_K, F32_DOT,
                                 SWAP_AB)  # fmt: skip
        if GU_SPLIT_K > 1:
            # Few tokens: splitting D multiplies the programs streaming weights. Each split
            # stores its partial; the last to arrive adds the others' (read at L2: .cg) to
            # its own and goes on to the epilogue; the rest are done.
            slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            part = part_ptr + slots.to(tl.int64)[None, :] * (2 * I) + rows[:, None]
            split_stride = tl.num_programs(0).to(tl.int64) * BLOCK_M * (2 * I)
            pmask = mask_r[:, None] & mask_m[None, :]
            tl.store(part + tl.program_id(2) * split_stride, acc, mask=pmask)
            tl.debug_barrier()  # every thread's stores before the counter's release
            counter = counters_ptr + pid_m * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived != GU_SPLIT_K - 1:
                return
            for other in tl.static_range(GU_SPLIT_K):
                if other != tl.program_id(2):
                    acc += tl.load(part + other * split_stride, mask=pmask, other=0.0,
                                   cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0)  # zero again for the next launch
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
        h = swiglu(gate, up, SWIGLU_LIMIT)  # [HALF, BLOCK_M]
        offs_u = pid_n * HALF + tl.arange(0, HALF)
        h_out = h_ptr + pairs.to(tl.int64)[None, :] * stride_hp + offs_u[:, None]
        tl.store(h_out, h.to(h_ptr.dtype.element_ty), mask=mask_m[None, :] & (offs_u < I)[:, None])
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WFMT == 0:  # bf16 operands go straight into tl.dot, which Triton pipelines itself
        for k0 in range(0, D, BLOCK_K):
            wg, _ = _load_weights(w_e, ws_e, offs_n, mask_n, k0, D, stride_wn, stride_wsn,
                                  WFMT, BLOCK_K)  # fmt: skip
            wu, _ = _load_weights(w_e, ws_e, offs_n + I, mask_n, k0, D, stride_wn, stride_wsn,
                                  WFMT, BLOCK_K)  # fmt: skip
            acc_gate = _apply_weights(acc_gate, a_rows, mask_m, wg, wg, k0, D, WFMT, BLOCK_K,
                                      F32_DOT)  # fmt: skip
            acc_up = _apply_weights(acc_up, a_rows, mask_m, wu, wu, k0, D, WFMT, BLOCK_K,
                                    F32_DOT)  # fmt: skip
    else:
        # Codes pass through a decode before the dot, and Triton does not pipeline such
        # loads: the next step's codes are loaded before this step's math (a register
        # double buffer), so their latency hides behind the decode and the dots.
        wg, sg = _load_weights(w_e, ws_e, offs_n, mask_n, 0, D, stride_wn, stride_wsn,
                               WFMT, BLOCK_K)  # fmt: skip
        wu, su = _load_weights(w_e, ws_e, offs_n + I, mask_n, 0, D, stride_wn, stride_wsn,
                               WFMT, BLOCK_K)  # fmt: skip
        for k0 in range(0, D, BLOCK_K):
            nwg, nsg = _load_weights(w_e, ws_e, offs_n, mask_n, k0 + BLOCK_K, D, stride_wn,
                                     stride_wsn, WFMT, BLOCK_K)  # fmt: skip
            nwu, nsu = _load_weights(w_e, ws_e, offs_n + I, mask_n, k0 + BLOCK_K, D, stride_wn,
                                     stride_wsn, WFMT, BLOCK_K)  # fmt: skip
            acc_gate = _apply_weights(acc_gate, a_rows, mask_m, wg, sg, k0, D, WFMT, BLOCK_K,
                                      F32_DOT)  # fmt: skip
            acc_up = _apply_weights(acc_up, a_rows, mask_m, wu, su, k0, D, WFMT, BLOCK_K,
                                    F32_DOT)  # fmt: skip
            wg, sg, wu, su = nwg, nsg, nwu, nsu
    h = swiglu(acc_gate, acc_up, SWIGLU_LIMIT)
    h_out = h_ptr + pairs.to(tl.int64)[:, None] * stride_hp + offs_n[None, :]
    tl.store(h_out, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def moe_down_kernel(
    # pointers
    h_ptr,  # [P, I]
    w_ptr,  # [E, D, I] (MXFP4: [E, D, I/2] uint8)
    ws_ptr,  # scales: FP8 [E, ceil(D/128), ceil(I/128)]; MXFP4 [E, D, I/32]
    topk_weights_ptr,  # [P] float32 routing weights (unused when DENSE: weight 1)
    y_ptr,  # [T, D] float32 accumulator: += weight * down(h) of each of the token's pairs
    sorted_pairs_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    D,
    I,
    # strides
    stride_hp,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_yt,
    # meta-parameters
    TOPK: tl.constexpr,
    WFMT: tl.constexpr,
    DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,  # grid axis 2: K splits, each adding its partial into y
    SWAP_AB: tl.constexpr = False,  # acc [BLOCK_N, BLOCK_M] = W @ h^T (module docstring)
    GROUP_M: tl.constexpr = 1,  # token tiles per launch-order group (_tile_ids)
):
    pid_m, pid_n = _tile_ids(GROUP_M)
    expert, pairs = _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, BLOCK_M, DENSE)
    if expert < 0:
        return
    mask_m = pairs < num_pairs
    a_rows = h_ptr + pairs.to(tl.int64) * stride_hp
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    # Split-K: program pid_k takes whole steps [k_lo, k_end); the combine below is an atomic
    # add anyway, so the splits' partial sums need no extra launch.
    steps_per_split = tl.cdiv(tl.cdiv(I, BLOCK_K), SPLIT_K)
    k_lo = tl.program_id(2) * steps_per_split * BLOCK_K
    k_end = tl.minimum(I, k_lo + steps_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WFMT == 0 or SWAP_AB:  # loads inside the step, as in moe_gate_up_kernel
        for k0 in range(k_lo, k_end, BLOCK_K):
            w, s = _load_weights(w_e, ws_e, offs_n, mask_n, k0, k_end, stride_wn, stride_wsn,
                                 WFMT, BLOCK_K, SWAP_AB)  # fmt: skip
            acc = _apply_weights(acc, a_rows, mask_m, w, s, k0, k_end, WFMT, BLOCK_K, F32_DOT,
                                 SWAP_AB)  # fmt: skip
    else:  # next step's codes loaded before this step's math, as in moe_gate_up_kernel
        w, s = _load_weights(w_e, ws_e, offs_n, mask_n, k_lo, k_end, stride_wn, stride_wsn,
                             WFMT, BLOCK_K)  # fmt: skip
        for k0 in range(k_lo, k_end, BLOCK_K):
            nw, ns = _load_weights(w_e, ws_e, offs_n, mask_n, k0 + BLOCK_K, k_end, stride_wn,
                                   stride_wsn, WFMT, BLOCK_K)  # fmt: skip
            acc = _apply_weights(acc, a_rows, mask_m, w, s, k0, k_end, WFMT, BLOCK_K, F32_DOT)
            w, s = nw, ns
    # The combine: a tile holds one expert, so its rows are distinct tokens; tiles of other
    # experts add to the same rows, hence atomics (float32: the order changes only the
    # last bits, rounded away by the cast to bf16 in all but rare ties).
    tokens = (pairs // TOPK).to(tl.int64)
    if SWAP_AB:
        if not DENSE:
            acc = acc * tl.load(topk_weights_ptr + pairs, mask=mask_m, other=0.0)[None, :]
        y_out = y_ptr + tokens[None, :] * stride_yt + offs_n[:, None]
        tl.atomic_add(y_out, acc, mask=mask_m[None, :] & mask_n[:, None], sem="relaxed")
    else:
        if not DENSE:
            acc = acc * tl.load(topk_weights_ptr + pairs, mask=mask_m, other=0.0)[:, None]
        y_out = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
        tl.atomic_add(y_out, acc, mask=mask_m[:, None] & mask_n[None, :], sem="relaxed")


@triton.jit
def ordered_pair_sum_kernel(
    pairs_ptr,  # [T * TOPK, D] float32: each (token, slot) pair's weighted expert output
    y_ptr,  # [T, D] float32
    D,
    TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """y[t] = pairs[t*TOPK] + pairs[t*TOPK + 1] + ... in slot order: the combine whose
    result does not depend on which expert tile finished first."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.load(pairs_ptr + t * TOPK * D + offs, mask=mask, other=0.0)
    for a in tl.static_range(1, TOPK):
        acc += tl.load(pairs_ptr + (t * TOPK + a) * D + offs, mask=mask, other=0.0)
    tl.store(y_ptr + t * D + offs, acc, mask=mask)
