"""The engine on a CUDA GPU (marker `gpu`; run by scripts/gpu_engine_check.sh): the CUDA
backend and the decode CUDA graphs must give the CPU path's greedy tokens in float32, and
logits within bf16 tolerance of the float32 CPU path at real (Moonlight) shapes."""

import pytest
import torch

from engine.checkpoint_maker import make_random_checkpoint
from engine.ops.attention_context import AttentionContext
from engine.sampling_params import SamplingParams
from tests.engine.deepseek_helpers import PagedRunner, load_engine_model, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return make_random_checkpoint(out, preset="tiny", seed=11, device="cuda", mtp=False)


def test_greedy_tokens_equal_the_cpu_path_in_float32(tiny_checkpoint):
    from engine.llm import LLM

    prompts = _prompts(6, 258, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cpu = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", kv_cache_memory=32 << 20)
    want = _tokens(cpu.generate(prompts, params))
    gpu = LLM(str(tiny_checkpoint), device="cuda", dtype="float32", max_num_seqs=8)
    runner = gpu.engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    assert runner.num_blocks > 1000  # sized from free memory after the warm-up
    assert gpu.engine.async_scheduling  # on by default with graphs
    assert _tokens(gpu.generate(prompts, params)) == want
    gpu.engine.async_scheduling = False  # every step read back before the next
    assert _tokens(gpu.generate(prompts, params)) == want
    runner.graphs = None  # the same engine, every step eager
    assert _tokens(gpu.generate(prompts, params)) == want
    # Sequences leaving the batch at different steps: the rows of a step's pending tokens
    # move between steps, and a stopped row's extra token must be dropped.
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, stop_token_ids=[want[i][5]])
        for i in range(len(prompts))
    ]
    cpu_mixed = [o.outputs[0].token_ids for o in cpu.generate(prompts, mixed)]
    runner.graphs, gpu.engine.async_scheduling = graphs, True
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, mixed)] == cpu_mixed
    # Buckets captured again (bench step-tune does after changing a launch config) replay
    # the same step; the others are kept as they were.
    kept = graphs.graphs[8]
    graphs.recapture([1, 4])
    assert graphs.graphs[8] is kept and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert _tokens(gpu.generate(prompts, params)) == want
    del gpu, runner
    torch.cuda.empty_cache()


def test_seeded_sampling_repeats_on_graphs(tiny_checkpoint):
    from engine.llm import LLM

    gpu = LLM(
        str(tiny_checkpoint),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=4,
        kv_cache_memory=256 << 20,
    )
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True)
    prompts = _prompts(3, 258, seed=2)
    first = _tokens(gpu.generate(prompts, params))
    assert _tokens(gpu.generate(prompts, params)) == first
    assert len({tuple(t) for t in first}) > 1


def _gpu_logits(model, tokens: list[int]) -> torch.Tensor:
    """Prefill all but the last token, then decode the last one (the CUDA decode path);
    the decode step's logits [V]. Uses the model's bound cache from block 0 on."""
    device, bs = torch.device("cuda"), 16
    n = len(tokens)
    table = torch.arange(-(-n // bs), dtype=torch.int32, device=device)[None, :]

    def ctx(start: int, count: int) -> AttentionContext:
        return AttentionContext(
            block_size=bs,
            slot_mapping=torch.arange(start, start + count, device=device),
            cu_query_lens=torch.tensor([0, count], dtype=torch.int32, device=device),
            context_lens=torch.tensor([start + count], dtype=torch.int32, device=device),
            block_tables=table,
            query_lens_host=[count],
            context_lens_host=[start + count],
            is_decode=count == 1,
        )

    ids = torch.tensor(tokens, device=device)
    with torch.inference_mode():
        model(ids[:-1], torch.arange(n - 1, device=device), ctx(0, n - 1))
        hidden = model(ids[-1:], torch.tensor([n - 1], device=device), ctx(n - 1, 1))
        return model.compute_logits(hidden)[0].float().cpu()


@pytest.mark.parametrize(
    ("dense", "experts", "native", "expanded_f32", "fold"),
    [
        ("bf16", "bf16", None, True, False),
        ("fp8", "mxfp4", None, True, False),
        ("fp8", "mxfp4", 1, True, False),
        ("fp8", "mxfp4", None, False, False),
        ("fp8", "mxfp4", None, False, True),
    ],
)
def test_bf16_logits_close_to_float32_cpu_at_moonlight_shapes(
    tmp_path, dense, experts, native, expanded_f32, fold, monkeypatch
):
    # native=1: every dense FP8 linear quantizes its activations (EngineConfig.
    # fp8_native_min_tokens), one E4M3 rounding per linear input on top of bf16.
    # expanded_f32=False: the prefill's MLA expanded form in bf16 (EngineConfig.
    # mla_expanded_float32), whose cache entries the decode step then reads
    import kernels.triton.fp8_linear as fp8_module
    from engine.llm import LLM

    paths = []  # the native_fp8 flag of every FP8 linear call: the option must reach them
    plain = fp8_module.fp8_block_linear

    def recorded(*args, native_fp8=False, **kwargs):
        paths.append(native_fp8)
        return plain(*args, native_fp8=native_fp8, **kwargs)

    monkeypatch.setattr(fp8_module, "fp8_block_linear", recorded)
    folds = []  # fold=True (EngineConfig.fold_input_norm): the decode row's q/kv_a GEMVs
    plain_fold = fp8_module.fp8_gemv_rmsnorm
    monkeypatch.setattr(fp8_module, "fp8_gemv_rmsnorm",
                        lambda *a, **k: folds.append(1) or plain_fold(*a, **k))  # fmt: skip

    path = make_random_checkpoint(
        tmp_path / "m",
        preset="moonlight-16b-a3b",
        layers=2,
        dense_dtype=dense,
        expert_dtype=experts,
        seed=3,
        device="cuda",
        mtp=False,
    )
    tokens = _prompts(1, 163840, seed=4)[0] + [1000, 2000]
    gpu = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=2,
        max_model_len=128,
        kv_cache_memory=1 << 30,
        fp8_native_min_tokens=native,
        mla_expanded_float32=expanded_f32,
        fold_input_norm=fold,
        batch_invariant=False,  # the tuning switches: invariance fixes their choices
    )
    paths.clear()  # count the logits forward only, not start-up's warm-up and capture
    folds.clear()
    got = _gpu_logits(gpu.engine.runner.model, tokens)
    if dense == "fp8":
        assert paths and all(p == (native is not None) for p in paths)
    assert len(folds) == (1 if fold else 0)  # layer 1's decode row (layer 0 has no residual)
    del gpu
    torch.cuda.empty_cache()
    cpu_model = load_engine_model(path, enable_mtp=False)
    runner = PagedRunner(cpu_model, block_size=16, num_blocks=8)
    runner.step([(0, tokens[:-1])])
    want = runner.step([(0, tokens[-1:])])[0][0]
    assert relative_error(got, want) < (6e-2 if native else 3e-2)
