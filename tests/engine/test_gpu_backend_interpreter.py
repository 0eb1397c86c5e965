"""The CUDA backend's ops (engine/backends/cuda/) on the CPU, through Triton's interpreter,
at tiny sizes: a CPU model prepared as for CUDA takes them for every layer, and the fused
MoE path, the MLA decode and prefill paths and the FP8 linears must equal the torch ops
(engine/ops/) on the same weights and cache. (tests/engine/test_gpu_engine.py checks the
same end to end on a GPU.)"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest

import engine.backends.cuda.mla as mla_backend
from engine.backends.cuda.mla import CudaMlaOps
from engine.backends.cuda.moe import CudaMoeOps, gathered_experts
from engine.backends.cuda.norm_linear import CUDA_NORM, Fp8LinearOps, StackedLinear
from engine.backends.prepare import prepare_model
from engine.checkpoint_maker import make_random_checkpoint
from engine.config import CudaTuning
from engine.layers.mla import MultiLatentAttention
from engine.layers.moe import DeepseekMoE
from engine.ops.device_layer import DeviceSetup
from engine.ops.mla import TORCH_MLA
from engine.ops.moe import TORCH_MOE
from tests.engine.deepseek_helpers import PagedRunner, load_engine_model, relative_error

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU runs test_gpu_engine.py"
)


def _bf16_model(path):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return load_engine_model(path, enable_mtp=False)
    finally:
        torch.set_default_dtype(previous)


def cuda_setup(dtype, max_len=64, **tuning) -> DeviceSetup:
    """A setup that picks the CUDA backend's ops for tensors that stay on the CPU (where
    the kernels run in the interpreter)."""
    tuning = CudaTuning(**{"shared_expert_stream": False, **tuning})
    return DeviceSetup(torch.device("cuda"), dtype, max_len, tuning, batch_invariant=False)


def prepare_as_cuda(model, dtype, max_len=64, **tuning):
    prepare_model(model, cuda_setup(dtype, max_len, **tuning))


def _first_moe(model) -> tuple[DeepseekMoE, CudaMoeOps]:
    moe = next(m for m in model.modules() if isinstance(m, DeepseekMoE))
    assert isinstance(moe.ops, CudaMoeOps)
    return moe, moe.ops


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def tiny_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    make_random_checkpoint(
        out, preset="tiny", expert_dtype=request.param, seed=5, device="cpu", mtp=False
    )
    model = _bf16_model(out)
    prepare_as_cuda(model, torch.bfloat16)
    return model


def test_experts_are_stacked_as_views(tiny_model):
    moe, ops = _first_moe(tiny_model)
    fused = ops.fused
    assert fused is not None and fused.fmt in ("bf16", "mxfp4")
    gate = moe.experts.gate_proj.weight
    assert gate.data_ptr() == fused.w13.data_ptr()  # no second copy of the weights
    assert torch.equal(fused.w13[:, : gate.shape[1]], gate)


def test_shared_expert_is_stacked_as_views_and_fused(tiny_model):
    moe, ops = _first_moe(tiny_model)
    assert moe.shared_experts is not None, "the tiny preset has a shared expert"
    shared = ops.shared
    gate, up = moe.shared_experts.gate_proj.weight, moe.shared_experts.up_proj.weight
    assert gate.data_ptr() == shared.w13.data_ptr()
    assert torch.equal(shared.w13[gate.shape[0] :], up)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, gate.shape[1], generator=gen).bfloat16()
    weights, ids = moe.gate(x)
    routed = ops.routed_experts(moe.experts, x, weights, ids).float()
    both = ops.routed_experts(moe.experts, x, weights, ids, shared).float()
    assert relative_error(both - routed, moe.shared_experts(x).float()) < 3e-2


@pytest.mark.parametrize("tokens", [1, 5, 40])  # with moe_prologue's one launch, and without
def test_moe_forward_matches_the_torch_path(tiny_model, tokens):
    from kernels.triton.moe_prologue import PROLOGUE_MAX_TOKENS

    moe, ops = _first_moe(tiny_model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=gen).bfloat16()
    want = TORCH_MOE.forward(moe, x).float()
    prologue = ops.prologue(moe, x, ops.launch_config(x))
    assert (prologue is not None) == (tokens <= PROLOGUE_MAX_TOKENS)
    got = moe(x)
    assert got.dtype == torch.float32  # the accumulator itself: the next norm adds it
    assert relative_error(got, want) < 2e-2


@pytest.mark.parametrize("tokens", [3, 40])
def test_moe_forward_with_a_dequant_config_matches_the_torch_path(tiny_model, tokens, monkeypatch):
    # a table entry choosing "dequant" (MXFP4 experts decoded to bf16 once): no prologue
    # launch even at decode sizes, and the layer's result as its own torch code gives it
    from kernels.triton import configs

    moe, ops = _first_moe(tiny_model)
    if ops.fused.fmt != "mxfp4":
        pytest.skip("dequant configs are for MXFP4 experts")
    tile = dict(KERNEL="dequant", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    real_lookup = configs.lookup
    monkeypatch.setattr(
        configs, "lookup", lambda op, key, device=None: dict(tile) if "_E1_" not in key
        else real_lookup(op, key, device)  # the shared expert keeps its own entry
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=gen).bfloat16()
    want = TORCH_MOE.forward(moe, x).float()
    assert ops.prologue(moe, x, ops.launch_config(x)) is None
    assert relative_error(moe(x), want) < 2e-2


def test_moe_forward_takes_an_empty_batch(tiny_model):
    moe, ops = _first_moe(tiny_model)
    x = torch.zeros(0, moe.gate.weight.shape[1], dtype=torch.bfloat16)
    assert ops.prologue(moe, x, None) is None
    assert moe(x).shape == x.shape


def test_gathered_experts_match_the_torch_path(tiny_model):
    moe, _ = _first_moe(tiny_model)
    if moe.experts.gate_proj.format.name != "unquantized":
        pytest.skip("the gathered path serves unquantized experts")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, moe.gate.weight.shape[1], generator=gen).bfloat16()
    weights, ids = moe.gate(x)
    want = moe.experts(x, weights, ids).float()
    got = gathered_experts(moe.experts, x, weights, ids).float()
    assert relative_error(got, want) < 1e-2


def test_mla_decode_path_matches_the_torch_path(tiny_model):
    runner = PagedRunner(tiny_model, block_size=4, num_blocks=32, seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = {0: torch.randint(0, 200, (7,), generator=gen).tolist(), 1: [5, 9, 14]}
    runner.step([(s, toks) for s, toks in prompts.items()])  # prefill, torch path
    ctx, positions = runner.context([(0, 1), (1, 1)])
    attn = tiny_model.model.layers[1].self_attn
    assert isinstance(attn, MultiLatentAttention) and isinstance(attn.ops, CudaMlaOps)
    assert attn.ops.q_kv_a is not None  # q_a_proj and kv_a in one linear
    assert ctx.is_decode
    x = torch.randn(2, attn.dims.hidden_size, generator=gen).bfloat16()
    cache = attn.kv_cache.clone()
    want = TORCH_MLA.forward(attn, x, positions, ctx).float()
    want_cache = attn.kv_cache.clone()
    attn.kv_cache.copy_(cache)
    got = attn(x, positions, ctx).float()
    assert relative_error(got, want) < 3e-2
    assert relative_error(attn.kv_cache.float(), want_cache.float()) < 1e-2


def _prefill_inputs_error(model, dtype) -> float:
    """A prefill step's query and cache writes: the layer's torch code (RMSNorm, rope ops,
    concatenation and scatter) against CudaMlaOps.project (one stacked GEMM, one rope +
    norm + cache launch); the largest relative error of the three results."""
    from engine.ops.mla_forms import write_latent_cache

    runner = PagedRunner(model, block_size=4, num_blocks=32, seed=5)
    ctx, positions = runner.context([(0, 6), (1, 3)])  # two prompts, nothing cached yet
    attn = model.model.layers[1].self_attn
    d = attn.dims
    T, H, N, R = 9, d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
    x = torch.randn(T, d.hidden_size, generator=torch.Generator().manual_seed(6)).to(dtype)
    before = attn.kv_cache.clone()
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if d.q_lora_rank else attn.q_proj(x)
    q = q.view(T, H, N + d.qk_rope_head_dim)
    kv = attn.kv_a_proj_with_mqa(x)
    q_rope, k_rope = attn.rotary(positions, q[..., N:], kv[:, None, R:])
    latent = attn.kv_a_layernorm(kv[:, :R].contiguous())
    write_latent_cache(attn.kv_cache, ctx, latent, k_rope[:, 0])
    want_cache = attn.kv_cache.clone()
    attn.kv_cache.copy_(before)
    got = attn.ops.project(attn, x, positions, ctx)
    got_nope, got_rope = got[..., :N], got[..., N:]
    assert not torch.equal(attn.kv_cache, before)  # the new tokens' entries were written
    return max(
        relative_error(got_nope.float(), q[..., :N].float()),
        relative_error(got_rope.float(), q_rope.float()),
        relative_error(attn.kv_cache.float(), want_cache.float()),
    )


def test_mla_prefill_inputs_match_the_torch_path(tiny_model):
    assert _prefill_inputs_error(tiny_model, torch.bfloat16) < 1e-2


def test_float32_prefill_inputs_are_exact(tmp_path):
    make_random_checkpoint(tmp_path, preset="tiny", seed=6, device="cpu", mtp=False)
    model = load_engine_model(tmp_path, enable_mtp=False)  # float32
    prepare_as_cuda(model, torch.float32)
    assert _prefill_inputs_error(model, torch.float32) < 1e-5


def test_mla_prefill_in_the_model_dtype_is_prepared_and_close(tmp_path):
    # CudaTuning.mla_expanded_float32 = False reaches every MLA layer through
    # prepare_model; a bf16 prefill's logits then stay close to the float32 form's.
    make_random_checkpoint(tmp_path, preset="tiny", seed=8, device="cpu", mtp=False)
    model = _bf16_model(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [(0, torch.randint(0, 200, (9,), generator=gen).tolist()), (1, [4, 8, 15, 16])]
    logits = {}
    for in_float32 in (True, False):
        prepare_as_cuda(model, torch.bfloat16, mla_expanded_float32=in_float32)
        attns = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
        assert attns and all(
            a.ops.expanded_dtype == (torch.float32 if in_float32 else torch.bfloat16) for a in attns
        )
        for a in attns:
            a.mode = "expanded"
        rows = PagedRunner(model, block_size=4, num_blocks=32).step(prompts)
        logits[in_float32] = torch.cat(rows).float()  # every prompt token's next-token logits
    assert 0 < relative_error(logits[False], logits[True]) < 3e-2


def _float32_decode_error(tmp_path, max_len: int, prompts: list) -> float:
    """One decode row per prompt after its prefill, in float32: the CUDA backend's decode
    path (prepared for `max_len`) against the layer's torch code on the same cache."""
    make_random_checkpoint(tmp_path, preset="tiny", seed=6, device="cpu", mtp=False)
    model = load_engine_model(tmp_path, enable_mtp=False)  # float32
    prepare_as_cuda(model, torch.float32, max_len)
    runner = PagedRunner(model, block_size=4, num_blocks=32, seed=7)
    runner.step(list(enumerate(prompts)))
    ctx, positions = runner.context([(i, 1) for i in range(len(prompts))])
    attn = model.model.layers[0].self_attn
    x = torch.randn(len(prompts), attn.dims.hidden_size, generator=torch.Generator().manual_seed(8))
    cache = attn.kv_cache.clone()
    want = TORCH_MLA.forward(attn, x, positions, ctx)
    attn.kv_cache.copy_(cache)
    return relative_error(attn(x, positions, ctx), want)


