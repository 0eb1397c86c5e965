"""Async scheduling (engine/pending_step.py) must not change a single output: on the CPU
the same launch/resolve bookkeeping runs with eager steps, so each case compares an engine
with async_scheduling=True against one without, request by request."""

import pytest

from engine import LLM, Request, SamplingParams
from engine.sequence import PENDING_TOKEN

PROMPTS = [[(11 * i + j) % 300 + 2 for j in range(2 + i % 7)] for i in range(10)]


def completions(outs):
    return {
        o.request_id: [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, o.error) for c in o.outputs
        ]
        for o in outs
    }


def run_both(model, requests, **kw):
    got = {}
    for flag in (False, True):
        llm = LLM(str(model), dtype="float32", async_scheduling=flag, **kw)
        engine = llm.engine
        launches = count_launches(engine.runner)
        got[flag] = completions(llm.stream(requests))
        assert (launches[0] > 0) == flag  # the async path really ran (and only when asked)
        assert not engine.has_unfinished() and engine._inflight is None
        assert engine.scheduler.blocks.num_free == engine.runner.num_blocks
    return got[False], got[True]


def count_launches(runner) -> list[int]:
    counter = [0]
    launch = runner.launch

    def counted(batch, previous):
        counter[0] += 1
        return launch(batch, previous)

    runner.launch = counted
    return counter


def reqs(params_for):
    return [Request(f"r{i}", p, params_for(i)) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def common_token(tiny_llama):
    """A token greedy decoding emits often, to stop on mid-sequence."""
    llm = LLM(str(tiny_llama), dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    counts: dict[int, int] = {}
    for o in outs:
        for t in o.outputs[0].token_ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def test_varied_lengths_and_more_requests_than_seqs(tiny_llama):
    sync, asyn = run_both(
        tiny_llama,
        reqs(lambda i: SamplingParams(temperature=0, max_tokens=1 + 3 * i, ignore_eos=True)),
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    assert asyn == sync
    assert [len(v[0][0]) for v in sync.values()] == [1 + 3 * i for i in range(10)]


def test_stop_token_ends_sequences_mid_batch(tiny_llama, common_token):
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[common_token])
    sync, asyn = run_both(tiny_llama, reqs(lambda i: params), max_num_seqs=8)
    assert asyn == sync
    reasons = [v[0][3] for v in sync.values()]
    assert common_token in reasons  # some stopped on the token, before max_tokens
    for v in asyn.values():
        assert PENDING_TOKEN not in v[0][0]


def test_stop_strings_and_seeded_sampling(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    text = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=12))[0]
    stop = text.outputs[0].text[4:6] or "a"

    def params(i):
        if i % 2:
            return SamplingParams(temperature=0.9, top_p=0.9, max_tokens=14, seed=i, n=2)
        return SamplingParams(temperature=0, max_tokens=14, stop=[stop])

    sync, asyn = run_both(tiny_llama, reqs(params), max_num_seqs=6)
    assert asyn == sync


def test_preemption_with_a_pending_token(tiny_llama):
    # 12 blocks of 4 tokens: sequences are preempted while their last token is pending.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = reqs(lambda i: params)
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        block_size=4,
        kv_cache_memory=512 * 48,
        async_scheduling=True,
    )
    scheduler, pending_preempted = llm.engine.scheduler, []
    preempt = scheduler._preempt

    def watched(seq):
        pending_preempted.append(seq.token_ids[-1] == PENDING_TOKEN)
        preempt(seq)

    scheduler._preempt = watched
    got = completions(llm.stream(requests))
    assert any(pending_preempted)
    ref = LLM(str(tiny_llama), dtype="float32", async_scheduling=False)
    assert got == completions(ref.stream(requests))


def test_async_scheduling_refuses_speculative_tokens(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(tiny_llama), async_scheduling=True, speculative_tokens=1)
