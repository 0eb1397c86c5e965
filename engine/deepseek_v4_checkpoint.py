"""Random-weight DeepSeek-V4 checkpoints in the hub's layout and formats, for tests and
benchmarks (`batchgen models make-random --arch deepseek_v4`). Nobody downloads weights.

Writes config.json in the hub's spelling (`compress_ratios` with the MTP entry,
`num_hash_layers`, `rope_scaling`, `quantization_config` with `scale_fmt: ue8m0`), sharded
safetensors with model.safetensors.index.json holding exactly `hub_tensor_specs` (names,
shapes, dtypes: FP8 E4M3 + E8M0 `.scale` per 128 x 128 block, MXFP4 experts as int8 + E8M0
`.scale` per 32 inputs), generation_config.json and the byte-level tokenizer. The tensors
come from one stream, `hub_tensors`: make-random writes it, the in-memory `random:` model
source (engine/loader/random_source.py) hands it to the loader.

Weights: each tensor is drawn from its own generator seeded by (seed, hub name), so the
bf16 and the quantized checkpoints of one seed hold the same weights before quantization.
Every tensor is random, the ones transformers initialises to zeros or ones included
(sinks, `ape`, router bias, `tid2eid`, mHC base and scale), so a test on these weights
exercises them. Scales, chosen so activations stay O(1) through the layers:
- linears (the router and the compressors' projections included) ~ N(0, 1/fan_in);
- norms ~ 1 + N(0, 0.1^2); embeddings ~ N(0, 1); router bias ~ N(0, 0.1^2);
- attention sinks ~ N(0, 1); compressor `ape` ~ N(0, 0.5^2);
- mHC `fn` ~ N(0, 1/(C*D)): the mixes of a unit-RMS stream are then ~ N(0, 1), so `pre`,
  `post` and the Sinkhorn `comb` vary with the token without saturating; `base` ~
  N(0, 0.5^2); `scale` ~ 0.5 + U(0, 1);
- `tid2eid`: num_experts_per_tok distinct experts per token, uniformly at random.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.checkpoint_files import (
    BOS_ID,
    DEFAULT_SHARD_BYTES,
    EOS_ID,
    draw,
    resolve_device,
    seeded_generator,
    write_checkpoint,
)
from engine.models.deepseek_v4_config import MTP_COMPRESS_RATIO, DeepseekV4ModelConfig
from engine.models.deepseek_v4_names import E8M0, FP8, TensorSpec, hub_tensor_specs
from kernels.formats.fp8 import quantize_fp8_block
from kernels.formats.mxfp4 import quantize_mxfp4

# Sources of the preset numbers:
# - v4-flash: deepseek-ai/DeepSeek-V4-Flash's config.json as published (a copy is
#   tests/engine/data/deepseek-v4-flash-config.json; the test checks this dict against it).
#   Its quantization_config follows --dense-dtype / --expert-dtype; bos / eos are the
#   maker's byte tokenizer's.
# - tiny: small enough for CPU tests with every feature on: sliding, CSA (4) and HCA (8)
#   layers, a hash-routed layer, YaRN on the compressed layers, an MTP layer, dims that
#   suit MXFP4 (inputs x32), index_topk >= max_position_embeddings / 4 (every committed CSA
#   entry selected, so indexer ties cannot change a test's logits), swiglu_limit 2 (expert
#   pre-activations are ~N(0, 1), so the clamp binds on a few per cent of them), and
#   max_position_embeddings = YaRN factor x original (transformers warns otherwise).
_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [MTP_COMPRESS_RATIO]
PRESETS: dict[str, dict] = {
    "tiny": {
        "vocab_size": 258,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "compress_ratios": [0, 4, 8, 4, MTP_COMPRESS_RATIO],
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 64,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4,
            "original_max_position_embeddings": 64,
            "type": "yarn",
        },
        "max_position_embeddings": 256,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 2.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "rms_norm_eps": 1e-06,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
    },
    "v4-flash": {
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "compress_ratios": _FLASH_RATIOS,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
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
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "num_hash_layers": 3,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "rms_norm_eps": 1e-06,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
    },
}
# (dense, experts): the formats the hub ships (bf16 everything is the dequantized form)
FORMATS = (("bf16", "bf16"), ("fp8", "mxfp4"), ("fp8", "fp8"))
_EXPERT_DTYPE_KEY = {"mxfp4": "fp4", "fp8": "fp8"}  # quantization_config.expert_dtype
HC_BASE_STD = 0.5
APE_STD = 0.5
ROUTER_BIAS_STD = 0.1
NORM_STD = 0.1


def make_random_v4_checkpoint(
    out: str | Path,
    *,
    preset: str = "tiny",
    layers: int | None = None,
    dense_dtype: str = "bf16",
    expert_dtype: str = "bf16",
    seed: int = 0,
    device: str = "auto",
    mtp: bool = True,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the checkpoint into `out` (created; must be empty if it exists) and return it."""
    config = build_config(preset, layers, dense_dtype, expert_dtype, mtp)
    tensors = hub_tensors(config, seed, resolve_device(device))
    return write_checkpoint(out, config, tensors, shard_bytes)