def test_float32_decode_path_is_exact(tmp_path):
    assert _float32_decode_error(tmp_path, 64, [[3, 1, 4, 1, 5, 9], [2, 6]]) < 1e-5


def test_mxfp4_scales_beyond_the_kernels_exact_range_are_refused(tmp_path):
    make_random_checkpoint(
        tmp_path, preset="tiny", expert_dtype="mxfp4", seed=6, device="cpu", mtp=False
    )
    model = _bf16_model(tmp_path)
    experts = next(m for m in model.modules() if isinstance(m, DeepseekMoE)).experts
    experts.down_proj.scale.data[0, 0, 0] = 129  # 2^2: beyond the bf16-folded decode
    with pytest.raises(ValueError, match=r"down_proj\.scale: MXFP4 scale byte 129"):
        prepare_as_cuda(model, torch.bfloat16)


def test_fp8_linears_multiply_in_fp8_from_the_configured_token_count(tmp_path):
    from engine.layers.linear import Linear
    from engine.quant.fp8_block import Fp8BlockFormat
    from kernels.triton.fp8_linear import fp8_block_linear

    make_random_checkpoint(tmp_path, preset="tiny", dense_dtype="fp8", seed=6, device="cpu",
                           mtp=False)  # fmt: skip
    model = _bf16_model(tmp_path)
    prepare_as_cuda(model, torch.bfloat16, fp8_native_min_tokens=3)
    fp8 = [
        m for m in model.modules() if isinstance(m, Linear) and isinstance(m.format, Fp8BlockFormat)
    ]
    assert fp8 and all(isinstance(m.ops, Fp8LinearOps) and m.ops.native_min == 3 for m in fp8)
    layer = fp8[0]
    scale = getattr(layer, layer.format.scale_name)
    gen = torch.Generator().manual_seed(9)
    for rows, native in ((2, False), (3, True)):
        x = torch.randn(rows, layer.in_features, generator=gen).bfloat16()
        got = layer(x)
        assert torch.equal(got, fp8_block_linear(x, layer.weight, scale, native_fp8=native))
        # (the two paths differ: the quantized activations change the result's low bits)
        other = fp8_block_linear(x, layer.weight, scale, native_fp8=not native)
        assert not torch.equal(got, other)


