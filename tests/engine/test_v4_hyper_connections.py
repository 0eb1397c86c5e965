"""DeepSeek-V4's hyper-connections (engine/layers/hyper_connections.py) against transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead on the same random weights.

The engine's ops take the batch-invariant matmuls and elementwise forms (kernels/cpu/
batch_invariant.py: a row's bits do not depend on its batch), so they agree with
transformers to float rounding, not bit for bit; a row computed alone and in a batch
agrees bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.layers.hyper_connections import HyperConnection, HyperHead
from engine.ops.device_layer import DeviceSetup
from engine.ops.hyper_connections import TORCH_HYPER_CONNECTION, TORCH_HYPER_HEAD, sinkhorn

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

D = 64


def _near(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to float rounding of the dtype, relative to the largest value."""
    assert ours.dtype == ref.dtype
    tol = 1e-6 if ref.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * ref.abs().max().item())


def _config(hc_mult: int, iters: int = 20) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=128,
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        hc_mult=hc_mult,
        hc_sinkhorn_iters=iters,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
    )


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random fn, base and scale (transformers initialises base to 0 and scale to 1, which
    would hide a swapped or ignored base / scale)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("fn"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif name.endswith("base"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.25)


def _copy_by_name(ours, theirs, names: dict[str, str]) -> None:
    """Copy transformers' parameters into ours through the hub-name map (ckpt <- HF name)."""
    hf_params = dict(theirs.named_parameters())
    ours_by_ckpt = ours.checkpoint_tensors()
    assert set(ours_by_ckpt) == set(names)
    with torch.no_grad():
        for ckpt, hf_name in names.items():
            ours_by_ckpt[ckpt].copy_(hf_params[hf_name])


def _pair(hc_mult: int, iters: int = 20, seed: int = 0):
    cfg = _config(hc_mult, iters)
    gen = torch.Generator().manual_seed(seed)
    theirs = hf_v4.DeepseekV4HyperConnection(cfg).to(torch.float32)
    _randomise(theirs, gen)
    ours = HyperConnection(D, hc_mult, iters, cfg.hc_eps, cfg.rms_norm_eps, "hc_attn", "layers.2.")
    names = {f"layers.2.hc_attn_{leaf}": leaf for leaf in ("fn", "base", "scale")}
    _copy_by_name(ours, theirs, names)
    return ours, theirs, gen


def _streams(gen, B: int, S: int, C: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(B, S, C, D, generator=gen) * 3).to(dtype)


@pytest.mark.parametrize("hc_mult", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connection_matches_transformers(hc_mult, dtype):
    ours, theirs, gen = _pair(hc_mult, seed=hc_mult)
    B, S = 2, 5
    streams = _streams(gen, B, S, hc_mult, dtype)  # [B, S, C, D]
    y = torch.randn(B, S, D, generator=gen).to(dtype)  # a sublayer's output

    post_ref, comb_ref, x_ref = theirs(streams)
    # DeepseekV4DecoderLayer's mix of a sublayer output back into the streams
    out_ref = post_ref.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb_ref.to(dtype).transpose(-1, -2), streams
    )

    flat = streams.reshape(B * S, hc_mult, D)  # the engine's [T, C, D]
    x, post, comb = ours.pre(flat)
    out = ours.post(y.reshape(B * S, D), flat, post, comb)
    assert x.dtype == dtype and out.dtype == dtype
    assert post.dtype == torch.float32 and comb.dtype == torch.float32
    _near(post, post_ref.reshape(B * S, hc_mult))
    _near(comb, comb_ref.reshape(B * S, hc_mult, hc_mult))
    _near(x, x_ref.reshape(B * S, D))
    _near(out, out_ref.reshape(B * S, hc_mult, D))
    # forward(streams, sublayer) is pre, the sublayer, then post
    seen = []
    out2 = ours(flat, lambda h: seen.append(h) or y.reshape(B * S, D))
    torch.testing.assert_close(seen[0], x, rtol=0, atol=0)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_a_batch(dtype):
    ours, _, gen = _pair(4, seed=3)
    head = HyperHead(D, 4, 1e-6, 1e-6)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    streams = torch.randn(27, 4, D, generator=gen).to(dtype)
    y = torch.randn(27, D, generator=gen).to(dtype)
    x, post, comb = ours.pre(streams)
    out = ours.post(y, streams, post, comb)
    collapsed = head(streams)
    for t in range(27):
        one = slice(t, t + 1)
        x1, post1, comb1 = ours.pre(streams[one])
        assert torch.equal(x1, x[one]) and torch.equal(post1, post[one])
        assert torch.equal(comb1, comb[one])
        assert torch.equal(ours.post(y[one], streams[one], post1, comb1), out[one])
        assert torch.equal(head(streams[one]), collapsed[one])


def test_hyper_connection_keeps_leading_dims():
    ours, theirs, gen = _pair(4, seed=7)
    streams = _streams(gen, 3, 4, 4)
    post_ref, comb_ref, x_ref = theirs(streams)
    x, post, comb = ours.pre(streams)
    _near(x, x_ref)
    _near(post, post_ref)
    _near(comb, comb_ref)


@pytest.mark.parametrize("hc_mult", [4, 3])
def test_hyper_head_matches_transformers(hc_mult):
    cfg = _config(hc_mult)
    gen = torch.Generator().manual_seed(10 + hc_mult)
    theirs = hf_v4.DeepseekV4HyperHead(cfg).to(torch.float32)
    _randomise(theirs, gen)
    ours = HyperHead(D, hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    names = {f"hc_head_{leaf}": f"hc_{leaf}" for leaf in ("fn", "base", "scale")}
    _copy_by_name(ours, theirs, names)
    streams = _streams(gen, 2, 6, hc_mult)
    ref = theirs(streams)  # [B, S, D]
    out = ours(streams.reshape(12, hc_mult, D))
    _near(out, ref.reshape(12, D))
    # the base and scale matter: a head with them reset gives another collapse
    with torch.no_grad():
        ours.hc_head_base.zero_()
    assert not torch.allclose(ours(streams.reshape(12, hc_mult, D)), out, rtol=1e-3)


def test_comb_is_doubly_stochastic():
    ours, _, gen = _pair(4, iters=20, seed=3)
    with torch.no_grad():  # comb logits of spread ~1, where 20 iterations converge
        ours.hc_attn_base[8:] = torch.randn(16, generator=gen) * 0.5
        ours.hc_attn_scale[2] = 0.5
    _, _, comb = ours.pre(_streams(gen, 4, 8, 4).reshape(32, 4, D))  # [T, C, C]
    assert (comb > 0).all()
    ones = torch.ones(32, 4)
    torch.testing.assert_close(comb.sum(dim=-1), ones, rtol=0, atol=1e-5)  # rows
    torch.testing.assert_close(comb.sum(dim=-2), ones, rtol=0, atol=1e-5)  # columns
    # a row softmax alone is only row-stochastic: the normalisation is what makes columns 1
    soft = torch.softmax(torch.randn(32, 4, 4, generator=gen), dim=-1)
    assert (soft.sum(dim=-2) - 1).abs().max() > 1e-2
    fixed = sinkhorn(torch.log(soft), 20, 1e-6)
    torch.testing.assert_close(fixed.sum(dim=-1), ones, rtol=0, atol=1e-5)
    torch.testing.assert_close(fixed.sum(dim=-2), ones, rtol=0, atol=1e-5)


def test_sinkhorn_rows_converge_with_iterations():
    """Columns are normalised last, so they sum to 1 (up to eps / column sum); rows converge
    with the iterations, slowly for peaked logits (20 are not enough at spread 2)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 4, 4, generator=gen) * 2
    ones = torch.ones(256, 4)
    row_err = []
    for iters in (20, 50, 200):
        comb = sinkhorn(logits, iters, 1e-6)
        torch.testing.assert_close(comb.sum(dim=-2), ones, rtol=0, atol=1e-5)
        row_err.append((comb.sum(dim=-1) - 1).abs().max().item())
    assert row_err[0] > row_err[1] > row_err[2]
    assert row_err[1] > 1e-4  # 20 iterations leave peaked rows off: kernels must iterate alike


def test_checkpoint_names_and_cpu_ops():
    hc = HyperConnection(D, 4, 20, 1e-6, 1e-6, "hc_ffn", "mtp.0.")
    shapes = {n: tuple(p.shape) for n, p in hc.checkpoint_tensors().items()}
    assert shapes == {
        "mtp.0.hc_ffn_fn": (24, 4 * D),
        "mtp.0.hc_ffn_base": (24,),
        "mtp.0.hc_ffn_scale": (3,),
    }
    head = HyperHead(D, 4, 1e-6, 1e-6)
    assert {n: tuple(p.shape) for n, p in head.checkpoint_tensors().items()} == {
        "hc_head_fn": (4, 4 * D),
        "hc_head_base": (4,),
        "hc_head_scale": (1,),
    }
    assert all(p.dtype == torch.float32 for p in [*hc.parameters(), *head.parameters()])
    setup = DeviceSetup(torch.device("cpu"), torch.float32, 64)
    hc.prepare(setup)
    head.prepare(setup)
    assert hc.ops is TORCH_HYPER_CONNECTION and head.ops is TORCH_HYPER_HEAD
