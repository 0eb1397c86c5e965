"""DeepSeek-V4's MoE in the engine against transformers' on the same random float32 weights:
the sqrtsoftplus + bias top-k router, the hash router (tid2eid by token id), and the whole
block with its SwiGLU clamps on the routed and the shared experts. The bias and tid2eid
are randomised (transformers initialises them to zeros: every token to expert 0)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
)

from engine.config import CudaTuning  # noqa: E402
from engine.layers.deepseek_router import RouterSpec  # noqa: E402
from engine.layers.moe import DeepseekMoE  # noqa: E402
from engine.ops.device_layer import DeviceSetup  # noqa: E402

VOCAB, D, I, E, K = 128, 64, 32, 16, 3
# Small against the gate/up values of these weights (std ~1.6), so most clamps bind.
LIMIT = 1.0


def hf_config(swiglu_limit: float = LIMIT) -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=D, moe_intermediate_size=I, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        partial_rotary_factor=0.25, num_experts_per_tok=K, n_routed_experts=E,
        sliding_window=8, o_groups=2, o_lora_rank=16,
        layer_types=[
            "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
        ],
        mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=2, index_head_dim=16,
        index_topk=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        swiglu_limit=swiglu_limit,
    )  # fmt: skip
    cfg._experts_implementation = "eager"  # the reference loop
    return cfg


def spec_of(cfg: DeepseekV4Config, layer: int) -> RouterSpec:
    return RouterSpec(
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        scoring_func=cfg.scoring_func,
        topk_method="noaux_tc",
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        hash_routing=cfg.mlp_layer_types[layer] == "hash_moe",
        vocab_size=cfg.vocab_size,
    )


def random_hf_block(cfg: DeepseekV4Config, layer: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    block = hf.DeepseekV4SparseMoeBlock(cfg, layer)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if block.is_hash:
            rows = [torch.randperm(E, generator=g)[:K] for _ in range(VOCAB)]
            block.gate.tid2eid.copy_(torch.stack(rows))  # distinct experts per token
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    return block


def engine_block(cfg: DeepseekV4Config, layer: int, block, swiglu_limit) -> DeepseekMoE:
    moe = DeepseekMoE(
        D, I, cfg.n_shared_experts, spec_of(cfg, layer), None, f"layers.{layer}.mlp", layer,
        swiglu_limit=swiglu_limit,
    )  # fmt: skip
    with torch.no_grad():
        moe.gate.weight.copy_(block.gate.weight)
        if block.is_hash:
            moe.gate.tid2eid.copy_(block.gate.tid2eid)
        else:
            moe.gate.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
        gate, up = block.experts.gate_up_proj.chunk(2, dim=1)  # [E, I, D] each, gate first
        moe.experts.gate_proj.weight.copy_(gate)
        moe.experts.up_proj.weight.copy_(up)
        moe.experts.down_proj.weight.copy_(block.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            ours = getattr(moe.shared_experts, name).weight
            ours.copy_(getattr(block.shared_experts, name).weight)
    return moe


def inputs(seed: int, t: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g)  # [T, D]
    ids = torch.randint(0, VOCAB, (t,), generator=g)  # [T]
    return x, ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_router_matches_transformers(seed):
    cfg = hf_config()
    block = random_hf_block(cfg, 1, seed)
    assert isinstance(block.gate, hf.DeepseekV4TopKRouter)
    moe = engine_block(cfg, 1, block, LIMIT)
    x, _ = inputs(seed)
    _, ref_w, ref_ids = block.gate(x[None])
    w, ids = moe.gate(x)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-5)
    # The bias steers the choice: without it some token picks other experts.
    _, plain_ids = moe_route_without_bias(moe, x)
    assert not torch.equal(plain_ids.sort(dim=1).values, ids.sort(dim=1).values)


def moe_route_without_bias(moe, x):
    from kernels.reference.moe_router import moe_gate_route_reference

    return moe_gate_route_reference(x, moe.gate.weight, K, scoring="sqrtsoftplus", sorted=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hash_router_matches_transformers(seed):
    cfg = hf_config()
    block = random_hf_block(cfg, 0, seed)
    assert isinstance(block.gate, hf.DeepseekV4HashRouter)
    moe = engine_block(cfg, 0, block, LIMIT)
    x, tokens = inputs(seed)
    _, ref_w, ref_ids = block.gate(x[None], tokens[None])
    w, ids = moe.gate(x, tokens)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(ids, block.gate.tid2eid[tokens])
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "topk"])
@pytest.mark.parametrize("seed", [0, 1])
def test_moe_block_matches_transformers(layer, seed):
    cfg = hf_config()
    block = random_hf_block(cfg, layer, seed)
    moe = engine_block(cfg, layer, block, LIMIT)
    x, tokens = inputs(seed + 10)
    with torch.no_grad():
        ref = block(x[None], tokens[None])[0]  # [T, D]
        out = moe(x, tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The clamps bind on these weights: the unclamped block is far from transformers'.
    unclamped = engine_block(cfg, layer, block, None)
    with torch.no_grad():
        gap = (unclamped(x, tokens) - ref).abs().max().item()
    assert gap > 1e-2


def test_shared_expert_is_clamped_as_transformers_clamps_it():
    cfg = hf_config()
    block = random_hf_block(cfg, 1, 3)
    moe = engine_block(cfg, 1, block, LIMIT)
    x, _ = inputs(4)
    with torch.no_grad():
        ref = block.shared_experts(x)
        out = moe.shared_experts(x)
        gate = x @ block.shared_experts.gate_proj.weight.T
        up = x @ block.shared_experts.up_proj.weight.T
    assert (gate > LIMIT).any() and (up < -LIMIT).any() and (up > LIMIT).any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_hash_layer_needs_input_ids():
    cfg = hf_config()
    moe = engine_block(cfg, 0, random_hf_block(cfg, 0, 0), LIMIT)
    x, tokens = inputs(0)
    with pytest.raises(ValueError, match="input_ids"):
        moe(x)
    with pytest.raises(ValueError, match="input_ids"):
        moe(x, tokens[:-1])


def test_router_spec_checks_hash_routing():
    with pytest.raises(ValueError, match="vocab_size"):
        RouterSpec(num_experts=E, top_k=K, hash_routing=True)
    with pytest.raises(ValueError, match="n_group"):
        RouterSpec(
            num_experts=E, top_k=K, n_group=4, topk_group=2, hash_routing=True, vocab_size=VOCAB
        )
    spec = RouterSpec(num_experts=E, top_k=K, hash_routing=True, vocab_size=VOCAB)
    assert not spec.uses_bias and not spec.uses_groups


def cuda_setup(dtype=torch.float32, batch_invariant=False) -> DeviceSetup:
    """A setup that picks the CUDA backend's ops for tensors that stay on the CPU (where
    the kernels run in the interpreter)."""
    tuning = CudaTuning(shared_expert_stream=False)
    return DeviceSetup(torch.device("cuda"), dtype, 64, tuning, batch_invariant=batch_invariant)


def cuda_ops(moe, setup: DeviceSetup):
    from engine.backends.cuda.moe import CudaMoeOps, cuda_moe_ops

    ops = cuda_moe_ops(moe, setup)
    assert isinstance(ops, CudaMoeOps)  # every V4 layer: no torch fallback
    return ops


def _no_torch_router(*args, **kwargs):
    raise AssertionError("the router module ran: the CUDA ops should route by kernel")


@pytest.mark.parametrize(
    "layer, limit",
    [(0, None), (1, LIMIT), (0, LIMIT), (1, None)],
    ids=["hash", "clamp", "hash+clamp", "sqrtsoftplus-topk"],
)
@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "batch-invariant"])
def test_cuda_ops_compute_every_v4_layer_as_transformers(layer, limit, invariant, monkeypatch):
    # float32: the router kernels (the hash lookup included) and the experts gathered by
    # id with the clamp, equal to transformers' float32 block
    cfg = hf_config()
    block = random_hf_block(cfg, layer, 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # else the interpreter
    moe = engine_block(cfg, layer, block, limit).to(device)
    moe.ops = cuda_ops(moe, cuda_setup(batch_invariant=invariant))
    monkeypatch.setattr(moe.gate, "forward", _no_torch_router)
    x, tokens = inputs(5)
    cfg_limit = hf_config(limit if limit is not None else 1e9)
    ref_block = random_hf_block(cfg_limit, layer, 0)
    with torch.no_grad():
        ref = ref_block(x[None], tokens[None])[0]
        out = moe(x.to(device), tokens.to(device)).cpu()
    torch.testing.assert_close(out.float(), ref, rtol=1e-5, atol=1e-5)


def test_cuda_ops_hash_layer_needs_input_ids():
    cfg = hf_config()
    moe = engine_block(cfg, 0, random_hf_block(cfg, 0, 0), LIMIT)
    moe.ops = cuda_ops(moe, cuda_setup())
    x, tokens = inputs(0)
    with pytest.raises(ValueError, match="input_ids"):
        moe(x)
    with pytest.raises(ValueError, match="input_ids"):
        moe(x, tokens[:-1])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bf16_blocks(layer: int, seed: int):
    """transformers' float32 block on bf16-representable weights, and the engine's bf16
    block (float32 router) with the same values: the CUDA ops take their fused kernels."""
    cfg = hf_config()
    block = random_hf_block(cfg, layer, seed)
    with torch.no_grad():
        for p in block.parameters():
            if p.is_floating_point():
                p.copy_(p.bfloat16().float())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        moe = engine_block(cfg, layer, block, LIMIT)
    finally:
        torch.set_default_dtype(previous)
    return block, moe


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "topk"])
@pytest.mark.parametrize(
    "tokens, invariant",
    [(1, False), (5, False), (24, False), (24, True)],
    ids=["prologue-1", "prologue-5", "router+align", "batch-invariant"],
)
def test_cuda_fused_kernels_equal_transformers_in_bf16(layer, tokens, invariant):
    # bf16 activations: the router (or the decode prologue) with the hash lookup, the
    # fused MoE with the clamp, the shared expert clamped inside the same launches (or,
    # batch-invariant, through its own linears)
    block, moe = bf16_blocks(layer, seed=6)
    ops = cuda_ops(moe, cuda_setup(torch.bfloat16, batch_invariant=invariant))
    assert ops.fused is not None and ops.shared.swiglu_limit == LIMIT
    moe.ops = ops
    x, ids = inputs(7, tokens)
    x = x.bfloat16()
    with torch.no_grad():
        ref = block(x.float()[None], ids[None])[0]
        out = moe(x, ids)
    assert rel_err(out, ref) < 2e-2
    # The clamps bind: the unclamped block is far outside that tolerance.
    unclamped = hf.DeepseekV4SparseMoeBlock(hf_config(1e9), layer)
    unclamped.load_state_dict(block.state_dict())
    with torch.no_grad():
        assert rel_err(unclamped(x.float()[None], ids[None])[0], ref) > 0.2
