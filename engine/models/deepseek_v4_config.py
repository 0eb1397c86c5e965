"""DeepSeek-V4 model config: one frozen dataclass from either spelling of config.json.

Two spellings describe the same model (MODELS.md section 2):

- the hub's own config.json (DeepSeek's): `compress_ratios` (one entry per layer, then one
  per MTP layer), `num_hash_layers`, `rope_scaling` (YaRN, used by the compressed layers
  only), `compress_rope_theta`, `qk_rope_head_dim`, `quantization_config` with
  `scale_fmt: ue8m0`;
- transformers' `DeepseekV4Config` (its `to_dict()` or the config.json it saves):
  `layer_types` / `compress_rates` instead of `compress_ratios`, `mlp_layer_types` instead
  of `num_hash_layers`, `rope_parameters` {"main", "compress"} instead of `rope_theta` /
  `compress_rope_theta` / `rope_scaling`, `partial_rotary_factor` beside `qk_rope_head_dim`.

`DeepseekV4ModelConfig.from_dict` reads either and gives equal dataclasses. Field names are
the hub's keys. Every key that shapes the model is required; a missing key, a value of the
wrong type or range, or a setting the architecture does not have (a CSA rate other than 4,
biases, tied embeddings, several KV heads) is a `ConfigError` naming the key. Keys that do
not shape the model (`initializer_range`, `architectures`, ...) are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
# The only CSA rate: DeepSeek's reference adds the overlapping windows and the indexer at
# ratio 4 only, transformers at any CSA rate, so other rates would mean two different models.
CSA_RATIO = 4
# DeepSeek's reference builds the MTP block as a sliding-only layer.
MTP_COMPRESS_RATIO = 0


class ConfigError(ValueError):
    """A DeepSeek-V4 config.json key is missing or has a value the model cannot take."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN of the compressed layers (`rope_scaling`), applied without mscale."""

    type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class QuantizationConfig:
    """`quantization_config`: FP8 E4M3 block-scaled linears with E8M0 (`ue8m0`) scales.

    `expert_dtype` is the routed experts' format: "fp4" (MXFP4, two E2M1 per byte, one
    E8M0 scale per 32 inputs) or "fp8" (the dense format). The hub's V4-Flash config.json
    does not name it and ships MXFP4 experts, so absent means "fp4".
    """

    quant_method: str
    fmt: str
    scale_fmt: str
    weight_block_size: tuple[int, int]
    activation_scheme: str
    expert_dtype: str


@dataclass(frozen=True)
class DeepseekV4ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # one per layer, then one per MTP layer: 0 sliding only, 4 CSA, any other > 0 HCA
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_hash_layers: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    max_position_embeddings: int
    quantization_config: QuantizationConfig | None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeepseekV4ModelConfig:
        """From the hub's config.json or transformers' (either spelling, told apart by
        `layer_types`)."""
        return _build(dict(d))

    @classmethod
    def from_transformers(cls, config: Any) -> DeepseekV4ModelConfig:
        """From a transformers `DeepseekV4Config` object (duck-typed: its `to_dict()`)."""
        return _build(config.to_dict())

    def layer_type(self, i: int) -> str:
        """SLIDING, CSA or HCA for layer i (i >= num_hidden_layers: the MTP layers)."""
        return layer_type_of(self.compress_ratios[i])

    def is_hash_layer(self, i: int) -> bool:
        """Layer i routes through `tid2eid[input_ids]` (MTP layers never do)."""
        return i < min(self.num_hash_layers, self.num_hidden_layers)


def layer_type_of(ratio: int) -> str:
    if ratio == 0:
        return SLIDING
    return CSA if ratio == CSA_RATIO else HCA


# Keys whose value is fixed by the architecture the engine builds: value it must have.
_FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
}
_INT_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "hc_mult",
    "hc_sinkhorn_iters",
    "max_position_embeddings",
)
_FLOAT_KEYS = ("routed_scaling_factor", "hc_eps", "rms_norm_eps")


def _require(d: Mapping[str, Any], key: str, where: str = "config.json") -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: DeepSeek-V4 needs key {key!r}")
    return d[key]


def _int(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json {key!r} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"config.json {key!r} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json {key!r} must be a number, got {value!r}")
    if value <= 0:
        raise ConfigError(f"config.json {key!r} must be > 0, got {value}")
    return float(value)