def hub_tensors(
    config: dict, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint `config` describes, drawn on `device` one at a time in
    checkpoint order: what make-random writes and the `random:` source streams. Each is
    checked against the hub's name, shape and dtype, and the stream against the whole
    layout, so neither consumer can hold a tensor the hub's checkpoint would not."""
    cfg = DeepseekV4ModelConfig.from_dict(config)
    specs = hub_tensor_specs(cfg, dtype=torch.bfloat16)
    drawn = []
    for name, tensor in random_tensors(cfg, specs, seed, device):
        spec = specs.get(name)
        if spec is None or (tuple(tensor.shape), tensor.dtype) != (spec.shape, spec.dtype):
            raise RuntimeError(
                f"tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} is not the hub's {spec}"
            )
        drawn.append(name)
        yield name, tensor
    if drawn != list(specs):
        raise RuntimeError(f"drew {drawn} tensors, the hub layout has {len(specs)}")


def plan(
    preset: str,
    layers: int | None = None,
    dense_dtype: str = "bf16",
    expert_dtype: str = "bf16",
    mtp: bool = True,
) -> tuple[dict, dict[str, TensorSpec]]:
    """The config.json (hub spelling) and every tensor it implies, without drawing any."""
    config = build_config(preset, layers, dense_dtype, expert_dtype, mtp)
    specs = hub_tensor_specs(DeepseekV4ModelConfig.from_dict(config), dtype=torch.bfloat16)
    return config, specs


def build_config(
    preset: str, layers: int | None, dense_dtype: str, expert_dtype: str, mtp: bool
) -> dict:
    """The hub config.json of `preset` with `layers` layers (real shapes; the first `layers`
    compress ratios and hash layers), in the given formats."""
    if preset not in PRESETS:
        raise ValueError(f"unknown deepseek_v4 preset {preset!r}; choose one of {sorted(PRESETS)}")
    if (dense_dtype, expert_dtype) not in FORMATS:
        combos = ", ".join(f"{d} dense + {e} experts" for d, e in FORMATS)
        raise ValueError(
            f"deepseek_v4 checkpoints come as {combos}; got {dense_dtype} dense + "
            f"{expert_dtype} experts"
        )
    shape = copy.deepcopy(PRESETS[preset])
    full = shape["num_hidden_layers"]
    if layers is not None and not 1 <= layers <= full:
        raise ValueError(f"layers must be in 1..{full} for preset {preset!r}, got {layers}")
    n = full if layers is None else layers
    n_mtp = 1 if mtp else 0
    shape["num_hidden_layers"] = n
    shape["compress_ratios"] = shape["compress_ratios"][:n] + [MTP_COMPRESS_RATIO] * n_mtp
    shape["num_hash_layers"] = min(shape["num_hash_layers"], n)
    shape["num_nextn_predict_layers"] = n_mtp
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **shape,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "batchgen_random_preset": preset,
    }
    if dense_dtype == "fp8":
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            "expert_dtype": _EXPERT_DTYPE_KEY[expert_dtype],
        }
    return config


def random_tensors(
    cfg: DeepseekV4ModelConfig, specs: dict[str, TensorSpec], seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stored tensors in checkpoint order; a quantized weight is followed by its scale."""
    floats = hub_tensor_specs(cfg, dtype=torch.float32, quantized=False)
    block = cfg.quantization_config.weight_block_size if cfg.quantization_config else None
    for name, spec in specs.items():
        if name.endswith(".scale"):
            continue  # yielded with its weight
        value = _value(name, floats[name].shape, cfg, seed, device)
        scale_name = name[: -len("weight")] + "scale"
        if spec.dtype == FP8:
            if block[0] != block[1]:
                raise ValueError(
                    f"weight_block_size {block}: the FP8 quantizer takes square blocks"
                )
            codes, scale = quantize_fp8_block(value, "e8m0", block[0])
            yield name, codes
            yield scale_name, scale.view(E8M0)
        elif spec.dtype == torch.int8:  # MXFP4: two E2M1 codes per byte, low nibble even k
            packed, scale = quantize_mxfp4(value)
            yield name, packed.view(torch.int8)
            yield scale_name, scale.view(E8M0)
        else:
            yield name, value.to(spec.dtype)


def _value(
    name: str, shape: tuple[int, ...], cfg: DeepseekV4ModelConfig, seed: int, device
) -> torch.Tensor:
    """Tensor `name`'s unquantized values (float32; int64 for `tid2eid`)."""
    if name.endswith(".tid2eid"):
        gen = seeded_generator(seed, name, device)
        order = torch.rand((shape[0], cfg.n_routed_experts), generator=gen, device=device)
        return order.argsort(dim=1)[:, : shape[1]]  # [V, K] distinct experts per token
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return draw(name, shape, 1 / math.sqrt(shape[1]), 0.0, seed, device)
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return draw(name, shape, HC_BASE_STD, 0.0, seed, device)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        gen = seeded_generator(seed, name, device)
        return torch.rand(shape, generator=gen, device=device) + 0.5
    if leaf == "attn_sink":
        return draw(name, shape, 1.0, 0.0, seed, device)
    if leaf == "ape":
        return draw(name, shape, APE_STD, 0.0, seed, device)
    if name.endswith(".gate.bias"):
        return draw(name, shape, ROUTER_BIAS_STD, 0.0, seed, device)
    if name.endswith("norm.weight"):
        return draw(name, shape, NORM_STD, 1.0, seed, device)
    if name == "embed.weight":
        return draw(name, shape, 1.0, 0.0, seed, device)
    if name.endswith(".weight") and len(shape) == 2:
        return draw(name, shape, 1 / math.sqrt(shape[1]), 0.0, seed, device)
    raise ValueError(f"no random-init rule for DeepSeek-V4 tensor {name!r}")
