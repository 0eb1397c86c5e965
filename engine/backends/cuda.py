"""CUDA backend of the DeepSeek-V3 layers: the functions the layer classes call when their
input is a CUDA tensor. One dispatch line in each layer leads here:

  RMSNorm.forward              -> rmsnorm             Triton, residual add fused
  Fp8BlockFormat.apply         -> fp8_linear          Triton, E4M3 decoded in registers (or
                                                      FP8 x FP8, EngineConfig.fp8_native_min_tokens)
  DeepseekMoE.forward          -> moe_forward         router kernel + fused MoE (bf16/FP8/MXFP4);
                                                      at decode sizes one prologue launch for
                                                      routing, grouping and quantization
  MultiLatentAttention.forward -> mla_decode_forward  (decode steps) one kernel for rope, latent
                                                      norm, cache write and (small T) the W_UK
                                                      absorption; absorbed MLA decode

Legend: T = tokens in the step, H = heads, N = qk_nope_head_dim, P = qk_rope_head_dim,
R = kv_lora_rank, V = v_head_dim, D = hidden, I = expert intermediate, E = experts,
K = experts per token.

Nothing on the decode path reads a device value back to the host (sizes come from host-known
T, K, E; context lengths are read by the attention kernel from a device tensor), so a
decode step can be captured in one CUDA graph (engine/cuda_graph_runner.py).

`prepare_model` runs once after the weights are loaded: it stacks each MoE layer's gate and
up weights into the [E, 2I, D] tensor the fused kernel reads (the per-projection
parameters become views of it, so no memory is added and the CPU code still works), and
precomputes per MLA layer the two halves of kv_b for the absorbed form and the rope table.

The Triton kernels take bf16/fp16 activations. A float32 model (exactness tests) keeps the
torch code, except where the torch code would sync the host (decode attention; experts),
which use capturable equivalents here (the attention kernel in float32; experts gathered by
id for unquantized weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CudaTuning
from engine.layers.deepseek_router import RouterSpec, select_experts
from engine.layers.linear import Linear
from engine.layers.mla import MultiLatentAttention, context_slots
from engine.layers.moe import DeepseekMoE, RoutedExperts, routed_experts_forward
from engine.models.base import CausalLM
from engine.ops.attention_context import AttentionContext
from engine.quant.fp8_block import Fp8BlockFormat
from engine.quant.unquantized import Unquantized
from engine.spec_decode.mtp import MAX_DRAFTS

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MIN_DOT_K = 16  # tl.dot needs K >= 16; the decode kernel dots over the latent and rope widths
# Tokens up to which the shared expert runs inside the fused MoE launches, where it saves
# launches and runs beside the routed experts. Larger steps are arithmetic-bound, where
# its narrow DENSE tiles lose to cuBLAS's: fused at every size, batch-256 decode gained
# nothing on the H200 and prefill slowed (docs/notes-gpu-engine.md).
SHARED_FUSED_MAX_TOKENS = 64
# Tokens up to which the router computes the float32 gate GEMV itself (one launch instead
# of x.float(), cuBLAS's dot + split-K reduce and the router). Its programs re-read their
# weight block per token (from L2), so larger T, arithmetic-bound, goes to cuBLAS.
ROUTER_FUSED_MAX_TOKENS = 64


# -- norms and dense linears ------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    """Same contract as RMSNorm.forward: y, or (y, x + residual)."""
    from kernels.triton.rmsnorm import rmsnorm as rmsnorm_kernel

    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    return rmsnorm_kernel(x, weight, eps, residual)


def fp8_linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16/fp16 @ (the layer's E4M3 [N, K] with 128x128 block scales)^T ->
    [..., N]. From the layer's cuda_native_min_tokens rows on (set by prepare_model on GPUs
    with FP8 tensor cores) the activations are quantized per token per 128 and multiplied
    as FP8. Under CUDA graphs the rows are the padded batch of the graph's bucket."""
    from kernels.triton.fp8_linear import fp8_block_linear

    scale = getattr(layer, layer.format.scale_name)
    native_min = getattr(layer, "cuda_native_min_tokens", None)
    rows = x.numel() // max(1, x.shape[-1])
    native = native_min is not None and rows >= native_min
    return fp8_block_linear(x, layer.weight, scale, native_fp8=native)


