"""The separate_prefill policy (engine/scheduler.py): steps all decode or all prefill,
waiting sequences admitted in groups. On the CPU it is off by default; these tests turn it
on and check the outputs against the mixed policy's and the shape of every step."""

import pytest

from engine import LLM, Request, SamplingParams
from engine.config import EngineConfig

# Requests that finish at different steps, so slots free one at a time mid-run.
PROMPTS = [[(5 * i + j) % 300 + 2 for j in range(2 + i % 7)] for i in range(14)]
PARAMS = [SamplingParams(temperature=0, max_tokens=3 + (i * 5) % 11, ignore_eos=True)
          for i in range(len(PROMPTS))]  # fmt: skip


def _requests():
    return [Request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]


def _tokens(llm) -> dict[str, list[int]]:
    return {o.request_id: o.outputs[0].token_ids for o in llm.stream(_requests())}


def _recorded_batches(llm) -> list[list[tuple[bool, int]]]:
    """Every scheduled step as [(is the row a prefill, its token count)]."""
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        steps.append(
            [(s.num_uncomputed > 1 or n > 1, n) for s, n in zip(batch.seqs, batch.num_tokens)]
        )
        return batch

    scheduler.schedule = recording
    return steps


@pytest.fixture(scope="module")
def mixed(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              separate_prefill=False)  # fmt: skip
    return _tokens(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_same_tokens_as_mixed_steps_and_no_step_mixes(tiny_llama, mixed, async_scheduling):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              separate_prefill=True, min_prefill_seqs=2,
              async_scheduling=async_scheduling)  # fmt: skip
    steps = _recorded_batches(llm)
    assert _tokens(llm) == mixed
    kinds = [{prefill for prefill, _ in step} for step in steps if step]
    assert all(len(k) == 1 for k in kinds), "a step mixed prefill and decode rows"
    prefill_steps = [step for step in steps if step and step[0][0]]
    # 14 requests in groups: the first step fills the 4 slots, later ones admit >= 2
    # (one at the tail, where fewer wait)
    assert len(prefill_steps[0]) == 4
    assert all(len(step) >= 2 for step in prefill_steps[1:-1])
    assert len(prefill_steps) < len(PROMPTS) - 3


def test_a_chunked_prefill_finishes_before_decoding_resumes(tiny_llama):
    # A 40-token prompt over a 16-token budget: three prefill steps in a row, while the
    # sequence admitted first waits to decode.
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
              separate_prefill=True, min_prefill_seqs=1)  # fmt: skip
    steps = _recorded_batches(llm)
    short = Request("short", [3, 4, 5], SamplingParams(temperature=0, max_tokens=6))
    long = Request("long", [(7 * j) % 300 + 2 for j in range(40)],
                   SamplingParams(temperature=0, max_tokens=2))  # fmt: skip
    outs = {o.request_id: o for o in llm.stream([short, long])}
    assert set(outs) == {"short", "long"}
    counts = [[n for _, n in step] for step in steps if step]
    assert counts[:3] == [[3, 13], [16], [11]]  # then both decode


def test_preemption_under_separate_prefill(tiny_llama, mixed):
    # 512 bytes of cache per token (2 layers x k,v x 2 heads x 16 dims x 4 bytes); 10 blocks
    # of 4 tokens: less than 4 running sequences of up to 20 tokens need.
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              block_size=4, kv_cache_memory=512 * 40, separate_prefill=True,
              min_prefill_seqs=2)  # fmt: skip
    assert _tokens(llm) == mixed
    assert llm.num_preemptions > 0


def test_min_prefill_seqs_must_be_positive():
    with pytest.raises(ValueError, match="min_prefill_seqs"):
        EngineConfig(model="x", min_prefill_seqs=0)


def test_off_without_decode_graphs_and_groups_of_half_the_slots(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=64)
    assert llm.engine.runner.graphs is None  # the CPU: every step is eager anyway
    assert not llm.engine.scheduler.separate_prefill
    assert llm.engine.scheduler.min_prefill_seqs == 32


@pytest.mark.parametrize(
    ("options", "graphs", "separate", "group"),
    [
        ({}, True, True, 32),  # decode graphs: prefill steps apart, half the slots a group
        ({}, False, False, 32),
        ({"separate_prefill": False}, True, False, 32),
        ({"separate_prefill": True, "min_prefill_seqs": 5}, False, True, 5),
        ({"max_num_seqs": 1}, True, True, 1),
    ],
)
def test_the_engine_policy_comes_from_the_config_and_the_graphs(options, graphs, separate, group):
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

    config = EngineConfig(model="x", **{"max_num_seqs": 64, **options})
    scheduler = Scheduler.for_engine(config, BlockManager(8, 16), decode_graphs=graphs)
    assert scheduler.separate_prefill is separate
    assert scheduler.min_prefill_seqs == group
    assert scheduler.max_num_seqs == config.max_num_seqs
    assert scheduler.max_num_batched_tokens == config.max_num_batched_tokens


def test_speculative_tokens_keep_cache_room_ahead():
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

    config = EngineConfig(model="x", speculative_tokens=3)
    assert Scheduler.for_engine(config, BlockManager(8, 16), False).lookahead_slots == 3
