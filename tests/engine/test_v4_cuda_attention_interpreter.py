"""The CUDA backend's V4 attention ops (engine/backends/cuda/v4_attention.py) on the CPU
through Triton's interpreter, against the torch ops (engine/ops/v4_paged_attention.py) on
the tiny float32 V4 model (a sliding, a CSA, an HCA and a CSA layer; CSA windows of 4,
HCA of 8, a window ring of 8, blocks of 8 tokens): sequences prefilled by the torch ops,
then decode steps of a batch at different lengths that close CSA and HCA windows at
different steps, with the first windows (CSA's Ca slots of window -1) among them."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest

from engine.backends.cuda.v4_attention import CudaV4AttentionOps, indexer_selection
from engine.ops.device_layer import DeviceSetup
from engine.ops.v4_paged_attention import TORCH_V4_ATTENTION, entry_rows
from tests.engine.deepseek_helpers import PagedRunner, relative_error
from tests.engine.v4_helpers import engine_v4_from_hf, hf_v4_model

pytest.importorskip("transformers.models.deepseek_v4")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; PagedRunner keeps its state on the CPU"
)

VOCAB = 128


def cuda_ops(model) -> None:
    """Every attention layer of `model` takes the CUDA ops (for tensors on the CPU)."""
    dtype = next(model.parameters()).dtype
    setup = DeviceSetup(torch.device("cuda"), dtype, model.max_model_len)
    for layer in model.layers:
        layer.attn.ops = CudaV4AttentionOps(layer.attn, setup)


def prefilled(hf, lengths, seed=1, dtype=torch.float32) -> tuple:
    """The engine's model on hf's weights in `dtype` with one sequence per length prefilled
    in one step by the torch ops, its runner, and a token generator for the steps after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = engine_v4_from_hf(hf)
    finally:
        torch.set_default_dtype(previous)
    runner = PagedRunner(model, block_size=8, num_blocks=64)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    runner.step(list(enumerate(prompts)))
    return model, runner, gen


def layer_state(attn) -> dict[str, torch.Tensor]:
    names = ("ring", "pool_state", "entries", "index_keys", "index_pool_state")
    return {n: getattr(attn, n) for n in names if getattr(attn, n) is not None}


@pytest.fixture(scope="module")
def hf():
    return hf_v4_model(seed=3)


def test_decode_steps_match_the_torch_ops(hf):
    # Two models on the same weights and schedule; 22 steps take positions 2..23, 7..28,
    # 12..33, 21..42 through every CSA and HCA window residue, each on its own step.
    lengths = [2, 7, 12, 21]
    torch_model, torch_runner, gen = prefilled(hf, lengths)
    cuda_model, cuda_runner, _ = prefilled(hf, lengths)
    cuda_ops(cuda_model)
    for step in range(22):
        tokens = torch.randint(0, VOCAB, (len(lengths),), generator=gen).tolist()
        items = [(i, [t]) for i, t in enumerate(tokens)]
        want = torch.cat(torch_runner.step(items))
        got = torch.cat(cuda_runner.step(items))
        assert relative_error(got, want) < 1e-5, f"step {step}"
    for ref, out in zip(torch_runner.states + torch_runner.caches,
                        cuda_runner.states + cuda_runner.caches):  # fmt: skip
        assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"]
)
def test_each_layer_leaves_the_torch_ops_state(hf, dtype, tol):
    # Layer by layer from the same state and input: the ring and the pooling states equal
    # the torch ops' bit for bit (the same projections and float32 rows); the committed
    # entries and the indexer's keys within float rounding (the compressor kernel's exp,
    # sum orders and fused multiply-adds: ~1e-7 in float32, one bf16 ulp in bf16), the
    # output within `tol` (bf16: the kernel's float32 softmax against the torch ops' bf16
    # one). Positions 3, 6, 7, 13 and the 9 after: every residue of 8, window 0 of both
    # compressors.
    model, runner, gen = prefilled(hf, [3, 6, 7, 13], dtype=dtype)
    cuda_ops(model)
    hidden = model.config.hidden_size
    for step in range(10):
        ctx, positions = runner.context([(i, 1) for i in range(4)])
        x = torch.randn(4, hidden, generator=gen).to(dtype)
        for i, layer in enumerate(model.layers):
            attn = layer.attn
            before = {n: t.clone() for n, t in layer_state(attn).items()}
            want = TORCH_V4_ATTENTION.forward(attn, x, positions, ctx)
            after = {n: t.clone() for n, t in layer_state(attn).items()}
            for n, t in layer_state(attn).items():
                t.copy_(before[n])
            got = attn.ops.forward(attn, x, positions, ctx)
            where = f"step {step}, layer {i}"
            assert relative_error(got.float(), want.float()) < tol, where
            for n, t in layer_state(attn).items():
                if n in ("entries", "index_keys", "ring"):  # kernels' exp / cos round their way
                    assert relative_error(t.float(), after[n].float()) < tol, f"{where}: {n}"
                else:
                    assert torch.equal(t, after[n]), f"{where}: {n}"