# -- MoE --------------------------------------------------------------------------------
@dataclass
class FusedExperts:
    """One MoE layer's experts as the fused kernel reads them (views of the parameters)."""

    fmt: str  # "bf16" | "fp8" | "mxfp4" (fused_moe's names)
    w13: torch.Tensor  # [E, 2I, D(/2)] gate rows, then up rows
    w2: torch.Tensor  # [E, D, I(/2)]
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None


def _routing_args(spec: RouterSpec, bias: torch.Tensor | None) -> dict | None:
    """The router kernels' routing arguments for `spec`, or None where they do not apply
    (V2's greedy groups score a group by its max; the kernels by the top-2 sum)."""
    if spec.topk_method == "group_limited_greedy" and spec.topk_group < spec.n_group:
        return None
    grouped = spec.uses_groups and spec.topk_group < spec.n_group
    return dict(
        top_k=spec.top_k,
        bias=bias if spec.uses_bias else None,
        n_group=spec.n_group if grouped else 1,
        topk_group=spec.topk_group if grouped else 1,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        scoring=spec.scoring_func,
    )


def route(
    spec: RouterSpec, x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, K] float32, ids [T, K]) like DeepseekRouter.forward: the
    logits x.float() @ W.float().T in float32."""
    routing = _routing_args(spec, bias)
    if routing is None:
        return select_experts(F.linear(x.float(), gate_weight), spec, bias)
    from kernels.triton.moe_router import moe_gate_route, moe_route

    if x.shape[0] <= ROUTER_FUSED_MAX_TOKENS:  # one launch: the GEMV inside the router
        ids, weights = moe_gate_route(x.contiguous(), gate_weight.contiguous(), **routing)
    else:
        ids, weights = moe_route(F.linear(x.float(), gate_weight).contiguous(), **routing)
    return weights, ids


def moe_prologue(moe: DeepseekMoE, x: torch.Tensor):
    """At decode sizes on the fused path: routing, pair grouping, x's int8 quantization
    and the accumulator's zeroing in one launch (kernels/triton/moe_prologue.py), as a
    MoePrologue for fused_moe; else None (the router and fused_moe launch their own)."""
    from kernels.triton.fused_moe import choose_config
    from kernels.triton.moe_prologue import PROLOGUE_MAX_TOKENS
    from kernels.triton.moe_prologue import moe_prologue as launch_prologue

    gate, experts = moe.gate, moe.experts
    routing = _routing_args(gate.spec, gate.e_score_correction_bias)
    decode_sized = 1 <= x.shape[0] <= PROLOGUE_MAX_TOKENS
    if not decode_sized or routing is None or not _uses_kernels(experts, x):
        return None
    fused: FusedExperts = experts.cuda_fused
    t, d = x.shape
    e = fused.w13.shape[0]
    i = fused.w2.shape[-1] * (2 if fused.fmt == "mxfp4" else 1)
    cfg = choose_config(t, routing["top_k"], e, d, i, fused.fmt, x.device)
    if cfg.get("KERNEL") == "dequant":  # a prefill-sized choice: fused_moe aligns itself
        return None
    return launch_prologue(
        x,
        gate.weight.contiguous(),
        block_m=cfg["BLOCK_M"],
        quantize_int8=cfg.get("KERNEL") == "int8",
        **routing,
    )


def moe_forward(moe: DeepseekMoE, x: torch.Tensor) -> torch.Tensor:
    """DeepseekMoE.forward on CUDA: x [T, D] -> [T, D]. On the fused path the result is
    the kernels' float32 accumulator: the next step is always the pre-norm residual add
    (the fused RMSNorm takes a float32 x), so a cast launch per layer is saved."""
    from kernels.triton.fused_moe import start_shared_expert

    gate = moe.gate
    x = x.contiguous()
    # At decode sizes the fused kernels add the shared expert into the routed experts'
    # accumulator (two launches instead of gate, up, silu, mul, down and the add). Larger
    # T is arithmetic, where cuBLAS's tiles beat the fused kernel's narrow DENSE ones.
    shared = getattr(moe, "cuda_shared", None) if x.shape[0] <= SHARED_FUSED_MAX_TOKENS else None
    stream = getattr(moe, "cuda_shared_stream", None)  # None off CUDA (prepare_model)
    fused = _uses_kernels(moe.experts, x)
    # On its own stream the shared expert's gate+up starts now, beside the routing: it
    # needs only x (its down waits in fused_moe for the zeroed accumulator).
    side = fused and shared is not None and stream is not None
    pending = start_shared_expert(x, shared, stream) if side else None
    try:
        prologue = moe_prologue(moe, x)
        if prologue is not None:
            weights, ids = prologue.topk_weights, prologue.topk_ids
        else:
            weights, ids = route(gate.spec, x, gate.weight, gate.e_score_correction_bias)
        if moe.routing_recorder is not None:
            moe.routing_recorder.record(moe.layer_index, ids, moe.experts.bytes_per_expert())
        out = routed_experts(moe.experts, x, weights, ids, pending or shared, stream, prologue)
    finally:
        if pending is not None:
            pending.join()
    if moe.shared_experts is not None and (shared is None or not fused):
        out = out + moe.shared_experts(x)
    return out


def _uses_kernels(experts: RoutedExperts, x: torch.Tensor) -> bool:
    return getattr(experts, "cuda_fused", None) is not None and x.dtype in KERNEL_DTYPES


def routed_experts(
    experts: RoutedExperts,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared=None,
    shared_stream: torch.cuda.Stream | None = None,
    prologue=None,
) -> torch.Tensor:
    """Routed experts' weighted sum; `shared` (a fused_moe.SharedExpert, or a
    PendingSharedExpert already running on its own stream) is added in the same kernels
    when the fused path runs (a SharedExpert on `shared_stream` when given, concurrently
    with the routed experts), else the caller adds it. `prologue`: moe_prologue's, if any."""
    if _uses_kernels(experts, x):
        from kernels.triton.fused_moe import fused_moe

        fused: FusedExperts = experts.cuda_fused
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
            shared_stream=shared_stream,
            prologue=prologue,
        )
    if experts.gate_proj.format.name == "unquantized":
        return gathered_experts(experts, x, weights, ids)
    # Quantized experts with float32 activations: the CPU code (it syncs: eager steps only).
    return routed_experts_forward(experts, x, weights, ids.long())


