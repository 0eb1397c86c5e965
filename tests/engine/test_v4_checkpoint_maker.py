"""The DeepSeek-V4 random-checkpoint maker (`make-random --arch deepseek_v4`).

- The v4-flash preset is the published config.json; `--layers N` keeps its shapes (the
  plan only: no full-size tensors are drawn here).
- The tiny preset in bf16, fp8 + mxfp4 and fp8 + fp8: exactly `hub_tensor_specs` of the
  written config (names, order, shapes, torch dtypes read back from the shards), the config
  round-trips, every tensor is random (no zero-initialised sinks, ape, biases, tid2eid).
- The quantized checkpoints hold the bf16 one's weights: MXFP4 nibbles and FP8 codes,
  decoded here with MODELS.md's LUT and block rule written independently of kernels/formats,
  are within each format's rounding error of the bf16 weights; unquantized tensors equal.
- The bf16 tiny checkpoint runs in transformers' DeepseekV4ForCausalLM: finite logits,
  more than 2 experts per layer, the SwiGLU clamp binding on some pre-activations.
- The CLI, and its refusals (a V3 preset with arch v4 and back, a format the hub lacks).
"""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from engine.checkpoint_maker import make_random_checkpoint
from engine.deepseek_v4_checkpoint import plan
from engine.models.deepseek_v4_config import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4ModelConfig,
    layer_type_of,
)
from engine.models.deepseek_v4_names import E8M0, FP8, hf_state_from_hub, hub_tensor_specs

FLASH = Path(__file__).resolve().parent / "data" / "deepseek-v4-flash-config.json"
# MODELS.md section 2: E2M1 code -> value, bit 3 the sign
LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
SEED = 7


