"""RMSNorm and dense linears on CUDA: the fused Triton RMSNorm (residual add inside), FP8
block-scaled weights decoded in registers (or FP8 x FP8 from CudaTuning.fp8_native_min_tokens
rows on, where the GPU has FP8 tensor cores), and two linears of one input stacked into one.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.ops.device_layer import DeviceSetup, register
from engine.ops.linear import TORCH_LINEAR, LinearOps
from engine.ops.norm import NormOps
from engine.quant.fp8_block import Fp8BlockFormat
from engine.quant.unquantized import Unquantized

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class CudaNormOps(NormOps):
    def forward(self, norm, x, residual):
        from kernels.triton.rmsnorm import rmsnorm

        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        return rmsnorm(x, norm.weight, norm.eps, residual)


CUDA_NORM = CudaNormOps()


@register("rmsnorm", "cuda")
def cuda_norm_ops(norm, setup: DeviceSetup) -> NormOps:
    return CUDA_NORM


def fp8_native_min_tokens(setup: DeviceSetup) -> int | None:
    """The row count from which dense FP8 linears multiply in FP8: the tuning's, where the
    GPU has FP8 tensor cores (logged once per model where it has not)."""

    def decide() -> int | None:
        wanted = setup.tuning.fp8_native_min_tokens
        if wanted is not None and not has_fp8_tensor_cores():
            log.info("no FP8 tensor cores: dense FP8 linears decode their weights to bf16 always")
            return None
        return wanted

    return setup.shared("cuda.fp8_native_min_tokens", decide)


def has_fp8_tensor_cores() -> bool:
    """sm_89 (Ada) and sm_90+ (Hopper on) multiply E4M3 natively; the interpreter (CPU tests)
    runs the FP8 dot too."""
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability() >= (8, 9)


def fp8_matmul(
    x: torch.Tensor, weight, scale, native_min: int | None, fixed: bool = False
) -> torch.Tensor:
    """x [..., K] bf16/fp16 @ (E4M3 [N, K] with 128x128 block scales)^T -> [..., N]. From
    `native_min` rows on the activations are quantized per token per 128 and multiplied as
    FP8. Under CUDA graphs the rows are the padded batch of the graph's bucket. `fixed`:
    the launch config chosen from the weight's shape alone (batch-invariant)."""
    from kernels.triton.fp8_linear import fixed_config, fp8_block_linear

    rows = x.numel() // max(1, x.shape[-1])
    native = native_min is not None and rows >= native_min
    config = fixed_config(*weight.shape, x.device) if fixed else None
    return fp8_block_linear(x, weight, scale, native_fp8=native, config=config)


class Fp8LinearOps(LinearOps):
    """`fixed`: one launch config per weight shape at every row count (batch-invariant)."""

    def __init__(self, native_min: int | None, fixed: bool = False):
        self.native_min = None if fixed else native_min
        self.fixed = fixed

    def forward(self, linear, x):
        if x.dtype not in KERNEL_DTYPES:  # float32 activations: the format's torch code
            return linear.format.apply(linear, x)
        scale = getattr(linear, linear.format.scale_name)
        return fp8_matmul(x, linear.weight, scale, self.native_min, self.fixed)


class FixedLinearOps(LinearOps):
    """Plain weights through the fixed-configuration Triton matmul (kernels/triton/matmul.py)
    instead of cuBLAS, whose algorithm depends on the row count."""

    def forward(self, linear, x):
        from kernels.triton.matmul import fixed_linear

        w = linear.weight
        return fixed_linear(x.to(w.dtype), w).to(x.dtype)


FIXED_LINEAR = FixedLinearOps()


@register("linear", "cuda")
def cuda_linear_ops(linear, setup: DeviceSetup) -> LinearOps:
    if isinstance(linear.format, Fp8BlockFormat):
        return Fp8LinearOps(fp8_native_min_tokens(setup), fixed=setup.batch_invariant)
    if isinstance(linear.format, Unquantized) and setup.batch_invariant:
        return FIXED_LINEAR
    return TORCH_LINEAR


class StackedLinear:
    """[first(x) | second(x)] for two bias-free linears of the same input, in one GEMM: plain
    or FP8 block weights of one format, the first's rows ending on a 128-row scale block.
    The two layers' parameters become views of the stacked tensors (re-pointed in place:
    the Parameter objects stay the same), so the weights are not held twice."""

    def __init__(self, first, second, native_min: int | None, fixed: bool = False):
        self.format = first.format
        self.out_features = first.out_features + second.out_features
        self.native_min = None if fixed else native_min
        self.fixed = fixed
        self.weight = _stack_rows(first.weight, second.weight)
        self.scale = None
        if isinstance(self.format, Fp8BlockFormat):
            name = self.format.scale_name
            self.scale = _stack_rows(getattr(first, name), getattr(second, name))

    @staticmethod
    def of(first, second, native_min: int | None, fixed: bool = False) -> StackedLinear | None:
        fmt = first.format
        if first.bias is not None or second.bias is not None:
            return None
        if first.in_features != second.in_features or type(fmt) is not type(second.format):
            return None
        if not isinstance(fmt, (Unquantized, Fp8BlockFormat)):
            return None
        names = ["weight"]
        if isinstance(fmt, Fp8BlockFormat):
            if fmt.scale_name != second.format.scale_name or first.out_features % 128:
                return None
            names.append(fmt.scale_name)
        if any(getattr(first, n).dtype != getattr(second, n).dtype for n in names):
            return None
        return StackedLinear(first, second, native_min, fixed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            if self.fixed:
                from kernels.triton.matmul import fixed_linear

                return fixed_linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
            return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        if x.dtype in KERNEL_DTYPES:
            return fp8_matmul(x, self.weight, self.scale, self.native_min, self.fixed)
        from kernels.formats.fp8 import dequantize_fp8_block

        return F.linear(x, dequantize_fp8_block(self.weight, self.scale, dtype=x.dtype))


def _stack_rows(a: torch.nn.Parameter, b: torch.nn.Parameter) -> torch.Tensor:
    """cat(a, b) along the rows; a and b become views of it."""
    both = torch.cat((a.data, b.data))
    rows = a.shape[0]
    a.data, b.data = both[:rows], both[rows:]
    return both
