"""DeepSeek-V4's hyper-connections (mHC) on CUDA: the Triton mixes + Sinkhorn + collapse and
the post-mix (kernels/triton/hyper_connections.py) for bf16/fp16 streams. Float32 streams
(exactness tests) keep the torch ops, which equal transformers bit for bit; the kernels
project first and scale after, a few float32 ulps from them. Every launch's configuration
is fixed by the weights' shapes, so a token's mixes do not depend on its batch."""

from __future__ import annotations

from engine.backends.cuda.norm_linear import KERNEL_DTYPES
from engine.ops.device_layer import DeviceSetup, register
from engine.ops.hyper_connections import (
    TORCH_HYPER_CONNECTION,
    TORCH_HYPER_HEAD,
    HyperConnectionOps,
    HyperHeadOps,
)


def _kernel_layout(streams):
    """The kernels read each token's [C, D] as one contiguous row."""
    C, D = streams.shape[-2:]
    if streams.stride(-1) != 1 or streams.stride(-2) != D:
        return streams.contiguous()
    return streams


class CudaHyperConnectionOps(HyperConnectionOps):
    def pre(self, hc, streams):
        if streams.dtype not in KERNEL_DTYPES:
            return TORCH_HYPER_CONNECTION.pre(hc, streams)
        from kernels.triton.hyper_connections import hc_pre

        return hc_pre(
            _kernel_layout(streams), hc.fn, hc.base, hc.scale,
            hc.hc_sinkhorn_iters, hc.hc_eps, hc.norm_eps,
        )  # fmt: skip

    def post(self, hc, y, streams, post, comb):
        if streams.dtype not in KERNEL_DTYPES:
            return TORCH_HYPER_CONNECTION.post(hc, y, streams, post, comb)
        from kernels.triton.hyper_connections import hc_post

        return hc_post(y.contiguous(), _kernel_layout(streams), post, comb)


class CudaHyperHeadOps(HyperHeadOps):
    def forward(self, head, streams):
        if streams.dtype not in KERNEL_DTYPES:
            return TORCH_HYPER_HEAD.forward(head, streams)
        from kernels.triton.hyper_connections import hc_head

        return hc_head(
            _kernel_layout(streams), head.fn, head.base, head.scale, head.hc_eps, head.norm_eps
        )


CUDA_HYPER_CONNECTION = CudaHyperConnectionOps()
CUDA_HYPER_HEAD = CudaHyperHeadOps()


@register("hyper_connection", "cuda")
def cuda_hyper_connection_ops(hc, setup: DeviceSetup) -> HyperConnectionOps:
    return CUDA_HYPER_CONNECTION


@register("hyper_head", "cuda")
def cuda_hyper_head_ops(head, setup: DeviceSetup) -> HyperHeadOps:
    return CUDA_HYPER_HEAD
