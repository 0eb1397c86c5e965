"""The whole DeepSeek-V4 model against transformers' DeepseekV4ForCausalLM (eager, float32)
on tiny random weights with every layer kind (sliding, CSA, HCA), a hash layer and binding
SwiGLU clamps: logits within 1e-4 and greedy tokens equal, through prefill, chunked prefill
whose chunks split compression windows and exceed the window ring, batched decode of
sequences of different lengths, and a long generation that commits many HCA entries."""

from __future__ import annotations

import json

import pytest
import torch

from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.deepseek_v4_config import DeepseekV4ModelConfig
from engine.models.deepseek_v4_names import hub_state_from_hf
from engine.models.weights import CheckpointMismatch
from tests.engine.deepseek_helpers import PagedRunner, hf_logits, read_checkpoint, relative_error
from tests.engine.v4_helpers import engine_v4_from_hf, hf_v4_model

pytest.importorskip("transformers.models.deepseek_v4")

PROMPTS = [
    [3, 17, 42, 5, 9, 11, 60, 2, 8, 13, 21, 34, 55, 89, 1, 7, 19, 23, 29],  # 19
    [7, 70, 77],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 4, 44, 45, 46, 47, 48, 49, 50,
     51, 52, 53, 54, 55, 56, 57],  # 27: chunks 13 + 14 split CSA and HCA windows
]  # fmt: skip
NEW_TOKENS = 14  # several CSA and HCA windows close during decode


def run_schedule(model, prompts, new_tokens=NEW_TOKENS):
    """Seq 0 whole, seq 2 in two chunks (the second beside decodes and seq 1's prefill),
    then batched greedy decode. Returns (tokens, logits rows per sequence)."""
    runner = PagedRunner(model, block_size=8, num_blocks=96)
    tokens = [list(p) for p in prompts]
    rows = {i: [] for i in range(len(prompts))}
    split = 13
    out = runner.step([(0, prompts[0]), (2, prompts[2][:split])])
    rows[0].append(out[0]), rows[2].append(out[1])
    tokens[0].append(int(out[0][-1].argmax()))
    out = runner.step([(2, prompts[2][split:]), (0, tokens[0][-1:]), (1, prompts[1])])
    for seq, logits in zip((2, 0, 1), out):
        rows[seq].append(logits)
        tokens[seq].append(int(logits[-1].argmax()))
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < new_tokens:
        out = runner.step([(i, t[-1:]) for i, t in enumerate(tokens)])
        for i, logits in enumerate(out):
            rows[i].append(logits)
            tokens[i].append(int(logits[-1].argmax()))
    return tokens, {i: torch.cat(r) for i, r in rows.items()}


def check_against(hf, tokens, rows, prompts, tol=1e-4):
    worst = 0.0
    for i, toks in enumerate(tokens):
        ref = hf_logits(hf, toks)[: rows[i].shape[0]]
        worst = max(worst, relative_error(rows[i], ref))
        start = len(prompts[i]) - 1
        assert ref[start:].argmax(-1).tolist() == toks[start + 1 :], f"sequence {i}"
    assert worst < tol, f"max relative logit error {worst:.2e}"
    return worst


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_and_greedy_tokens_match_transformers(seed):
    hf = hf_v4_model(seed=seed)
    model = engine_v4_from_hf(hf)
    tokens, rows = run_schedule(model, PROMPTS)
    check_against(hf, tokens, rows, PROMPTS)


def test_long_generation_commits_many_hca_entries():
    """330+ positions with an HCA ratio of 64: five HCA and 80 CSA entries per sequence,
    two sequences decoding side by side; index_topk stays >= T / 4 (indexer ties)."""
    hf = hf_v4_model(
        seed=7,
        index_topk=96,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 64},
    )
    model = engine_v4_from_hf(hf)
    prompts = [PROMPTS[0], PROMPTS[1]]
    runner = PagedRunner(model, block_size=64, num_blocks=24)
    tokens = [list(p) for p in prompts]
    rows = {0: [], 1: []}
    for i, p in enumerate(prompts):
        rows[i].append(runner.step([(i, p)])[0])
        tokens[i].append(int(rows[i][-1][-1].argmax()))
    while len(tokens[1]) - len(prompts[1]) < 310:
        out = runner.step([(i, t[-1:]) for i, t in enumerate(tokens)])
        for i, logits in enumerate(out):
            rows[i].append(logits)
            tokens[i].append(int(logits[-1].argmax()))
    rows = {i: torch.cat(r) for i, r in rows.items()}
    assert len(tokens[0]) > 320
    check_against(hf, tokens, rows, prompts)


def test_chunking_and_batching_do_not_change_logits():
    """A prompt run whole, in chunks of 1..5 tokens, or beside another sequence gives the
    same logits bit for bit (the CPU linears are row-invariant; entries are chunk-exact)."""
    hf = hf_v4_model(seed=4)
    model = engine_v4_from_hf(hf)
    prompt = PROMPTS[2]
    whole = PagedRunner(model, block_size=8).step([(0, prompt)])[0]
    runner = PagedRunner(model, block_size=8, seed=3)
    pieces, at, size = [], 0, 1
    while at < len(prompt):
        pieces.append(runner.step([(5, PROMPTS[1]), (0, prompt[at : at + size])])[1])
        at, size = at + size, size % 5 + 1
    assert torch.equal(torch.cat(pieces), whole)


