"""A row's tokens on a CUDA GPU do not depend on its batch (marker `gpu`): seeded sampled
rows alone, then among neighbours that force eager steps (min_tokens), chunked prefills and
other lengths, with FP8 dense weights and MXFP4 experts in bf16 (docs/batch-invariance.md).
scripts/gpu_batch_invariance.py measures the same at Moonlight's shapes."""

import pytest
import torch

from engine.checkpoint_maker import make_random_checkpoint
from engine.outputs import Request
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(llm, targets, others):
    reqs = [Request(f"n{i}", p, sp) for i, (p, sp) in enumerate(others)]
    for t, (p, sp) in enumerate(targets):
        reqs.insert((3 * t) % (len(reqs) + 1), Request(f"t{t}", p, sp))
    outs = {o.request_id: o for o in llm.stream(reqs)}
    return [outs[f"t{t}"].outputs[0].token_ids for t in range(len(targets))]


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_a_rows_tokens_do_not_depend_on_its_batch(tmp_path, experts):
    from engine.llm import LLM

    path = make_random_checkpoint(tmp_path, preset="tiny", dense_dtype="fp8", expert_dtype=experts,
                                  seed=21, mtp=False)  # fmt: skip
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=96)
    targets = [
        ([(13 * t + 7 * j) % 180 + 10 for j in range(5 + 11 * t)],
         SamplingParams(temperature=1.0, max_tokens=24, seed=100 + t, ignore_eos=True))
        for t in range(4)
    ]  # fmt: skip
    others = []
    for i in range(28):
        prompt = [(5 * i + j) % 180 + 10 for j in range(3 + (17 * i) % 60)]
        if i % 3 == 0:
            sp = SamplingParams(temperature=1.0, min_tokens=6, max_tokens=20, seed=i)
        else:
            sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4 + i, seed=i,
                                ignore_eos=True)  # fmt: skip
        others.append((prompt, sp))
    alone = [_run(llm, [t], [])[0] for t in targets]
    assert _run(llm, targets, others) == alone
