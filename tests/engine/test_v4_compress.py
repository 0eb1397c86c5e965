"""DeepSeek-V4's KV compressors and lightning indexer (engine/layers/v4_compress.py,
engine/ops/v4_compress.py) against transformers' DeepseekV4HCACompressor,
DeepseekV4CSACompressor and DeepseekV4Indexer on the same random weights (float32)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary import compute_inv_freq
from engine.layers.v4_compress import V4Compressor, V4Indexer
from engine.ops.v4_compress import compress_chunk, compress_prefix, state_rows

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config, DynamicCache  # noqa: E402

D, HEAD, Q_LORA, IDX_HEADS, IDX_DIM = 64, 32, 32, 2, 16
CSA, HCA = 4, 8
T = 37  # not a multiple of either ratio: the last window of each stays open
CSA_LAYER, HCA_LAYER = 1, 2


def _config(topk: int) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=128,
        hidden_size=D,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=HEAD,
        q_lora_rank=Q_LORA,
        partial_rotary_factor=0.25,
        num_experts_per_tok=2,
        n_routed_experts=8,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        index_n_heads=IDX_HEADS,
        index_head_dim=IDX_DIM,
        index_topk=topk,
        compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )


def _inv_freq(cfg: DeepseekV4Config) -> torch.Tensor:
    """The engine's YaRN frequencies for the compressed layers; equal to transformers'."""
    params = dict(cfg.rope_parameters["compress"])
    inv_freq, _ = compute_inv_freq(params, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    hf = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    assert hf.compress_attention_scaling == 1.0
    assert torch.equal(inv_freq, hf.compress_inv_freq)
    return inv_freq


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random everything, position biases included (transformers leaves them empty or zero)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("kv_norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


# transformers leaf -> hub leaf, for the compressor's and the indexer's own tensors.
_HUB = {
    "kv_proj.weight": "wkv.weight",
    "gate_proj.weight": "wgate.weight",
    "position_bias": "ape",
    "kv_norm.weight": "norm.weight",
}


def _copy_compressor(hf: torch.nn.Module, ours: V4Compressor, hf_prefix: str = "") -> None:
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for hf_leaf, hub_leaf in _HUB.items():
            ours.checkpoint_tensors()[ours.prefix + hub_leaf].copy_(params[hf_prefix + hf_leaf])


def _copy_indexer(hf_indexer: torch.nn.Module, ours: V4Indexer) -> None:
    _copy_compressor(hf_indexer, ours.compressor)
    with torch.no_grad():
        ours.wq_b.weight.copy_(hf_indexer.q_b_proj.weight)
        ours.weights_proj.weight.copy_(hf_indexer.scorer.weights_proj.weight)


def _inputs(gen: torch.Generator, t: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, t, D, generator=gen), torch.randn(1, t, Q_LORA, generator=gen)


def _hca(seed: int):
    cfg = _config(topk=64)
    gen = torch.Generator().manual_seed(seed)
    hf = hf_v4.DeepseekV4HCACompressor(cfg).eval()
    _randomise(hf, gen)
    ours = V4Compressor(
        D, HEAD, HCA, False, _inv_freq(cfg), cfg.rms_norm_eps, "layers.2.attn.compressor."
    )
    _copy_compressor(hf, ours)
    return cfg, gen, hf, ours


def _csa(seed: int, topk: int):
    cfg = _config(topk)
    gen = torch.Generator().manual_seed(seed)
    hf = hf_v4.DeepseekV4CSACompressor(cfg).eval()
    _randomise(hf, gen)
    inv_freq = _inv_freq(cfg)
    eps = cfg.rms_norm_eps
    comp = V4Compressor(D, HEAD, CSA, True, inv_freq, eps, "layers.1.attn.compressor.")
    idx = V4Indexer(
        D, Q_LORA, IDX_HEADS, IDX_DIM, CSA, topk, inv_freq, eps, "layers.1.attn.indexer."
    )
    _copy_compressor(hf, comp)
    _copy_indexer(hf.indexer, idx)
    return cfg, gen, hf, comp, idx


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_hub_names():
    _, _, _, comp, idx = _csa(0, topk=4)
    assert sorted(comp.checkpoint_tensors()) == [
        "layers.1.attn.compressor." + n
        for n in ("ape", "norm.weight", "wgate.weight", "wkv.weight")
    ]
    names = sorted(idx.checkpoint_tensors())
    assert "layers.1.attn.indexer.compressor.ape" in names
    assert "layers.1.attn.indexer.wq_b.weight" in names
    assert "layers.1.attn.indexer.weights_proj.weight" in names
    assert comp.ape.shape == (CSA, 2 * HEAD) and idx.compressor.ape.shape == (CSA, 2 * IDX_DIM)


@torch.no_grad()
def test_hca_entries_match_transformers():
    cfg, gen, hf, ours = _hca(1)
    x, qr = _inputs(gen)
    positions = torch.arange(T)[None]
    expected, _ = hf(x, qr, positions, None, HCA_LAYER)
    got = ours.prefix_entries(x[0])
    assert got.shape == (T // HCA, HEAD)
    _close(got, expected[0, 0])


@torch.no_grad()
def test_csa_entries_and_indexer_keys_match_transformers():
    cfg, gen, hf, comp, idx = _csa(2, topk=3)
    x, qr = _inputs(gen)
    positions = torch.arange(T)[None]
    cache = DynamicCache(config=cfg)
    expected, _ = hf(x, qr, positions, cache, CSA_LAYER)
    layer = cache.layers[CSA_LAYER]
    got = comp.prefix_entries(x[0])
    assert got.shape == (T // CSA, HEAD)
    _close(got, expected[0, 0])
    keys = idx.compressor.prefix_entries(x[0])
    _close(keys, layer.compressed_kv["indexer"][0])


def _hf_indexer_scores(hf_indexer, x, qr, positions, keys):
    """transformers' own query path and scorer over the given keys -> [T, n]."""
    cos, sin = hf_indexer.rotary_emb(x, position_ids=positions, layer_type="compress")
    q = hf_indexer.q_b_proj(qr).view(1, x.shape[1], -1, IDX_DIM).transpose(1, 2)
    q = hf_v4.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
    return hf_indexer.scorer(q, keys[None], x)[0]


