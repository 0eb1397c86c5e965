"""Torch twin of the host expert kernels (kernels/cpu/host_experts.py): every chosen expert
that lives on the host, dequantized with kernels/formats and run as float32 matmuls.

out[t] = sum over k with slot_ids[t, k] >= 0, in k order, of
    weights[t, k] * down_s(swiglu(gate_s x[t], up_s x[t]))     s = slot_ids[t, k]

`quantize_activations=True` rounds x (before gate/up) and the SwiGLU output (before down)
the way the int8 kernel does (`quantize_int8_blocks`), so the kernel and the twin then
differ only in float rounding, not in the activation quantization's error.

Legend: S = host slots, T = tokens, K = experts per token, D = hidden, I = intermediate.
"""

from __future__ import annotations

import torch

from kernels.formats.fp8 import bits_to_fp8, dequantize_fp8_block
from kernels.formats.mxfp4 import dequantize_mxfp4

GROUP = 32  # activation values per int8 scale


def quantize_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [N, C] (C % 32 == 0) rounded as the kernel's int8 activations, back in float32:
    per row per 32 values step = max(amax, 1e-30) / 127, code = x / step rounded to
    nearest (ties away from zero), clamped to +-127; returns code * step."""
    n, c = x.shape
    xb = x.float().reshape(n, c // GROUP, GROUP)  # [N, C/32, 32]
    step = xb.abs().amax(-1).clamp_min(1e-30) / 127.0  # [N, C/32]
    q = xb / step[..., None]
    q = torch.where(q >= 0, q + 0.5, q - 0.5).trunc().clamp(-127, 127)
    return (q * step[..., None]).reshape(n, c)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up with V4's clamps: gate from above, up to [-limit, limit]."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def _combine(expert_fn, x, slot_ids, weights, swiglu_limit, quantize_activations):
    """Run `expert_fn(slot, which)` -> float32 weight for each host-resident choice."""
    T, K = slot_ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for t in range(T):
        for k in range(K):
            s = int(slot_ids[t, k])
            if s < 0:
                continue
            xt = x[t : t + 1].float()  # [1, D]
            if quantize_activations:
                xt = quantize_int8_blocks(xt)
            g = xt @ expert_fn(s, "gate").T  # [1, I]
            u = xt @ expert_fn(s, "up").T
            h = swiglu_reference(g, u, swiglu_limit)
            if quantize_activations:
                h = quantize_int8_blocks(h)
            out[t] += float(weights[t, k]) * (h @ expert_fn(s, "down").T)[0]
    return out


def mxfp4_experts_reference(
    stored: dict[str, torch.Tensor],
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    swiglu_limit: float | None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """stored: gate_w/up_w [S, I, D/2], gate_s/up_s [S, I, D/32], down_w [S, D, I/2],
    down_s [S, D, I/32] (uint8, the checkpoint's MXFP4 layout) -> out [T, D] float32."""

    def weight(s: int, which: str) -> torch.Tensor:
        return dequantize_mxfp4(stored[f"{which}_w"][s], stored[f"{which}_s"][s])

    return _combine(weight, x, slot_ids, weights, swiglu_limit, quantize_activations)


def fp8_experts_reference(
    stored: dict[str, torch.Tensor],
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """stored: gate_w/up_w [S, I, D], down_w [S, D, I] (float8_e4m3fn or its uint8 bytes),
    gate_s/up_s/down_s their 128x128 block scales (float32 or E8M0 uint8) -> out [T, D]
    float32."""

    def weight(s: int, which: str) -> torch.Tensor:
        codes = stored[f"{which}_w"][s]
        if codes.dtype == torch.uint8:
            codes = bits_to_fp8(codes)
        return dequantize_fp8_block(codes, stored[f"{which}_s"][s])

    return _combine(weight, x, slot_ids, weights, swiglu_limit, False)
