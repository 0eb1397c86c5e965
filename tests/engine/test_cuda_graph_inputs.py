"""CPU tests of the CUDA graph runner's pure logic: bucket choice and the static decode
buffers (what a replay reads), without a GPU."""

import pytest
import torch

from engine.cuda_graph_runner import (
    CONTEXT_LENS,
    INPUT_IDS,
    POSITIONS,
    SEEDS,
    SLOTS,
    SRC_ROWS,
    STATE_SLOTS,
    STEPS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    DecodeInputs,
    bucket_for,
    capture_buckets,
)
from engine.sampling_params import SamplingParams
from engine.sequence import PENDING_TOKEN, Sequence


def test_capture_buckets_cover_max_num_seqs():
    assert capture_buckets(1) == [1]
    assert capture_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert capture_buckets(1000)[-3:] == [768, 896, 1024]
    # past the listed buckets, one every LARGE_BUCKET_STEP rows up to max_num_seqs
    assert capture_buckets(1500)[-3:] == [1024, 1280, 1536]


@pytest.mark.parametrize("n", [1, 3, 17, 100, 257, 513, 1000, 1024, 1025, 2000])
def test_every_batch_up_to_max_num_seqs_has_a_bucket(n):
    buckets = capture_buckets(n)
    assert buckets == sorted(set(buckets))
    assert all(bucket_for(k, buckets) is not None for k in range(1, n + 1))
    # padding stays within a quarter of the bucket past 16 rows (a step's cost grows with rows)
    assert all(bucket_for(k, buckets) <= max(16, k * 1.5) for k in range(1, n + 1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_buckets(0)


@pytest.mark.parametrize(("n", "want"), [(1, 1), (3, 4), (8, 8), (9, 16), (100, 128), (129, None)])
def test_bucket_for_pads_up(n, want):
    assert bucket_for(n, [1, 2, 4, 8, 16, 32, 64, 128]) == want


def _seq(prompt, generated, table, params, seed=None):
    seq = Sequence("r", 0, prompt, params, seed)
    seq.token_ids += generated
    seq.block_table = list(table)
    seq.num_computed = len(seq) - 1
    return seq


def test_fill_writes_rows_and_pads_on_the_scratch_block():
    bs, scratch = 4, 9
    inputs = DecodeInputs(8, 5, bs, scratch, torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, seed=3)
    a = _seq([11, 12, 13, 14, 15], [16], [7, 2], greedy)  # last token at position 5
    b = _seq([21, 22], [23, 24], [4], sampled, seed=1234)  # position 3
    inputs.fill([a, b], 4)
    ints, floats, tables = inputs.ints, inputs.floats, inputs.tables
    assert ints[INPUT_IDS, :2].tolist() == [16, 24]
    assert ints[POSITIONS, :2].tolist() == [5, 3]
    assert ints[SLOTS, :2].tolist() == [2 * bs + 1, 4 * bs + 3]
    assert ints[CONTEXT_LENS, :2].tolist() == [6, 4]
    assert ints[SEEDS, :2].tolist() == [0, 1234]
    assert ints[STEPS, :2].tolist() == [1, 2]
    assert floats[TEMPERATURE, :2].tolist() == pytest.approx([0.0, 0.7])
    assert floats[TOP_P, 1].item() == pytest.approx(0.9)
    assert floats[TOP_K, 1].item() == 5
    assert tables[0, :2].tolist() == [7, 2] and tables[1, 0].item() == 4
    # padding rows: one token of context on the scratch block, greedy
    assert ints[SLOTS, 2:4].tolist() == [scratch * bs] * 2
    assert ints[CONTEXT_LENS, 2:4].tolist() == [1, 1]
    assert tables[2:4, 0].tolist() == [scratch, scratch]
    assert floats[TEMPERATURE, 2:4].tolist() == [0.0, 0.0]
    ctx = inputs.context(4, max_model_len=20)
    assert ctx.is_decode and ctx.num_seqs == 4 and ctx.max_context_len == 20
    assert ctx.cu_query_lens.tolist() == [0, 1, 2, 3, 4]
    assert ctx.slot_mapping.data_ptr() == ints[SLOTS].data_ptr()  # views, not copies


def test_fill_refills_a_row_after_padding():
    inputs = DecodeInputs(4, 3, 2, 5, torch.device("cpu"))
    inputs.fill([], 4)
    seq = _seq([1, 2, 3], [4], [0, 3], SamplingParams(max_tokens=4))
    inputs.fill([seq], 1)
    assert inputs.ints[SLOTS, 0].item() == 3 * 2 + 1
    assert inputs.ints[CONTEXT_LENS, 0].item() == 4


def test_fill_rejects_a_position_without_a_block():
    inputs = DecodeInputs(4, 2, 4, 7, torch.device("cpu"))
    seq = _seq([1, 2, 3, 4], [5], [0], SamplingParams(max_tokens=4))  # position 4 needs block 2
    with pytest.raises(ValueError, match="no cache block"):
        inputs.fill([seq], 1)
    with pytest.raises(ValueError, match="do not fit"):
        inputs.fill([seq, seq], 1)


def test_pending_tokens_are_gathered_from_the_previous_steps_rows():
    inputs = DecodeInputs(4, 3, 4, 7, torch.device("cpu"))
    params = SamplingParams(max_tokens=8)
    done = _seq([1, 2, 3], [4], [0], params)  # last token known on the host
    waiting = _seq([5, 6], [PENDING_TOKEN], [1], params)  # sampled by row 2 of the last step
    inputs.sampled[:4] = torch.tensor([40, 41, 42, 43])
    inputs.fill([done, waiting], 4, pending_rows={waiting.seq_id: 2})
    assert inputs.ints[SRC_ROWS, :4].tolist() == [-1, 2, -1, -1]
    assert inputs.input_ids(4).tolist() == [4, 42, 0, 0]
    with pytest.raises(ValueError, match="pending"):
        inputs.fill([waiting], 1)


def test_fill_gives_each_row_its_state_slot_and_padding_the_scratch_slot():
    """A model with per-sequence state (DeepSeek-V4): rows carry their sequence's slot, on
    the device only (a captured step cannot read host lists); padding rows the scratch."""
    inputs = DecodeInputs(8, 5, 4, 9, torch.device("cpu"), scratch_state_slot=6)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    a, b = _seq([1, 2, 3], [4], [7], params), _seq([5, 6], [7], [3], params)
    a.state_slot, b.state_slot = 2, 0
    inputs.fill([a, b], 4)
    assert inputs.ints[STATE_SLOTS, :4].tolist() == [2, 0, 6, 6]
    ctx = inputs.context(4, 16)
    assert ctx.state_slots.tolist() == [2, 0, 6, 6] and ctx.state_slots_host is None
    plain = DecodeInputs(8, 5, 4, 9, torch.device("cpu"))
    plain.fill([a], 2)
    assert plain.context(2, 16).state_slots is None


def test_decode_graphs_apply_only_where_every_layer_can_be_captured():
    from types import SimpleNamespace

    from engine.cuda_graph_runner import decode_graphs_apply
    from engine.layers.moe import DeepseekMoE
    from engine.layers.v4_attention import V4Attention
    from tests.engine.v4_helpers import engine_v4_from_hf, hf_v4_model

    model = engine_v4_from_hf(hf_v4_model(seed=0))
    cuda = torch.device("cuda")
    assert not decode_graphs_apply(model, torch.device("cpu"))
    assert not decode_graphs_apply(model, cuda)  # the torch V4 attention ops sync
    for m in model.modules():
        if isinstance(m, V4Attention):
            m.ops = SimpleNamespace(captures_decode=True)
    assert decode_graphs_apply(model, cuda)
    moe = next(m for m in model.modules() if isinstance(m, DeepseekMoE))
    moe.ops = SimpleNamespace(captures_decode=False)  # quantized experts on the torch path
    assert not decode_graphs_apply(model, cuda)
