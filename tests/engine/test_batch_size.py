"""max_num_seqs "auto": the KV budget at the expected sequence length decides, capped."""

import pytest

from engine.batch_size import DEFAULT_MAX_NUM_SEQS, choose_max_num_seqs
from engine.llm import LLM


def test_the_budget_holds_whole_blocks_per_sequence():
    # 100 tokens in blocks of 16: 7 blocks of 1,000 bytes, plus 300 bytes of state
    choice = choose_max_num_seqs(73_000, 1_000, 300, 16, 100, cap=1024)
    assert choice.per_sequence_bytes == 7_300
    assert choice.kv_holds == 10
    assert choice.max_num_seqs == 10


def test_the_cap_bounds_what_the_budget_would_hold():
    choice = choose_max_num_seqs(10**12, 1_000, 0, 16, 100, cap=512)
    assert (choice.max_num_seqs, choice.cap) == (512, 512)
    assert choice.kv_holds > 512


def test_a_budget_without_room_for_one_sequence_is_an_error():
    with pytest.raises(ValueError, match="do not hold one sequence of 100 tokens"):
        choose_max_num_seqs(5_000, 1_000, 0, 16, 100, cap=64)


def test_the_engine_resolves_auto_from_its_kv_budget(tiny_llama):
    # a budget that holds 5 sequences of 64 + 1 tokens on the CPU (cap 64)
    probe = LLM(str(tiny_llama), device="cpu", max_num_seqs=4)
    per_block = sum(c[0].numel() * c.element_size() for c in probe.engine.runner.kv_caches)
    blocks = -(-65 // probe.engine.runner.block_size)
    llm = LLM(str(tiny_llama), device="cpu", max_num_seqs="auto", expected_seq_len=64,
              kv_cache_memory=5 * blocks * per_block + per_block // 2)  # fmt: skip
    assert llm.engine.config.max_num_seqs == 5
    assert llm.engine.scheduler.max_num_seqs == 5
    assert llm.batch_size_choice["kv_holds"] == 5
    outs = llm.generate([[5, 6, 7]] * 7, None)
    assert len(outs) == 7


def test_auto_on_the_cpu_stops_at_the_default(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", max_num_seqs="auto", expected_seq_len=32)
    assert llm.engine.config.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert LLM(str(tiny_llama), device="cpu").batch_size_choice is None