def _build(d: dict[str, Any]) -> DeepseekV4ModelConfig:
    mt = d.get("model_type")
    if mt is not None and mt != "deepseek_v4":
        raise ConfigError(f"config.json 'model_type' must be 'deepseek_v4', got {mt!r}")
    for key, want in _FIXED.items():
        if key in d and d[key] is not None and d[key] != want:
            raise ConfigError(
                f"config.json {key!r} is {d[key]!r}: DeepSeek-V4 in this engine needs {want!r}"
            )
    ints = {k: _int(_require(d, k), k) for k in _INT_KEYS}
    floats = {k: _float(_require(d, k), k) for k in _FLOAT_KEYS}
    n = ints["num_hidden_layers"]
    n_mtp = _int(d.get("num_nextn_predict_layers", 0), "num_nextn_predict_layers", 0)
    if "layer_types" in d:
        schedule = _transformers_schedule(d, n, n_mtp)
    else:
        schedule = _hub_schedule(d, n, n_mtp)
    limit = d.get("swiglu_limit")
    cfg = DeepseekV4ModelConfig(
        **ints,
        **floats,
        **schedule,
        scoring_func=_FIXED["scoring_func"],
        topk_method=d.get("topk_method") or "noaux_tc",
        norm_topk_prob=True,
        swiglu_limit=None if limit is None else _float(limit, "swiglu_limit"),
        num_nextn_predict_layers=n_mtp,
        quantization_config=_quantization(d),
    )
    _check_shapes(cfg)
    return cfg


def _hub_schedule(d: Mapping[str, Any], n: int, n_mtp: int) -> dict[str, Any]:
    ratios = _require(d, "compress_ratios")
    if not isinstance(ratios, (list, tuple)) or len(ratios) not in (n, n + n_mtp):
        raise ConfigError(
            f"config.json 'compress_ratios' must be a list of num_hidden_layers ({n}) or "
            f"num_hidden_layers + num_nextn_predict_layers ({n + n_mtp}) ints, got {ratios!r}"
        )
    ratios = [_int(r, "compress_ratios", 0) for r in ratios]
    ratios += [MTP_COMPRESS_RATIO] * (n + n_mtp - len(ratios))
    if any(r != MTP_COMPRESS_RATIO for r in ratios[n:]):
        raise ConfigError(
            f"config.json 'compress_ratios' MTP entries {ratios[n:]}: the MTP block is "
            "sliding-only (0)"
        )
    theta = _float(_require(d, "rope_theta"), "rope_theta")
    compress_theta = _float(_require(d, "compress_rope_theta"), "compress_rope_theta")
    qk_rope = _int(_require(d, "qk_rope_head_dim"), "qk_rope_head_dim")
    return {
        "compress_ratios": tuple(ratios),
        "num_hash_layers": _int(_require(d, "num_hash_layers"), "num_hash_layers", 0),
        "rope_theta": theta,
        "compress_rope_theta": compress_theta,
        "rope_scaling": _rope_scaling(d.get("rope_scaling"), "rope_scaling"),
        "qk_rope_head_dim": qk_rope,
    }


def _transformers_schedule(d: Mapping[str, Any], n: int, n_mtp: int) -> dict[str, Any]:
    types = _require(d, "layer_types")
    if not isinstance(types, (list, tuple)) or len(types) != n:
        raise ConfigError(
            f"config.json 'layer_types' must list num_hidden_layers ({n}) types, got {types!r}"
        )
    rates = _require(d, "compress_rates")
    ratios = []
    for t in types:
        if t == SLIDING:
            ratios.append(0)
            continue
        if t not in (CSA, HCA):
            raise ConfigError(f"config.json 'layer_types' has unknown type {t!r}")
        rate = _int(_require(rates, t, "config.json 'compress_rates'"), f"compress_rates.{t}")
        if (t == CSA) != (rate == CSA_RATIO):
            raise ConfigError(
                f"config.json 'compress_rates' {t!r} is {rate}: the CSA rate must be "
                f"{CSA_RATIO} and the HCA rate another"
            )
        ratios.append(rate)
    ratios += [MTP_COMPRESS_RATIO] * n_mtp
    mlp = _require(d, "mlp_layer_types")
    mlp = list(mlp) if isinstance(mlp, (list, tuple)) else []
    n_hash = mlp.count("hash_moe")
    if len(mlp) != n or mlp != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
        raise ConfigError(
            f"config.json 'mlp_layer_types' must be num_hidden_layers ({n}) entries, "
            f"'hash_moe' first and then 'moe', got {d['mlp_layer_types']!r}"
        )
    rope = _require(d, "rope_parameters")
    main = _require(rope, "main", "config.json 'rope_parameters'")
    compress = _require(rope, "compress", "config.json 'rope_parameters'")
    if main.get("rope_type", "default") != "default":
        raise ConfigError(
            f"config.json 'rope_parameters.main.rope_type' is {main.get('rope_type')!r}: the "
            "sliding layers take plain RoPE ('default')"
        )
    head_dim = _int(_require(d, "head_dim"), "head_dim")
    factor = _float(
        _require(main, "partial_rotary_factor", "config.json 'rope_parameters.main'"),
        "rope_parameters.main.partial_rotary_factor",
    )
    qk_rope = round(head_dim * factor)
    if "qk_rope_head_dim" in d and d["qk_rope_head_dim"] != qk_rope:
        raise ConfigError(
            f"config.json 'qk_rope_head_dim' {d['qk_rope_head_dim']} disagrees with "
            f"head_dim * partial_rotary_factor = {qk_rope}"
        )
    scaling = None
    if compress.get("rope_type", "default") != "default":
        scaling = _rope_scaling(compress, "rope_parameters.compress")
    where = "config.json 'rope_parameters.main'"
    return {
        "compress_ratios": tuple(ratios),
        "num_hash_layers": n_hash,
        "rope_theta": _float(_require(main, "rope_theta", where), "rope_parameters.main"),
        "compress_rope_theta": _float(
            _require(compress, "rope_theta", "config.json 'rope_parameters.compress'"),
            "rope_parameters.compress.rope_theta",
        ),
        "rope_scaling": scaling,
        "qk_rope_head_dim": qk_rope,
    }