@pytest.mark.parametrize("dense", ["bf16", "fp8"])
def test_stacked_linears_equal_the_two_and_share_their_storage(dense):
    from engine.layers.linear import Linear
    from engine.quant.deepseek_quant_config import DeepseekQuantConfig
    from engine.quant.fp8_block import Fp8BlockFormat

    quant = DeepseekQuantConfig(dense=dense)
    dtype = torch.float8_e4m3fn if dense == "fp8" else torch.bfloat16
    gen = torch.Generator().manual_seed(4)

    def linear(rows: int) -> Linear:
        layer = Linear(160, rows, False, quant, f"l{rows}", params_dtype=torch.bfloat16)
        layer.weight.data = torch.randn(rows, 160, generator=gen).to(dtype)
        if dense == "fp8":
            scale = getattr(layer, layer.format.scale_name)
            scale.data = torch.rand(scale.shape, generator=gen) + 0.5
        layer.prepare(cuda_setup(torch.bfloat16, fp8_native_min_tokens=None))
        return layer

    # FP8: the first ends on a 128-row scale block; bf16 has no blocks (any row count)
    first, second = linear(256 if dense == "fp8" else 100), linear(72)
    weights = (first.weight, second.weight)
    x = torch.randn(3, 160, generator=gen).bfloat16()
    want = torch.cat((first(x), second(x)), dim=-1)
    stacked = StackedLinear.of(first, second, native_min=None)
    assert stacked is not None and stacked.out_features == first.out_features + 72
    assert torch.equal(stacked(x), want)
    assert torch.equal(torch.cat((first(x), second(x)), dim=-1), want)  # now views
    assert first.weight is weights[0] and second.weight is weights[1]  # same Parameters
    names = [("weight", "weight")]
    if dense == "fp8":
        names.append((first.format.scale_name, "scale"))
    for name, stacked_name in names:  # every tensor of both is a view of the stacked one
        base = getattr(stacked, stacked_name)
        assert getattr(first, name).data_ptr() == base.data_ptr()
        offset = getattr(first, name).numel() * base.element_size()
        assert getattr(second, name).data_ptr() == base.data_ptr() + offset
    if dense == "fp8":
        assert isinstance(stacked.format, Fp8BlockFormat)
        # rows ending inside a scale block would need the block split: not stacked
        assert StackedLinear.of(linear(200), linear(72), native_min=None) is None