def read(path: Path) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """(config.json, tensors, names in index order), each tensor read from the shard the
    index names."""
    config = json.loads((path / "config.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                assert index["weight_map"][name] == shard
                tensors[name] = f.get_tensor(name)
    return config, tensors, list(index["weight_map"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4")
    made = {}
    for dense, experts in (("bf16", "bf16"), ("fp8", "mxfp4"), ("fp8", "fp8")):
        path = make_random_checkpoint(
            root / f"{dense}-{experts}",
            arch="deepseek_v4",
            preset="tiny",
            dense_dtype=dense,
            expert_dtype=experts,
            seed=SEED,
            device="cpu",
            shard_bytes=200_000,
        )
        made[experts] = read(path)
    return made


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scale.view(torch.uint8).double() - 127)


def test_flash_preset_is_the_published_config():
    published = json.loads(FLASH.read_text())
    config, specs = plan("v4-flash", None, "fp8", "mxfp4")
    differ = {k for k in published if config.get(k) != published[k]}
    # the maker's byte tokenizer's ids; the experts' format named (absent means fp4)
    assert differ == {"bos_token_id", "eos_token_id", "transformers_version", "quantization_config"}
    assert config["quantization_config"] == {
        **published["quantization_config"],
        "expert_dtype": "fp4",
    }
    real = DeepseekV4ModelConfig.from_dict(published)
    assert DeepseekV4ModelConfig.from_dict(config) == real
    assert specs == hub_tensor_specs(real)
    bf16, _ = plan("v4-flash", None, "bf16", "bf16")
    assert "quantization_config" not in bf16


def test_flash_with_fewer_layers_keeps_the_real_shapes():
    real = hub_tensor_specs(DeepseekV4ModelConfig.from_dict(json.loads(FLASH.read_text())))
    config, specs = plan("v4-flash", 4, "fp8", "mxfp4")
    assert config["num_hidden_layers"] == 4 and config["num_hash_layers"] == 3
    assert config["compress_ratios"] == [0, 0, 4, 128, 0]  # + the MTP entry
    assert [n for n in specs if not n.startswith("mtp.")] == [
        n
        for n in real
        if not n.startswith("mtp.") and (not n.startswith("layers.") or int(n.split(".")[1]) < 4)
    ]
    assert all(specs[n] == real[n] for n in specs)  # MTP included: its shapes are a layer's
    two, specs2 = plan("v4-flash", 2, "bf16", "bf16")
    assert two["compress_ratios"] == [0, 0, 0] and two["num_hash_layers"] == 2
    assert specs2["layers.1.ffn.gate.tid2eid"].shape == (129280, 6)
    assert specs2["layers.1.ffn.experts.255.w2.weight"].dtype == torch.bfloat16
    no_mtp, specs3 = plan("v4-flash", 2, "bf16", "bf16", mtp=False)
    assert no_mtp["compress_ratios"] == [0, 0] and no_mtp["num_nextn_predict_layers"] == 0
    assert not any(n.startswith("mtp.") for n in specs3)
    with pytest.raises(ValueError, match="1..43"):
        plan("v4-flash", 44)


@pytest.mark.parametrize("experts", ["bf16", "mxfp4", "fp8"])
def test_tiny_holds_exactly_the_hub_tensors(tiny, experts):
    config, tensors, order = tiny[experts]
    cfg = DeepseekV4ModelConfig.from_dict(config)
    specs = hub_tensor_specs(cfg)
    assert order == list(specs)
    assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == {
        n: (s.shape, s.dtype) for n, s in specs.items()
    }
    dtypes = {t.dtype for t in tensors.values()}
    if experts == "bf16":
        assert cfg.quantization_config is None and FP8 not in dtypes
    else:
        assert {FP8, E8M0} <= dtypes and cfg.quantization_config.scale_fmt == "ue8m0"
        assert cfg.quantization_config.expert_dtype == {"mxfp4": "fp4", "fp8": "fp8"}[experts]
        assert (torch.int8 in dtypes) == (experts == "mxfp4")


def test_tiny_config_round_trips(tiny):
    config, _, _ = tiny["mxfp4"]
    cfg = DeepseekV4ModelConfig.from_dict(config)
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert [cfg.layer_type(i) for i in range(5)] == [SLIDING, CSA, HCA, CSA, SLIDING]
    assert [cfg.is_hash_layer(i) for i in range(4)] == [True, False, False, False]
    assert cfg.rope_scaling.factor * cfg.rope_scaling.original_max_position_embeddings == (
        cfg.max_position_embeddings
    )
    assert cfg.index_topk >= cfg.max_position_embeddings // 4
    assert cfg.vocab_size >= 258  # the byte tokenizer's 256 bytes + BOS + EOS
    assert DeepseekV4ModelConfig.from_dict(json.loads(json.dumps(config))) == cfg


def test_every_tensor_is_random(tiny):
    config, tensors, _ = tiny["bf16"]
    K, E = config["num_experts_per_tok"], config["n_routed_experts"]
    for name, t in tensors.items():
        if name.endswith("tid2eid"):
            assert t.min() >= 0 and t.max() < E
            assert (t.sort(dim=1).values.diff(dim=1) > 0).all(), "experts repeat in a row"
            assert t.unique().numel() == E and t.shape[1] == K
            continue
        t = t.double()
        assert (t == 0).double().mean() < 0.01, name
        assert t.numel() == 1 or t.std() > 0, name
        if name.endswith("norm.weight"):
            assert (t - 1).abs().max() < 0.6, name
        if name.endswith("_scale"):
            assert t.min() >= 0.5 and t.max() <= 1.5, name
    assert (tensors["layers.1.ffn.gate.bias"].abs() > 0).all()
    assert tensors["layers.1.attn.compressor.ape"].std() > 0.2
    assert tensors["layers.0.attn.attn_sink"].std() > 0.3


def test_quantized_and_bf16_checkpoints_share_the_unquantized_tensors(tiny):
    _, plain, _ = tiny["bf16"]
    for experts in ("mxfp4", "fp8"):
        _, quant, _ = tiny[experts]
        same = [n for n, t in quant.items() if t.dtype not in (FP8, E8M0, torch.int8)]
        assert len(same) > 50
        assert [n for n in same if not torch.equal(quant[n], plain[n])] == []


def test_mxfp4_experts_decode_to_the_bf16_weights(tiny):
    _, plain, _ = tiny["bf16"]
    _, quant, _ = tiny["mxfp4"]
    experts = [n for n, t in quant.items() if t.dtype == torch.int8]
    assert len(experts) == 5 * 8 * 3  # 4 layers + MTP, 8 experts, w1 w3 w2
    for name in experts:
        byte = quant[name].view(torch.uint8).long()  # [out, in/2]
        codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(1)  # low nibble = even k
        scale = e8m0(quant[name[: -len("weight")] + "scale"])  # [out, in/32]
        got = LUT.double()[codes] * scale.repeat_interleave(32, dim=1)
        ref = plain[name].double()
        group_max = ref.abs().unflatten(1, (-1, 32)).amax(-1).repeat_interleave(32, dim=1)
        # scale = the power of two with group max / scale in (3, 6]: the grid step near the
        # top is 2 codes = 2 * scale, so the rounding error is at most one scale < max / 3
        assert ((group_max / scale.repeat_interleave(32, dim=1)) <= 6 * (1 + 2**-7)).all()
        assert ((got - ref).abs() <= group_max / 3 + 1e-6).all(), name
        assert torch.corrcoef(torch.stack((got.flatten(), ref.flatten())))[0, 1] > 0.95


def test_fp8_linears_decode_to_the_bf16_weights(tiny):
    _, plain, _ = tiny["bf16"]
    for experts in ("mxfp4", "fp8"):
        _, quant, _ = tiny[experts]
        linears = [n for n, t in quant.items() if t.dtype == FP8]
        assert any(".experts." in n for n in linears) == (experts == "fp8")
        assert "layers.1.attn.indexer.wq_b.weight" in linears and "mtp.0.e_proj.weight" in linears
        for name in linears:
            out_f, in_f = quant[name].shape
            block_scale = e8m0(
                quant[name[: -len("weight")] + "scale"]
            )  # [ceil(o/128), ceil(i/128)]
            scale = block_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_f, :in_f]
            got = quant[name].double() * scale
            ref = plain[name].double()
            # E4M3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal step 2^-9; the
            # bf16 reference adds its own 2^-9
            bound = ref.abs() * (2**-4 + 2**-8) + scale * 2**-10
            assert ((got - ref).abs() <= bound).all(), name
            amax = ref.abs().max()  # tiny linears fit one block: the smallest power of two
            assert amax / 448 <= block_scale.max() < amax / 224 * (1 + 2**-7), name


def hf_config_of(config: dict):
    """transformers' config for a hub config.json: its legacy `compress_ratios` reader only
    knows the ratios 4 and 128, so the tiny HCA rate (8) goes in through layer_types."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    d = copy.deepcopy(config)  # transformers writes into the rope_scaling dict it is given
    ratios = d.pop("compress_ratios")[: d["num_hidden_layers"]]
    hf_cfg = DeepseekV4Config(
        **d,
        layer_types=[layer_type_of(r) for r in ratios],
        compress_rates={CSA: 4, HCA: next(r for r in ratios if layer_type_of(r) == HCA)},
    )
    hf_cfg._experts_implementation = "eager"
    return hf_cfg


def test_bf16_tiny_runs_in_transformers(tiny, monkeypatch):
    hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    config, tensors, _ = tiny["bf16"]
    cfg = DeepseekV4ModelConfig.from_dict(config)
    hf_cfg = hf_config_of(config)
    assert DeepseekV4ModelConfig.from_transformers(hf_cfg) == cfg
    model = hf.DeepseekV4ForCausalLM(hf_cfg).eval()
    hub = {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()}
    model.load_state_dict(hf_state_from_hub(hub, cfg), strict=True)

    chosen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(
            lambda _m, _in, out, i=i: chosen.__setitem__(i, out[2].flatten())
        )
    clamped = []
    apply_gate = hf.DeepseekV4Experts._apply_gate

    def recording_gate(self, gate_up):
        clamped.append((gate_up.abs() > self.limit).double().mean())
        return apply_gate(self, gate_up)

    monkeypatch.setattr(hf.DeepseekV4Experts, "_apply_gate", recording_gate)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # 40 tokens > sliding window 8: CSA and HCA entries exist
        logits = model(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert sorted(chosen) == [0, 1, 2, 3]
    assert all(chosen[i].unique().numel() > 2 for i in chosen), chosen
    fraction = torch.stack(clamped).mean()
    assert 0 < fraction < 0.25, fraction


def test_cli_make_random_v4(tmp_path):
    from batchgen.cli.models import models

    out = tmp_path / "cli"
    args = ["make-random", "--arch", "deepseek_v4", "--preset", "tiny", "--layers", "2"]
    args += ["--dense-dtype", "fp8", "--expert-dtype", "mxfp4", "--device", "cpu", str(out)]
    result = CliRunner().invoke(models, args)
    assert result.exit_code == 0, result.output
    config, tensors, _ = read(out)
    assert config["model_type"] == "deepseek_v4" and config["compress_ratios"] == [0, 4, 0]
    assert config["quantization_config"]["expert_dtype"] == "fp4"
    assert set(tensors) == set(hub_tensor_specs(DeepseekV4ModelConfig.from_dict(config)))
    refusals = {
        ("--arch", "deepseek_v4", "--preset", "moonlight-16b-a3b"): "deepseek_v3 preset",
        ("--arch", "deepseek_v3", "--preset", "v4-flash"): "deepseek_v4 preset",
        ("--arch", "deepseek_v4", "--expert-dtype", "mxfp4"): "fp8 dense \\+ mxfp4",
    }
    for i, (options, message) in enumerate(refusals.items()):
        bad = CliRunner().invoke(models, ["make-random", *options, str(tmp_path / f"x{i}")])
        assert bad.exit_code != 0
        assert re.search(message, bad.output), bad.output
        assert not (tmp_path / f"x{i}").exists()
