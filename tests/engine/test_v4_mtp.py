"""DeepSeek-V4's MTP layer (`mtp.0.*`) and speculative decoding with it, on tiny random
hub-layout checkpoints (sliding window 8, CSA ratio 4, HCA ratio 8).

- The MTP forward against a reference written here from DeepSeek's `MTPBlock`: plain torch
  for enorm / e_proj and hnorm / h_proj (per stream) and for the inputs' sum; the block is
  transformers' own decoder layer (a one-layer DeepseekV4 model holding mtp.0.*'s block, with
  mtp.0's hc_head and norm and the shared head), fed the MTP input through a pre-hook; the
  target's final streams are read from transformers' main model before its hc_head. Prefill
  rows and two chained drafts (the MTP's output streams fed back) agree within 1e-4, and
  MtpDrafter proposes the same three tokens.
- Loading: strict by name, dropped when the checkpoint has no mtp.*, skipped with
  enable_mtp=False, FP8 e_proj / h_proj in a quantized checkpoint.
- The decode state under reserve_lookahead(K): rings of sliding_window + K keys, pooling
  states of R + K rows; and at the op level, a chunk with rejected drafts then the real
  tokens gives the entries of a run without drafts when the state has K more rows (and
  not without them).
- engine.LLM: greedy outputs equal for speculative_tokens 0..3; an oracle drafter proposing
  the true continuation with corrupted drafts (every accepted length, rejected rows at
  positions that close CSA and HCA windows) equals plain greedy; sampled second tokens
  follow the exact marginal of the target.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.deepseek_v4_config import CSA, HCA, DeepseekV4ModelConfig, layer_type_of
from engine.models.deepseek_v4_names import hf_state_from_hub
from engine.models.weights import CheckpointMismatch
from engine.ops.v4_compress import compress_chunk, compress_prefix, state_rows
from engine.spec_decode.mtp import DraftProposal, MtpDrafter
from tests.engine.deepseek_helpers import PagedRunner, read_checkpoint, relative_error

PROMPTS = [[5, 9, 13, 2, 7], [40, 41], list(range(10, 40)), [100, 3, 7, 8, 9, 200]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4mtp") / "tiny"
    return make_random_checkpoint(path, arch="deepseek_v4", preset="tiny", mtp=True, seed=3)


def load_v4(path, names=None, **kwargs) -> DeepseekV4ForCausalLM:
    """The engine's model from a checkpoint; `names` keeps only the tensors it accepts."""
    config, tensors = read_checkpoint(path)
    model = DeepseekV4ForCausalLM(config, **kwargs).eval()
    model.load_weights((n, t) for n, t in tensors if names is None or names(n))
    return model


# -- the reference -----------------------------------------------------------------------------
def hf_config(config: dict, layer_types: list[str], mlp_layer_types: list[str]):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    d = copy.deepcopy(config)  # transformers writes into the rope_scaling dict it is given
    ratios = d.pop("compress_ratios")[: d["num_hidden_layers"]]
    d.pop("num_hash_layers")
    d["num_hidden_layers"] = len(layer_types)
    cfg = DeepseekV4Config(
        **d,
        layer_types=layer_types,
        mlp_layer_types=mlp_layer_types,
        compress_rates={CSA: 4, HCA: next(r for r in ratios if layer_type_of(r) == HCA)},
    )
    cfg._experts_implementation = "eager"
    return cfg


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()


