"""Random-weight DeepSeek-V3-family checkpoints in the official layout, for tests and
benchmarks (`batchgen models make-random`). Nobody downloads weights. DeepSeek-V4
(`arch` deepseek_v4) has its own presets and layout: `engine/deepseek_v4_checkpoint.py`.

Writes config.json, sharded safetensors with model.safetensors.index.json (per-expert
tensor names, the MTP layer at model.layers.{num_hidden_layers}), generation_config.json
and a byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json). `RandomCheckpoint`
describes one such model of either arch: make-random writes it, and the in-memory
`random:` model source (engine/loader/random_source.py) streams the same tensors.

Weights: every tensor is drawn from its own generator seeded by (seed, name), so a bf16
and an fp8 / mxfp4 checkpoint with the same seed hold the same weights before
quantization. Linears ~ N(0, 1/fan_in) so activations stay O(1) through many layers;
norms ~ 1 + N(0, 0.1^2); embeddings ~ N(0, 1); router weights ~ N(0, 1/D) and correction
bias ~ N(0, 0.1^2), so routing depends on the data. On CUDA the weights are drawn and
quantized on the GPU. Shards are written one at a time: peak host memory is about one
shard plus one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint_files import (
    BOS_ID,
    DEFAULT_SHARD_BYTES,
    EOS_ID,
    draw,
    resolve_device,
    write_checkpoint,
)
from engine.deepseek_v4_checkpoint import PRESETS as V4_PRESETS
from engine.deepseek_v4_checkpoint import build_config as build_v4_config
from engine.deepseek_v4_checkpoint import hub_tensors
from engine.llama_checkpoint import PRESETS as LLAMA_PRESETS
from engine.llama_checkpoint import build_config as build_llama_config
from engine.llama_checkpoint import llama_tensors
from kernels.formats.fp8 import quantize_fp8_block
from kernels.formats.mxfp4 import quantize_mxfp4

# Sources of the preset numbers:
# - deepseek-v3-671b: transformers' DeepseekV3Config defaults, which equal
#   deepseek-ai/DeepSeek-V3's config.json (see ../shared/MODELS.md section 1), plus the
#   YaRN block of that config.json (factor 40, original 4096, beta 32/1, mscale 1/1).
# - moonlight-16b-a3b: moonshotai/Moonlight-16B-A3B config.json as published (27 layers,
#   1 dense + 26 MoE, 64 routed experts top-6 + 2 shared, kv_lora_rank 512, no q_lora,
#   hidden 2048, 16 heads, moe_intermediate 1408, intermediate 11264, vocab 163840,
#   rope_theta 50000 without scaling, rms_norm_eps 1e-5, routed_scaling_factor 2.446,
#   n_group = topk_group = 1, noaux_tc / sigmoid, max_position_embeddings 8192). Moonlight
#   ships no MTP layer; the maker adds one so MTP can be benchmarked at these shapes.
# - tiny: small enough for CPU tests, with every feature on (q_lora, groups with
#   topk_group < n_group, a dense layer, shared experts) and dims that suit MXFP4 (x32).
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
    ),
    "moonlight-16b-a3b": dict(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        routed_scaling_factor=2.446,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=None,
    ),
    "deepseek-v3-671b": dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        num_experts_per_tok=8,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}
DENSE_DTYPES = ("bf16", "fp8")
EXPERT_DTYPES = ("bf16", "fp8", "mxfp4")
V3_ARCHS = ("deepseek_v3", "DeepseekV3ForCausalLM")
V4_ARCHS = ("deepseek_v4", "DeepseekV4ForCausalLM")
LLAMA_ARCHS = ("llama", "LlamaForCausalLM")
ARCHS = {"deepseek_v3": V3_ARCHS, "deepseek_v4": V4_ARCHS, "llama": LLAMA_ARCHS}
FAMILY_PRESETS = {"deepseek_v3": PRESETS, "deepseek_v4": V4_PRESETS, "llama": LLAMA_PRESETS}


@dataclass(frozen=True)
class RandomCheckpoint:
    """One random-weight model, validated at construction: its config.json (`config`) and
    its tensors in the hub's layout and formats (`tensors`, drawn one at a time). `write`
    puts them in a directory (`batchgen models make-random`); the `random:` model source
    (engine/loader/random_source.py) hands the same stream to the loader, so a model
    loaded from either holds the same weights when drawn on the same device type.
    llama checkpoints are bf16 and have no MTP layer (`mtp` is DeepSeek's)."""

    arch: str = "deepseek_v3"  # a key of ARCHS, or one of its architecture names
    preset: str = "tiny"
    layers: int | None = None
    dense_dtype: str = "bf16"
    expert_dtype: str = "bf16"
    seed: int = 0
    mtp: bool = True

    def __post_init__(self) -> None:
        family = self.family  # raises for an unknown arch
        owners = [f for f, presets in FAMILY_PRESETS.items() if self.preset in presets]
        if self.preset not in FAMILY_PRESETS[family]:
            if owners:
                raise ValueError(
                    f"preset {self.preset!r} is a {' and '.join(owners)} preset (pass --arch "
                    f"{owners[0]}); {family} takes {sorted(FAMILY_PRESETS[family])}"
                )
            raise ValueError(
                f"unknown {family} preset {self.preset!r}; choose one of "
                f"{sorted(FAMILY_PRESETS[family])}"
            )
        if family == "llama" and (self.dense_dtype, self.expert_dtype) != ("bf16", "bf16"):
            raise ValueError(
                f"llama random checkpoints are bf16, got {self.dense_dtype} dense + "
                f"{self.expert_dtype} experts"
            )
        if family == "deepseek_v3":
            if self.dense_dtype not in DENSE_DTYPES:
                raise ValueError(f"dense dtype {self.dense_dtype!r}: choose one of {DENSE_DTYPES}")
            if self.expert_dtype not in EXPERT_DTYPES:
                raise ValueError(
                    f"expert dtype {self.expert_dtype!r}: choose one of {EXPERT_DTYPES}"
                )
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        self.config()  # the family's own checks (V4: formats, layers up to the preset's)

    @property
    def family(self) -> str:
        """deepseek_v3 | deepseek_v4 | llama."""
        for family, names in ARCHS.items():
            if self.arch in names:
                return family
        raise ValueError(
            f"random checkpoints come in arch {', '.join(map(repr, ARCHS))}, got {self.arch!r}"
        )

    def config(self) -> dict:
        """config.json, as written."""
        if self.family == "llama":
            return build_llama_config(self.preset, self.layers)
        build = build_v4_config if self.family == "deepseek_v4" else build_config
        return build(self.preset, self.layers, self.dense_dtype, self.expert_dtype, self.mtp)

    def tensors(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """(hub name, tensor) for every tensor of the checkpoint, in checkpoint order,
        drawn and quantized on `device`; each is dropped by this stream once yielded."""
        config = self.config()
        if self.family == "llama":
            return llama_tensors(config, self.seed, device)
        if self.family == "deepseek_v4":
            return hub_tensors(config, self.seed, device)
        return _tensors(config, self.dense_dtype, self.expert_dtype, self.seed, device)

    def write(
        self, out: str | Path, device: str = "auto", shard_bytes: int = DEFAULT_SHARD_BYTES
    ) -> Path:
        """The checkpoint written into `out` (created; must be empty if it exists)."""
        tensors = self.tensors(resolve_device(device))
        return write_checkpoint(out, self.config(), tensors, shard_bytes)


def make_random_checkpoint(
    out: str | Path,
    *,
    arch: str = "deepseek_v3",
    preset: str = "tiny",
    layers: int | None = None,
    dense_dtype: str = "bf16",
    expert_dtype: str = "bf16",
    seed: int = 0,
    device: str = "auto",
    mtp: bool = True,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the checkpoint into `out` (created; must be empty if it exists) and return it.

    `arch` deepseek_v4 / DeepseekV4ForCausalLM takes `engine.deepseek_v4_checkpoint`'s
    presets and layout, llama `engine.llama_checkpoint`'s."""
    model = RandomCheckpoint(arch, preset, layers, dense_dtype, expert_dtype, seed, mtp)
    return model.write(out, device, shard_bytes)


def build_config(
    preset: str, layers: int | None, dense_dtype: str, expert_dtype: str, mtp: bool
) -> dict:
    shape = dict(PRESETS[preset])
    if layers is not None:
        # Fewer layers, real shapes; keep at least one MoE layer when there are two or more.
        shape["num_hidden_layers"] = layers
        shape["first_k_dense_replace"] = min(shape["first_k_dense_replace"], max(layers - 1, 0))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **shape,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1 if mtp else 0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "batchgen_random_preset": preset,
    }
    if config["rope_scaling"] is None:
        del config["rope_scaling"]
    if dense_dtype == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    if expert_dtype != dense_dtype:
        # DeepSeek-V4's inference config spells the expert format this way.
        config["expert_dtype"] = {"bf16": "bf16", "fp8": "fp8", "mxfp4": "fp4"}[expert_dtype]
        if "quantization_config" in config:
            config["quantization_config"]["expert_dtype"] = config["expert_dtype"]
    return config


def _linear(name, out_f, in_f, fmt, seed, device) -> Iterator[tuple[str, torch.Tensor]]:
    w = draw(f"{name}.weight", (out_f, in_f), 1 / math.sqrt(in_f), 0.0, seed, device)
    if fmt == "fp8":
        codes, scale_inv = quantize_fp8_block(w, "float32")
        yield f"{name}.weight", codes
        yield f"{name}.weight_scale_inv", scale_inv
    elif fmt == "mxfp4":
        packed, scales = quantize_mxfp4(w)
        yield f"{name}.weight", packed
        yield f"{name}.scale", scales
    else:
        yield f"{name}.weight", w.to(torch.bfloat16)


def _norm(name, dim, seed, device):
    yield f"{name}.weight", draw(f"{name}.weight", (dim,), 0.1, 1.0, seed, device).bfloat16()


def _layer(config, index, dense, experts, seed, device) -> Iterator[tuple[str, torch.Tensor]]:
    p = f"model.layers.{index}"
    D, H = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    R, Q = config["kv_lora_rank"], config["q_lora_rank"]
    yield from _norm(f"{p}.input_layernorm", D, seed, device)
    yield from _norm(f"{p}.post_attention_layernorm", D, seed, device)
    a = f"{p}.self_attn"
    if Q:
        yield from _linear(f"{a}.q_a_proj", Q, D, dense, seed, device)
        yield from _norm(f"{a}.q_a_layernorm", Q, seed, device)
        yield from _linear(f"{a}.q_b_proj", H * (nope + rope), Q, dense, seed, device)
    else:
        yield from _linear(f"{a}.q_proj", H * (nope + rope), D, dense, seed, device)
    yield from _linear(f"{a}.kv_a_proj_with_mqa", R + rope, D, dense, seed, device)
    yield from _norm(f"{a}.kv_a_layernorm", R, seed, device)
    yield from _linear(f"{a}.kv_b_proj", H * (nope + v), R, dense, seed, device)
    yield from _linear(f"{a}.o_proj", D, H * v, dense, seed, device)
    m = f"{p}.mlp"
    if index < config["first_k_dense_replace"]:
        inter = config["intermediate_size"]
        yield from _linear(f"{m}.gate_proj", inter, D, dense, seed, device)
        yield from _linear(f"{m}.up_proj", inter, D, dense, seed, device)
        yield from _linear(f"{m}.down_proj", D, inter, dense, seed, device)
        return
    E, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    router = draw(f"{m}.gate.weight", (E, D), 1 / math.sqrt(D), 0.0, seed, device)
    yield f"{m}.gate.weight", router.bfloat16()
    bias_name = f"{m}.gate.e_score_correction_bias"
    yield bias_name, draw(bias_name, (E,), 0.1, 0.0, seed, device)
    for e in range(E):
        x = f"{m}.experts.{e}"
        yield from _linear(f"{x}.gate_proj", inter, D, experts, seed, device)
        yield from _linear(f"{x}.up_proj", inter, D, experts, seed, device)
        yield from _linear(f"{x}.down_proj", D, inter, experts, seed, device)
    shared = inter * config["n_shared_experts"]
    if shared:
        s = f"{m}.shared_experts"
        yield from _linear(f"{s}.gate_proj", shared, D, dense, seed, device)
        yield from _linear(f"{s}.up_proj", shared, D, dense, seed, device)
        yield from _linear(f"{s}.down_proj", D, shared, dense, seed, device)


def _tensors(config, dense_dtype, expert_dtype, seed, device):
    D, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    embed = draw("model.embed_tokens.weight", (V, D), 1.0, 0.0, seed, device).bfloat16()
    yield "model.embed_tokens.weight", embed
    for i in range(L):
        yield from _layer(config, i, dense_dtype, expert_dtype, seed, device)
    yield from _norm("model.norm", D, seed, device)
    yield from _linear("lm_head", V, D, "bf16", seed, device)
    for j in range(config["num_nextn_predict_layers"]):
        p = f"model.layers.{L + j}"
        yield f"{p}.embed_tokens.weight", embed.clone()  # the official checkpoint repeats it
        yield from _norm(f"{p}.enorm", D, seed, device)
        yield from _norm(f"{p}.hnorm", D, seed, device)
        yield from _linear(f"{p}.eh_proj", D, 2 * D, "bf16", seed, device)
        yield from _layer(config, L + j, dense_dtype, expert_dtype, seed, device)
        yield from _norm(f"{p}.shared_head.norm", D, seed, device)
        head = draw("lm_head.weight", (V, D), 1 / math.sqrt(D), 0.0, seed, device)
        yield f"{p}.shared_head.head.weight", head.bfloat16()