def _hub_state(hf):
    cfg = DeepseekV4ModelConfig.from_transformers(hf.config)
    return {n: t.detach().clone() for n, t in hub_state_from_hf(hf.state_dict(), cfg).items()}


def test_hub_and_save_pretrained_layouts_load_the_same_model(tmp_path):
    hf = hf_v4_model(seed=2)
    ids = torch.tensor(PROMPTS[2])
    ref = engine_v4_from_hf(hf)
    want = PagedRunner(ref, block_size=8).step([(0, ids.tolist())])[0]

    hub = DeepseekV4ForCausalLM(hf.config.to_dict()).eval()
    hub.load_weights(_hub_state(hf).items())
    assert torch.equal(PagedRunner(hub, block_size=8).step([(0, ids.tolist())])[0], want)

    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, tensors = read_checkpoint(tmp_path)
    saved = DeepseekV4ForCausalLM(config).eval()
    saved.load_weights(tensors)
    assert torch.equal(PagedRunner(saved, block_size=8).step([(0, ids.tolist())])[0], want)
    # the hub's config.json spelling gives the same model
    assert DeepseekV4ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))


def test_missing_and_unexpected_tensors_are_named():
    hf = hf_v4_model(seed=2)
    state = _hub_state(hf)
    state.pop("layers.1.attn.indexer.compressor.ape")
    state.pop("layers.2.ffn.experts.5.w3.weight")
    state["layers.9.attn.wq_a.weight"] = torch.zeros(1)
    model = DeepseekV4ForCausalLM(hf.config.to_dict())
    with pytest.raises(CheckpointMismatch) as err:
        model.load_weights(state.items())
    msg = str(err.value)
    assert "layers.1.attn.indexer.compressor.ape" in msg
    assert "layers.2.ffn.experts.5.w3.weight" in msg
    assert "unexpected tensors: layers.9.attn.wq_a.weight" in msg


def test_wrong_shape_and_dtype_are_refused_by_name():
    hf = hf_v4_model(seed=2)
    state = _hub_state(hf)
    state["layers.0.ffn.gate.tid2eid"] = state["layers.0.ffn.gate.tid2eid"].float()
    model = DeepseekV4ForCausalLM(hf.config.to_dict())
    with pytest.raises(CheckpointMismatch, match="layers.0.ffn.gate.tid2eid"):
        model.load_weights(state.items())
    state = _hub_state(hf)
    state["layers.0.ffn.gate.tid2eid"][7, 1] = hf.config.n_routed_experts
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.gate\.tid2eid holds expert ids 0\.\.8"):
        model.load_weights(state.items())
    state = _hub_state(hf)
    state["layers.3.attn.attn_sink"] = torch.zeros(5)
    with pytest.raises(CheckpointMismatch, match=r"layers.3.attn.attn_sink.*\(5,\)"):
        model.load_weights(state.items())


def test_a_larger_ring_gives_the_same_bits():
    """Speculative decoding sizes the ring and pooling rows window + K: the queries' keys
    keep their canonical places, so logits do not change by a bit."""
    hf = hf_v4_model(seed=5)
    plain, roomy = engine_v4_from_hf(hf), engine_v4_from_hf(hf)
    roomy.reserve_lookahead(3)
    want = PagedRunner(plain, block_size=8).step([(0, PROMPTS[2])])[0]
    runner = PagedRunner(roomy, block_size=8)
    got = runner.step([(0, PROMPTS[2][:11])])[0]
    got = torch.cat([got, runner.step([(0, PROMPTS[2][11:])])[0]])
    assert torch.equal(got, want)


def test_routing_statistics_cover_every_moe_layer():
    from engine.routing_stats import RoutingRecorder

    model = engine_v4_from_hf(hf_v4_model(seed=6))
    recorder = RoutingRecorder()
    model.routing_recorder = recorder
    recorder.begin_step(len(PROMPTS[2]), is_decode=False)
    PagedRunner(model, block_size=8).step([(0, PROMPTS[2])])
    layers = recorder.summary()["all"]["layers"]
    assert sorted(layers) == [0, 1, 2, 3]
    assert all(1 < v["mean_distinct_experts"] <= 8 for v in layers.values())


def test_a_model_of_sliding_layers_only_runs_without_a_paged_cache():
    """Layer 0 is sliding-window only (compress ratio 0): its K/V live in each sequence's
    ring, so the engine has no paged cache to size; it still runs every sequence to
    max_model_len, and a row's tokens are the same alone and batched."""
    from engine import LLM, SamplingParams

    llm = LLM("random:tiny?arch=deepseek_v4&layers=1&mtp=0", device="cpu", max_num_seqs=4)
    assert llm.engine.runner.model.cache_specs() == []
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, params)
    assert batched[0].outputs[0].token_ids == alone
    assert all(len(o.outputs[0].token_ids) == 6 for o in batched)
