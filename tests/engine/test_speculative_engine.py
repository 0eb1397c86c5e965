"""MTP speculative decoding through the engine on a tiny random DeepSeek-V3 checkpoint."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint

PROMPTS = [[5, 9, 13, 2, 7], [40, 41], list(range(10, 40)), [100, 3, 7, 8, 9, 200]]


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("ds") / "m", preset="tiny", seed=3)


def greedy(llm, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_outputs_equal_with_and_without_mtp(tiny_deepseek, k):
    plain = greedy(LLM(str(tiny_deepseek), dtype="float32"))
    # a small token budget mixes prefill chunks with verify steps of other sequences
    llm = LLM(
        str(tiny_deepseek),
        dtype="float32",
        speculative_tokens=k,
        max_num_batched_tokens=24,
        block_size=4,
    )
    assert greedy(llm) == plain
    stats = llm.speculative_stats()
    assert len(stats["histogram"]) == k + 1 and stats["sequence_steps"] > 0
    assert 1.0 <= stats["mean_tokens_per_step"] <= k + 1


def test_sampled_token_distribution_is_unchanged_by_mtp(tiny_deepseek):
    # The second and third sampled tokens go through draft verification with MTP on; their
    # marginal distribution must match plain sampling. A low temperature makes the random
    # model's distribution peaked (top token ~0.55), so 600 samples resolve it: two plain
    # runs with different seeds differ by a total variation of ~0.05, while a verifier that
    # accepted the (near-uniform) drafts would be off by ~0.5.
    def marginals(speculative_tokens):
        llm = LLM(
            str(tiny_deepseek),
            dtype="float32",
            speculative_tokens=speculative_tokens,
            max_num_seqs=64,
            seed=11,
        )
        params = [
            SamplingParams(temperature=0.08, max_tokens=3, ignore_eos=True, seed=1000 + i)
            for i in range(600)
        ]
        outs = llm.generate([[5, 6, 7]] * 600, params)
        counts = torch.zeros(3, 258)
        for o in outs:
            for pos, t in enumerate(o.outputs[0].token_ids):
                counts[pos, t] += 1
        return counts / 600

    plain, spec = marginals(0), marginals(2)
    tv = 0.5 * (plain - spec).abs().sum(-1)  # per position
    assert tv[0] == 0  # the first token never goes through a draft: same seeds, same token
    assert tv[1] < 0.12 and tv[2] < 0.12, f"total variation {tv.tolist()}"


def test_a_seeded_sampled_row_is_the_same_alone_and_in_any_batch_with_mtp(tiny_deepseek):
    """Draft draws come from each sequence's own generator, and only where the sequence
    keeps its drafts: a prompt chunked differently beside other rows (a small token budget)
    proposes a different number of times, which must not move its draws."""
    llm = LLM(
        str(tiny_deepseek),
        dtype="float32",
        speculative_tokens=2,
        max_num_batched_tokens=24,
        block_size=4,
        seed=5,
    )

    def params(seed):
        return SamplingParams(temperature=0.9, max_tokens=14, ignore_eos=True, seed=seed)

    alone = [llm.generate([p], params(70 + i))[0].outputs[0].token_ids
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    together = llm.generate(PROMPTS, [params(70 + i) for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in together] == alone
    reordered = llm.generate(PROMPTS[::-1], [params(70 + i) for i in range(len(PROMPTS))][::-1])
    assert [o.outputs[0].token_ids for o in reordered][::-1] == alone
