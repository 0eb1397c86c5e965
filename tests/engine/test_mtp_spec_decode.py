"""MTP speculative decoding end to end on a tiny random checkpoint, with the step loop the
engine uses (written out here: prefill -> MTP drafts -> verify K+1 rows -> accept ->
roll back the rejected cache rows -> MTP over the verified rows -> ...)."""

import pytest
import torch

from engine.checkpoint_maker import make_random_checkpoint
from engine.spec_decode.acceptance import AcceptanceStats, greedy_accept, rejection_sample
from engine.spec_decode.mtp import DraftProposal, MtpDrafter
from tests.engine.deepseek_helpers import PagedRunner, load_engine_model

PROMPTS = [[256, 72, 101, 108], [256, 9], [256, 30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny", preset="tiny", seed=3)
    return load_engine_model(path)


def target_probs(logits, temperature):
    return torch.softmax(logits / temperature, dim=-1)


@torch.no_grad()
def speculative_generate(model, prompts, K, max_new, temperature=0.0, seed=0, oracle=None):
    gen = torch.Generator().manual_seed(seed)
    runner = PagedRunner(model, block_size=4, num_blocks=16 * len(prompts), lookahead=K)
    drafter = MtpDrafter(model, K)
    B = len(prompts)
    out = [[] for _ in prompts]
    if oracle is not None:  # a stand-in drafter that knows (most of) the answer
        drafter = oracle(out, K)
    temps = torch.full((B,), float(temperature))
    stats = AcceptanceStats()

    def sample(logits):
        if temperature == 0:
            return logits.argmax(-1)
        return torch.multinomial(target_probs(logits, temperature), 1, generator=gen)[:, 0]

    # prefill; then MTP over the prompt rows with next_ids = prompt[1:] + sampled token
    ctx, pos = runner.context([(b, len(p)) for b, p in enumerate(prompts)])
    hidden = model(torch.tensor([t for p in prompts for t in p]), pos, ctx)
    last = (ctx.cu_query_lens[1:] - 1).long()
    first = sample(model.compute_logits(hidden[last])).tolist()
    for b in range(B):
        out[b].append(first[b])
    next_ids = torch.tensor([t for b, p in enumerate(prompts) for t in p[1:] + [first[b]]])
    drafts = drafter.propose(hidden, next_ids, pos, ctx, temps, [gen] * B)
    while min(len(o) for o in out) < max_new:
        # verify: rows [last emitted token, d1..dK] for each sequence at positions L..L+K
        ctx, pos = runner.context([(b, K + 1) for b in range(B)])
        rows = torch.cat([torch.tensor([out[b][-1]]) for b in range(B)])
        ids = torch.cat((rows[:, None], drafts.tokens), dim=1).reshape(-1)
        hidden = model(ids, pos, ctx)
        logits = model.compute_logits(hidden).view(B, K + 1, -1)
        if temperature == 0:
            res = greedy_accept(drafts.tokens, logits)
        else:
            p = target_probs(logits, temperature)
            res = rejection_sample(drafts.tokens, drafts.probs, p, generator=gen)
        stats.update(res)
        # keep the cache rows of the verified prefix only, then MTP over those rows
        n = res.num_accepted.tolist()
        keep_rows, next_ids, items = [], [], []
        for b in range(B):
            start = runner.lengths[b] - (K + 1)
            runner.lengths[b] = start + n[b] + 1
            keep_rows += [b * (K + 1) + i for i in range(n[b] + 1)]
            next_ids += res.tokens[b]
            out[b] += res.tokens[b]
            items.append((b, start, n[b] + 1))
        ctx = runner.context_at(items)
        keep = torch.tensor(keep_rows)
        drafts = drafter.propose(
            hidden[keep], torch.tensor(next_ids), pos[keep], ctx, temps, [gen] * B
        )
    return [o[:max_new] for o in out], stats


@torch.no_grad()
def plain_greedy(model, prompts, max_new):
    runner = PagedRunner(model, block_size=4, num_blocks=128)
    logits = runner.step([(b, p) for b, p in enumerate(prompts)])
    out = [[int(lg[-1].argmax())] for lg in logits]
    while min(len(o) for o in out) < max_new:
        logits = runner.step([(b, o[-1:]) for b, o in enumerate(out)])
        for b, lg in enumerate(logits):
            out[b].append(int(lg[-1].argmax()))
    return [o[:max_new] for o in out]


@pytest.mark.parametrize("K", [1, 3])
def test_greedy_outputs_identical_with_and_without_mtp(model, K):
    want = plain_greedy(model, PROMPTS, 10)
    got, stats = speculative_generate(model, PROMPTS, K, 10)
    assert got == want
    summary = stats.summary()
    assert len(summary["histogram"]) == K + 1 and summary["sequence_steps"] > 0
    print(f"K={K} accepted-length histogram {summary['histogram']}")


class CorruptedOracle:
    """Proposes the true greedy continuation with some drafts replaced, so every accepted
    length 0..K occurs and the loop's cache rollback is exercised."""

    def __init__(self, want, out, K):
        self.want, self.out, self.K = want, out, K
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, *args, **kwargs):
        tokens = []
        for b, o in enumerate(self.out):
            future = (self.want[b] + [0] * 8)[len(o) : len(o) + self.K]
            bad = torch.rand(self.K, generator=self.gen) < 0.25
            tokens.append([(t + 1) % 200 if x else t for t, x in zip(future, bad.tolist())])
        tokens = torch.tensor(tokens)
        return DraftProposal(tokens, torch.nn.functional.one_hot(tokens, 258).float())


def test_loop_with_accepted_drafts_matches_plain_greedy(model):
    K = 3
    want = plain_greedy(model, PROMPTS, 16)
    got, stats = speculative_generate(
        model, PROMPTS, K, 16, oracle=lambda out, k: CorruptedOracle(want, out, k)
    )
    assert got == want
    hist = stats.summary()["histogram"]
    assert all(h > 0 for h in hist), hist  # every accepted length 0..K occurred


def test_mtp_cache_is_an_extra_cache_spec(model):
    specs = model.cache_specs()
    c = model.config
    assert len(specs) == c.num_hidden_layers + 1
    assert specs[-1].shape == (c.kv_lora_rank + c.qk_rope_head_dim,)


def test_sampled_speculative_decoding_keeps_the_token_distribution(model):
    """The second generated token (the first one that goes through acceptance) must follow
    the target's marginal sum_t1 p(t1) p(t2 | t1), computed exactly here."""
    prompt, T, N = [256, 40, 41], 1.0, 800
    with torch.no_grad():
        runner = PagedRunner(model, block_size=4, num_blocks=8)
        p1 = target_probs(runner.step([(0, prompt)])[0][-1], T)  # [V]
        V = p1.numel()
        runner = PagedRunner(model, block_size=4, num_blocks=4 * V)
        logits = runner.step([(v, prompt + [v]) for v in range(V)])
        p2_given = torch.stack([target_probs(lg[-1], T) for lg in logits])  # [V, V]
    marginal = (p1[:, None] * p2_given).sum(0).double()
    got, stats = speculative_generate(model, [prompt] * N, 2, 2, temperature=T, seed=7)
    assert stats.histogram[1:].sum() > 0  # some drafts were accepted, some rejected
    assert stats.histogram[0] > 0
    second = torch.tensor([o[1] for o in got])
    freq = torch.bincount(second, minlength=V).double() / N
    tv = 0.5 * float((freq - marginal).abs().sum())
    # sampling noise alone: E[TV] ~ 0.4 * sum sqrt(p / N) for this marginal
    noise = 0.4 * float(marginal.sqrt().sum()) / N**0.5
    assert tv < 2 * noise + 0.02, (tv, noise)
