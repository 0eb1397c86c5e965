"""DeepSeek-V4's config and tensor names against transformers 5.24.

- The hub's config.json and transformers' DeepseekV4Config with the same values give equal
  `DeepseekV4ModelConfig`s (the real V4-Flash config and a tiny one); bad keys are refused
  by name.
- Every name of a tiny `DeepseekV4ForCausalLM.state_dict()` and of its `save_pretrained`
  files maps to a hub name and back, none left over, with the shapes the mapping predicts;
  a hub-layout file written by the mapping loads in transformers (its own conversion
  mapping) to the same tensors; weights carried hub -> transformers by the mapping and
  read from save_pretrained's files by it give transformers' logits exactly
  (random values everywhere, the zero-initialised sinks, position biases, router biases, mHC
  bases and tid2eid included), and swapping w1 / w3 (gate / up) in the mapping does not.
- The quantized hub layout of the real config: the tensor table's shapes and dtypes, and
  the checkpoint's size (MODELS.md section 4: 159.6 GB, 156.0 GB without MTP).
"""

import json
import math
from pathlib import Path

import pytest
import torch

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
)

from engine.models.deepseek_v4_config import (  # noqa: E402
    CSA,
    HCA,
    SLIDING,
    ConfigError,
    DeepseekV4ModelConfig,
)
from engine.models.deepseek_v4_names import (  # noqa: E402
    E8M0,
    FP8,
    from_layout,
    hf_place,
    hf_state_from_hub,
    hf_tensor_shapes,
    hub_names_of_hf,
    hub_state_from_hf,
    hub_tensor_specs,
    to_layout,
)

# The hub's own config.json of DeepSeek-V4-Flash, as published.
FLASH = Path(__file__).resolve().parent / "data" / "deepseek-v4-flash-config.json"
YARN = {"factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


def tiny_hf_config() -> DeepseekV4Config:
    """MODELS.md section 3's tiny config in transformers' spelling, YaRN on the compressed
    layers, plus an HCA layer so each kind appears twice but sliding."""
    cfg = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
        partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
        sliding_window=8, o_groups=2, o_lora_rank=16, max_position_embeddings=128,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], index_n_heads=2,
        index_head_dim=16, index_topk=64,
        compress_rates={CSA: 4, HCA: 8},
        rope_parameters={"rope_type": "yarn", **YARN}, compress_rope_theta=40000.0,
        swiglu_limit=3.0,
    )  # fmt: skip
    cfg._experts_implementation = "eager"
    return cfg


def tiny_hub_dict() -> dict:
    """The same model in the hub's spelling (DeepSeek's config.json keys)."""
    return {
        "model_type": "deepseek_v4", "vocab_size": 128, "hidden_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
        "num_experts_per_tok": 2, "n_routed_experts": 8, "n_shared_experts": 1,
        "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16, "max_position_embeddings": 128,
        "compress_ratios": [0, 4, 8, 4, 0], "num_hash_layers": 2, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": 64, "rope_theta": 10000,
        "compress_rope_theta": 40000, "rope_scaling": {"type": "yarn", **YARN},
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 3.0, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
    }  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    """A tiny transformers model with random values in every tensor, and its config."""
    torch.manual_seed(0)
    hf_cfg = tiny_hf_config()
    model = hf.DeepseekV4ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):  # distinct experts per token, not all expert 0
                t.copy_(torch.rand(t.shape[0], hf_cfg.n_routed_experts).argsort(1)[:, : t.shape[1]])
            elif name.endswith(("norm.weight", "scale")):
                t.copy_(1 + 0.2 * torch.randn_like(t))
            else:
                t.copy_(torch.randn_like(t) / math.sqrt(t.shape[-1]))
    return model, DeepseekV4ModelConfig.from_transformers(hf_cfg)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def fresh_model_from_hub(hub: dict[str, torch.Tensor], cfg) -> torch.nn.Module:
    model = hf.DeepseekV4ForCausalLM(tiny_hf_config()).eval()
    model.load_state_dict(hf_state_from_hub(hub, cfg), strict=True)
    return model