def gathered_experts(
    experts: RoutedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Unquantized experts with each (token, slot)'s weights gathered by id: no host sync,
    any dtype; reads T*K expert weights, so it is for small models and float32 checks."""
    ids = ids.long()
    w_gate = experts.gate_proj.weight[ids]  # [T, K, I, D]
    w_up = experts.up_proj.weight[ids]  # [T, K, I, D]
    w_down = experts.down_proj.weight[ids]  # [T, K, D, I]
    xw = x.to(w_gate.dtype)
    h = F.silu(torch.einsum("td,tkid->tki", xw, w_gate)) * torch.einsum("td,tkid->tki", xw, w_up)
    y = torch.einsum("tki,tkdi->tkd", h, w_down)  # [T, K, D]
    return (y.float() * weights[..., None]).sum(dim=1).to(x.dtype)


def _stack_pair(gate: torch.nn.Module, up: torch.nn.Module, leaf: str) -> torch.Tensor:
    """cat(gate.leaf, up.leaf) along the output rows; both parameters become views of it."""
    a, b = getattr(gate, leaf), getattr(up, leaf)
    both = torch.cat((a.data, b.data), dim=1)
    rows = a.shape[1]
    a.data, b.data = both[:, :rows], both[:, rows:]
    return both


def stack_experts(experts: RoutedExperts) -> FusedExperts | None:
    """The fused kernel's view of a layer's experts, or None where it cannot read them."""
    gate, up, down = experts.gate_proj, experts.up_proj, experts.down_proj
    name = gate.format.name
    if name == "unquantized":
        if gate.weight.dtype not in KERNEL_DTYPES:
            return None
        fmt, leaf = "bf16", None
    elif name.startswith("fp8_block"):
        if gate.out_features % 128:
            return None  # gate and up scale grids would share a 128-row block
        fmt, leaf = "fp8", gate.format.scale_name
    elif name == "mxfp4":
        fmt, leaf = "mxfp4", "scale"
        _check_mxfp4_scales(experts)
    else:
        return None
    w13 = _stack_pair(gate, up, "weight")
    s13 = _stack_pair(gate, up, leaf) if leaf else None
    s2 = getattr(down, leaf) if leaf else None
    return FusedExperts(fmt, w13, down.weight, s13, s2)


def _check_mxfp4_scales(experts: RoutedExperts) -> None:
    """The fused kernel decodes MXFP4 exactly only up to a scale of 2^1 (|w| <= 12); a
    checkpoint beyond that is refused by name rather than computed wrong."""
    from kernels.triton.fused_moe import MXFP4_MAX_EXACT_SCALE

    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        largest = int(proj.scale.max())
        if largest > MXFP4_MAX_EXACT_SCALE:
            raise ValueError(
                f"{proj.prefix}.scale: MXFP4 scale byte {largest} "
                f"(2^{largest - 127}) is above the GPU kernel's exact range "
                f"(<= {MXFP4_MAX_EXACT_SCALE}, 2^1); weights this large are not expected "
                "in a real checkpoint"
            )


def _format_of(linear: torch.nn.Module) -> tuple[str, str | None] | None:
    """(fused_moe format, scale attribute) of a dense linear, or None if the kernels cannot
    read it."""
    name = linear.format.name
    if name == "unquantized":
        return ("bf16", None) if linear.weight.dtype in KERNEL_DTYPES else None
    if name.startswith("fp8_block"):
        return "fp8", linear.format.scale_name
    return None


def stack_shared_expert(mlp: torch.nn.Module):
    """The shared expert (a SwiGluMlp) as a fused_moe.SharedExpert: gate and up stacked into
    one [2Is, D] weight (the parameters become views of it), or None."""
    from kernels.triton.fused_moe import SharedExpert

    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    fmts = {_format_of(gate), _format_of(up), _format_of(down)}
    if len(fmts) != 1 or None in fmts:
        return None
    fmt, leaf = fmts.pop()
    if fmt == "fp8" and gate.out_features % 128:
        return None  # gate and up scale grids would share a 128-row block

    def stack(leaf_name: str) -> torch.Tensor:
        a, b = getattr(gate, leaf_name), getattr(up, leaf_name)
        both = torch.cat((a.data, b.data), dim=0)
        a.data, b.data = both[: a.shape[0]], both[a.shape[0] :]
        return both

    w13 = stack("weight")
    s13 = stack(leaf) if leaf else None
    s2 = getattr(down, leaf) if leaf else None
    return SharedExpert(fmt, w13, down.weight, s13, s2)


# -- MLA --------------------------------------------------------------------------------
@dataclass
class MlaCudaState:
    w_uk: torch.Tensor  # [H, N, R] kv_b's key half, for q_c = q_nope W_uk
    w_uv_t: torch.Tensor  # [H, R, V] kv_b's value half, transposed, for o = o_lat W_uv^T
    cos: torch.Tensor  # [max_model_len + MAX_DRAFTS, P/2] float32 (YaRN factor included)
    sin: torch.Tensor
    # q_proj (or q_a_proj) and kv_a_proj_with_mqa stacked into one linear: they read the
    # same x, so a decode step launches one GEMV (and one activation quantization) for
    # both. None where stack_linears cannot stack them.
    q_kv_a: Linear | None = None
    # EngineConfig.fold_input_norm: decode steps whose q/kv_a runs the FP8 GEMV take the
    # layer's input RMSNorm inside it (mla_decode_with_input_norm).
    fold_input_norm: bool = False


def prepare_mla(
    attn: MultiLatentAttention, dtype: torch.dtype, max_len: int, native_min: int | None
) -> MlaCudaState:
    d = attn.dims
    N = d.qk_nope_head_dim
    w = attn.kv_b_weight().float()  # [H, N+V, R]
    device = attn.kv_a_layernorm.weight.device
    # Rows past max_len too: the MTP drafter decodes up to MAX_DRAFTS - 1 positions past a
    # sequence's last row (drafts it then drops when they would pass max_model_len), and the
    # rope kernels index this table by position without a bound.
    cos, sin = attn.rotary.cos_sin(torch.arange(max_len + MAX_DRAFTS, device=device))
    q_in = attn.q_a_proj if d.q_lora_rank else attn.q_proj
    q_kv_a = stack_linears(q_in, attn.kv_a_proj_with_mqa)
    if q_kv_a is not None and isinstance(q_kv_a.format, Fp8BlockFormat):
        q_kv_a.cuda_native_min_tokens = native_min
    return MlaCudaState(
        w_uk=w[:, :N].to(dtype).contiguous(),
        w_uv_t=w[:, N:].transpose(1, 2).to(dtype).contiguous(),
        cos=cos.float().contiguous(),
        sin=sin.float().contiguous(),
        q_kv_a=q_kv_a,
    )


def stack_linears(first: Linear, second: Linear) -> Linear | None:
    """One Linear computing [first(x) | second(x)], for two linears of the same input, or
    None: bias, formats other than plain or FP8 block weights, formats that differ, or a
    first whose rows end inside a 128-row FP8 scale block. Afterwards both layers' tensors
    are views of the stacked ones, so the weights are not held twice."""
    fmt = first.format
    if first.bias is not None or second.bias is not None or first.in_features != second.in_features:
        return None
    if type(fmt) is not type(second.format) or not isinstance(fmt, (Unquantized, Fp8BlockFormat)):
        return None
    names = ["weight"]
    if isinstance(fmt, Fp8BlockFormat):
        if fmt.scale_name != second.format.scale_name or first.out_features % 128:
            return None
        names.append(fmt.scale_name)
    if any(getattr(first, n).dtype != getattr(second, n).dtype for n in names):
        return None
    stacked = Linear.__new__(Linear)
    nn.Module.__init__(stacked)
    stacked.in_features = first.in_features
    stacked.out_features = first.out_features + second.out_features
    stacked.prefix = f"{first.prefix}+{second.prefix}"
    stacked.format, stacked.bias = fmt, None
    for name in names:
        a, b = getattr(first, name), getattr(second, name)
        both = torch.cat((a.data, b.data))
        setattr(stacked, name, nn.Parameter(both, requires_grad=False))
        # re-pointed in place (as stack_experts does): the Parameter objects stay the same
        rows = a.shape[0]
        a.data, b.data = both[:rows], both[rows:]
    return stacked


def _mla_query_and_latent(
    attn: MultiLatentAttention, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, N+P] and kv_a's output [T, R+P], q_proj (or q_a) and kv_a in one GEMM where
    they are stacked."""
    state: MlaCudaState = attn.cuda_state
    d = attn.dims
    if state.q_kv_a is not None:
        return _split_query_latent(attn, state.q_kv_a(x))
    q_in = attn.q_a_proj if d.q_lora_rank else attn.q_proj
    return _query_heads(attn, q_in(x)), attn.kv_a_proj_with_mqa(x)  # kv [T, R+P]


def _split_query_latent(
    attn: MultiLatentAttention, both: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked q/kv_a output [T, q rows + R + P] -> q [T, H, N+P], kv [T, R+P]."""
    d = attn.dims
    rows = (attn.q_a_proj if d.q_lora_rank else attn.q_proj).out_features
    return _query_heads(attn, both[:, :rows]), both[:, rows:]


def _query_heads(attn: MultiLatentAttention, q: torch.Tensor) -> torch.Tensor:
    """q_proj's output (or q_a's, through its norm and q_b) as [T, H, N+P]."""
    d = attn.dims
    if d.q_lora_rank:
        q = attn.q_b_proj(attn.q_a_layernorm(q))
    return q.view(q.shape[0], d.num_heads, d.qk_nope_head_dim + d.qk_rope_head_dim)


def _rope_cache_args(
    attn: MultiLatentAttention, kv: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
) -> tuple:
    """kernels.triton.mla_cache's arguments after q: the latent and rope key to normalise,
    rotate and write at the step's slots."""
    state: MlaCudaState = attn.cuda_state
    norm = attn.kv_a_layernorm
    return (kv, positions, state.cos, state.sin, attn.rotary.interleaved, norm.weight,
            norm.eps, attn.kv_cache.view(-1, attn.dims.cache_width), ctx.slot_mapping)  # fmt: skip


def mla_prefill_inputs(
    attn: MultiLatentAttention, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
) -> torch.Tensor:
    """MultiLatentAttention.forward's work before the attention itself, for steps that are
    not plain decode (prefill): q [T, H, N+P] with its rope slice rotated, the new tokens'
    cache entries written. q and kv_a in one GEMM, then one launch for rope, the latent's
    norm and the cache write, where the layer's torch code launches an RMSNorm, ~12 ops of
    rope per tensor and a concatenation and scatter (H200: one prompt's prefill step is
    host-bound, ~2,000 launches for 11.5 ms of kernels in 63 ms)."""
    from kernels.triton.mla_cache import mla_rope_cache_write_

    q, kv = _mla_query_and_latent(attn, x)
    n = attn.dims.qk_nope_head_dim
    mla_rope_cache_write_(q[..., n:], *_rope_cache_args(attn, kv, positions, ctx))
    return q


def mla_decode_forward(
    attn: MultiLatentAttention, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
) -> torch.Tensor:
    """MultiLatentAttention.forward for a step where every sequence has one new token."""
    q, kv = _mla_query_and_latent(attn, x)
    return _mla_decode_attend(attn, q, kv, positions, ctx, x.dtype)


def input_norm_fold_config(
    attn: MultiLatentAttention, x: torch.Tensor, residual: torch.Tensor, ctx: AttentionContext
) -> dict | None:
    """The q/kv_a GEMV config a decode step takes its input RMSNorm into
    (mla_decode_with_input_norm), or None where that does not apply: the fold is off, the
    step is not an absorbed decode, q/kv_a is not one stacked FP8 linear, or its config for
    this many rows is not the GEMV (which alone takes a float32 x and the norm)."""
    from kernels.triton.fp8_linear import GEMV_MAX_M, choose_config

    state = getattr(attn, "cuda_state", None)
    if state is None or not state.fold_input_norm or state.q_kv_a is None:
        return None
    linear = state.q_kv_a
    rows = x.shape[0]
    if (
        not ctx.is_decode
        or attn.mode not in ("auto", "absorbed")
        or attn.kv_cache is None
        or not isinstance(linear.format, Fp8BlockFormat)
        or rows > GEMV_MAX_M
        or residual.dtype not in KERNEL_DTYPES
        or x.dtype not in (torch.float32, residual.dtype)
    ):
        return None
    native_min = getattr(linear, "cuda_native_min_tokens", None)
    native = native_min is not None and rows >= native_min
    n, k = linear.weight.shape
    cfg = choose_config(rows, n, k, x.device, native)
    return cfg if cfg.get("KERNEL") == "gemv" and not native else None


def mla_decode_with_input_norm(
    attn: MultiLatentAttention,
    norm: torch.nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    ctx: AttentionContext,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """norm(x, residual) then the attention, with the RMSNorm inside the q/kv_a GEMV (one
    launch fewer per layer; EngineConfig.fold_input_norm): (attention output, x +
    residual), as the decoder layer's two calls give, or None where the fold does not apply
    (input_norm_fold_config)."""
    from kernels.triton.fp8_linear import fp8_gemv_rmsnorm

    cfg = input_norm_fold_config(attn, x, residual, ctx)
    if cfg is None:
        return None
    linear = attn.cuda_state.q_kv_a
    scale = getattr(linear, linear.format.scale_name)
    both, residual = fp8_gemv_rmsnorm(
        x.contiguous(), residual.contiguous(), norm.weight, norm.eps, linear.weight, scale, cfg
    )
    q, kv = _split_query_latent(attn, both)
    return _mla_decode_attend(attn, q, kv, positions, ctx, residual.dtype), residual


def _mla_decode_attend(
    attn: MultiLatentAttention,
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    ctx: AttentionContext,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The decode step after q/kv_a: rope and the cache write, the absorbed attention,
    W_UV and o_proj; the output in `dtype` (the layer input's)."""
    from kernels.triton.mla_cache import (
        ABSORB_MAX_TOKENS,
        mla_decode_prologue_,
        mla_rope_cache_write_,
    )
    from kernels.triton.mla_decode import choose_num_splits, mla_decode

    state: MlaCudaState = attn.cuda_state
    d = attn.dims
    T, H, N, P, R = q.shape[0], d.num_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.kv_lora_rank
    cache = attn.kv_cache
    # One launch: rope on q's rope slices (in place), and the entry [norm(c) | rope(k_rot)]
    # written into the token's cache slot; at decode batch sizes also the absorption of
    # q_nope through W_UK (q_c), which larger T leaves to one batched GEMM.
    cache_args = _rope_cache_args(attn, kv, positions, ctx)
    if T <= ABSORB_MAX_TOKENS and q.dtype in KERNEL_DTYPES:
        q_c = mla_decode_prologue_(q, P, *cache_args, state.w_uk)  # [T, H, R]
    else:
        mla_rope_cache_write_(q[..., N:], *cache_args)
        q_c = torch.bmm(q[..., :N].transpose(0, 1), state.w_uk.to(q.dtype))  # [H, T, R]
        q_c = q_c.transpose(0, 1).to(cache.dtype)  # [T, H, R]
    q_rope = q[..., N:].to(cache.dtype)  # [T, H, P]
    if cache.dtype in KERNEL_DTYPES and min(R, P) >= MIN_DOT_K:
        splits = choose_num_splits(T, ctx.max_context_len, H, q.device)
        o_lat = mla_decode(
            q_c, q_rope, cache, ctx.block_tables, ctx.context_lens, attn.scale, splits
        )  # [T, H, R]
    else:  # float32 (the kernel's float32 dots round to tf32), or dims under tl.dot's K
        o_lat = absorbed_decode_torch(q_c, q_rope, cache, ctx, attn.scale)
    # The value half written straight in [T, H, V] order (cuBLAS takes the strided output),
    # so no transpose copy before o_proj.
    out = torch.empty((T, H, d.v_head_dim), dtype=o_lat.dtype, device=q.device)
    torch.bmm(o_lat.transpose(0, 1), state.w_uv_t.to(o_lat.dtype), out=out.transpose(0, 1))
    return attn.o_proj(out.view(T, H * d.v_head_dim).to(dtype))


def absorbed_decode_torch(
    q_c: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    ctx: AttentionContext,
    scale: float,
) -> torch.Tensor:
    """The decode kernel's contract in torch, with no host sync: every sequence reads
    ctx.max_context_len slots (host-known), those past its device-side length masked.
    q_c [T, H, R], q_rope [T, H, P] -> [T, H, R]."""
    R = q_c.shape[-1]
    slots = context_slots(ctx.block_tables, ctx.max_context_len, ctx.block_size)  # [T, L]
    entries = cache.view(-1, cache.shape[-1])[slots]  # [T, L, R+P]
    latent, k_rope = entries[..., :R], entries[..., R:]
    scores = torch.einsum("thr,tlr->thl", q_c, latent)
    scores = (scores + torch.einsum("thp,tlp->thl", q_rope, k_rope)) * scale  # [T, H, L]
    keys = torch.arange(slots.shape[1], device=q_c.device)
    pad = keys[None, :] >= ctx.context_lens[:, None]  # [T, L]
    probs = scores.masked_fill(pad[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("thl,tlr->thr", probs, latent)


# -- the whole model --------------------------------------------------------------------
def prepare_model(
    model: CausalLM, dtype: torch.dtype, max_model_len: int, tuning: CudaTuning | None = None
) -> None:
    """Once after loading, on CUDA: stacked expert views, MLA decode state and the
    CudaTuning choices (native FP8 only where the GPU has FP8 tensor cores; one shared
    expert stream for the whole model)."""
    tuning = tuning or CudaTuning()
    fp8_native_min_tokens = tuning.fp8_native_min_tokens
    shared_expert_stream = tuning.shared_expert_stream
    mla_expanded_float32 = tuning.mla_expanded_float32
    fold_input_norm = tuning.fold_input_norm
    native = fp8_native_min_tokens if _has_fp8_tensor_cores() else None
    if fp8_native_min_tokens is not None and native is None:
        log.info("no FP8 tensor cores: dense FP8 linears decode their weights to bf16 always")
    fused = 0
    device = next(model.parameters()).device
    side = torch.cuda.Stream(device) if shared_expert_stream and device.type == "cuda" else None
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.format, Fp8BlockFormat):
            module.cuda_native_min_tokens = native
        if isinstance(module, RoutedExperts):
            module.cuda_fused = stack_experts(module)
            fused += module.cuda_fused is not None
        elif isinstance(module, DeepseekMoE) and module.shared_experts is not None:
            module.cuda_shared = stack_shared_expert(module.shared_experts)
            module.cuda_shared_stream = side
        elif isinstance(module, MultiLatentAttention):
            module.cuda_state = prepare_mla(module, dtype, max_model_len, native)
            module.cuda_state.fold_input_norm = fold_input_norm
            module.expanded_dtype = torch.float32 if mla_expanded_float32 else dtype
    if fused:
        log.info("CUDA backend: %d MoE layers on the fused kernel", fused)


def _has_fp8_tensor_cores() -> bool:
    """sm_89 (Ada) and sm_90+ (Hopper on) multiply E4M3 natively; the interpreter (CPU tests)
    runs the FP8 dot too."""
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability() >= (8, 9)


# Memory kept free after the KV cache: CUDA graphs' pool (largest bucket's activations and
# logits), cuBLAS workspaces, allocator fragmentation.
GRAPH_HEADROOM_BYTES = 1 << 30
FREE_MEMORY_SHARE = 0.9


def kv_cache_budget(
    model: CausalLM,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    warmup_tokens: int,
    vocab_size: int,
    max_num_seqs: int,
) -> int:
    """Bytes for the KV cache, measured after a warm-up forward: a prefill of
    `warmup_tokens` tokens (the most one step computes) over a temporary cache. What the
    warm-up peaked at, the graphs' headroom and the logits of the largest decode batch
    are kept free; the KV cache gets a share of the rest."""
    blocks = -(-warmup_tokens // block_size) + 1
    temp = [
        torch.empty(blocks, block_size, *s.shape, dtype=s.dtype or dtype, device=device)
        for s in model.cache_specs()
    ]
    model.bind_kv_cache(temp)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab_size, (warmup_tokens,), device=device, generator=gen)
    positions = torch.arange(warmup_tokens, device=device)
    ctx = AttentionContext(
        block_size=block_size,
        slot_mapping=positions.clone(),  # blocks 0.. of the temporary cache, in order
        cu_query_lens=torch.tensor([0, warmup_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([warmup_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None, :],
        query_lens_host=[warmup_tokens],
        context_lens_host=[warmup_tokens],
        is_decode=False,
    )
    with torch.inference_mode():
        hidden = model(ids, positions, ctx)
        model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del temp, hidden
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    logits = 3 * max_num_seqs * vocab_size * 4  # float32 logits, their copy, sampler scratch
    budget = int(free * FREE_MEMORY_SHARE) - peak - GRAPH_HEADROOM_BYTES - logits
    log.info(
        "KV budget after warm-up: %.2f GiB free, warm-up peak %.2f GiB -> %.2f GiB for KV",
        free / 2**30,
        peak / 2**30,
        budget / 2**30,
    )
    return budget
