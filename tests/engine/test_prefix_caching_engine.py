"""Prefix caching through the engine: the same tokens with caching on and off (greedy and
seeded sampled; shared-prefix batches, n > 1, chunked prefill, preemption under a tiny KV
budget, the MTP speculator), the prompt tokens each row read from the cache, and at the
model level a reused prefix's K/V the same bits as computing it (llama and DeepSeek-V3;
DeepSeek-V4 runs without the cache)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, Request, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint
from tests.engine.deepseek_helpers import PagedRunner
from tests.model_factory import make_tiny_llama

FAMILIES = ["llama", "deepseek"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_cache")
    # transformers' 0.02 init: flat logits, so a changed bit in a row would change a token
    return {
        "llama": make_tiny_llama(root / "llama", seed=4, initializer_range=0.02),
        "deepseek": make_random_checkpoint(root / "ds", preset="tiny", seed=2, mtp=False),
    }


def _rows(seed: int, vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests over two shared prefixes (one longer than a few blocks, one shorter than a
    block), some with n > 1, some exactly a prefix, and unrelated neighbours; greedy and
    seeded sampled."""
    rng = random.Random(seed)

    def tokens(k):
        return [rng.randrange(2, vocab - 2) for _ in range(k)]

    long_prefix, short_prefix = tokens(45), tokens(5)
    rows = []
    for i in range(14):
        kind = i % 4
        if kind == 0:
            prompt = long_prefix + tokens(1 + i % 7)
        elif kind == 1:
            prompt = short_prefix + tokens(3 + i)
        elif kind == 2:
            prompt = long_prefix[: 16 * (1 + i % 3)]  # ends on a block boundary
        else:
            prompt = tokens(2 + 3 * i)
        if i % 3 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=1 + i % 2)
        else:
            params = SamplingParams(
                temperature=1.0,
                top_p=0.95,
                max_tokens=8 + i % 5,
                seed=50 + i,
                n=1 + (i % 5 == 1) * 2,
            )
        rows.append((f"r{i}", prompt, params))
    return rows


def _generate(llm: LLM, rows) -> dict[str, list[list[int]]]:
    outs = {o.request_id: o for o in llm.stream(Request(r, p, sp) for r, p, sp in rows)}
    assert len(outs) == len(rows)
    return outs


def _tokens(outs) -> dict[str, list[list[int]]]:
    return {r: [c.token_ids for c in o.outputs] for r, o in outs.items()}


def _vocab(path) -> int:
    return int(LLM(str(path), device="cpu").engine.runner.source.config["vocab_size"])


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_are_identical_with_caching_on_and_off(models, family):
    path = str(models[family])
    rows = _rows(1, _vocab(path))
    settings = dict(device="cpu", max_num_seqs=6, max_num_batched_tokens=24)  # chunked prefill
    off = LLM(path, enable_prefix_caching=False, **settings)
    on = LLM(path, **settings)
    assert off.engine.runner.blocks.cache is None and on.engine.runner.blocks.cache is not None
    got_off, got_on = _generate(off, rows), _generate(on, rows)
    assert _tokens(got_on) == _tokens(got_off)
    assert all(o.cached_prompt_tokens == 0 for o in got_off.values())
    cached = {r: o.cached_prompt_tokens for r, o in got_on.items()}
    assert sum(cached.values()) > 0
    bs = on.engine.runner.block_size
    for rid, prompt, _ in rows:
        completions = got_on[rid].outputs
        for c in completions:
            # a multiple of the block size, never the last prompt token
            assert c.cached_prompt_tokens % bs == 0 and c.cached_prompt_tokens < len(prompt)
        # the later completions of an n > 1 request read the whole prompt but its last block
        for c in completions[1:]:
            assert c.cached_prompt_tokens == (len(prompt) - 1) // bs * bs
        assert got_on[rid].metrics["cached_prompt_tokens"] == cached[rid]


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_under_a_tiny_kv_budget_keeps_outputs_identical(models, family):
    path = str(models[family])
    rows = _rows(2, _vocab(path))
    runner = LLM(path, device="cpu").engine.runner
    block = 8
    per_block = sum(s.bytes_per_block(block, runner.dtype) for s in runner.model.cache_specs())
    settings = dict(device="cpu", block_size=block, max_num_seqs=12, max_num_batched_tokens=32)
    # 18 blocks of 8 tokens: far fewer than a dozen rows of up to ~60 tokens need at once,
    # so running sequences are preempted and indexed blocks are evicted
    tiny = dict(settings, kv_cache_memory=per_block * 18)
    reference = _tokens(_generate(LLM(path, enable_prefix_caching=False, **settings), rows))
    off = LLM(path, enable_prefix_caching=False, **tiny)
    on = LLM(path, **tiny)
    assert _tokens(_generate(off, rows)) == reference
    got = _generate(on, rows)
    assert _tokens(got) == reference
    assert on.num_preemptions > 0 and on.engine.runner.blocks.cache.num_evictions > 0
    assert sum(o.cached_prompt_tokens for o in got.values()) > 0
    assert on.engine.runner.blocks.num_free == on.engine.runner.num_blocks


