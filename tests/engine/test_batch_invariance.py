"""A row's output does not depend on its batch: the same seeded (and greedy) rows give the
same tokens alone, in batches of 2, 7 and 64 with mixed neighbours, under chunked prefill
and after forced preemption; and at the model level a row's logits are the same bits
whichever step, chunking or neighbours computed them (CPU, float32 and bfloat16, llama,
DeepSeek-V3 and DeepSeek-V4 families)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, Request, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint
from tests.engine.deepseek_helpers import PagedRunner
from tests.model_factory import make_tiny_llama

NEW = 24
FAMILIES = ["llama", "deepseek", "deepseek_v4"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    # transformers' own 0.02 init: flat logits, near-ties everywhere, so a changed bit in a
    # row's arithmetic would show as a changed token
    return {
        "llama": make_tiny_llama(root / "llama", seed=4, initializer_range=0.02),
        "deepseek": make_random_checkpoint(root / "ds", preset="tiny", seed=2, mtp=False),
        "deepseek_v4": make_random_checkpoint(
            root / "ds4", arch="deepseek_v4", preset="tiny", seed=2, mtp=False
        ),
    }


def _targets(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """The rows whose outputs are compared: seeded sampled ones with different filters,
    and a greedy one."""
    prompts = [[(5 * i + 3 * j) % (vocab - 10) + 2 for j in range(4 + 9 * i)] for i in range(4)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=NEW, seed=11, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=NEW, seed=12),
        SamplingParams(temperature=1.2, min_p=0.02, max_tokens=NEW, seed=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
    ]
    return list(zip(prompts, params))


def _neighbours(count: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Rows of every kind beside the targets: other lengths, min_tokens (which makes a step
    ban tokens), stop strings and ids, greedy and unseeded sampling."""
    out = []
    for i in range(count):
        prompt = [(7 * i + j) % (vocab - 10) + 2 for j in range(1 + (13 * i) % 40)]
        kind = i % 5
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=3 + i % 17)
        elif kind == 1:
            p = SamplingParams(temperature=1.0, min_tokens=5, max_tokens=12 + i % 9, seed=100 + i)
        elif kind == 2:
            p = SamplingParams(temperature=0.7, stop=["e", "a"], stop_token_ids=[5], max_tokens=30)
        elif kind == 3:
            p = SamplingParams(temperature=1.0, top_k=3, max_tokens=1 + i % 5)
        else:
            p = SamplingParams(temperature=0.5, top_p=0.5, max_tokens=40, seed=200 + i)
        out.append((prompt, p))
    return out


def _vocab(llm: LLM) -> int:
    return int(llm.engine.runner.source.config["vocab_size"])


def _run(llm: LLM, rows: list[tuple[list[int], SamplingParams]], targets) -> list[list[int]]:
    """Tokens of the targets, run among `rows` (targets spread through the batch)."""
    requests = [Request(f"n{i}", p, sp) for i, (p, sp) in enumerate(rows)]
    for t, (prompt, sp) in enumerate(targets):
        requests.insert((t * 7) % (len(requests) + 1), Request(f"t{t}", prompt, sp))
    outs = {o.request_id: o for o in llm.stream(requests)}
    assert len(outs) == len(requests)
    return [outs[f"t{t}"].outputs[0].token_ids for t in range(len(targets))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_rows_alone_equal_rows_in_any_batch(models, family, dtype):
    path = str(models[family])
    base = LLM(path, device="cpu", dtype=dtype)
    vocab = _vocab(base)
    targets = _targets(vocab)
    alone = [_run(base, [], [t])[0] for t in targets]
    assert len({tuple(a) for a in alone}) == len(alone)  # the rows really differ
    for size in (2, 7, 64):
        llm = LLM(path, device="cpu", dtype=dtype, max_num_seqs=size, max_num_batched_tokens=48)
        assert _run(llm, _neighbours(size, vocab), targets) == alone, size


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_survive_forced_preemption_unchanged(models, family):
    path = str(models[family])
    base = LLM(path, device="cpu")
    vocab = _vocab(base)
    targets = _targets(vocab)
    alone = [_run(base, [], [t])[0] for t in targets]
    runner = base.engine.runner
    model = runner.model
    block = 8  # a multiple of V4's entry spans (4, 8); the others take any
    per_block = sum(s.bytes_per_block(block, runner.dtype) for s in model.cache_specs())
    per_seq = sum(s.bytes_per_sequence(runner.dtype) for s in model.state_specs())
    # 20 blocks of 8 tokens: far fewer than 20 rows of up to ~60 tokens need at once
    llm = LLM(path, device="cpu", block_size=block, kv_cache_memory=per_block * 20 + per_seq * 20,
              max_num_seqs=20, max_num_batched_tokens=32)  # fmt: skip
    assert _run(llm, _neighbours(16, vocab), targets) == alone
    assert llm.num_preemptions > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_the_same_bits_whatever_computed_them(models, family, dtype):
    """One sequence's logits: its prompt in one step and then decoded alone, against the
    prompt chunked 5 + 20 + rest beside other sequences, decoded beside others, and
    recomputed in one prefill as after a preemption."""
    model = LLM(str(models[family]), device="cpu", dtype=dtype).engine.runner.model
    prompt = [(3 * j) % 200 + 2 for j in range(37)]
    decoded = [17, 42, 99, 3, 150, 8]

    alone = PagedRunner(model, num_blocks=128, seed=1)
    want = [alone.step([(0, prompt)])[0][-1]]
    for tok in decoded:
        want.append(alone.step([(0, [tok])])[0][-1])

    mixed = PagedRunner(model, num_blocks=512, seed=2)
    others = {s: [(11 * s + j) % 200 + 2 for j in range(3 + 7 * s)] for s in range(1, 9)}
    got = []
    cuts = [0, 5, 25, len(prompt)]
    for c, (a, b) in enumerate(zip(cuts, cuts[1:])):
        items = [(s, toks) for s, toks in others.items() if s <= 2 + 3 * c] + [(0, prompt[a:b])]
        for s, _ in items:
            if s:
                others[s] = [others[s][-1]]  # later steps decode them
        logits = mixed.step(items)
    got.append(logits[-1][-1])
    for i, tok in enumerate(decoded):
        items = [(s, [t[-1]]) for s, t in others.items() if (s + i) % 3] + [(0, [tok])]
        got.append(mixed.step(items)[-1][-1])
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    recompute = PagedRunner(model, num_blocks=128, seed=3)
    again = recompute.step([(5, [2, 3]), (0, prompt + decoded[:-1])])[1]
    assert torch.equal(again[len(prompt) - 1], want[0])
    for i in range(len(decoded) - 1):
        assert torch.equal(again[len(prompt) + i], want[i + 1])


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariant_off_takes_the_fused_forms_with_the_same_greedy_tokens(models, family):
    path = str(models[family])
    prompts = [p for p, _ in _targets(200)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    on = LLM(path, device="cpu")
    off = LLM(path, device="cpu", batch_invariant=False)
    assert off.engine.runner.config.batch_invariant is False
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for llm in (on, off)]
    assert tokens[0] == tokens[1]
