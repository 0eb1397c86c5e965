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


def cramped_async_llm(model) -> LLM:
    """12 blocks of 4 tokens (512 bytes per token): far less than the prompts need, so
    sequences are preempted, some while their last token is pending."""
    return LLM(
        str(model), dtype="float32", block_size=4, kv_cache_memory=512 * 48, async_scheduling=True
    )


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
    llm = cramped_async_llm(tiny_llama)
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


def test_a_sequence_outgrowing_the_cache_fails_alone(tiny_llama):
    # 48 cache slots: r0 (a 2-token prompt, 60 new tokens) outgrows the whole cache mid-
    # decode and fails with a message; the other requests finish as they would alone, and
    # the synchronous and async engines agree (neither stops the run).
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = reqs(lambda i: long if i == 0 else short)
    sync, asyn = run_both(tiny_llama, requests, block_size=4, kv_cache_memory=512 * 48)
    assert asyn == sync
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory=512 * 48,
              async_scheduling=False)  # fmt: skip
    errors = {o.request_id: o.error for o in llm.stream(requests)}
    assert errors.pop("r0") == "sequence does not fit the KV cache"
    assert not any(errors.values())
    ref = completions(LLM(str(tiny_llama), dtype="float32").stream(requests[1:]))
    assert {k: v for k, v in sync.items() if k != "r0"} == ref


def test_async_scheduling_refuses_speculative_tokens(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(tiny_llama), async_scheduling=True, speculative_tokens=1)


def test_no_step_left_in_flight_when_the_last_sequence_stops_on_a_token(tiny_llama):
    # The last sequence stops on a token that a resolve reads one launch late: the step
    # launched after it (for that sequence alone) must be resolved before the engine says
    # it is done, not left in flight for whatever runs next.
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling=True)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    third = llm.generate([PROMPTS[0]], free)[0].outputs[0].token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[third])
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert out.stop_reason == third and len(out.token_ids) == 3
    assert not llm.engine.has_unfinished() and llm.engine._inflight is None
    again = llm.generate([PROMPTS[1]], free)[0].outputs[0].token_ids
    ref = LLM(str(tiny_llama), dtype="float32", async_scheduling=False)
    assert again == ref.generate([PROMPTS[1]], free)[0].outputs[0].token_ids


def test_a_preempted_sequence_stops_while_waiting(tiny_llama, common_token):
    # A sequence preempted while its last token is pending goes back to the queue; when
    # that token turns out to be a stop, the resolve must finish it out of the queue.
    params = SamplingParams(
        temperature=0, max_tokens=6, stop_token_ids=[common_token], ignore_eos=True
    )
    requests = reqs(lambda i: params)
    llm = cramped_async_llm(tiny_llama)
    scheduler, finished_waiting = llm.engine.scheduler, []
    finish = scheduler.finish

    def watched(seq):
        if seq in scheduler.waiting:
            finished_waiting.append(seq.finish_reason)
        finish(seq)

    scheduler.finish = watched
    got = completions(llm.stream(requests))
    assert "stop" in finished_waiting
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.blocks.num_free == llm.engine.runner.num_blocks
    ref = LLM(str(tiny_llama), dtype="float32", async_scheduling=False)
    assert got == completions(ref.stream(requests))


@pytest.mark.parametrize("prompt_len", [30, 31])
def test_length_limits_and_min_tokens(tiny_llama, common_token, prompt_len):
    # max_tokens 1 and 2 (the pending token is the last), a prompt one or two tokens short
    # of max_model_len, and min_tokens (banned stop ids while the placeholder counts).
    long_prompt = [(7 * j) % 300 + 2 for j in range(prompt_len)]
    requests = [
        Request("one", PROMPTS[1], SamplingParams(temperature=0, max_tokens=1)),
        Request("two", PROMPTS[2], SamplingParams(temperature=0, max_tokens=2)),
        Request("long", long_prompt, SamplingParams(temperature=0, max_tokens=8)),
        *[
            Request(
                f"min{i}",
                p,
                SamplingParams(
                    temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[common_token]
                ),
            )
            for i, p in enumerate(PROMPTS)
        ],
    ]
    sync, asyn = run_both(tiny_llama, requests, max_model_len=32)
    assert asyn == sync
    assert len(sync["one"][0][0]) == 1 and len(sync["two"][0][0]) == 2
    assert len(sync["long"][0][0]) == 32 - prompt_len


def test_turning_async_off_mid_run_resolves_at_the_next_step(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    outs = []
    while engine._inflight is None:  # prefill, then the first launched decode step
        outs += engine.step()
    engine.async_scheduling = False
    outs += engine.step()
    assert engine._inflight is None  # resolved, and this step ran synchronously
    while engine.has_unfinished():
        outs += engine.step()
        assert engine._inflight is None
    ref = LLM(str(tiny_llama), dtype="float32", async_scheduling=False)
    want = ref.generate(PROMPTS[:3], params)
    got = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert [got[f"r{i}"] for i in range(3)] == [o.outputs[0].token_ids for o in want]


class _RecordingGraphs:
    """Stands in for the CUDA graph runner: every step fits, and each launch records
    which previous-step rows it was told to gather and what it calls before the masks."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[int, int] | None, object]] = []

    def fits(self, num_seqs: int) -> bool:
        return True

    def launch(self, seqs, pending_rows=None, before_mask=None):
        self.calls.append((pending_rows, before_mask))
        return lambda: [7] * len(seqs)


def test_a_graph_step_chains_on_the_device_and_leaves_the_wait_to_the_mask(tiny_llama):
    """Behind a graph step, the next graph step gets the previous rows to gather and the
    previous step's write as `before_mask` (a constrained step waits there, after its
    forward), with the previous tokens still pending; behind an eager step, the tokens
    are written first and nothing is chained."""
    from engine.pending_step import PendingStep
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    runner = LLM(str(tiny_llama), dtype="float32").engine.runner
    runner.graphs = graphs = _RecordingGraphs()
    params = SamplingParams(temperature=0, max_tokens=8)
    seqs = [Sequence(f"r{i}", 0, [3, 4, 5 + i], params, None) for i in range(2)]
    for seq in seqs:
        seq.token_ids.append(PENDING_TOKEN)  # sampled by the previous step
        seq.block_table, seq.num_computed = [0, 1], len(seq) - 1
    batch = ScheduledBatch(seqs, [1, 1])

    on_device = PendingStep(seqs, [3, 3], lambda: [21, 22], device_rows=True)
    runner.launch(batch, on_device)
    rows, before_mask = graphs.calls[-1]
    assert rows == {seqs[0].seq_id: 0, seqs[1].seq_id: 1}
    assert before_mask == on_device.write_tokens
    assert [s.token_ids[3] for s in seqs] == [PENDING_TOKEN] * 2  # not waited for yet
    before_mask()
    assert [s.token_ids[3] for s in seqs] == [21, 22]

    for seq in seqs:
        seq.num_computed = len(seq) - 1
    on_host = PendingStep(seqs, [4, 4], lambda: [31, 32])  # an eager step's tokens
    runner.launch(batch, on_host)
    assert graphs.calls[-1] == (None, None)
    assert [s.token_ids[4] for s in seqs] == [31, 32]  # written before the launch
