"""Grammar masks and logprobs inside the decode CUDA graphs (marker `gpu`): constrained
greedy rows on the split graphs give the CPU path's tokens and logprobs in float32, mixed
with free rows, with async scheduling on and off; the split graphs replay the one-graph
step bit for bit in bf16; a run without grammars captures no split graph."""

import re

import pytest
import torch

from engine.checkpoint_maker import make_random_checkpoint
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("llguidance")

REGEX = r"[a-f]{3,12}(-[0-9]{1,3}){0,4}"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return make_random_checkpoint(out, preset="tiny", seed=11, device="cuda", mtp=False)


def _params():
    regex = {"type": "regex", "regex": REGEX}
    choice = {"type": "choice", "choice": ["alpha", "beta", "gamma delta"]}
    return [
        SamplingParams(temperature=0.0, max_tokens=20, response_format=regex, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, response_format=choice),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, response_format=regex),
    ]


def test_graph_masks_and_logprobs_equal_the_cpu_path(tiny_checkpoint):
    from engine.llm import LLM

    prompts = [[5, 9, 13, 2, 7], [40, 41], list(range(10, 30)), [100, 3, 7], [8, 8, 9]]
    cpu = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", kv_cache_memory=32 << 20)
    want = [o.outputs[0] for o in cpu.generate(prompts, _params())]
    gpu = LLM(str(tiny_checkpoint), device="cuda", dtype="float32", max_num_seqs=8)
    graphs = gpu.engine.runner.graphs
    assert graphs is not None
    free = [i for i, p in enumerate(_params()) if p.response_format is None]
    gpu.generate([prompts[i] for i in free], [_params()[i] for i in free])
    assert not graphs.forward_graphs and not graphs.sample_graphs  # no grammar, no split
    for async_on in (True, False):
        gpu.engine.async_scheduling = async_on
        got = [o.outputs[0] for o in gpu.generate(prompts, _params())]
        for i in (0, 1, 2, 3):  # greedy rows: the same tokens
            assert got[i].token_ids == want[i].token_ids, (async_on, i)
        for i in (0, 1):
            assert [e.token_id for e in got[i].logprobs] == got[i].token_ids
            assert [e.logprob for e in got[i].logprobs] == pytest.approx(
                [e.logprob for e in want[i].logprobs], abs=1e-3
            )
            for a, b in zip(got[i].logprobs, want[i].logprobs):
                assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        assert got[2].logprobs is None
        assert re.fullmatch(REGEX, got[0].text) or got[0].finish_reason == "length"
        assert got[3].text in ("alpha", "beta", "gamma delta")
        if got[4].finish_reason == "stop":
            assert re.fullmatch(REGEX, got[4].text)
    assert graphs.logprob_graphs  # the free rows' logprob graphs were captured
    # constrained steps ran on the split graphs, with and without logprob rows
    assert graphs.forward_graphs
    assert {logprobs for _, logprobs in graphs.sample_graphs} == {True, False}


def test_split_graphs_replay_the_one_graph_step_bit_for_bit(tiny_checkpoint):
    """On the same inputs (constrained and free rows, bf16: the benchmark's dtype) the
    forward graph then the mask + sampler graph give the one graph's tokens and logprobs
    exactly: a row's result does not depend on which path ran."""
    from engine.llm import LLM
    from engine.sequence import Sequence
    from engine.structured_output.matcher import SequenceGrammar
    from kernels.reference.token_mask import unpack_bitmask

    gpu = LLM(str(tiny_checkpoint), device="cuda", dtype="bfloat16", max_num_seqs=8)
    engine = gpu.engine
    graphs = engine.runner.graphs
    prompts = [[5, 9, 13, 2, 7], [40, 41], [10, 11, 12, 13], [100, 3, 7], [8, 8, 9]]
    seqs = []
    for i, (prompt, params) in enumerate(zip(prompts, _params())):
        seq = Sequence(f"r{i}", 0, prompt, params, 1000 + i)
        if params.grammar is not None:  # as the engine gives a request its grammar
            compiled = engine.grammars.compile(params.grammar)
            seq.grammar = SequenceGrammar(compiled, engine.grammars.stop_token_ids)
        seq.block_table, seq.num_computed = [i], len(seq) - 1  # one block each
        seqs.append(seq)
    bucket = 8
    with torch.inference_mode():
        for logprobs in (False, True):
            if logprobs:
                graphs._capture_logprobs(bucket)
            graphs._capture_split(bucket, logprobs)
            rows = seqs if logprobs else [s for s in seqs if s.params.logprobs is None]
            one = graphs.logprob_graphs[bucket] if logprobs else graphs.graphs[bucket]
            one_out = graphs.logprob_outputs[bucket] if logprobs else graphs.tokens[bucket]
            graphs.inputs.fill(rows, bucket)
            one.replay()
            want = [t[: len(rows)].clone() for t in (one_out if logprobs else (one_out,))]
            graphs.inputs.fill(rows, bucket, masks=False)
            graphs.forward_graphs[bucket].replay()
            graphs.inputs.fill_masks(rows)
            graphs.sample_graphs[bucket, logprobs].replay()
            split_out = graphs.sample_outputs[bucket, logprobs]
            got = [t[: len(rows)] for t in (split_out if logprobs else (split_out,))]
            torch.cuda.synchronize()
            for a, b in zip(got, want):
                assert torch.equal(a, b), logprobs
            assert graphs.inputs.constrained[: len(rows)].sum().item() == sum(
                s.grammar is not None for s in rows
            )
    vocab = engine.runner.vocab_size
    allowed = unpack_bitmask(graphs.inputs.bitmask[3:4].cpu(), vocab)[0]  # row 3: a choice
    assert int(allowed.sum()) < vocab and allowed[want[0][3]]  # the mask was applied
