"""Continuous batching behaviour through the public API on a tiny random llama."""

import pytest

from engine import LLM, Request, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 300 + 2 for j in range(3 + i % 9)] for i in range(12)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=64)
    return tokens(llm.generate(PROMPTS, GREEDY))


def test_more_requests_than_max_num_seqs(tiny_llama, reference):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=3, max_num_batched_tokens=20)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference


def test_preemption_when_the_cache_is_full(tiny_llama, reference):
    # 2 layers x 2 (k,v) x 2 heads x 16 dims x 4 bytes = 512 bytes per token; 12 blocks of
    # 4 tokens hold 48 tokens, far less than 12 sequences of up to 23 tokens need.
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, kv_cache_memory=512 * 48)
    assert llm.engine.runner.num_blocks == 12
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    assert llm.num_preemptions > 0


def test_n_completions_are_independent_samples(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=3))
    assert tokens_all(again[0]) == tokens_all(out)


def tokens_all(out):
    return [c.token_ids for c in out.outputs]


def test_seeded_request_is_independent_of_its_batch(tiny_llama):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234)
    alone = LLM(str(tiny_llama), dtype="float32").generate([[9, 8, 7, 6]], params)[0]
    others = [
        Request(
            f"o{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=1.0, max_tokens=16 + i)
        )
        for i in range(31)
    ]
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=32)
    mixed = others[:13] + [Request("me", [9, 8, 7, 6], params)] + others[13:]
    results = {o.request_id: o for o in llm.stream(mixed)}
    assert len(results) == 32
    assert results["me"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_too_long_prompt_fails_alone(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32")
    outs = llm.generate([[3] * 300, [4, 5, 6]], GREEDY)
    assert outs[0].error and "context" in outs[0].error and outs[0].outputs == []
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 12


def test_stop_token_ids_and_min_tokens(tiny_llama, reference):
    first = reference[0]
    stop_at = first[4]
    out = LLM(str(tiny_llama), dtype="float32").generate(
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0]
    got = out.outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop_at
    assert got.token_ids == first[: first.index(stop_at) + 1]


def test_stream_pulls_requests_lazily(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=2)
    pulled = []

    def source():
        for i in range(20):
            pulled.append(i)
            yield Request(str(i), [i + 2, i + 3], SamplingParams(temperature=0, max_tokens=2))

    stream = llm.stream(source())
    next(stream)
    # at most the running batch plus a lookahead of 2 x max_num_seqs waiting, not all 20
    assert len(pulled) <= 2 + 2 * 2 + 1
    assert len(list(stream)) == 19


def test_text_prompt_without_tokenizer_is_a_clear_error(tmp_path):
    from tests.model_factory import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path, with_tokenizer=False)
    llm = LLM(str(model_dir), dtype="float32")
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")
    assert len(llm.generate([[3, 4]], GREEDY)[0].outputs[0].token_ids) == 12