def test_decode_rope_covers_the_drafters_positions_past_max_model_len(tmp_path):
    # The MTP drafter decodes up to MAX_DRAFTS - 1 positions past a sequence's last row,
    # which near the end lie past max_model_len (the drafts are dropped afterwards); the
    # kernel's rope table must still hold them. Here max_model_len is 8 and the decode row
    # sits at position 9.
    assert _float32_decode_error(tmp_path, 8, [[3, 1, 4, 1, 5, 9, 2, 6, 5]]) < 1e-5


def test_input_norm_folded_into_the_fp8_q_kv_a_gemv(tmp_path, monkeypatch):
    # CudaTuning.fold_input_norm: a one-row decode step (the q/kv_a config is the GEMV)
    # takes norm(x + residual) inside q/kv_a; the same attention output, cache entry and
    # new residual as the norm launch then the decode path. Two rows take the dot kernel
    # here: no fold. (q_lora_rank 128: FP8 q_a and kv_a stack only on a scale-block edge.)
    from engine import checkpoint_maker

    tiny = dict(checkpoint_maker.PRESETS["tiny"], q_lora_rank=128)
    monkeypatch.setitem(checkpoint_maker.PRESETS, "tiny", tiny)
    make_random_checkpoint(tmp_path, preset="tiny", dense_dtype="fp8", seed=9, device="cpu",
                           mtp=False)  # fmt: skip
    model = _bf16_model(tmp_path)
    prepare_as_cuda(model, torch.bfloat16, fold_input_norm=True)
    layer = model.model.layers[1]
    attn, norm = layer.self_attn, layer.input_layernorm
    assert attn.ops.fold_input_norm and attn.ops.q_kv_a is not None
    runner = PagedRunner(model, block_size=4, num_blocks=32, seed=3)
    gen = torch.Generator().manual_seed(10)
    runner.step([(0, torch.randint(0, 200, (6,), generator=gen).tolist()), (1, [7, 3])])
    d = attn.dims.hidden_size
    for rows in (1, 2):
        ctx, positions = runner.context([(s, 1) for s in range(rows)])
        acc = torch.randn(rows, d, generator=gen)  # the MoE's float32 accumulator
        residual = torch.randn(rows, d, generator=gen).bfloat16()
        cache = attn.kv_cache.clone()
        x, want_res = CUDA_NORM.forward(norm, acc, residual)  # the GPU's norm
        want = attn(x, positions, ctx).float()
        want_cache = attn.kv_cache.clone()
        attn.kv_cache.copy_(cache)
        folded = attn.forward_with_input_norm(norm, acc, residual, positions, ctx)
        if rows == 2:
            assert folded is None  # q/kv_a's two-row config is the dot kernel
            continue
        got, got_res = folded
        assert torch.equal(got_res, want_res)
        assert relative_error(got.float(), want) < 1e-2
        assert relative_error(attn.kv_cache.float(), want_cache.float()) < 1e-2
        attn.kv_cache.copy_(cache)
    prepare_as_cuda(model, torch.bfloat16, fold_input_norm=False)
    ctx, positions = runner.context([(0, 1)])
    acc, residual = torch.randn(1, d, generator=gen), torch.randn(1, d, generator=gen).bfloat16()
    assert attn.forward_with_input_norm(norm, acc, residual, positions, ctx) is None