def test_flash_config_hub_and_transformers_agree():
    d = json.loads(FLASH.read_text())
    hub = DeepseekV4ModelConfig.from_dict(d)
    hf_cfg = DeepseekV4Config(**d)
    assert DeepseekV4ModelConfig.from_transformers(hf_cfg) == hub
    # transformers' own config.json (what save_pretrained writes), read back as a dict
    assert DeepseekV4ModelConfig.from_dict(json.loads(hf_cfg.to_json_string())) == hub
    kinds = [hub.layer_type(i) for i in range(hub.num_hidden_layers)]
    assert (kinds.count(SLIDING), kinds.count(CSA), kinds.count(HCA)) == (2, 21, 20)
    assert hub.layer_type(43) == SLIDING  # the MTP layer
    assert [hub.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert hub.rope_scaling.factor == 16 and hub.compress_rope_theta == 160000
    assert hub.quantization_config.weight_block_size == (128, 128)


def test_tiny_config_hub_and_transformers_agree():
    from_hf = DeepseekV4ModelConfig.from_transformers(tiny_hf_config())
    assert DeepseekV4ModelConfig.from_dict(tiny_hub_dict()) == from_hf
    assert from_hf.compress_ratios == (0, 4, 8, 4, 0)
    assert from_hf.quantization_config is None and from_hf.qk_rope_head_dim == 8


def _set(d: dict, path: str, value) -> dict:
    d = json.loads(json.dumps(d))
    *keys, last = path.split(".")
    node = d
    for k in keys:
        node = node[k]
    if value is _DEL:
        del node[last]
    else:
        node[last] = value
    return d


_DEL = object()
_FLASH_DICT = json.loads(FLASH.read_text())


@pytest.mark.parametrize(
    "path, value, named",
    [
        ("hidden_size", _DEL, "hidden_size"),
        ("hidden_size", "4096", "hidden_size"),
        ("compress_ratios", _DEL, "compress_ratios"),  # e.g. spelt compress_ratio
        ("compress_ratios", [0, 4, 128], "compress_ratios"),
        ("num_hash_layers", _DEL, "num_hash_layers"),
        ("num_key_value_heads", 8, "num_key_value_heads"),
        ("tie_word_embeddings", True, "tie_word_embeddings"),
        ("quantization_config.scale_fmt", "float32", "scale_fmt"),
        ("rope_scaling.type", "linear", "rope_scaling"),
        ("rope_scaling.factor", _DEL, "factor"),
        ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
    ],
)
def test_bad_hub_key_is_refused_by_name(path, value, named):
    with pytest.raises(ConfigError, match=named):
        DeepseekV4ModelConfig.from_dict(_set(_FLASH_DICT, path, value))


@pytest.mark.parametrize(
    "path, value, named",
    [
        (f"compress_rates.{CSA}", 8, "compress_rates"),
        ("layer_types", [SLIDING, CSA, "full_attention", CSA], "layer_types"),
        ("mlp_layer_types", ["moe", "hash_moe", "moe", "moe"], "mlp_layer_types"),
        ("rope_parameters.compress.attention_factor", 1.25, "attention_factor"),
        ("rope_parameters.main", _DEL, "main"),
    ],
)
def test_bad_transformers_key_is_refused_by_name(path, value, named):
    d = json.loads(tiny_hf_config().to_json_string())
    with pytest.raises(ConfigError, match=named):
        DeepseekV4ModelConfig.from_dict(_set(d, path, value))


def test_state_dict_names_map_to_hub_and_back(tiny):
    model, cfg = tiny
    state = model.state_dict()
    specs = hub_tensor_specs(cfg, dtype=torch.float32)
    assert hf_tensor_shapes(cfg) == {k: tuple(v.shape) for k, v in state.items()}
    seen = []
    for name, tensor in state.items():
        for hub, place in hub_names_of_hf(name, cfg):
            assert hf_place(hub, cfg) == place and place.name == name
            part = place.take(tensor)
            assert (tuple(part.shape), part.dtype) == (specs[hub].shape, specs[hub].dtype), hub
            seen.append(hub)
    assert len(seen) == len(set(seen))
    # every hub tensor but the MTP layer's (transformers has none) is held, once
    assert set(seen) == {n for n in specs if not n.startswith("mtp.")}
    assert all(hf_place(n, cfg) is None for n in specs if n.startswith("mtp."))


def test_hub_round_trip_gives_transformers_logits(tiny):
    model, cfg = tiny
    ids = torch.randint(0, cfg.vocab_size, (2, 20))  # 20 > sliding 8: HCA (8) entries exist
    want = logits(model, ids)
    hub = {k: v.clone() for k, v in hub_state_from_hf(model.state_dict(), cfg).items()}
    torch.testing.assert_close(logits(fresh_model_from_hub(hub, cfg), ids), want, rtol=0, atol=0)
    # mutation: gate and up exchanged (w1 <-> w3, as if the stacking order were reversed)
    swapped = dict(hub)
    for name in hub:
        if ".experts." in name and name.endswith(".w1.weight"):
            w3 = name.replace(".w1.", ".w3.")
            swapped[name], swapped[w3] = hub[w3], hub[name]
    got = logits(fresh_model_from_hub(swapped, cfg), ids)
    assert (got - want).abs().max() > 1e-3


def test_hub_layout_loads_in_transformers(tiny, tmp_path):
    """Tensors written under the mapping's hub names, read by transformers' own conversion
    mapping (from_pretrained of the hub layout), are transformers' tensors."""
    model, cfg = tiny
    hub = {k: v.contiguous() for k, v in hub_state_from_hf(model.state_dict(), cfg).items()}
    save_file(hub, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    tiny_hf_config().save_pretrained(tmp_path)
    loaded = hf.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    want, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


def test_save_pretrained_names_map_to_hub_and_back(tiny, tmp_path):
    model, cfg = tiny
    model.save_pretrained(tmp_path)
    specs = hub_tensor_specs(cfg, dtype=torch.float32, mtp=False)
    hub = {}
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        for name in names:
            hub_name = from_layout(name, "hf_saved", cfg)
            assert to_layout(hub_name, "hf_saved", cfg) == name
            hub[hub_name] = f.get_tensor(name)
            assert tuple(hub[hub_name].shape) == specs[hub_name].shape, name
    assert hub.keys() == specs.keys()
    # the unfaithful inverse: the attention's kv_norm is written as attn.norm
    assert to_layout("layers.1.attn.kv_norm.weight", "hf_saved", cfg) == (
        "model.layers.1.attn.norm.weight"
    )
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    want = logits(model, ids)
    torch.testing.assert_close(logits(fresh_model_from_hub(hub, cfg), ids), want, rtol=0, atol=0)


def test_unknown_names_are_refused(tiny):
    _, cfg = tiny
    with pytest.raises(KeyError, match="compressor"):
        hf_place("layers.0.attn.compressor.wkv.weight", cfg)  # layer 0 is sliding-only
    with pytest.raises(KeyError, match="tid2eid"):
        hf_place("layers.2.ffn.gate.tid2eid", cfg)  # layer 2 is a learned-bias layer
    with pytest.raises(KeyError):
        hub_names_of_hf("model.layers.0.self_attn.wq_a.weight", cfg)
    with pytest.raises(KeyError):
        from_layout("layers.0.attn.kv_norm.weight", "hf_saved", cfg)
    assert to_layout("layers.1.attn.wq_a.scale", "hf_saved", cfg) is None


def test_flash_quantized_layout():
    cfg = DeepseekV4ModelConfig.from_dict(json.loads(FLASH.read_text()))
    specs = hub_tensor_specs(cfg)
    want = {  # MODELS.md section 2's tensor table
        "layers.2.attn.wq_b.weight": ((32768, 1024), FP8),
        "layers.2.attn.wq_b.scale": ((256, 8), E8M0),
        "layers.2.attn.wo_a.weight": ((8192, 4096), FP8),
        "layers.2.attn.attn_sink": ((64,), torch.float32),
        "layers.2.attn.compressor.wkv.weight": ((1024, 4096), torch.bfloat16),
        "layers.2.attn.compressor.ape": ((4, 1024), torch.float32),
        "layers.3.attn.compressor.ape": ((128, 512), torch.float32),
        "layers.2.attn.indexer.wq_b.scale": ((64, 8), E8M0),
        "layers.2.attn.indexer.compressor.ape": ((4, 256), torch.float32),
        "layers.0.ffn.gate.tid2eid": ((129280, 6), torch.int64),
        "layers.3.ffn.gate.bias": ((256,), torch.float32),
        "layers.3.ffn.experts.255.w1.weight": ((2048, 2048), torch.int8),
        "layers.3.ffn.experts.255.w1.scale": ((2048, 128), E8M0),
        "layers.3.ffn.experts.0.w2.weight": ((4096, 1024), torch.int8),
        "layers.3.ffn.experts.0.w2.scale": ((4096, 64), E8M0),
        "layers.3.ffn.shared_experts.w2.weight": ((4096, 2048), FP8),
        "layers.3.hc_ffn_fn": ((24, 16384), torch.float32),
        "hc_head_fn": ((4, 16384), torch.float32),
        "mtp.0.e_proj.weight": ((4096, 4096), FP8),
        "mtp.0.ffn.gate.bias": ((256,), torch.float32),
    }
    for name, (shape, dtype) in want.items():
        assert (specs[name].shape, specs[name].dtype) == (shape, dtype), name
    for absent in ("layers.0.attn.compressor.ape", "layers.3.attn.indexer.wq_b.weight",
                   "layers.3.ffn.gate.tid2eid", "mtp.0.ffn.gate.tid2eid"):  # fmt: skip
        assert absent not in specs

    def nbytes(s):
        return math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size()

    total = sum(nbytes(s) for s in specs.values())
    main = sum(nbytes(s) for n, s in specs.items() if not n.startswith("mtp."))
    assert round(total / 1e9, 1) == 159.6 and round(main / 1e9, 1) == 156.0
