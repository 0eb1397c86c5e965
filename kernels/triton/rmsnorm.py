"""RMSNorm with an optional fused residual add: one read of x (and residual), one write of
each output, one program per row.

  residual None:  y = x * rsqrt(mean(x^2) + eps) * weight
  residual given: r = x + residual; y = rmsnorm(r); returns (y, r)

With a residual, x may be float32 while the residual (the stream) is bf16/fp16: the MoE's
float32 accumulator is added here instead of being cast to bf16 by a separate kernel. The
sum is rounded once, to the residual's dtype (an unfused cast-then-add rounds twice, so the
two can differ by one ulp of the stream's dtype); y and r take the residual's dtype.
Torch twin: kernels/reference/rmsnorm.py; the @triton.jit body is in _rmsnorm_kernels.py.
"""

from __future__ import annotations

import torch

from kernels.triton._common import check_device, next_pow2
from kernels.triton._rmsnorm_kernels import rmsnorm_kernel


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D], weight [D], residual of x's shape. Returns y (like x), or (y, x + residual)
    both in the residual's dtype; x may then be float32 (see the module docstring)."""
    d = x.shape[-1]
    assert weight.shape == (d,), f"weight must be [{d}], got {list(weight.shape)}"
    assert x.stride(-1) == 1, "x must have a contiguous last dim"
    check_device(x, weight)
    x2 = x.reshape(-1, d)
    out_dtype = x.dtype if residual is None else residual.dtype
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape, f"residual {list(residual.shape)} != x {list(x.shape)}"
        assert x.dtype in (residual.dtype, torch.float32), (
            f"x must be the residual's dtype ({residual.dtype}) or float32, got {x.dtype}"
        )
        r2 = residual.reshape(-1, d)
        r_out = torch.empty(x2.shape, dtype=residual.dtype, device=x.device)
    else:
        r2 = r_out = x2
    rows = x2.shape[0]
    if rows:
        block = next_pow2(d)
        rmsnorm_kernel[(rows,)](
            x2, r2, weight, y, r_out, d, eps,
            x2.stride(0), r2.stride(0), y.stride(0), r_out.stride(0),
            HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    if residual is None:
        return y.reshape(x.shape)
    return y.reshape(x.shape), r_out.reshape(x.shape)
