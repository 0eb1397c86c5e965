"""DeepSeek-V4's sliding-window attention (engine/layers/v4_attention.py) against
transformers' DeepseekV4Attention for a sliding layer, on the same random weights, with
prompts longer than the window."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.layers.v4_attention import V4Attention, v4_rope_parameters
from engine.ops.v4_attention import apply_rope, rope_cos_sin

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402

# the hub name under layers.{i}.attn. -> transformers' name under self_attn.
HUB_TO_HF = {
    "wq_a.weight": "q_a_proj.weight",
    "q_norm.weight": "q_a_norm.weight",
    "wq_b.weight": "q_b_proj.weight",
    "wkv.weight": "kv_proj.weight",
    "kv_norm.weight": "kv_norm.weight",
    "wo_a.weight": "o_a_proj.weight",
    "wo_b.weight": "o_b_proj.weight",
    "attn_sink": "sinks",
}
PREFIX = "layers.0.attn."


def _config(window: int, rope_dim: int = 16, groups: int = 2) -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=24,
        partial_rotary_factor=rope_dim / 32,
        o_groups=groups,
        o_lora_rank=12,
        sliding_window=window,
        layer_types=["sliding_attention"],
        mlp_layer_types=["moe"],
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "eager"
    return cfg


def _pair(cfg: DeepseekV4Config, seed: int):
    gen = torch.Generator().manual_seed(seed)
    theirs = hf_v4.DeepseekV4Attention(cfg, layer_idx=0).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name == "sinks":  # transformers zero-inits them; random sinks are exercised
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    ours = V4Attention(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.sliding_window,
        rms_norm_eps=cfg.rms_norm_eps,
        rope=v4_rope_parameters(cfg.to_dict(), compressed=False),
        max_position_embeddings=cfg.max_position_embeddings,
        prefix=PREFIX,
    )
    hf_params = dict(theirs.named_parameters())
    ours_by_ckpt = ours.checkpoint_tensors()
    assert set(ours_by_ckpt) == {PREFIX + n for n in HUB_TO_HF}
    with torch.no_grad():
        for hub, hf_name in HUB_TO_HF.items():
            ours_by_ckpt[PREFIX + hub].copy_(hf_params[hf_name])
    return ours, theirs, gen


def _reference(theirs, cfg, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention over a whole prompt x [1, T, D], its model's rope and mask."""
    T = x.shape[1]
    position_ids = torch.arange(T)[None]
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    embeddings = {kind: rotary(x, position_ids, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=cfg,
        inputs_embeds=x,
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
    )
    out, _ = theirs(x, embeddings, position_ids, mask)
    return out[0]


def _close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> float:
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= rtol, f"max error {err:.2e} of the largest value"
    return err


@pytest.mark.parametrize(
    ("window", "T", "rope_dim", "groups"),
    [(16, 40, 16, 2), (128, 160, 8, 4)],
)
def test_prompt_matches_transformers(window, T, rope_dim, groups):
    cfg = _config(window, rope_dim, groups)
    ours, theirs, gen = _pair(cfg, seed=window)
    x = torch.randn(1, T, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        ref = _reference(theirs, cfg, x)
        out = ours.prompt_forward(x[0], torch.arange(T))
    err = _close(out, ref)
    print(f"window {window} T {T}: {err:.1e}")


def test_window_ring_read_matches_the_prompt():
    """The last queries, each given only the keys of its own window (what a ring holds, in
    a rotated order), equal the whole prompt's rows: the explicit-keys interface is enough
    for a paged window."""
    cfg = _config(16)
    ours, theirs, gen = _pair(cfg, seed=3)
    T, W = 40, cfg.sliding_window
    x = torch.randn(1, T, cfg.hidden_size, generator=gen)
    positions = torch.arange(T)
    with torch.no_grad():
        ref = _reference(theirs, cfg, x)
        cos, sin = ours.cos_sin(positions)
        kv = ours.key_value(x[0], cos, sin)
        q, _ = ours.query(x[0], cos, sin)
        for t in (W - 1, W, T - 1):
            ring = torch.arange(t - W + 1, t + 1).roll(5)  # slot order != position order
            o = ours.attend(q[t : t + 1], kv[ring], positions[t : t + 1], positions[ring])
            out = ours.output(o, cos[t : t + 1], sin[t : t + 1])
            _close(out[0], ref[t])


@pytest.mark.parametrize(
    "mutation", ["window_plus_one", "no_sink", "no_derotation", "plain_pair_order"]
)
def test_mutations_fail(mutation, monkeypatch):
    """Each of these breaks the match: the window counting the query (W keys, not W + 1),
    the sinks, the output's de-rotation, and the interleaved (not half-split) rope pairs."""
    import engine.layers.v4_attention as layer_mod

    cfg = _config(16)
    ours, theirs, gen = _pair(cfg, seed=7)
    x = torch.randn(1, 40, cfg.hidden_size, generator=gen)
    if mutation == "window_plus_one":
        ours.sliding_window += 1
    elif mutation == "no_sink":
        ours.attn_sink.data.fill_(-torch.inf)
    elif mutation == "no_derotation":
        real = apply_rope
        calls = []

        def rope_but_not_back(x, c, s):
            calls.append(1)
            return x if len(calls) == 3 else real(x, c, s)  # query, key, then output

        monkeypatch.setattr(layer_mod, "apply_rope", rope_but_not_back)
    elif mutation == "plain_pair_order":

        def half_split(x, c, s):
            half = c.shape[-1]
            rope = x[..., -2 * half :]
            perm = torch.cat([torch.arange(0, 2 * half, 2), torch.arange(1, 2 * half, 2)])
            inv = torch.argsort(perm)
            out = apply_rope(torch.cat([x[..., : -2 * half], rope[..., perm]], -1), c, s)
            return torch.cat([out[..., : -2 * half], out[..., -2 * half :][..., inv]], -1)

        monkeypatch.setattr(layer_mod, "apply_rope", half_split)
    with torch.no_grad():
        ref = _reference(theirs, cfg, x)
        out = ours.prompt_forward(x[0], torch.arange(40))
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err > 1e-3, f"{mutation} still matches ({err:.2e})"


def test_rope_frequencies_match_transformers():
    """Sliding layers take the "main" rope (rope_theta), compressed layers the "compress"
    one (compress_rope_theta, YaRN, no attention factor): from transformers' config and
    from the hub's keys alike."""
    hub = {
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "max_position_embeddings": 1048576,
    }
    cfg = DeepseekV4Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=512,
        qk_rope_head_dim=64,
        layer_types=["sliding_attention"],
        mlp_layer_types=["moe"],
        **copy.deepcopy(hub),  # transformers writes rope_theta into the rope_scaling dict
    )
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 127, 4095, 70000])
    x = torch.zeros(1, 1, 1)
    for compressed, kind in ((False, "main"), (True, "compress")):
        cos_ref, sin_ref = rotary(x, positions[None], layer_type=kind)
        for source in (cfg.to_dict(), hub):
            layer = V4Attention(
                hidden_size=64,
                num_attention_heads=4,
                head_dim=512,
                qk_rope_head_dim=64,
                q_lora_rank=16,
                o_groups=8,
                o_lora_rank=8,
                sliding_window=128,
                rms_norm_eps=1e-6,
                rope=v4_rope_parameters(source, compressed),
                max_position_embeddings=source["max_position_embeddings"],
            )
            torch.testing.assert_close(layer.inv_freq, getattr(rotary, f"{kind}_inv_freq"))
            cos, sin = rope_cos_sin(positions, layer.inv_freq)
            torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=0)
            torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=0)
    main = v4_rope_parameters(hub, False)["rope_theta"]
    compress = v4_rope_parameters(hub, True)["rope_theta"]
    assert (main, compress) == (10000, 160000)