@pytest.mark.parametrize("attention", ["kernels", "reference"])
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_batch_invariant_cuda_ops_give_a_sequence_the_same_logits_however_it_is_stepped(
    tmp_path, experts, attention, monkeypatch
):
    # batch_invariant: every launch's configuration is fixed by its weights' shape and
    # every query attends through the decode kernel, so a sequence's logits are the same
    # bits whether its tokens arrive in one prefill, in chunks, one decode row at a time,
    # alone or among other sequences. The tiny model's rope width (8) is under tl.dot's K
    # on a GPU, where the reference attends instead; "kernels" lowers that bound, which the
    # interpreter does not have, so the decode kernel runs here too.
    if attention == "kernels":
        monkeypatch.setattr(mla_backend, "MIN_DOT_K", 8)
    make_random_checkpoint(tmp_path, preset="tiny", expert_dtype=experts, dense_dtype="fp8",
                           seed=12, device="cpu", mtp=False)  # fmt: skip
    model = _bf16_model(tmp_path)
    tuning = CudaTuning(shared_expert_stream=False)
    prepare_model(model, DeviceSetup(torch.device("cuda"), torch.bfloat16, 64, tuning))
    assert all(m.ops.invariant for m in model.modules() if isinstance(m, (DeepseekMoE, CudaMlaOps)))
    gen = torch.Generator().manual_seed(13)
    tokens = torch.randint(0, 200, (9,), generator=gen).tolist()
    other = torch.randint(0, 200, (6,), generator=gen).tolist()

    whole = PagedRunner(model, seed=1).step([(0, tokens)])[0]
    chunked = PagedRunner(model, seed=2)
    parts = chunked.step([(0, tokens[:4])])[0], chunked.step([(0, tokens[4:])])[0]
    decoded = PagedRunner(model, seed=3)
    rows = [decoded.step([(0, tokens[:5])])[0]]
    rows += [decoded.step([(0, [t])])[0] for t in tokens[5:]]
    crowded = PagedRunner(model, seed=4)
    crowded.step([(1, other[:3]), (0, tokens[:6]), (2, other)])
    last = [crowded.step([(2, [7]), (0, [t]), (1, [5, 6])])[1] for t in tokens[6:]]

    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(torch.cat(rows), whole)
    assert torch.equal(torch.cat(last), whole[6:])


