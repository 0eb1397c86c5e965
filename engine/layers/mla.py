"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents:
the layer's projections, norms and rope; its arithmetic is the device's MLA ops
(engine/ops/mla.py, the forms in engine/ops/mla_forms.py; legend: docs/shapes.md).

Keys and values are recovered from the cached latents through kv_b_proj [H*(N+V), R].
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceLayer, DeviceSetup, build
from engine.ops.mla import TORCH_MLA, MlaOps
from engine.ops.mla_forms import MlaDims
from engine.quant.base import QuantConfig

# DeepSeek's and transformers' MLA norms use the RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(nn.Module, DeviceLayer):
    def __init__(
        self,
        dims: MlaDims,
        rotary: RotaryEmbedding,
        softmax_scale: float,
        quant: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.dims, self.rotary, self.scale = dims, rotary, softmax_scale
        D, H = dims.hidden_size, dims.num_heads
        qk_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        bias = dims.attention_bias
        if dims.q_lora_rank:
            self.q_a_proj = Linear(D, dims.q_lora_rank, bias, quant, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(dims.q_lora_rank, H * qk_dim, False, quant, f"{prefix}.q_b_proj")
        else:
            self.q_proj = Linear(D, H * qk_dim, False, quant, f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = Linear(
            D, dims.cache_width, bias, quant, f"{prefix}.kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            dims.kv_lora_rank,
            H * (dims.qk_nope_head_dim + dims.v_head_dim),
            False,
            quant,
            f"{prefix}.kv_b_proj",
        )
        self.o_proj = Linear(H * dims.v_head_dim, D, bias, quant, f"{prefix}.o_proj")
        self.kv_cache: torch.Tensor | None = None  # [blocks, block_size, R+P], bound by runner
        self.mode = "auto"
        self.ops: MlaOps = TORCH_MLA

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight as float32 [H, N+V, R] (a view when stored in float32)."""
        d = self.dims
        w = self.kv_b_proj.format.dequantize(self.kv_b_proj)
        return w.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("mla", self, setup)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        return self.ops.forward(self, x, positions, ctx)

    def forward_with_input_norm(
        self,
        norm: RMSNorm,
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """norm(x, residual) then this attention, fused where the device's ops can
        (attention output, x + residual), else None and the caller runs them apart."""
        return self.ops.forward_with_input_norm(self, norm, x, residual, positions, ctx)