def _rope_scaling(rs: Mapping[str, Any] | None, key: str) -> RopeScaling | None:
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ConfigError(f"config.json {key!r} type {kind!r}: DeepSeek-V4 takes 'yarn' only")
    # transformers writes attention_factor 1.0 for V4 (no mscale); any other is another model
    if rs.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(
            f"config.json '{key}.attention_factor' is {rs['attention_factor']}: DeepSeek-V4's "
            "YaRN has no mscale (1.0)"
        )
    where = f"config.json {key!r}"
    return RopeScaling(
        type="yarn",
        factor=_float(_require(rs, "factor", where), f"{key}.factor"),
        original_max_position_embeddings=_int(
            _require(rs, "original_max_position_embeddings", where),
            f"{key}.original_max_position_embeddings",
        ),
        beta_fast=_float(_require(rs, "beta_fast", where), f"{key}.beta_fast"),
        beta_slow=_float(_require(rs, "beta_slow", where), f"{key}.beta_slow"),
    )


def _quantization(d: Mapping[str, Any]) -> QuantizationConfig | None:
    qc = d.get("quantization_config")
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    where = "config.json 'quantization_config'"
    checks = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"}
    for key, want in checks.items():
        got = _require(qc, key, where)
        if got != want:
            raise ConfigError(
                f"config.json 'quantization_config.{key}' is {got!r}: DeepSeek-V4 ships {want!r}"
            )
    block = _require(qc, "weight_block_size", where)
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ConfigError(
            f"config.json 'quantization_config.weight_block_size' must be [out, in], got {block!r}"
        )
    block = tuple(_int(b, "quantization_config.weight_block_size") for b in block)
    expert = qc.get("expert_dtype", d.get("expert_dtype")) or "fp4"
    if expert not in ("fp4", "fp8"):
        raise ConfigError(
            f"config.json 'quantization_config.expert_dtype' is {expert!r}: 'fp4' or 'fp8'"
        )
    return QuantizationConfig(
        quant_method="fp8",
        fmt="e4m3",
        scale_fmt="ue8m0",
        weight_block_size=block,
        activation_scheme=qc.get("activation_scheme", "dynamic"),
        expert_dtype=expert,
    )


def _check_shapes(cfg: DeepseekV4ModelConfig) -> None:
    """The divisibility the layers rely on (MODELS.md section 3's shape rules)."""
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        raise ConfigError(
            f"config.json 'qk_rope_head_dim' {cfg.qk_rope_head_dim} must be even and <= "
            f"head_dim {cfg.head_dim}"
        )
    if cfg.qk_rope_head_dim > cfg.index_head_dim:
        raise ConfigError(
            f"config.json 'index_head_dim' {cfg.index_head_dim} must be >= qk_rope_head_dim "
            f"{cfg.qk_rope_head_dim} (the indexer ropes its last qk_rope_head_dim dims)"
        )
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise ConfigError(
            f"config.json 'o_groups' {cfg.o_groups} must divide num_attention_heads * head_dim"
        )
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(
            f"config.json 'num_experts_per_tok' {cfg.num_experts_per_tok} exceeds "
            f"n_routed_experts {cfg.n_routed_experts}"
        )
    if cfg.num_hash_layers > cfg.num_hidden_layers:
        raise ConfigError(
            f"config.json 'num_hash_layers' {cfg.num_hash_layers} exceeds num_hidden_layers"
        )