def _assert_same_selection(got, expected, scores):
    """Tie-aware: per query the same number of -1s and the same multiset of chosen scores."""
    assert got.shape == expected.shape
    assert torch.equal((got < 0).sum(-1), (expected < 0).sum(-1))
    for t in range(got.shape[0]):
        a, b = got[t][got[t] >= 0], expected[t][expected[t] >= 0]
        assert len(set(a.tolist())) == len(a)
        assert torch.equal(scores[t, a].sort().values, scores[t, b].sort().values), t


@pytest.mark.parametrize("topk", [3, 9])
@torch.no_grad()
def test_indexer_selection_matches_transformers(topk):
    cfg, gen, hf, comp, idx = _csa(3, topk=topk)
    x, qr = _inputs(gen)
    positions = torch.arange(T)
    expected = hf.indexer(x, qr, positions[None], None, CSA_LAYER)[0]
    keys = idx.compressor.prefix_entries(x[0])
    scores = idx.scores(x[0], qr[0], positions, keys)
    _close(scores, _hf_indexer_scores(hf.indexer, x, qr, positions[None], keys))
    got = idx.select(x[0], qr[0], positions, keys)
    assert got.shape == (T, min(topk, T // CSA))
    # queries before the first window closes have no entries; later ones only earlier windows
    assert (got[: CSA - 1] == -1).all()
    limit = ((positions + 1) // CSA)[:, None]
    assert ((got < limit) | (got == -1)).all()
    _assert_same_selection(got, expected, scores)
    # ReLU zeros make ties common at these sizes; the comparison above must survive them
    assert (scores == 0).any()


@pytest.mark.parametrize("kind", ["hca", "csa", "indexer"])
@pytest.mark.parametrize("splits", [[13, 24], [1, 2, 5, 29], [30, 1, 1, 5]])
@torch.no_grad()
def test_chunks_split_inside_windows_equal_the_whole_prefix(kind, splits):
    """Entries computed over chunks (splits inside windows; single-token chunks are decode
    steps), carrying only the [2, R, W] state: from the same projections they equal the
    whole prefix's bit for bit; through the layer they equal transformers' own cached
    chunked run (the projections of a 1-row and a 37-row GEMM round differently)."""
    if kind == "hca":
        cfg, gen, hf, ours = _hca(4)
        layer_idx, name = HCA_LAYER, "compressor"
    else:
        cfg, gen, hf, comp, idx = _csa(4, topk=4)
        ours = comp if kind == "csa" else idx.compressor
        layer_idx, name = CSA_LAYER, "compressor" if kind == "csa" else "indexer"
    assert sum(splits) == T
    x, qr = _inputs(gen)
    kv, score = ours.project(x[0])
    whole = compress_prefix(
        kv, score, ours.ape, ours.overlap, ours.norm.weight, ours.eps, ours.inv_freq
    )
    state, layer_state = ours.new_state(), ours.new_state()
    assert state.shape == (2, state_rows(ours.ratio, ours.overlap), ours.width)
    cache = DynamicCache(config=cfg)
    pieces, layer_pieces, start = [], [], 0
    for size in splits:
        end = start + size
        assert size < ours.ratio or start % ours.ratio or end % ours.ratio  # splits a window
        entries, first = compress_chunk(
            kv[start:end], score[start:end], start, state, ours.ape, ours.overlap,
            ours.norm.weight, ours.eps, ours.inv_freq,
        )  # fmt: skip
        assert first == start // ours.ratio and entries.shape[0] == end // ours.ratio - first
        pieces.append(entries)
        layer_pieces.append(ours.chunk_entries(x[0, start:end], start, layer_state)[0])
        hf(x[:, start:end], qr[:, start:end], torch.arange(start, end)[None], cache, layer_idx)
        start = end
    assert torch.equal(torch.cat(pieces), whole)
    _close(torch.cat(layer_pieces), cache.layers[layer_idx].compressed_kv[name][0])


@torch.no_grad()
def test_indexer_decode_after_prefill_matches_transformers():
    """A 30-token prefill then 7 decode steps: each step's selection over the keys committed
    so far (from the carried state) equals transformers' cached indexer, tie-aware."""
    cfg, gen, hf, comp, idx = _csa(5, topk=3)
    x, qr = _inputs(gen)
    state, keys = idx.compressor.new_state(), torch.zeros(0, IDX_DIM)
    cache = DynamicCache(config=cfg)
    for start, end in [(0, 30)] + [(p, p + 1) for p in range(30, T)]:
        positions = torch.arange(start, end)
        new, _ = idx.compressor.chunk_entries(x[0, start:end], start, state)
        keys = torch.cat([keys, new])
        expected = hf.indexer(x[:, start:end], qr[:, start:end], positions[None], cache, CSA_LAYER)
        scores = idx.scores(x[0, start:end], qr[0, start:end], positions, keys)
        got = idx.select(x[0, start:end], qr[0, start:end], positions, keys)
        _assert_same_selection(got, expected[0], scores)
    assert keys.shape[0] == T // CSA
