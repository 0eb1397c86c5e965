"""The decode-moe bench's measuring helpers on the tiny random llama, on the CPU (the bench
itself needs a GPU): they run the requests to the end and report what they name."""

from __future__ import annotations

from batchgen.bench.decode_moe import profile_prefill_step, run_engine_batch
from engine import LLM


def test_batch_run_splits_prefill_from_decode(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    vocab = int(llm.engine.runner.model.config.vocab_size)
    r = run_engine_batch(llm, batch=3, prompt_len=5, new_tokens=4, vocab=vocab)
    assert r["decode_steps"] == 3 and r["prefill_ms"] > 0 and r["tok_s"] > 0
    assert not llm.engine.has_unfinished()
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 0}
    r = run_engine_batch(llm, batch=2, prompt_len=5, new_tokens=4, vocab=vocab, sampling=sampled)
    assert r["decode_steps"] == 3 and not llm.engine.has_unfinished()


def test_prefill_profile_counts_the_prompts_one_step_computed(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=12)
    vocab = int(llm.engine.runner.model.config.vocab_size)
    p = profile_prefill_step(llm, prompt_len=5, vocab=vocab, batch=4)
    assert p["prompts"] == 4 and p["prefilled_prompts"] == 2  # 12 tokens: two 5-token prompts
    assert p["wall_ms"] > 0 and not llm.engine.has_unfinished()
    assert p["host_op_us"] > 0 and p["top_host_ops_us"]  # where the host's time went
