"""The decode-moe bench's measuring helpers on the tiny random llama, on the CPU (the bench
itself needs a GPU): they run the requests to the end and report what they name."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from batchgen.bench.decode_moe import profile_prefill_step, run_engine_batch, run_varied_lengths
from engine import LLM
from engine.config import FP8_NATIVE_MIN_TOKENS


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


def test_varied_lengths_run_counts_each_kind_of_step(tiny_model_dir):
    # 8 requests through 2 slots, 1-8 new tokens each: admissions happen mid-run, and with
    # separate_prefill no step mixes prefill and decode rows.
    for separate in (False, True):
        llm = LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=2,
                  separate_prefill=separate, min_prefill_seqs=1)  # fmt: skip
        vocab = int(llm.engine.runner.model.config.vocab_size)
        r = run_varied_lengths(llm, batch=2, prompt_len=5, new_tokens=4, vocab=vocab)
        assert r["requests"] == 8 and r["e2e_tok_s"] > 0 and not llm.engine.has_unfinished()
        assert r["first_run_e2e_tok_s"] > 0  # the same workload, run first (compiles in it)
        assert r["steps"]["decode"] > 0 and r["steps"]["prefill or mixed"] > 0
        assert llm.engine.scheduler.schedule.__name__ == "schedule"  # the wrapper is gone


def test_every_engine_option_of_the_command_is_an_llm_option():
    # The command runs only on a GPU; what it hands LLM(...) is checked here: every option
    # that is not the bench's own (a named parameter of the command) goes to LLM by name.
    import inspect

    from batchgen.bench.decode_moe import command
    from engine.config import EngineConfig

    own = set(inspect.signature(command.callback).parameters) - {"engine_options"}
    engine = {p.name: p.default for p in command.params if p.name not in own}
    assert {"fp8_native_min_tokens", "batch_invariant", "separate_prefill"} <= set(engine)
    config = EngineConfig.from_options("model", **engine)
    assert config.batch_invariant and config.cuda.fp8_native_min_tokens == FP8_NATIVE_MIN_TOKENS


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_the_command_parses_its_options_and_refuses_without_a_gpu():
    from batchgen.bench.decode_moe import command

    args = ["--weights", "fp8-mxfp4", "--batches", "1,8", "--no-batch-invariant", "--one-stream"]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
    result = CliRunner().invoke(command, ["--weights", "fp4"])
    assert result.exit_code == 2 and "unknown weights ['fp4']" in result.output


def test_the_in_memory_v3_model_is_the_checkpoint_the_bench_writes(tmp_path):
    from batchgen.bench.decode_moe import random_model
    from engine.checkpoint_maker import make_random_checkpoint
    from engine.loader import open_model_source

    written = make_random_checkpoint(tmp_path / "m", preset="tiny", layers=2, dense_dtype="fp8",
                                     expert_dtype="mxfp4", seed=0, device="cpu", mtp=False)  # fmt: skip
    spec = random_model("deepseek_v3", "tiny", 2, "fp8-mxfp4")
    drawn, stored = open_model_source(spec), open_model_source(written)
    assert drawn.config == stored.config
    tensors = dict(stored.iter_weights())
    names = [name for name, t in drawn.iter_weights() if torch.equal(t, tensors[name])]
    assert sorted(names) == sorted(tensors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_in_memory_runs_without_transformers():
    from batchgen.bench.decode_moe import command

    result = CliRunner().invoke(command, ["--in-memory", "--hf-batches", "1"])
    assert result.exit_code == 2 and "--in-memory has none" in result.output
    result = CliRunner().invoke(command, ["--in-memory"])  # no transformers batches by default
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