def test_a_recomputed_sequence_reads_its_own_blocks_back(models):
    """After a preemption the sequence's indexed blocks (prompt and generated tokens) are
    still there unless evicted: readmitted, it starts from them."""
    llm = LLM(str(models["llama"]), device="cpu", block_size=4)
    scheduler = llm.engine.scheduler
    prompt = list(range(3, 3 + 13))
    llm.engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=6))
    for _ in range(4):
        llm.engine.step()
    (seq,) = scheduler.running
    computed = seq.num_computed
    scheduler._preempt(seq)
    assert seq.num_computed == 0
    batch = scheduler.schedule()
    assert batch.seqs == [seq] and seq.num_computed == computed // 4 * 4
    assert seq.cached_prompt_tokens == 0  # counted at the first admission only


def _record_mtp_logits(llm: LLM) -> dict[tuple[str, int, int], torch.Tensor]:
    """Every MTP draft's logits, by (request id, position of the row it continues, draft
    number), recorded as the speculator proposes."""
    speculator = llm.engine.runner.speculator
    model = speculator.model
    record: dict[tuple[str, int, int], torch.Tensor] = {}
    current: dict = {}
    propose, mtp_logits = speculator._propose, model.mtp_logits

    def recording_propose(batch, hidden, valid_items, *args):
        current["rows"] = [(s.request_id, start + n - 1) for s, start, n in valid_items if n]
        current["k"] = 0
        return propose(batch, hidden, valid_items, *args)

    def recording_logits(hidden, depth):
        logits = mtp_logits(hidden, depth)
        for b, (rid, pos) in enumerate(current["rows"]):
            record[rid, pos, current["k"]] = logits[b].clone()
        current["k"] += 1
        return logits

    speculator._propose = recording_propose
    model.mtp_logits = recording_logits
    return record


def test_mtp_speculation_drafts_the_same_bits_with_caching(tmp_path):
    """The MTP layer's cache entry at a block's last position reads the next block's first
    token, so with the speculator that token is part of the block's key: every draft's
    logits are the same bits with caching on and off, also for prompts that share a block
    but not the token after it."""
    path = str(make_random_checkpoint(tmp_path / "mtp", preset="tiny", seed=3))
    rng = random.Random(3)
    prefix = [rng.randrange(2, 200) for _ in range(19)]
    prompts = [prefix + [rng.randrange(2, 200) for _ in range(1 + i)] for i in range(4)]
    prompts += [prefix[:8] + [5, 9], prefix[:8] + [6, 9]]  # same 2 blocks, other next token
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = []
    for on in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", speculative_tokens=2, block_size=4,
                  enable_prefix_caching=on)  # fmt: skip
        assert (llm.engine.runner.blocks.cache is not None) == on
        drafts = _record_mtp_logits(llm)
        outs = llm.generate(prompts, greedy)
        assert (sum(o.cached_prompt_tokens for o in outs) > 0) == on
        results.append(([o.outputs[0].token_ids for o in outs], drafts))
    (tokens_off, drafts_off), (tokens_on, drafts_on) = results
    assert tokens_on == tokens_off
    assert drafts_on.keys() == drafts_off.keys() and len(drafts_on) > 20
    for key, logits in drafts_off.items():
        assert torch.equal(drafts_on[key], logits), key


