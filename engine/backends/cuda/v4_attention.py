"""DeepSeek-V4 attention on CUDA (the interface: engine/ops/v4_paged_attention.py; the decode
state's layout: engine/layers/v4_attention.py's docstring).

A decode step (one token per sequence) reads the step only from device tensors (positions,
ctx.state_slots, ctx.block_tables) and takes every launch shape from sizes known before
the step (B, the block tables' width, index_topk, max_model_len), so it never syncs the
host and a CUDA graph can capture it:

1. q, qr of all B rows (the layer's `query`, its unit RMS and rope one launch,
   kernels/triton/v4_qkv.py);
2. the roped kv (the layer's `key_value`, one launch) written in the same launch into
   the ring at [slot, pos % ring_size], before the read: the attention kernel finds the
   query's own key there;
3. each compressor (the CSA indexer's too), one kernel launch after its projections
   (kernels/triton/v4_compress.py): the token's (kv, score + ape[pos % m]) into its
   pooling state at row pos % reach, and a row whose token closes its window
   (pos % m == m - 1) pools it (engine/ops/v4_compress.py's `_slots` and `_pool`) and
   writes the entry to its paged row; the other rows write no entry;
4. CSA: the indexer's scores (one launch) over every entry the row's block table can hold,
   -inf past the committed ones, torch.topk on the device -> sel [B, index_topk] int32,
   -1 padded;
5. kernels/triton/v4_attention.py over ring and entries with the sinks, then the layer's
   `output` (de-rotation, grouped wo_a, wo_b).

Prefill and mixed steps run the torch ops, which read the ring before writing it; the
state both leave is the same. Float32 models take the decode path too (the kernel computes
in IEEE float32 for them), so their decode step is capturable like a bf16 one.

Legend: docs/shapes.md (B sequences, H heads); m the compress ratio, reach the pooling
state's rows (m, or 2m with overlap, plus any speculative lookahead), W the projection width, d the entry width, S the slots an entry
pools (m, or 2m), n the entries a block table holds, Hi the indexer's heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceSetup, register
from engine.ops.v4_attention import apply_rope, rope_cos_sin
from engine.ops.v4_paged_attention import TORCH_V4_ATTENTION, V4AttentionOps
from engine.spec_decode.mtp import MAX_DRAFTS


def compress_decode(comp, cache, state, x, positions, slots, tables) -> None:
    """One decode token per row through a compressor (kernels/triton/v4_compress.py, one
    launch after the projections): its rows into the pooling states [slots, 2, reach, W],
    and the entry its token commits into the paged `cache` [num_blocks, block_size // m, d];
    rows that close no window write no entry."""
    from kernels.triton.v4_compress import v4_compress_decode

    kv, score = comp.project(x)  # [B, W]
    v4_compress_decode(kv, score, comp.ape, state, cache, positions, slots, tables,
                       comp.norm.weight, comp.inv_freq, comp.eps, comp.overlap)  # fmt: skip


def indexer_selection(indexer, x, qr, positions, keys_cache, tables):
    """sel [B, index_topk] int32: each row's indexer top entries among every entry its
    block table can hold (n, a shape, not a length: the step's data does not size it),
    scored -inf past its committed ones (w < (pos + 1) // m), -1 where it has fewer."""
    from kernels.triton.v4_compress import v4_indexer_scores

    q = indexer.wq_b(qr).view(-1, indexer.heads, indexer.head_dim)
    cos, sin = rope_cos_sin(positions, indexer.compressor.inv_freq)
    q = apply_rope(q, cos, sin)  # [B, Hi, d_i]
    weights = indexer.weights_proj(x)  # [B, Hi]
    scores = v4_indexer_scores(q, weights, keys_cache, positions, tables, indexer.ratio)
    k = min(indexer.topk, scores.shape[1])
    values, picked = scores.topk(k, dim=-1)  # [B, k]
    picked = torch.where(values == float("-inf"), -1, picked)
    return F.pad(picked, (0, indexer.topk - k), value=-1).to(torch.int32)


def decode_indices(ctx: AttentionContext) -> tuple[torch.Tensor, ...]:
    """The step's state slots as indices (int64) and as the kernel reads them (int32), and
    the block tables as int32 (the graph runner's buffers are int64): once per step."""
    slots = ctx.state_slots
    return slots.long(), slots.to(torch.int32), ctx.block_tables.to(torch.int32)


class CudaV4AttentionOps(V4AttentionOps):
    # a decode step reads no host data: the graph runner may capture it
    captures_decode = True

    def __init__(self, attn, setup: DeviceSetup):
        if not attn.compress_ratio:
            self.mode = "sliding"
        else:
            self.mode = "hca" if attn.indexer is None else "csa"
        # The HCA kernel's split axis must cover every decode row's position: the
        # sequence's last row plus the MTP drafter's positions past it.
        self.max_position = setup.max_model_len + MAX_DRAFTS - 1

    def forward(self, attn, x, positions, ctx: AttentionContext):
        if not ctx.is_decode:
            return TORCH_V4_ATTENTION.forward(attn, x, positions, ctx)
        if ctx.state_slots is None:
            raise ValueError("V4 attention needs each sequence's state slot (ctx.state_slots)")
        from kernels.triton.v4_attention import v4_attention_decode
        from kernels.triton.v4_qkv import v4_kv_prologue, v4_o_epilogue, v4_q_prologue

        slots, slots_i32, tables = ctx.shared("v4-decode-indices", lambda: decode_indices(ctx))
        # the layer's `query`: one launch after the projections
        qr = attn.q_norm(attn.wq_a(x))  # [B, q_lora_rank]
        q = v4_q_prologue(attn.wq_b(qr), positions, attn.inv_freq, attn.eps, attn.num_heads)
        # the layer's `key_value` and the ring write in one launch (its cos/sin may differ
        # from torch's by an ulp in the rope dims: a decode step's key equals the prefill
        # path's to rounding, not bit for bit)
        ring = attn.ring
        kv_norm = attn.kv_norm
        v4_kv_prologue(attn.wkv(x), kv_norm.weight, kv_norm.eps, positions, attn.inv_freq,
                       ring, slots)  # fmt: skip
        entries = block_tables = sel = None
        if attn.compressor is not None:
            entries, block_tables = attn.entries, tables
            compress_decode(attn.compressor, entries, attn.pool_state, x, positions, slots,
                            tables)  # fmt: skip
        if attn.indexer is not None:
            compress_decode(attn.indexer.compressor, attn.index_keys, attn.index_pool_state,
                            x, positions, slots, tables)  # fmt: skip
            sel = indexer_selection(attn.indexer, x, qr, positions, attn.index_keys, tables)
        o = v4_attention_decode(
            q, ring, entries, positions, slots_i32, block_tables, attn.attn_sink,
            window=attn.sliding_window, ratio=attn.compress_ratio or 1, mode=self.mode,
            sel=sel, max_position=self.max_position,
        )  # fmt: skip
        # the layer's `output`: de-rotation and the grouped wo_a in two launches, then wo_b
        wo_a = attn.wo_a.weight  # the family keeps it in float (dequantized at load)
        if attn.wo_a.format.name != "unquantized":
            wo_a = attn.wo_a.format.dequantize(attn.wo_a)
        return attn.wo_b(v4_o_epilogue(o, positions, attn.inv_freq, wo_a.to(o.dtype)))


@register("v4_attention", "cuda")
def cuda_v4_attention_ops(attn, setup: DeviceSetup) -> V4AttentionOps:
    return CudaV4AttentionOps(attn, setup)