@pytest.mark.parametrize("tokens", [1, 5])
def test_host_experts_copied_in_when_used_match_all_device(tmp_path, tokens):
    # expert_offload_compute "pcie": the odd experts kept pinned in their stored format,
    # copied to a staging stack when routed to, and computed by the same fused kernels
    from engine.backends.cuda.copied_experts import CopiedExperts
    from engine.expert_placement import ExpertPlacement, placing_experts

    make_random_checkpoint(tmp_path, preset="tiny", expert_dtype="mxfp4", dense_dtype="fp8",
                           seed=7, device="cpu", mtp=False)  # fmt: skip
    full = _bf16_model(tmp_path)
    prepare_as_cuda(full, torch.bfloat16)
    moe_full, _ = _first_moe(full)
    experts = moe_full.experts.num_experts
    odd = tuple(range(1, experts, 2))
    host = {m.layer_index: odd for m in full.modules() if isinstance(m, DeepseekMoE)}
    with placing_experts(ExpertPlacement(host, compute="pcie")):
        split = _bf16_model(tmp_path)
    prepare_as_cuda(split, torch.bfloat16)
    moe_split, ops = _first_moe(split)
    assert isinstance(ops.split, CopiedExperts) and not ops.captures_decode
    store = moe_split.experts.host.kernel_store
    gate = moe_full.experts.gate_proj.weight
    assert torch.equal(store.w13[0, : gate.shape[1]], gate[1])  # expert 1 in host slot 0
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, moe_full.gate.weight.shape[1], generator=gen).bfloat16()
    want = moe_full(x).float()
    got = moe_split(x).float()
    call = ops.split.times.per_call(tokens)
    assert call["calls"] == 1 and 0 < call["experts"] <= min(len(odd), tokens * 8)
    assert call["bytes"] == call["experts"] * store.nbytes // len(odd)
    assert call["pairs"] >= call["experts"]
    assert relative_error(got, want) < 1e-2
