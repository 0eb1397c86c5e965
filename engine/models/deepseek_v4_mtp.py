"""DeepSeek-V4's multi-token-prediction layer (`mtp.{k}.*`), the drafter of speculative
decoding (engine/spec_decode/). MODELS.md section 2 "MTP"; DeepSeek's `MTPBlock`.

Legend (docs/shapes.md): T tokens, C streams (`hc_mult`), D hidden.

At row i it reads the target's final C streams H_i [C, D] (after the last decoder layer,
before the head's collapse) and the embedding of the token at i + 1, and predicts the token
at i + 2:

    X_i = e_proj(enorm(embed(t_{i+1})))  (one [D] vector, added to every stream)
          + h_proj(hnorm(H_i))           (per stream: hnorm and h_proj act on each [D])
    Y_i = block(X_i)                     a V4 decoder layer: sliding-window attention
                                         over its own ring, a learned-bias MoE (not hashed)
    logits_i = head(norm(hc_head(Y_i)))  its own hc_head and norm, the model's head

Y is C streams again, so draft k + 1 chains on draft k's output exactly as on the target's.
The embedding and the head are the main model's (the hub has no copy under `mtp.`).

The block is handed in (the family's `V4DecoderLayer` at layer index num_hidden_layers + k,
prefix `mtp.{k}.`), so this module does not import the model that owns it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.hyper_connections import HyperHead
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.ops.attention_context import AttentionContext
from engine.quant.base import QuantConfig


class V4MtpLayer(nn.Module):
    def __init__(
        self,
        block: nn.Module,
        hidden_size: int,
        hc_mult: int,
        hc_eps: float,
        rms_norm_eps: float,
        quant_config: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        D = hidden_size
        self.prefix = prefix
        self.hc_mult = hc_mult
        self.enorm = RMSNorm(D, rms_norm_eps)
        self.hnorm = RMSNorm(D, rms_norm_eps)
        self.e_proj = Linear(D, D, False, quant_config, f"{prefix}e_proj")
        self.h_proj = Linear(D, D, False, quant_config, f"{prefix}h_proj")
        self.block = block
        self.hc_head = HyperHead(D, hc_mult, hc_eps, rms_norm_eps, prefix=prefix)
        self.norm = RMSNorm(D, rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        prev_streams: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """embeds [T, D] (of each row's next token, ids `input_ids` [T]), prev_streams
        [T, C, D] (the target's final streams, or the previous draft's) -> [T, C, D]."""
        T, C, D = prev_streams.shape
        e = self.e_proj(self.enorm(embeds))  # [T, D]
        h = self.h_proj(self.hnorm(prev_streams.reshape(T * C, D))).view(T, C, D)
        return self.block(h + e[:, None, :], positions, ctx, input_ids)  # [T, C, D]

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, C, D] -> [T, D], what the shared head reads."""
        return self.norm(self.hc_head(streams))

    def checkpoint_tensors(self) -> dict[str, nn.Parameter]:
        """Hub name -> parameter of everything but the block ("mtp.0.e_proj.weight", ...)."""
        own = {
            f"{self.prefix}{name}.{leaf}": p
            for name in ("enorm", "hnorm", "e_proj", "h_proj", "norm")
            for leaf, p in getattr(self, name).named_parameters()
        }
        return own | self.hc_head.checkpoint_tensors()