class ReferenceMtp:
    """DeepSeek's MTPBlock on the checkpoint's tensors: transformers' main model gives the
    final streams H [S, C, D]; X = e_proj(enorm(embed(next))) [S, 1, D] + h_proj(hnorm(H))
    [S, C, D]; a one-layer transformers model runs the block on X (its layer's input
    replaced by X through a pre-hook) and applies mtp.0's hc_head and norm and the shared
    head."""

    def __init__(self, path):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        config, tensors = read_checkpoint(path)
        hub = {n: t.float() if t.is_floating_point() else t for n, t in tensors}
        self.hub, self.eps = hub, config["rms_norm_eps"]
        L = config["num_hidden_layers"]
        ratios = config["compress_ratios"][:L]
        main_cfg = hf_config(
            config,
            [layer_type_of(r) for r in ratios],
            ["hash_moe" if i < config["num_hash_layers"] else "moe" for i in range(L)],
        )
        self.main = hf.DeepseekV4ForCausalLM(main_cfg).eval()
        self.main.load_state_dict(
            hf_state_from_hub(hub, DeepseekV4ModelConfig.from_transformers(main_cfg))
        )
        block_cfg = hf_config(config, [layer_type_of(config["compress_ratios"][L])], ["moe"])
        block_hub = {"embed.weight": hub["embed.weight"], "head.weight": hub["head.weight"]}
        for name, t in hub.items():
            if name.startswith("mtp.0."):
                leaf = name[len("mtp.0.") :]
                if leaf in ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"):
                    block_hub[leaf] = t
                else:
                    block_hub[f"layers.0.{leaf}"] = t  # e_proj & co are left unused
        self.block = hf.DeepseekV4ForCausalLM(block_cfg).eval()
        self.block.load_state_dict(
            hf_state_from_hub(block_hub, DeepseekV4ModelConfig.from_transformers(block_cfg))
        )

    @staticmethod
    def _run(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids at positions 0..S-1 -> (logits [S, V], the streams [S, C, D] the model's
        hc_head read)."""
        seen = []
        handle = model.model.hc_head.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        try:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        finally:
            handle.remove()
        return logits, seen[0][0]

    @torch.no_grad()
    def target_streams(self, ids: list[int]) -> torch.Tensor:
        """[S, C, D]: the main model's final streams."""
        return self._run(self.main, ids)[1]

    def mtp_input(self, streams: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        h = self.hub
        e = h["embed.weight"][torch.tensor(next_ids)]  # [S, D]
        e = F.linear(rms(e, h["mtp.0.enorm.weight"], self.eps), h["mtp.0.e_proj.weight"])
        x = F.linear(rms(streams, h["mtp.0.hnorm.weight"], self.eps), h["mtp.0.h_proj.weight"])
        return e[:, None, :] + x  # [S, C, D]

    @torch.no_grad()
    def block_forward(self, x: torch.Tensor, next_ids: list[int]):
        """x [S, C, D] at positions 0..S-1 -> (logits [S, V], the block's streams [S, C, D])."""
        hook = self.block.model.layers[0].register_forward_pre_hook(
            lambda _m, args, kwargs: ((x[None], *args[1:]), kwargs), with_kwargs=True
        )
        try:
            return self._run(self.block, next_ids)
        finally:
            hook.remove()


@pytest.fixture(scope="module")
def reference(tiny):
    pytest.importorskip("transformers.models.deepseek_v4")
    return ReferenceMtp(tiny)


@torch.no_grad()
def test_mtp_forward_and_chained_drafts_match_the_reference(tiny, reference):
    model = load_v4(tiny)
    ids = [(7 * j + 3) % 250 + 2 for j in range(20)]  # > the window; CSA / HCA entries commit
    next_ids = ids[1:] + [77]
    S = len(ids)

    runner = PagedRunner(model, block_size=8, num_blocks=32)
    ctx, pos = runner.context([(0, S)])
    streams = model(torch.tensor(ids), pos, ctx)  # [S, C, D]
    want_streams = reference.target_streams(ids)
    assert relative_error(streams, want_streams) < 1e-5
    out = model.mtp_forward(streams, torch.tensor(next_ids), pos, ctx)
    logits = model.mtp_logits(out)

    x = reference.mtp_input(want_streams, next_ids)
    want, ref_out = reference.block_forward(x, next_ids)
    assert relative_error(logits, want) < 1e-4
    drafts = [int(logits[-1].argmax())]
    assert drafts[0] == int(want[-1].argmax())

    for _ in range(2):  # chained drafts: the previous MTP output streams, the previous draft
        ctx, pos = runner.context([(0, 1)])
        out = model.mtp_forward(out[-1:], torch.tensor(drafts[-1:]), pos, ctx)
        logits = model.mtp_logits(out)
        next_ids.append(drafts[-1])
        x = torch.cat([x, reference.mtp_input(ref_out[-1:], drafts[-1:])])
        want, ref_out = reference.block_forward(x, next_ids)
        assert relative_error(logits[-1], want[-1]) < 1e-4
        drafts.append(int(logits[-1].argmax()))
        assert drafts[-1] == int(want[-1].argmax())

    # the drafter's own loop (one-row decode contexts with the sequences' state slots)
    runner = PagedRunner(model, block_size=8, num_blocks=32, lookahead=3, seed=5)
    ctx, pos = runner.context([(1, 3), (0, S)])  # a second sequence beside it
    ids2 = torch.tensor([9, 8, 7] + ids)
    hidden = model(ids2, pos, ctx)
    proposal = MtpDrafter(model, 3).propose(
        hidden, torch.tensor([8, 7, 66] + next_ids[:S]), pos, ctx
    )
    assert proposal.tokens[1].tolist() == drafts


# -- loading -------------------------------------------------------------------------------------
def test_mtp_loads_strictly_and_is_dropped_or_skipped_by_choice(tiny, tmp_path):
    model = load_v4(tiny)
    assert model.num_mtp_layers == 1

    def without(name):
        return lambda n: n != name

    for name in ("mtp.0.h_proj.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.experts.3.w2.weight"):
        with pytest.raises(CheckpointMismatch, match=name.replace(".", r"\.")):
            load_v4(tiny, names=without(name))

    no_mtp = load_v4(tiny, names=lambda n: not n.startswith("mtp."))
    assert no_mtp.mtp is None and no_mtp.num_mtp_layers == 0
    with pytest.raises(CheckpointMismatch, match=r"mtp\.0\.e_proj\.weight"):
        load_v4(tiny, names=lambda n: not n.startswith("mtp."), enable_mtp=True)
    off = load_v4(tiny, enable_mtp=False)
    assert off.mtp is None
    assert len(model.state_specs()) == len(off.state_specs()) + 1  # the MTP layer's ring
    assert model.cache_specs() == off.cache_specs()  # it is sliding-only: no paged cache

    config, tensors = read_checkpoint(tiny)
    L = config["num_hidden_layers"]
    declared_none = DeepseekV4ForCausalLM(
        {**config, "num_nextn_predict_layers": 0, "compress_ratios": config["compress_ratios"][:L]}
    )
    with pytest.raises(CheckpointMismatch, match=r"mtp\.0\.e_proj\.weight"):
        declared_none.load_weights(tensors)

    fp8 = make_random_checkpoint(
        tmp_path / "fp8", arch="deepseek_v4", preset="tiny", dense_dtype="fp8",
        expert_dtype="mxfp4", mtp=True, seed=3,
    )  # fmt: skip
    quantized = load_v4(fp8)
    mtp = quantized.mtp[0]
    assert mtp.e_proj.weight.dtype == torch.float8_e4m3fn
    assert mtp.block.attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert mtp.block.attn.wo_a.weight.dtype == torch.float32  # dequantized at load


# -- the decode state ----------------------------------------------------------------------------
def test_lookahead_sizes_every_ring_and_pooling_state(tiny):
    model = load_v4(tiny)
    plain = [s.shape for s in model.state_specs()]
    model.reserve_lookahead(3)
    grown = [s.shape for s in model.state_specs()]
    W = model.config.sliding_window
    rings = [(W, 32)] * 5  # 4 layers and the MTP layer, head_dim 32
    assert [s for s in plain if len(s) == 2] == rings
    assert [s for s in grown if len(s) == 2] == [(W + 3, 32)] * 5
    pools = [(s, g) for s, g in zip(plain, grown) if len(s) == 3]
    assert pools and all(g == (2, s[1] + 3, s[2]) for s, g in pools)
    PagedRunner(model, block_size=8, num_blocks=8)
    with pytest.raises(RuntimeError, match="after the decode state"):
        model.reserve_lookahead(2)


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (8, False)])
def test_rejected_draft_rows_leave_the_next_chunk_its_pooling_rows(ratio, overlap):
    """Tokens 0..T-1 through chunks where a verify step of K drafts rejects all of them
    (their garbage rows are written, then the real tokens follow): with R + K rows the
    entries equal one prefix bit for bit; with R rows some are corrupted."""
    gen = torch.Generator().manual_seed(0)
    T, d, K = 44, 16, 3
    width = 2 * d if overlap else d
    kv, score = torch.randn(T, width, generator=gen), torch.randn(T, width, generator=gen)
    junk = torch.randn(2, K, width, generator=gen) * 5
    ape = torch.randn(ratio, width, generator=gen)
    norm, inv_freq = 1 + 0.1 * torch.randn(d, generator=gen), torch.rand(2, generator=gen)
    want = compress_prefix(kv, score, ape, overlap, norm, 1e-6, inv_freq)

    def run(lookahead):
        state = torch.zeros(2, state_rows(ratio, overlap, lookahead), width)
        entries = torch.zeros((T + K) // ratio, d)  # a draft past T may close one more
        start = 0
        for n in [5, 1, 2, 1, 3, 1, 1, 4, 2, 1, 3, 1, 1, 2, 1, 1, 5, 1, 3, 1, 1, 2, 1]:
            # a verify step: the real token, then K drafts that are all rejected
            args = (ape, overlap, norm, 1e-6, inv_freq)
            step_kv = torch.cat([kv[start : start + 1], junk[0]])
            step_score = torch.cat([score[start : start + 1], junk[1]])
            got, first = compress_chunk(step_kv, step_score, start, state, *args)
            entries[first : first + got.shape[0]] = got
            # no draft accepted: the next chunk starts after the step's real token
            got, first = compress_chunk(
                kv[start + 1 : start + n], score[start + 1 : start + n], start + 1, state, *args
            )
            entries[first : first + got.shape[0]] = got
            start += n
        assert start == T
        return entries[: T // ratio]

    assert torch.equal(run(K), want)
    assert not torch.equal(run(0), want)


# -- through engine.LLM --------------------------------------------------------------------------
def greedy(llm, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def spec_llm(path, k):
    # a small token budget mixes prefill chunks with other sequences' verify steps
    return LLM(str(path), dtype="float32", speculative_tokens=k, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    return greedy(LLM(str(tiny), dtype="float32"))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_outputs_equal_with_and_without_mtp(tiny, plain_greedy, k):
    llm = spec_llm(tiny, k)
    assert greedy(llm) == plain_greedy
    stats = llm.speculative_stats()
    assert len(stats["histogram"]) == k + 1 and stats["sequence_steps"] > 0
    print(f"k={k} accepted-length histogram {stats['histogram']}")


class CorruptingOracle:
    """Stands in for the MTP drafter: proposes each sequence's true greedy continuation
    with about a third of the drafts replaced, so every accepted length 0..K occurs, and
    records the positions of the rows verified after a sequence's first wrong draft (the
    rejected rows a verify step writes into the ring, the pooling state and the caches)."""

    def __init__(self, speculator, continuation: dict[tuple[int, ...], list[int]], K: int):
        self.continuation, self.K = continuation, K
        self.gen = torch.Generator().manual_seed(0)
        self.rejected: list[int] = []
        self.items = []
        build = speculator.build_inputs

        def recording(items):
            self.items = items  # _propose's rows, in the proposal's order
            return build(items)

        speculator.build_inputs = recording

    def propose(self, *_args, **_kwargs) -> DraftProposal:
        tokens = []
        for seq, start, n in self.items:
            full = self.continuation[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            first = start + n + 1  # the MTP row at position i drafts the token at i + 2
            true = (full + [0] * self.K)[first : first + self.K]
            bad = (torch.rand(self.K, generator=self.gen) < 0.35).tolist()
            tokens.append([(t + 1) % 258 if b else t for t, b in zip(true, bad)])
            if any(bad):
                self.rejected += range(first + bad.index(True), first + self.K)
        tokens = torch.tensor(tokens)
        return DraftProposal(tokens, F.one_hot(tokens, 258).float())


def test_rejected_drafts_across_window_boundaries_keep_greedy_outputs(tiny, plain_greedy):
    K = 3
    llm = spec_llm(tiny, K)
    speculator = llm.engine.runner.speculator
    continuation = {tuple(p): p + out for p, out in zip(PROMPTS, plain_greedy)}
    oracle = speculator.drafter = CorruptingOracle(speculator, continuation, K)
    assert greedy(llm) == plain_greedy
    hist = llm.speculative_stats()["histogram"]
    assert all(h > 0 for h in hist), hist
    closes_hca = [q for q in oracle.rejected if q % 8 == 7]
    closes_csa_only = [q for q in oracle.rejected if q % 4 == 3 and q % 8 != 7]
    assert closes_hca and closes_csa_only, oracle.rejected


class SkewedDrafter:
    """Stands in for the MTP drafter with a draft distribution q whose shape differs from
    the target's p: after the first token t1, q = 1/2 on p's likeliest second token a(t1)
    and 1/2 on its least likely w(t1). Verification must then accept a often, w almost
    never, and draw a rejection's token from the residual max(p - q, 0) (which excludes a
    where p(a) < 1/2), so that the second token still follows p exactly."""

    def __init__(self, a: torch.Tensor, w: torch.Tensor, K: int, V: int):
        self.a, self.w, self.K, self.V = a, w, K, V
        self.gen = torch.Generator().manual_seed(1)

    def propose(self, target_hidden, next_ids, positions, ctx, **_kwargs) -> DraftProposal:
        t1 = next_ids[(ctx.cu_query_lens[1:] - 1).long()]  # [B]: the token just sampled
        a, w = self.a[t1], self.w[t1]
        q = torch.zeros(len(t1), self.K, self.V)
        q[:, 0].scatter_(1, a[:, None], 0.5)
        q[:, 0].scatter_add_(1, w[:, None], torch.full((len(t1), 1), 0.5))
        q[:, 1:].scatter_(2, w[:, None, None].expand(-1, self.K - 1, 1), 1.0)
        pick_a = torch.rand(len(t1), generator=self.gen) < 0.5
        tokens = torch.stack([torch.where(pick_a, a, w)] + [w] * (self.K - 1), dim=1)
        return DraftProposal(tokens, q)


def test_sampled_second_token_follows_the_target_marginal(tiny):
    """With max_tokens 3 a sequence gets one draft for its second token, which is then an
    accepted draft or the residual's sample. Over N sequences its frequencies must match
    the exact marginal sum_t1 p(t1) p(t2 | t1) of the target at this temperature: the
    chance of t2 = a(t1) within 4 sigma of the binomial, t2 = w(t1) as rare as p makes it,
    and the whole histogram within the sampling noise in total variation."""
    prompt, temp, N = [256, 40, 41], 0.3, 256
    model = load_v4(tiny)
    with torch.no_grad():
        runner = PagedRunner(model, block_size=8, num_blocks=8)
        p1 = torch.softmax(runner.step([(0, prompt)])[0][-1] / temp, -1)  # [V]
        V = p1.numel()
        runner = PagedRunner(model, block_size=8, num_blocks=2 * V, num_state_slots=V)
        rows = runner.step([(v, prompt + [v]) for v in range(V)])
        p2_given = torch.stack([torch.softmax(r[-1] / temp, -1) for r in rows]).double()
    p1 = p1.double()
    marginal = (p1[:, None] * p2_given).sum(0)
    a, w = p2_given.argmax(-1), p2_given.argmin(-1)  # [V] per first token
    chance_a = float((p1 * p2_given.gather(1, a[:, None])[:, 0]).sum())
    chance_w = float((p1 * p2_given.gather(1, w[:, None])[:, 0]).sum())

    K = 2
    llm = LLM(str(tiny), dtype="float32", speculative_tokens=K, max_num_seqs=64, seed=11)
    llm.engine.runner.speculator.drafter = SkewedDrafter(a, w, K, V)
    params = [
        SamplingParams(temperature=temp, max_tokens=3, ignore_eos=True, seed=1000 + i)
        for i in range(N)
    ]
    outs = llm.generate([prompt] * N, params)
    hist = llm.speculative_stats()["histogram"]
    assert hist[0] > N / 3 and hist[1] > N / 4, hist  # w rejected, a mostly accepted
    first = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    second = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    got_a = float((second == a[first]).double().mean())
    got_w = float((second == w[first]).double().mean())
    sigma = (chance_a * (1 - chance_a) / N) ** 0.5
    assert abs(got_a - chance_a) < 4 * sigma, (got_a, chance_a, sigma)
    assert got_w <= chance_w + 4 / N, (got_w, chance_w)
    freq = torch.bincount(second, minlength=V).double() / N
    tv = 0.5 * float((freq - marginal).abs().sum())
    noise = 0.4 * float(marginal.sqrt().sum()) / N**0.5  # E[TV] of N samples, roughly
    assert tv < 2 * noise + 0.02, (tv, noise)
