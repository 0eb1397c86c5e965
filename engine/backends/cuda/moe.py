"""DeepSeekMoE on CUDA: the router kernel and the fused MoE kernels (bf16 / FP8 / MXFP4
experts read in their stored format), with the shared expert inside the same launches at
decode sizes. At decode sizes one prologue launch does the routing, the (token, slot)
grouping, x's int8 quantization and the accumulator's zeroing.

V4's layers take the same kernels: hash routing reads the layer's tid2eid table by the
step's token ids inside the router (and prologue) launch, and a `swiglu_limit` is the
clamp in the kernels' SiLU epilogue, for the routed experts and for the shared expert
fused into the same launches (a shared expert run through its own linears clamps itself).

Nothing here reads a device value back to the host (sizes come from host-known T, K, E),
so a decode step can be captured in one CUDA graph (engine/cuda_graph_runner.py). A
float32 model (exactness tests) keeps the torch code except for the router and the
experts, which are gathered by id (no host sync) where they are unquantized.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.backends.cuda.copied_experts import CopiedExperts
from engine.backends.cuda.expert_stacking import (
    FusedExperts,
    stack_experts,
    stack_shared_expert,
)
from engine.backends.cuda.host_experts import SplitExperts
from engine.backends.cuda.norm_linear import KERNEL_DTYPES
from engine.ops.device_layer import DeviceSetup, register
from engine.ops.moe import MoeOps, routed_experts_forward, swiglu

# Tokens up to which the shared expert runs inside the fused MoE launches, where it saves
# launches and runs beside the routed experts. Larger steps are arithmetic-bound, where
# its narrow DENSE tiles lose to cuBLAS's (docs/notes-gpu-engine.md).
SHARED_FUSED_MAX_TOKENS = 64
# Tokens up to which the router computes the float32 gate GEMV itself (one launch instead
# of x.float(), cuBLAS's dot + split-K reduce and the router). Its programs re-read their
# weight block per token (from L2), so larger T, arithmetic-bound, goes to cuBLAS.
ROUTER_FUSED_MAX_TOKENS = 64


def routing_args(
    spec, bias: torch.Tensor | None, tid2eid: torch.Tensor | None = None
) -> dict | None:
    """The router kernels' routing arguments for a RouterSpec, or None where they do not
    apply (V2's greedy groups score a group by its max; the kernels by the top-2 sum). A
    hash-routed spec gives its `tid2eid` table; each call adds the step's `token_ids`."""
    if spec.topk_method == "group_limited_greedy" and spec.topk_group < spec.n_group:
        return None
    grouped = spec.uses_groups and spec.topk_group < spec.n_group
    routing = dict(
        top_k=spec.top_k,
        bias=bias if spec.uses_bias else None,
        n_group=spec.n_group if grouped else 1,
        topk_group=spec.topk_group if grouped else 1,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        scoring=spec.scoring_func,
    )
    if spec.hash_routing:
        if tid2eid is None:
            raise ValueError("a hash-routed spec needs its tid2eid table")
        routing["tid2eid"] = tid2eid
    return routing


class CudaMoeOps(MoeOps):
    """`fused`: the layer's experts as the fused kernel reads them (None where it cannot);
    `shared`: its shared expert likewise; `stream`: the model's side stream for the shared
    expert (CudaTuning.shared_expert_stream), None for one stream."""

    def __init__(self, moe, setup: DeviceSetup):
        self.fused: FusedExperts | None = stack_experts(moe.experts)
        self.shared = None
        if moe.shared_experts is not None:
            self.shared = stack_shared_expert(moe.shared_experts)
            if self.shared is not None:
                self.shared = replace(self.shared, swiglu_limit=moe.shared_experts.swiglu_limit)
        self.stream = None
        if setup.tuning.shared_expert_stream and setup.device.type == "cuda":
            self.stream = setup.shared(
                "cuda.shared_stream", lambda: torch.cuda.Stream(setup.device)
            )
        gate = moe.gate
        self.routing = routing_args(gate.spec, gate.e_score_correction_bias, gate.tid2eid)
        self.routing_top_k = gate.spec.top_k
        self.hashed = gate.spec.hash_routing
        self.swiglu_limit = moe.experts.swiglu_limit
        self.invariant = setup.batch_invariant
        # quantized experts the kernels do not take (float32 activations, or shapes the
        # stacking refuses) run the torch code, which reads expert counts back to the host:
        # such a model's decode step cannot be captured
        unquantized = moe.experts.gate_proj.format.name == "unquantized"
        kernels = self.fused is not None and setup.dtype in KERNEL_DTYPES
        # experts placed on the host: engine/backends/cuda/host_experts.py
        # or, with expert_offload_compute "pcie", copied in when used: copied_experts.py
        self.split = None
        host = moe.experts.host
        if host is not None and host.compute == "pcie":
            self.split = CopiedExperts(moe.experts, setup, self.swiglu_limit,
                                       setup.batch_invariant)  # fmt: skip
        elif host is not None:
            self.split = SplitExperts(moe.experts, setup)
        # a copying step reads the routing back to choose what to copy
        copying = isinstance(self.split, CopiedExperts)
        self.captures_decode = (kernels or unquantized) and not copying

    def token_ids(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> dict:
        """The per-call routing argument: a hash-routed layer's `token_ids` (the step's
        input_ids, one per row of x), else nothing. A shape check only: no host sync."""
        if not self.hashed:
            return {}
        if input_ids is None:
            raise ValueError("a hash-routed MoE layer needs the step's input_ids")
        if input_ids.numel() != x.shape[0]:
            raise ValueError(f"{input_ids.numel()} input_ids for {x.shape[0]} tokens")
        return {"token_ids": input_ids}

    def uses_kernels(self, x: torch.Tensor) -> bool:
        return self.fused is not None and x.dtype in KERNEL_DTYPES

    def forward(self, moe, x, input_ids=None):
        """x [T, D] -> [T, D]; `input_ids` [T] is read by a hash-routed layer only. On the
        fused path the result is the kernels' float32 accumulator: the next step is always
        the pre-norm residual add (the fused RMSNorm takes a float32 x), so a cast launch
        per layer is saved."""
        from kernels.triton.fused_moe import start_shared_expert

        x = x.contiguous()
        copying = isinstance(self.split, CopiedExperts) and x.dtype in KERNEL_DTYPES
        if self.split is not None and (self.uses_kernels(x) or copying) and x.shape[0]:
            return self.forward_split(moe, x, input_ids)
        if self.invariant:
            return self.forward_invariant(moe, x, input_ids)
        # At decode sizes the fused kernels add the shared expert into the routed experts'
        # accumulator (two launches instead of gate, up, silu, mul, down and the add).
        shared = self.shared if x.shape[0] <= SHARED_FUSED_MAX_TOKENS else None
        fused = self.uses_kernels(x)
        # On its own stream the shared expert's gate+up starts now, beside the routing: it
        # needs only x (its down waits in fused_moe for the zeroed accumulator).
        side = fused and shared is not None and self.stream is not None
        pending = start_shared_expert(x, shared, self.stream) if side else None
        try:
            config = self.launch_config(x) if fused and x.shape[0] else None
            prologue = self.prologue(moe, x, config, input_ids)
            if prologue is not None:
                weights, ids = prologue.topk_weights, prologue.topk_ids
            else:
                weights, ids = self.route(moe, x, input_ids)
            if moe.routing_recorder is not None:
                moe.routing_recorder.record(moe.layer_index, ids, moe.experts.bytes_per_expert())
            out = self.routed_experts(
                moe.experts, x, weights, ids, pending or shared, prologue, config
            )
        finally:
            if pending is not None:
                pending.join()
        if moe.shared_experts is not None and (shared is None or not fused):
            out = out + moe.shared_experts(x)
        return out

    def forward_invariant(
        self, moe, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The batch-invariant form: the router's float32 logits from the fixed-config
        matmul and the per-token routing kernel, the routed experts with the ordered
        combine at invariant_config, the shared expert through its own (fixed-config)
        linears, added after. Launches pick only their tiles by the token count, never what
        a token's bits depend on (the K steps, their splits and their order)."""
        from kernels.triton.fused_moe import fused_moe
        from kernels.triton.matmul import fixed_linear
        from kernels.triton.moe_router import moe_route

        if self.routing is None:
            weights, ids = moe.gate(x, input_ids)
        else:
            token_ids = self.token_ids(x, input_ids)
            logits = fixed_linear(x.float(), moe.gate.weight.float())
            weights, ids = moe_route(logits, **self.routing, **token_ids)
        if moe.routing_recorder is not None:
            moe.routing_recorder.record(moe.layer_index, ids, moe.experts.bytes_per_expert())
        if self.uses_kernels(x) and x.shape[0]:
            fused = self.fused
            out = fused_moe(
                x, fused.w13, fused.w2, weights, ids, fused.fmt, fused.w13_scale, fused.w2_scale,
                out_dtype=torch.float32, ordered_combine=True, swiglu_limit=self.swiglu_limit,
            )  # fmt: skip
        else:
            out = self.routed_experts(moe.experts, x, weights, ids)
        if moe.shared_experts is not None:
            out = out + moe.shared_experts(x)
        return out

    def forward_split(self, moe, x: torch.Tensor, input_ids: torch.Tensor | None = None):
        """Experts split between the GPU and the host: the routing goes to the host first,
        then the GPU's routed and shared experts are launched, and the CPU computes its
        experts while they run (engine/backends/cuda/host_experts.py)."""
        from kernels.triton.fused_moe import fused_moe
        from kernels.triton.matmul import fixed_linear
        from kernels.triton.moe_router import moe_route

        split = self.split
        if self.invariant and self.routing is not None:
            logits = fixed_linear(x.float(), moe.gate.weight.float())
            weights, ids = moe_route(logits, **self.routing, **self.token_ids(x, input_ids))
        else:
            weights, ids = self.route(moe, x, input_ids)
        if moe.routing_recorder is not None:
            moe.routing_recorder.record(moe.layer_index, ids, moe.experts.bytes_per_expert())

        def device_experts() -> torch.Tensor:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            if split.num_device:
                fused = self.fused
                device_weights, slots = split.device_pairs(weights, ids)
                invariant = {"ordered_combine": True}
                out = fused_moe(
                    x, fused.w13, fused.w2, device_weights, slots, fused.fmt,
                    fused.w13_scale, fused.w2_scale, out_dtype=torch.float32,
                    swiglu_limit=self.swiglu_limit, **(invariant if self.invariant else {}),
                )  # fmt: skip
            if moe.shared_experts is not None:
                out = out + moe.shared_experts(x)
            return out

        return split.forward(x, weights, ids.to(torch.int32), device_experts)

    def route(
        self, moe, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K] float32, ids [T, K]) as the router module gives: the
        logits x.float() @ W.float().T in float32."""
        if self.routing is None:
            return moe.gate(x, input_ids)
        from kernels.triton.moe_router import moe_gate_route, moe_route

        routing = {**self.routing, **self.token_ids(x, input_ids)}
        gate_weight = moe.gate.weight
        if x.shape[0] <= ROUTER_FUSED_MAX_TOKENS:  # one launch: the GEMV inside the router
            return moe_gate_route(x.contiguous(), gate_weight.contiguous(), **routing)
        return moe_route(F.linear(x.float(), gate_weight).contiguous(), **routing)

    def launch_config(self, x: torch.Tensor) -> dict:
        """The fused kernels' launch config for this step's shape: looked up once, for
        the prologue's grouping and the kernels alike."""
        from kernels.triton.fused_moe import choose_config

        fused = self.fused
        t, d = x.shape
        e = fused.w13.shape[0]
        i = fused.w2.shape[-1] * (2 if fused.fmt == "mxfp4" else 1)
        return choose_config(t, self.routing_top_k, e, d, i, fused.fmt, x.device)

    def prologue(
        self, moe, x: torch.Tensor, config: dict | None, input_ids: torch.Tensor | None = None
    ):
        """At decode sizes on the fused path: routing, pair grouping, x's int8 quantization
        and the accumulator's zeroing in one launch (kernels/triton/moe_prologue.py), as a
        MoePrologue for fused_moe; else None (the router and fused_moe launch their own)."""
        from kernels.triton.moe_prologue import PROLOGUE_MAX_TOKENS, moe_prologue

        decode_sized = 1 <= x.shape[0] <= PROLOGUE_MAX_TOKENS
        if not decode_sized or self.routing is None or config is None:
            return None
        if config.get("KERNEL") == "dequant":  # a prefill-sized choice: fused_moe aligns itself
            return None
        return moe_prologue(
            x,
            moe.gate.weight.contiguous(),
            block_m=config["BLOCK_M"],
            quantize_int8=config.get("KERNEL") == "int8",
            **self.routing,
            **self.token_ids(x, input_ids),
        )

    def routed_experts(self, experts, x, weights, ids, shared=None, prologue=None, config=None):
        """Routed experts' weighted sum; `shared` (a fused_moe.SharedExpert, or a
        PendingSharedExpert already running on the side stream) is added in the same
        kernels when the fused path runs, else the caller adds it. `prologue`: the
        prologue's, if any; `config`: launch_config's (looked up here when None)."""
        if self.uses_kernels(x):
            from kernels.triton.fused_moe import fused_moe

            fused = self.fused
            return fused_moe(
                x.contiguous(),
                fused.w13,
                fused.w2,
                weights,
                ids,
                fused.fmt,
                fused.w13_scale,
                fused.w2_scale,
                shared=shared,
                out_dtype=torch.float32,
                shared_stream=self.stream,
                prologue=prologue,
                config=config,
                swiglu_limit=experts.swiglu_limit,
            )
        if experts.gate_proj.format.name == "unquantized":
            return gathered_experts(experts, x, weights, ids)
        # Quantized experts with float32 activations: the torch code (it syncs: eager only).
        return routed_experts_forward(experts, x, weights, ids.long())


def gathered_experts(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """Unquantized experts with each (token, slot)'s weights gathered by id: no host sync,
    any dtype; reads T*K expert weights, so it is for small models and float32 checks."""
    ids = ids.long()
    w_gate = experts.gate_proj.weight[ids]  # [T, K, I, D]
    w_up = experts.up_proj.weight[ids]  # [T, K, I, D]
    w_down = experts.down_proj.weight[ids]  # [T, K, D, I]
    xw = x.to(w_gate.dtype)
    gate = torch.einsum("td,tkid->tki", xw, w_gate)  # [T, K, I]
    h = swiglu(gate, torch.einsum("td,tkid->tki", xw, w_up), experts.swiglu_limit)  # [T, K, I]
    y = torch.einsum("tki,tkdi->tkd", h, w_down)  # [T, K, D]
    return (y.float() * weights[..., None]).sum(dim=1).to(x.dtype)


@register("moe", "cuda")
def cuda_moe_ops(moe, setup: DeviceSetup) -> MoeOps:
    return CudaMoeOps(moe, setup)
