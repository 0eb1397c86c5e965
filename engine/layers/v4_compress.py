"""DeepSeek-V4's KV compressor (HCA and CSA) and lightning indexer as modules holding the
hub's parameters; the arithmetic is engine/ops/v4_compress.py (legend: docs/shapes.md and
that file's docstring: m ratio, W projection width, d entry width, Hi indexer heads).

Hub names, under the owner's `prefix` ("layers.2.attn."):
- `compressor.wkv.weight`, `compressor.wgate.weight` [W, D] (BF16 in the hub),
  `compressor.ape` [m, W] float32, `compressor.norm.weight` [d]: W = d (HCA) or 2d (CSA).
- `indexer.wq_b.weight` [Hi * d_i, q_lora_rank] (FP8 + `.scale` in the hub; the family's
  loader dequantises or maps it), `indexer.weights_proj.weight` [Hi, D], and the indexer's
  own overlapping compressor `indexer.compressor.{wkv, wgate, ape, norm}` at d_i.
transformers names them `compressor.{kv_proj, gate_proj, position_bias, kv_norm}`, and
puts the indexer inside the compressor (`compressor.indexer.*`).

`inv_freq` [P/2] is the compressed layers' rope (`compress_rope_theta`, YaRN frequencies,
no mscale), the same tensor for the compressor's entries and the indexer's queries and keys.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.ops.v4_attention import apply_rope, rope_cos_sin
from engine.ops.v4_compress import (
    compress_chunk,
    compress_prefix,
    indexer_scores,
    indexer_topk,
    new_state,
)
from engine.quant.base import QuantConfig


class V4Compressor(nn.Module):
    """One layer's KV compressor: ratio m, entries of width d; `overlap` (CSA, m = 4) gives
    the [Ca | Cb] projections of width 2d and 2m-slot windows."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        overlap: bool,
        inv_freq: torch.Tensor,
        eps: float,
        prefix: str = "",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.ratio, self.overlap, self.head_dim, self.eps = ratio, overlap, head_dim, eps
        self.prefix = prefix
        self.width = 2 * head_dim if overlap else head_dim
        # engine Linears (row-invariant on every device) in the checkpoint's float dtype
        self.wkv = Linear(hidden_size, self.width, prefix=prefix + "wkv", params_dtype=dtype)
        self.wgate = Linear(hidden_size, self.width, prefix=prefix + "wgate", params_dtype=dtype)
        self.ape = nn.Parameter(
            torch.empty(ratio, self.width, dtype=torch.float32), requires_grad=False
        )
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(
            torch.empty(head_dim, dtype=torch.float32), requires_grad=False
        )
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)

    def checkpoint_tensors(self) -> dict[str, nn.Parameter]:
        """Hub checkpoint name -> parameter ("layers.3.attn.compressor.wkv.weight", ...)."""
        return {f"{self.prefix}{n}": p for n, p in self.named_parameters()}

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (kv, score) [T, W]."""
        return self.wkv(x), self.wgate(x)

    def new_state(self) -> torch.Tensor:
        """One sequence's empty pooling state [2, R, W] float32."""
        return new_state(self.ratio, self.width, self.overlap, self.ape.device)

    def prefix_entries(self, x: torch.Tensor) -> torch.Tensor:
        """A whole prefix x [T, D] from position 0 -> its entries [T // m, d]."""
        kv, score = self.project(x)
        return compress_prefix(
            kv, score, self.ape, self.overlap, self.norm.weight, self.eps, self.inv_freq
        )

    def chunk_entries(
        self, x: torch.Tensor, start: int, state: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """The next tokens x [T, D] at positions start.. after `state` -> (the entries they
        commit [n_new, d], the first one's index); updates `state` in place."""
        kv, score = self.project(x)
        return compress_chunk(
            kv, score, start, state, self.ape, self.overlap, self.norm.weight, self.eps,
            self.inv_freq,
        )  # fmt: skip


class V4Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own overlapping compressor at d_i makes the
    keys; queries come from the attention's low-rank q (`qr`, after q_norm)."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        inv_freq: torch.Tensor,
        eps: float,
        prefix: str = "",
        dtype: torch.dtype = torch.float32,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.ratio, self.topk = heads, head_dim, ratio, topk
        self.prefix = prefix
        # wq_b is FP8 in the hub (the quant config picks its format by name)
        self.wq_b = Linear(q_lora_rank, heads * head_dim, False, quant_config, prefix + "wq_b")
        self.weights_proj = Linear(
            hidden_size, heads, prefix=prefix + "weights_proj", params_dtype=dtype
        )
        self.compressor = V4Compressor(
            hidden_size, head_dim, ratio, True, inv_freq, eps, prefix + "compressor.", dtype
        )

    def checkpoint_tensors(self) -> dict[str, nn.Parameter]:
        """Hub checkpoint name -> parameter ("layers.2.attn.indexer.wq_b.weight", ...)."""
        return {f"{self.prefix}{n}": p for n, p in self.named_parameters()}

    def scores(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], qr [T, q_lora_rank], positions [T], keys [n, d_i] -> scores [T, n]."""
        q = self.wq_b(qr).view(-1, self.heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.compressor.inv_freq)
        q = apply_rope(q, cos, sin)
        return indexer_scores(q, keys, self.weights_proj(x))

    def select(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """-> each query's top entries [T, min(topk, n)] int64, -1 past its committed ones."""
        scores = self.scores(x, qr, positions, keys)
        return indexer_topk(scores, positions, self.ratio, self.topk)
