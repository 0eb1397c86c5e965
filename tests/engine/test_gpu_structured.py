"""Grammar masks and logprobs inside the decode CUDA graphs (marker `gpu`): constrained
greedy rows on the graphs give the CPU path's tokens and logprobs in float32, mixed with
free rows, with async scheduling on and off, and no graph is left for eager steps."""

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
    assert gpu.engine.runner.graphs is not None
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
    assert gpu.engine.runner.graphs.logprob_graphs  # the logprob graphs were captured
