"""DeepSeek-V4's attention, one class for the three layer kinds its `compress_ratio` picks:
0 a sliding window only; 4 (CSA) the window plus the lightning indexer's top entries of an
overlapping compressor; any other ratio (HCA) the window plus every committed entry of a
non-overlapping compressor. Its parameters carry the hub's names; the arithmetic is
engine/ops/v4_attention.py (legend there and in docs/shapes.md: T tokens, L keys, H heads,
D hidden, P rope dims; `head_dim` spelled out) and engine/ops/v4_compress.py, and the
paged decode state's is the device's ops (engine/ops/v4_paged_attention.py).

The hub names, under the layer's `layers.{i}.attn.` prefix: `wq_a`, `q_norm`, `wq_b`, `wkv`,
`kv_norm`, `wo_a`, `wo_b`, `attn_sink`. transformers calls them `self_attn.q_a_proj`,
`q_a_norm`, `q_b_proj`, `kv_proj`, `kv_norm`, `o_a_proj`, `o_b_proj`, `sinks`.

A compressed layer adds `compressor.*` and, for CSA, `indexer.*` (engine/layers/
v4_compress.py).

The step is split where the decode state goes between: `query` and `key_value` project
the step's tokens (`key_value` is what the window ring stores: one roped [head_dim] entry
a token), `attend` reads any set of keys with their positions and visibility, `output`
de-rotates and projects. `prompt_forward` is one whole prompt without a cache (the oracle
the paged ops are tested against); `forward` is the engine's step over the decode state.

Decode state (bound by the model; the ops read and write it):
- `ring` [slots, ring_size, head_dim]: a sequence's last keys, position p at p % ring_size.
- `entries` [num_blocks, block_size // m, head_dim]: committed compressed entries, paged
  like the latent cache (entry w in the sequence's block w * m // block_size).
- `pool_state` [slots, 2, R, W] float32: the pooling rows of the windows being compressed
  (R + the speculative lookahead rows, engine/ops/v4_compress.py).
- CSA only: `index_keys` [num_blocks, block_size // 4, index_head_dim] and
  `index_pool_state` [slots, 2, 8, 2 * index_head_dim] for the indexer's compressor.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import compute_inv_freq, rope_parameters
from engine.layers.v4_compress import V4Compressor, V4Indexer
from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceLayer, DeviceSetup, build
from engine.ops.v4_attention import (
    apply_rope,
    grouped_low_rank,
    rope_cos_sin,
    sink_attention,
    unit_rms,
    window_mask,
)
from engine.ops.v4_compress import state_rows
from engine.ops.v4_paged_attention import TORCH_V4_ATTENTION, V4AttentionOps
from engine.quant.base import QuantConfig


def v4_rope_parameters(config: dict, compressed: bool) -> dict:
    """The rope of one V4 layer kind as one flat dict for `compute_inv_freq`.

    Sliding-only layers: plain rope at `rope_theta` (1e4). Compressed layers (CSA, HCA):
    `compress_rope_theta` (1.6e5) with the config's YaRN scaling but attention factor 1
    (DeepSeek's reference does not scale cos/sin by YaRN's mscale). Reads the hub's keys
    (`rope_theta`, `compress_rope_theta`, `rope_scaling`) or transformers' nested
    `rope_parameters` {"main": ..., "compress": ...}; both give the same frequencies.
    """
    nested = config.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict):
        params = dict(nested["compress" if compressed else "main"])
        params.setdefault("rope_type", params.pop("type", "default"))
    elif not compressed:
        params = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    else:
        max_pos = config.get("max_position_embeddings", 2048)
        params = rope_parameters(
            {"rope_scaling": config.get("rope_scaling"), "max_position_embeddings": max_pos}
        )
        # the compressed layers' own theta, whatever a rope_scaling dict carries
        params["rope_theta"] = config.get("compress_rope_theta", 160000.0)
    if params["rope_type"] == "yarn":
        params["attention_factor"] = 1.0
        params.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings", 2048)
        )
    return params


CSA_RATIO = 4


class V4Attention(nn.Module, DeviceLayer):
    """MQA with one `head_dim`-wide head shared as key and value, over a window of
    `sliding_window` positions (the query's own included) and, with a `compress_ratio`,
    compressed entries; per-head sinks."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        head_dim: int,
        qk_rope_head_dim: int,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        sliding_window: int,
        rms_norm_eps: float,
        rope: dict,
        max_position_embeddings: int,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        compress_ratio: int = 0,
        index_n_heads: int = 0,
        index_head_dim: int = 0,
        index_topk: int = 0,
    ) -> None:
        super().__init__()
        H, head_dim = num_attention_heads, head_dim
        if (H * head_dim) % o_groups:
            raise ValueError(f"heads * head_dim = {H * head_dim} is not a multiple of o_groups")
        if qk_rope_head_dim % 2 or qk_rope_head_dim > head_dim:
            raise ValueError(f"qk_rope_head_dim {qk_rope_head_dim}: even and <= head_dim")
        self.num_heads, self.head_dim = H, head_dim
        self.o_groups = o_groups
        self.sliding_window = sliding_window
        self.compress_ratio = compress_ratio
        self.eps = rms_norm_eps
        self.scale = head_dim**-0.5
        self.prefix = prefix
        dtype = torch.get_default_dtype()

        def linear(name: str, in_features: int, out_features: int) -> Linear:
            prefixed = f"{prefix}{name}"
            return Linear(in_features, out_features, quant_config=quant_config, prefix=prefixed)

        self.wq_a = linear("wq_a", hidden_size, q_lora_rank)
        self.q_norm = RMSNorm(q_lora_rank, rms_norm_eps)
        self.wq_b = linear("wq_b", q_lora_rank, H * head_dim)
        self.wkv = linear("wkv", hidden_size, head_dim)
        self.kv_norm = RMSNorm(head_dim, rms_norm_eps)
        # Read whole by the grouped product (not through the linear ops): a quantized
        # format is dequantized per call, which DeepSeek's own conversion does once.
        self.wo_a = linear("wo_a", H * head_dim // o_groups, o_groups * o_lora_rank)
        self.wo_b = linear("wo_b", o_groups * o_lora_rank, hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32), requires_grad=False)
        inv_freq, attention_factor = compute_inv_freq(
            rope, qk_rope_head_dim, max_position_embeddings
        )
        if attention_factor != 1.0:
            raise ValueError(f"V4's rope has no attention factor (got {attention_factor})")
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [P/2]
        self.compressor = self.indexer = None
        if compress_ratio:
            self.compressor = V4Compressor(
                hidden_size,
                head_dim,
                compress_ratio,
                compress_ratio == CSA_RATIO,
                inv_freq,
                rms_norm_eps,
                prefix + "compressor.",
                dtype,
            )
        if compress_ratio == CSA_RATIO:
            self.indexer = V4Indexer(
                hidden_size,
                q_lora_rank,
                index_n_heads,
                index_head_dim,
                compress_ratio,
                index_topk,
                inv_freq,
                rms_norm_eps,
                prefix + "indexer.",
                dtype,
                quant_config,
            )
        # the decode state (module docstring), bound by the model
        self.ring: torch.Tensor | None = None
        self.entries: torch.Tensor | None = None
        self.pool_state: torch.Tensor | None = None
        self.index_keys: torch.Tensor | None = None
        self.index_pool_state: torch.Tensor | None = None
        self.ops: V4AttentionOps = TORCH_V4_ATTENTION

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("v4_attention", self, setup)

    # -- the decode state's shapes ---------------------------------------------------------
    def cache_shapes(self) -> list[tuple[tuple[int, ...], int]]:
        """(entry shape, tokens per entry) of each paged cache: the compressed entries,
        then the indexer's keys (CSA); none for a sliding-only layer."""
        if not self.compress_ratio:
            return []
        shapes = [((self.head_dim,), self.compress_ratio)]
        if self.indexer is not None:
            shapes.append(((self.indexer.head_dim,), self.indexer.ratio))
        return shapes

    def state_shapes(
        self, ring_size: int, lookahead: int = 0
    ) -> list[tuple[tuple[int, ...], bool]]:
        """(shape, float32?) of each per-sequence state: the window ring (model dtype),
        then the pooling states (float32) of the compressor and the indexer's, with
        `lookahead` rows more for the drafts a speculative step writes."""
        shapes = [((ring_size, self.head_dim), False)]
        for comp in self._compressors():
            rows = state_rows(comp.ratio, comp.overlap, lookahead)
            shapes.append(((2, rows, comp.width), True))
        return shapes

    def bind(self, caches: list[torch.Tensor], states: list[torch.Tensor]) -> None:
        """Take this layer's caches and states, in cache_shapes / state_shapes order."""
        self.entries, self.index_keys = (list(caches) + [None, None])[:2]
        self.ring, self.pool_state, self.index_pool_state = (list(states) + [None, None])[:3]

    def _compressors(self) -> list[V4Compressor]:
        comps = [self.compressor] if self.compressor is not None else []
        if self.indexer is not None:
            comps.append(self.indexer.compressor)
        return comps

    # -- the arithmetic's pieces -------------------------------------------------------------
    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, P/2] float32."""
        return rope_cos_sin(positions, self.inv_freq)

    def query(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (q [T, H, head_dim] roped, qr [T, q_lora_rank]: the normalised
        low-rank q, which a CSA layer's indexer reads too)."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(x.shape[0], self.num_heads, self.head_dim)
        return apply_rope(unit_rms(q, self.eps), cos, sin), qr

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> kv [T, head_dim]: the roped entry a window ring stores per token."""
        return apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

    def entries_visible(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys, n: int
    ) -> torch.Tensor:
        """[T, n] bool: which of a sequence's first n compressed entries each query reads.
        HCA: every committed one (w < (p + 1) // m); CSA: the indexer's selection over
        `keys` [n, index_head_dim], the sequence's committed indexer keys."""
        if self.indexer is None:
            limit = (positions + 1) // self.compress_ratio
            return torch.arange(n, device=x.device)[None, :] < limit[:, None]
        picked = self.indexer.select(x, qr, positions, keys)  # [T, k], -1 past committed
        visible = torch.zeros(x.shape[0], n + 1, dtype=torch.bool, device=x.device)
        visible.scatter_(1, torch.where(picked < 0, n, picked), True)
        return visible[:, :n]

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        entries: torch.Tensor | None = None,
        entries_visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, head_dim] at q_pos [T] over window keys [L, head_dim] at k_pos [L] and,
        for a compressed layer, `entries` [n, head_dim] with their visibility [T, n] ->
        o [T, H, head_dim]: one softmax over both with the sinks. Window keys outside a
        query's window (or after it) are masked, so any superset of the window gives the
        same result."""
        visible = window_mask(q_pos, k_pos, self.sliding_window)
        if entries is not None:
            keys = torch.cat([keys, entries.to(keys.dtype)])
            visible = torch.cat([visible, entries_visible], dim=1)
        return sink_attention(q, keys, visible, self.attn_sink, self.scale)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [T, H, head_dim] (rotated as its keys were) -> [T, D]: de-rotate at the query's
        position, the grouped wo_a, then wo_b."""
        o = apply_rope(o, cos, -sin)
        wo_a = self.wo_a.weight  # the family keeps it in float (dequantized at load)
        if self.wo_a.format.name != "unquantized":
            wo_a = self.wo_a.format.dequantize(self.wo_a)
        wo_a = wo_a.to(o.dtype)  # a no-op for a model-dtype weight
        return self.wo_b(grouped_low_rank(o, wo_a))

    # -- whole prompts and engine steps ----------------------------------------------------------
    def prompt_forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One sequence's whole prompt from position 0, without a cache: x [T, D] at
        positions [T] (0..T-1) -> [T, D]. The mask reads positions only, so a flat batch
        of several sequences must call it per sequence."""
        cos, sin = self.cos_sin(positions)
        q, qr = self.query(x, cos, sin)
        kv = self.key_value(x, cos, sin)
        entries = visible = None
        if self.compressor is not None:
            entries = self.compressor.prefix_entries(x)
            keys = self.indexer.compressor.prefix_entries(x) if self.indexer else None
            visible = self.entries_visible(x, qr, positions, keys, entries.shape[0])
        o = self.attend(q, kv, positions, positions, entries, visible)
        return self.output(o, cos, sin)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """The step's tokens x [T, D] (all sequences, flattened) at positions [T] -> [T, D],
        reading and updating each sequence's decode state."""
        return self.ops.forward(self, x, positions, ctx)

    def checkpoint_tensors(self) -> dict[str, nn.Parameter]:
        """Hub checkpoint name -> parameter ("layers.0.attn.wq_a.weight", ...)."""
        return {f"{self.prefix}{n}": p for n, p in self.named_parameters()}

    def extra_repr(self) -> str:
        return (
            f"{self.prefix or 'attn'} heads={self.num_heads}, head_dim={self.head_dim}, "
            f"window={self.sliding_window}, groups={self.o_groups}, "
            f"compress_ratio={self.compress_ratio}"
        )
