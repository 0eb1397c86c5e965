"""L2 prefetch of the next phase's dense weights during small decode steps (CUDA).

At a few tokens a DeepSeek layer is a chain of latency-bound kernels, each waiting on DRAM
for weights known long before its turn, while the DRAM bandwidth goes mostly unused (H200,
Moonlight batch 1: attention's kernels under a fifth of peak, the MoE near a third). So
each phase warms L2 with the dense weights of the phase after it, from a side stream:

  - when layer L's attention starts: layer L's MoE router and shared expert (read ~30 us
    later, by the kernels beside the routed experts);
  - when layer L's MoE starts: layer L+1's attention (q/kv_a, the absorbed W_UK and W_UV,
    o_proj), read once the MoE is done.

The routed experts are not prefetched: which ones a token takes is known only once it is
routed. A plan is capped at a share of L2 (`L2_SHARE`), the earliest-read weights first.

Stream discipline (CUDA graph capture wants every side stream joined back): each issue
first joins the previous prefetch into the current stream (long finished by then: a
prefetch kernel only issues requests), and a phase with nothing to fetch (the last layer's
MoE, a dense layer's attention) joins without issuing, so no fork is left open when the
forward ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.triton.l2_prefetch import PrefetchPlan, build_plan, l2_prefetch

# Steps of up to this many tokens prefetch (decode graphs' small buckets); larger steps
# read most experts per layer and keep DRAM busy by themselves.
PREFETCH_MAX_TOKENS = 16
# The most one plan may take of the L2 (what else the phase streams evicts the rest).
L2_SHARE = 0.5


class WeightPrefetcher:
    """The side stream the prefetches run on, and whether one is still to be joined."""

    def __init__(self, device: torch.device, max_tokens: int = PREFETCH_MAX_TOKENS) -> None:
        # High priority: its one-warp programs should not wait behind a wave of the main
        # chain's blocks for an SM slot, or the fetch starts late.
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.max_tokens = max_tokens
        self.pending = False

    def issue(self, plan: PrefetchPlan | None, num_tokens: int) -> None:
        """Join the previous prefetch, then start `plan`'s (None or a large step: join only)."""
        current = torch.cuda.current_stream(self.stream.device)
        if self.pending:
            current.wait_stream(self.stream)
            self.pending = False
        if plan is None or num_tokens > self.max_tokens:
            return
        self.stream.wait_stream(current)  # the weights' last writer, as for any kernel
        with torch.cuda.stream(self.stream):
            l2_prefetch(plan)
        self.pending = True


@dataclass
class PhasePrefetch:
    """What a layer's attention or MoE issues when it starts."""

    prefetcher: WeightPrefetcher
    plan: PrefetchPlan | None

    def start(self, num_tokens: int) -> None:
        self.prefetcher.issue(self.plan, num_tokens)


def _tensors_of(*modules: nn.Module | None) -> list[torch.Tensor]:
    out = []
    for m in modules:
        if m is not None:
            out += [t for t in (*m.parameters(), *m.buffers()) if t.is_cuda]
    return out


def attention_weights(attn: nn.Module, input_norm: nn.Module) -> list[torch.Tensor]:
    """A MultiLatentAttention's decode-step weights on CUDA, in the order they are read."""
    state = attn.cuda_state
    d = attn.dims
    if state.q_kv_a is not None:
        first = _tensors_of(state.q_kv_a)
    else:
        q_in = attn.q_a_proj if d.q_lora_rank else attn.q_proj
        first = _tensors_of(q_in, attn.kv_a_proj_with_mqa)
    if d.q_lora_rank:
        first += _tensors_of(attn.q_a_layernorm, attn.q_b_proj)
    return [
        *_tensors_of(input_norm),
        *first,
        *_tensors_of(attn.kv_a_layernorm),
        state.w_uk,
        state.w_uv_t,
        *_tensors_of(attn.o_proj),
    ]


def moe_dense_weights(moe: nn.Module) -> list[torch.Tensor]:
    """A DeepseekMoE's weights every token reads: the router's, then the shared expert's
    (as the fused kernels read them, gate and up stacked)."""
    out = _tensors_of(moe.gate)
    shared = getattr(moe, "cuda_shared", None)
    if shared is not None:
        out += [
            t for t in (shared.w13, shared.w13_scale, shared.w2, shared.w2_scale) if t is not None
        ]
    elif moe.shared_experts is not None:
        out += _tensors_of(moe.shared_experts)
    return out


def attach_prefetches(layers: nn.ModuleList, device: torch.device) -> WeightPrefetcher | None:
    """Give each decoder layer's attention (`self_attn.cuda_prefetch`) and MoE
    (`mlp.cuda_prefetch`) the plan it issues when it starts; None (nothing attached) unless
    every layer's attention is MLA with its CUDA state. Call after prepare_mla and the
    shared experts' stacking (the plans hold their addresses)."""
    from engine.layers.moe import DeepseekMoE

    if not all(getattr(layer.self_attn, "cuda_state", None) for layer in layers):
        return None
    cap = int(torch.cuda.get_device_properties(device).L2_cache_size * L2_SHARE)
    prefetcher = WeightPrefetcher(device)
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        is_moe = isinstance(mlp, DeepseekMoE)
        moe_plan = build_plan(moe_dense_weights(mlp), cap) if is_moe else None
        layer.self_attn.cuda_prefetch = PhasePrefetch(prefetcher, moe_plan)
        if is_moe:
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            attn_plan = (
                build_plan(attention_weights(nxt.self_attn, nxt.input_layernorm), cap)
                if nxt is not None
                else None
            )
            mlp.cuda_prefetch = PhasePrefetch(prefetcher, attn_plan)
    return prefetcher