def test_deepseek_v4_runs_without_the_cache(tmp_path, caplog):
    path = make_random_checkpoint(tmp_path / "v4", arch="deepseek_v4", preset="tiny", mtp=False)
    with caplog.at_level("INFO", logger="engine.model_runner"):
        llm = LLM(str(path), device="cpu")
    assert llm.engine.runner.blocks.cache is None
    assert "prefix caching off" in caplog.text
    prompt = list(range(2, 40))
    outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=4))
    assert [o.cached_prompt_tokens for o in outs] == [0, 0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_computed_in_another_batch_gives_the_same_bits(models, family, dtype):
    """Sequence A computes prefix + a in chunks beside neighbours; B then starts with A's
    prefix blocks in its table (what a cache hit gives it) and computes only its suffix.
    B's logits equal B computed whole alone, and the shared blocks' K/V equal the prefix
    computed alone in one step."""
    model = LLM(str(models[family]), device="cpu", dtype=dtype).engine.runner.model
    rng = random.Random(7)
    bs = 4
    prefix = [rng.randrange(2, 200) for _ in range(3 * bs)]
    suffix_a, suffix_b = [rng.randrange(2, 200) for _ in range(5)], [rng.randrange(2, 200)]

    alone = PagedRunner(model, block_size=bs, num_blocks=64, seed=1)
    want = alone.step([(0, prefix + suffix_b)])[0]  # [L, V]
    want_kv = [c[alone.blocks[0][:3]].clone() for c in alone.caches]

    shared = PagedRunner(model, block_size=bs, num_blocks=128, seed=2)
    others = {s: [rng.randrange(2, 200) for _ in range(2 + 5 * s)] for s in range(1, 5)}
    a = prefix + suffix_a
    for chunk in (a[:5], a[5:11], a[11:]):
        shared.step([(s, t) for s, t in others.items()] + [(1000, chunk)])
        others = {s: [t[-1]] for s, t in others.items()}
    shared.blocks[2000] = shared.blocks[1000][:3]
    shared.lengths[2000] = 3 * bs
    got = shared.step([(s, t) for s, t in others.items() if s % 2] + [(2000, suffix_b)])[-1]
    assert torch.equal(got[-1], want[-1])
    for cache, expected in zip(shared.caches, want_kv):
        assert torch.equal(cache[shared.blocks[2000][:3]], expected)


def test_reset_prefix_cache_starts_cold_and_switches_caching(models):
    llm = LLM(str(models["llama"]), device="cpu")
    prompt = list(range(2, 60))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prompt], greedy)[0]
    assert llm.generate([prompt], greedy)[0].cached_prompt_tokens == 48  # warm
    blocks = llm.engine.runner.blocks
    llm.reset_prefix_cache()
    assert not blocks.cache.block_of and blocks.num_free == llm.engine.runner.num_blocks
    assert llm.generate([prompt], greedy)[0].cached_prompt_tokens == 0  # cold
    llm.reset_prefix_cache(enabled=False)
    again = llm.generate([prompt, prompt], greedy)
    assert blocks.cache is None and [o.cached_prompt_tokens for o in again] == [0, 0]
    assert again[1].outputs[0].token_ids == first.outputs[0].token_ids
    assert sorted(blocks.free) == list(range(llm.engine.runner.num_blocks))