def test_the_selection_is_the_indexers_over_the_committed_keys():
    # index_topk 3 < the committed entries: the top-k cuts; rows with fewer than 3 get -1.
    # ReLU ties make indices ambiguous, so each row's chosen scores are compared.
    hf = hf_v4_model(seed=5, index_topk=3)
    model, runner, gen = prefilled(hf, [2, 5, 11, 30], seed=2)
    attn = model.layers[1].attn
    assert attn.indexer is not None and attn.indexer.topk == 3
    ctx, positions = runner.context([(i, 1) for i in range(4)])
    x = torch.randn(4, model.config.hidden_size, generator=gen)
    cos, sin = attn.cos_sin(positions)
    _, qr = attn.query(x, cos, sin)
    tables = ctx.block_tables.to(torch.int32)
    sel = indexer_selection(attn.indexer, x, qr, positions, attn.index_keys, tables)
    assert sel.shape == (4, 3) and sel.dtype == torch.int32
    flat = attn.index_keys.view(-1, attn.indexer.head_dim)
    for b, t in enumerate(positions.tolist()):
        n = (t + 1) // 4
        keys = flat[entry_rows(ctx.block_tables[b], 0, n, 4, ctx.block_size)]
        rows = slice(b, b + 1)
        want = attn.indexer.select(x[rows], qr[rows], positions[rows], keys)[0]
        assert (sel[b] < 0).sum() == max(0, 3 - n), f"row {b} at position {t}"
        scores = attn.indexer.scores(x[rows], qr[rows], positions[rows], keys)[0]
        chosen = sel[b][sel[b] >= 0].long()
        torch.testing.assert_close(
            scores[chosen].sort().values, scores[want[want >= 0]].sort().values,
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip


class HostOnly(list):
    """A context's host list that a decode step must not read (a graph replays the step
    with other lengths): its length only."""

    def __getitem__(self, i):
        raise AssertionError("the decode step read a host list of the context")

    def __iter__(self):
        raise AssertionError("the decode step read a host list of the context")


def _no_sync(name):
    def raiser(*args, **kwargs):
        raise AssertionError(f"the decode step called Tensor.{name} (a host sync on a GPU)")

    return raiser


def test_a_decode_step_never_reads_the_host(hf, monkeypatch):
    model, runner, gen = prefilled(hf, [3, 7, 12])
    cuda_ops(model)
    ctx, positions = runner.context([(i, 1) for i in range(3)])
    x = torch.randn(3, model.config.hidden_size, generator=gen)
    for name in ("query_lens_host", "context_lens_host", "state_slots_host"):
        setattr(ctx, name, HostOnly(getattr(ctx, name)))
    # Not .numpy(): the CPU's linears (fixed_order_linear) read their operands through it,
    # no transfer; on a GPU it raises for a CUDA tensor anyway.
    for name in ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, _no_sync(name))
    for layer in model.layers:
        out = layer.attn.ops.forward(layer.attn, x, positions, ctx)
        assert out.shape == x.shape
