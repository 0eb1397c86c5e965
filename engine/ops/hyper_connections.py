"""Hyper-connections (DeepSeek-V4's mHC): the interfaces and their torch implementations.

Legend: docs/shapes.md (T tokens, C residual streams, D hidden). Leading dimensions other
than T (a [B, S] batch) pass through unchanged.

The residual is C parallel streams [T, C, D]. Around each sublayer (attention, FFN):

    flat = rmsnorm(streams.flatten())                 unweighted, eps = rms_norm_eps
    mix  = flat @ fn^T                                [T, (2 + C) * C]
    pre  = sigmoid(mix[:C] * scale[0] + base[:C]) + hc_eps
    post = 2 * sigmoid(mix[C:2C] * scale[1] + base[C:2C])
    comb = sinkhorn(mix[2C:].view(C, C) * scale[2] + base[2C:])
    x    = sum_j pre_j * streams_j                    the sublayer's input
    out_k = post_k * sublayer(x) + sum_j comb[j, k] * streams_j

The head collapses the streams with its own pre weights (no post, no comb). The mixing
coefficients are float32 whatever the streams' dtype, the order of operations is
transformers' (normalise, then project), so float32 results agree with it bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.ops.device_layer import DeviceSetup, register
from kernels.cpu import batch_invariant


class HyperConnectionOps(ABC):
    """The mixing around one sublayer. `hc` is a HyperConnection: `fn` [(2 + C) * C, C * D],
    `base` [(2 + C) * C], `scale` [3] (float32), and `hc_mult`, `hc_sinkhorn_iters`,
    `hc_eps`, `norm_eps`."""

    @abstractmethod
    def pre(self, hc, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, C, D] -> (x [T, D] in streams' dtype, the sublayer's input;
        post [T, C] float32; comb [T, C, C] float32, doubly stochastic)."""

    @abstractmethod
    def post(
        self,
        hc,
        y: torch.Tensor,
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
    ) -> torch.Tensor:
        """y [T, D] (the sublayer's output), streams [T, C, D] (its input streams) ->
        the next streams [T, C, D]: post_k * y + sum_j comb[j, k] * streams_j."""


class HyperHeadOps(ABC):
    """The head's collapse. `head` is a HyperHead: `fn` [C, C * D], `base` [C], `scale` [1]
    (float32), and `hc_mult`, `hc_eps`, `norm_eps`."""

    @abstractmethod
    def forward(self, head, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, C, D] -> sum_j pre_j * streams_j  [T, D] in streams' dtype."""


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [T, C, C] float32 -> a doubly stochastic [T, C, C]: a row softmax plus eps, a
    column normalisation, then iters - 1 rounds of (rows, columns). The last step normalises
    columns, so columns sum to 1 up to eps and rows up to the iteration's convergence."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mixes(fn: torch.Tensor, streams: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """streams [T, C, D] -> rmsnorm(flattened streams) @ fn^T  [T, rows of fn] float32."""
    flat = streams.flatten(-2).float()  # [T, C*D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return batch_invariant.linear(flat, fn.float())


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """pre [T, C] float32, streams [T, C, D] -> sum_j pre_j * streams_j [T, D], summed in
    float32 and returned in streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


class TorchHyperConnectionOps(HyperConnectionOps):
    def pre(self, hc, streams):
        C = hc.hc_mult
        mix = _mixes(hc.fn, streams, hc.norm_eps)  # [T, (2+C)*C]
        pre_w, post_w, comb_w = mix.split([C, C, C * C], dim=-1)
        pre_b, post_b, comb_b = hc.base.float().split([C, C, C * C])
        pre_s, post_s, comb_s = hc.scale.float().unbind(0)
        pre = batch_invariant.lanes(torch.sigmoid, pre_w * pre_s + pre_b) + hc.hc_eps  # [T, C]
        post = 2 * batch_invariant.lanes(torch.sigmoid, post_w * post_s + post_b)  # [T, C]
        logits = comb_w.unflatten(-1, (C, C)) * comb_s + comb_b.view(C, C)  # [T, C, C]
        comb = sinkhorn(logits, hc.hc_sinkhorn_iters, hc.hc_eps)
        return _collapse(pre, streams), post, comb

    def post(self, hc, y, streams, post, comb):
        # In the streams' dtype with the coefficients cast to it, as transformers mixes;
        # comb is read transposed: out_k sums comb[j, k] over the input streams j.
        dtype = streams.dtype
        mixed = batch_invariant.batched_matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * y.to(dtype).unsqueeze(-2) + mixed


class TorchHyperHeadOps(HyperHeadOps):
    def forward(self, head, streams):
        mix = _mixes(head.fn, streams, head.norm_eps)  # [T, C]
        logits = mix * head.scale.float() + head.base.float()
        pre = batch_invariant.lanes(torch.sigmoid, logits) + head.hc_eps
        return _collapse(pre, streams)


TORCH_HYPER_CONNECTION = TorchHyperConnectionOps()
TORCH_HYPER_HEAD = TorchHyperHeadOps()


@register("hyper_connection", "cpu")
def torch_hyper_connection_ops(hc, setup: DeviceSetup) -> HyperConnectionOps:
    return TORCH_HYPER_CONNECTION


@register("hyper_head", "cpu")
def torch_hyper_head_ops(head, setup: DeviceSetup) -> HyperHeadOps:
    return TORCH_HYPER_HEAD
