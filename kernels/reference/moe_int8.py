"""Torch twin of the int8 MoE kernels' activation quantization (kernels/triton/
_moe_int8_kernels.py quantize_int8_words, launched by fused_moe's _act_quant_int8 and by
the MoE prologue).

Each row of x [T, D] in blocks of 32: step = max(amax, 1e-30) / 127 (an IEEE division),
codes = x / step rounded to nearest, ties away from zero, clamped to +-127; a NaN or inf
in a block makes its step NaN (and its codes unspecified: the scale carries the NaN). Codes are packed four to an int32 word, element 4j + i in
byte i of word j (little-endian bytes of the int8 row); the scale stored is step / 2,
undoing the x 2 of the kernels' E2M1 decode table.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale


def act_quant_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (D % 32 == 0) -> (int8 x 4 words [T, D/4] int32, scales [T, D/32] float32)."""
    t, d = x.shape
    assert d % GROUP == 0, f"int8 activations need D % {GROUP} == 0, got {d}"
    xb = x.float().view(t, d // GROUP, GROUP)  # [T, D/32, 32]
    poison = (xb * 0.0).sum(-1)  # NaN where a block holds a NaN or an inf
    step = xb.abs().amax(-1).clamp_min(1e-30) / 127.0 + poison  # [T, D/32]
    q = xb / step[..., None]
    q = torch.where(q >= 0, q + 0.5, q - 0.5).trunc().clamp(-127, 127)
    words = q.to(torch.int8).view(t, d).contiguous().view(torch.int32)  # [T, D/4]
    return words, step * 0.5
