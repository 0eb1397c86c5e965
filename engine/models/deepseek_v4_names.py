"""DeepSeek-V4 tensor names in three layouts, their shapes and dtypes (MODELS.md section 2).

Legend (docs/shapes.md): D hidden, H heads, C hc_mult, E routed experts, K top-k,
I moe_intermediate_size; here also hd = head_dim, qr = q_lora_rank, g = o_groups,
og = o_lora_rank, ih / ihd = index_n_heads / index_head_dim, m = a layer's compress ratio,
w = 2 where the compressor overlaps (CSA, m = 4) and 1 otherwise.

Layouts:
- "hub": DeepSeek's own names, no `model.` prefix: `embed.weight`, `head.weight`,
  `norm.weight`, `hc_head_{fn,base,scale}`, `layers.{i}.attn.*`, `layers.{i}.ffn.*`,
  `layers.{i}.hc_{attn,ffn}_*`, `mtp.{k}.*`. One tensor per expert and projection.
- "hf": transformers' module names, `DeepseekV4ForCausalLM.state_dict()`: `model.` prefix,
  `self_attn` / `mlp`, the indexer under `self_attn.compressor.indexer`, experts stacked
  into `mlp.experts.gate_up_proj` [E, 2I, D] (w1 rows first, then w3) and `down_proj`
  [E, D, I]. transformers has no MTP module, so `mtp.*` has no name here.
- "hf_saved": what `save_pretrained` writes. It reverses transformers' load-time renames
  and so is not a faithful inverse: `model.` + the hub name, except `model.embed_tokens.
  weight`, `model.norm.weight`, `model.hc_head.hc_{fn,base,scale}` and
  `model.layers.{i}.attn.norm.weight` for the hub's `attn.kv_norm.weight` (its rename
  `.norm.` -> `.kv_norm.` is meant for the compressors' norm and runs backwards over the
  attention's). Experts stay one tensor each.

`hub_tensor_specs` lists every hub tensor with its shape and dtype: quantized
(`quantization_config` set) dense linears are FP8 E4M3 with an E8M0 `.scale` per 128 x 128
block; routed experts are MXFP4, int8 [out, in / 2] holding two E2M1 codes per byte (low
nibble the even input) with an E8M0 `.scale` [out, in / 32] (or FP8 like the dense linears
when `expert_dtype` is "fp8"). Norms, embeddings, the head, the router and the compressors
are in the checkpoint's float dtype; sinks, `ape`, the router bias and mHC are float32;
`tid2eid` is int64. The quantized formats have no transformers name (transformers
dequantizes them on load), so `to_layout` maps a `.scale` only in the "hub" layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.models.deepseek_v4_config import CSA_RATIO, DeepseekV4ModelConfig

LAYOUTS = ("hub", "hf", "hf_saved")
E8M0 = torch.float8_e8m0fnu
FP8 = torch.float8_e4m3fn
MXFP4_GROUP = 32  # inputs per E8M0 scale of an MXFP4 expert row


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: name in its layout, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class HfPlace:
    """Where a hub tensor lives in the "hf" layout.

    `expert` is None for a tensor of its own; otherwise the hub tensor is
    `hf_tensor[expert, rows[0]:rows[1]]` of the stacked expert tensor (rows None: all rows).
    """

    name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def take(self, hf_tensor: torch.Tensor) -> torch.Tensor:
        if self.expert is None:
            return hf_tensor
        t = hf_tensor[self.expert]
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]


# (kind, hub leaf, hf leaf) per layer. Kinds: "linear" (FP8 when quantized), "float"
# (checkpoint float dtype), "f32". Shapes come from _layer_shapes.
_ATTN = (
    ("float", "attn_norm.weight", "input_layernorm.weight"),
    ("float", "ffn_norm.weight", "post_attention_layernorm.weight"),
    ("f32", "attn.attn_sink", "self_attn.sinks"),
    ("linear", "attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("float", "attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("linear", "attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("linear", "attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("float", "attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("linear", "attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("linear", "attn.wo_b.weight", "self_attn.o_b_proj.weight"),
)
_HC = tuple(
    ("f32", f"hc_{part}_{leaf}", f"{part}_hc.{leaf}")
    for part in ("attn", "ffn")
    for leaf in ("fn", "base", "scale")
)
_COMPRESSOR = (
    ("float", "attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("float", "attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("f32", "attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("float", "attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
)
_INDEXER = (
    ("linear", "attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    (
        "float",
        "attn.indexer.weights_proj.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
    ),
    ("float", "attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    (
        "float",
        "attn.indexer.compressor.wgate.weight",
        "self_attn.compressor.indexer.gate_proj.weight",
    ),
    ("f32", "attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("float", "attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
)
_FFN = (
    ("float", "ffn.gate.weight", "mlp.gate.weight"),
    ("linear", "ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("linear", "ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("linear", "ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
)
_HASH_GATE = ("i64", "ffn.gate.tid2eid", "mlp.gate.tid2eid")
_BIAS_GATE = ("f32", "ffn.gate.bias", "mlp.gate.e_score_correction_bias")
_GLOBAL = (
    ("float", "embed.weight", "model.embed_tokens.weight"),
    ("float", "norm.weight", "model.norm.weight"),
    ("f32", "hc_head_fn", "model.hc_head.hc_fn"),
    ("f32", "hc_head_base", "model.hc_head.hc_base"),
    ("f32", "hc_head_scale", "model.hc_head.hc_scale"),
    ("float", "head.weight", "lm_head.weight"),
)
_MTP_EXTRA = (
    ("linear", "e_proj.weight"),
    ("linear", "h_proj.weight"),
    ("float", "enorm.weight"),
    ("float", "hnorm.weight"),
    ("float", "norm.weight"),
    ("f32", "hc_head_fn"),
    ("f32", "hc_head_base"),
    ("f32", "hc_head_scale"),
)
_EXPERT_HF = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}
# save_pretrained's names where they are not `model.` + the hub name
_SAVED_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def _layer_shapes(cfg: DeepseekV4ModelConfig, ratio: int) -> dict[str, tuple[int, ...]]:
    D, H, C, hd, qr = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.hc_mult,
        cfg.head_dim,
        cfg.q_lora_rank,
    )
    g, og, I = cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size  # noqa: E741
    mix = (2 + C) * C
    w = 2 if ratio == CSA_RATIO else 1
    ihd = cfg.index_head_dim
    shapes = {
        "attn_norm.weight": (D,),
        "ffn_norm.weight": (D,),
        "attn.attn_sink": (H,),
        "attn.wq_a.weight": (qr, D),
        "attn.q_norm.weight": (qr,),
        "attn.wq_b.weight": (H * hd, qr),
        "attn.wkv.weight": (cfg.num_key_value_heads * hd, D),
        "attn.kv_norm.weight": (hd,),
        "attn.wo_a.weight": (g * og, H * hd // g),
        "attn.wo_b.weight": (D, g * og),
        "hc_attn_fn": (mix, C * D),
        "hc_attn_base": (mix,),
        "hc_attn_scale": (3,),
        "attn.compressor.wkv.weight": (w * hd, D),
        "attn.compressor.wgate.weight": (w * hd, D),
        "attn.compressor.ape": (ratio, w * hd),
        "attn.compressor.norm.weight": (hd,),
        "attn.indexer.wq_b.weight": (cfg.index_n_heads * ihd, qr),
        "attn.indexer.weights_proj.weight": (cfg.index_n_heads, D),
        "attn.indexer.compressor.wkv.weight": (2 * ihd, D),
        "attn.indexer.compressor.wgate.weight": (2 * ihd, D),
        "attn.indexer.compressor.ape": (CSA_RATIO, 2 * ihd),
        "attn.indexer.compressor.norm.weight": (ihd,),
        "ffn.gate.weight": (cfg.n_routed_experts, D),
        "ffn.gate.bias": (cfg.n_routed_experts,),
        "ffn.gate.tid2eid": (cfg.vocab_size, cfg.num_experts_per_tok),
        "ffn.shared_experts.w1.weight": (I * cfg.n_shared_experts, D),
        "ffn.shared_experts.w3.weight": (I * cfg.n_shared_experts, D),
        "ffn.shared_experts.w2.weight": (D, I * cfg.n_shared_experts),
        "ffn.experts.w1": (I, D),
        "ffn.experts.w3": (I, D),
        "ffn.experts.w2": (D, I),
    }
    for part in ("fn", "base", "scale"):
        shapes[f"hc_ffn_{part}"] = shapes[f"hc_attn_{part}"]
    return shapes


def _block_leaves(
    cfg: DeepseekV4ModelConfig, ratio: int, hashed: bool
) -> list[tuple[str, str, str]]:
    leaves = list(_ATTN + _HC)
    if ratio:
        leaves += _COMPRESSOR
    if ratio == CSA_RATIO:
        leaves += _INDEXER
    leaves += [*_FFN, _HASH_GATE if hashed else _BIAS_GATE]
    return leaves


def hub_tensor_specs(
    cfg: DeepseekV4ModelConfig,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quantized: bool | None = None,
    mtp: bool = True,
) -> dict[str, TensorSpec]:
    """Every tensor of a hub-layout checkpoint for `cfg`, by name, in checkpoint order.

    `dtype` is the float dtype of what the hub stores as BF16; `quantized` defaults to
    whether `cfg.quantization_config` is set; `mtp=False` leaves out `mtp.*`.
    """
    if quantized is None:
        quantized = cfg.quantization_config is not None
    block = cfg.quantization_config.weight_block_size if cfg.quantization_config else (128, 128)
    expert_fp4 = quantized and (
        cfg.quantization_config is None or cfg.quantization_config.expert_dtype == "fp4"
    )
    specs: dict[str, TensorSpec] = {}

    def add(name: str, kind: str, shape: tuple[int, ...]) -> None:
        if kind == "linear" and quantized:
            specs[name] = TensorSpec(name, shape, FP8)
            scale = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
            specs[name[: -len("weight")] + "scale"] = TensorSpec(
                name[: -len("weight")] + "scale", scale, E8M0
            )
            return
        kind_dtype = {"float": dtype, "linear": dtype, "f32": torch.float32, "i64": torch.int64}
        specs[name] = TensorSpec(name, shape, kind_dtype[kind])

    def add_expert(name: str, shape: tuple[int, int]) -> None:
        if not expert_fp4:
            add(name, "linear", shape)
            return
        out, inp = shape
        specs[name] = TensorSpec(name, (out, inp // 2), torch.int8)
        scale = name[: -len("weight")] + "scale"
        specs[scale] = TensorSpec(scale, (out, inp // MXFP4_GROUP), E8M0)

    def add_block(prefix: str, ratio: int, hashed: bool) -> None:
        shapes = _layer_shapes(cfg, ratio)
        for kind, hub, _ in _block_leaves(cfg, ratio, hashed):
            add(prefix + hub, kind, shapes[hub])
        for j in range(cfg.n_routed_experts):
            for w in ("w1", "w3", "w2"):
                add_expert(f"{prefix}ffn.experts.{j}.{w}.weight", shapes[f"ffn.experts.{w}"])

    D = cfg.hidden_size
    for kind, hub, _ in _GLOBAL[:1]:
        add(hub, kind, (cfg.vocab_size, D))
    for i in range(cfg.num_hidden_layers):
        add_block(f"layers.{i}.", cfg.compress_ratios[i], cfg.is_hash_layer(i))
    C = cfg.hc_mult
    global_shapes = {
        "norm.weight": (D,),
        "hc_head_fn": (C, C * D),
        "hc_head_base": (C,),
        "hc_head_scale": (1,),
        "head.weight": (cfg.vocab_size, D),
    }
    for kind, hub, _ in _GLOBAL[1:]:
        add(hub, kind, global_shapes[hub])
    if mtp:
        mtp_shapes = {"e_proj.weight": (D, D), "h_proj.weight": (D, D), **global_shapes}
        mtp_shapes |= {"enorm.weight": (D,), "hnorm.weight": (D,)}
        for k in range(cfg.num_nextn_predict_layers):
            prefix = f"mtp.{k}."
            add_block(prefix, cfg.compress_ratios[cfg.num_hidden_layers + k], hashed=False)
            for kind, leaf in _MTP_EXTRA:
                add(prefix + leaf, kind, mtp_shapes[leaf])
    return specs


def hf_place(name: str, cfg: DeepseekV4ModelConfig) -> HfPlace | None:
    """The "hf" place of hub tensor `name`; None for `mtp.*` (transformers has no MTP).

    Raises KeyError for a name that is not a hub tensor of `cfg` in float form (`.scale`
    included: transformers holds no quantized tensors).
    """
    _check_hub_name(name, cfg, allow_scale=False)
    return _hub_to_hf(cfg)[name]


def hub_names_of_hf(name: str, cfg: DeepseekV4ModelConfig) -> list[tuple[str, HfPlace]]:
    """The hub tensors held by "hf" tensor `name` (several for a stacked expert tensor),
    each with its place. Raises KeyError for a name transformers' model does not have."""
    table = _hf_to_hub(cfg)
    if name not in table:
        raise KeyError(f"{name!r} is not a transformers DeepSeek-V4 tensor for this config")
    return table[name]


def to_layout(name: str, layout: str, cfg: DeepseekV4ModelConfig) -> str | None:
    """Hub tensor `name` in a one-tensor-per-name layout ("hub" or "hf_saved").

    None where the layout has no such tensor (`.scale` and `mtp.*` in "hf_saved").
    For "hf" use `hf_place` (stacked experts are a slice, not a name).
    """
    _check_hub_name(name, cfg, allow_scale=True)
    if layout == "hub":
        return name
    if layout != "hf_saved":
        raise ValueError(f"layout {layout!r}: to_layout takes 'hub' or 'hf_saved'")
    return _saved_name(name)


def _saved_name(hub: str) -> str | None:
    if hub.startswith("mtp.") or hub.endswith(".scale"):
        return None
    if hub in _SAVED_GLOBAL:
        return _SAVED_GLOBAL[hub]
    if hub.endswith(".attn.kv_norm.weight"):
        hub = hub[: -len("kv_norm.weight")] + "norm.weight"
    return "model." + hub


def from_layout(name: str, layout: str, cfg: DeepseekV4ModelConfig) -> str:
    """The hub name of tensor `name` stored in `layout` ("hub" or "hf_saved").

    Raises KeyError for a name that layout does not have for this config.
    """
    if layout not in ("hub", "hf_saved"):
        raise ValueError(f"layout {layout!r}: from_layout takes 'hub' or 'hf_saved'")
    if layout == "hub":
        _check_hub_name(name, cfg, allow_scale=True)
        return name
    table = _saved_to_hub(cfg)
    if name not in table:
        raise KeyError(f"{name!r} is not a save_pretrained DeepSeek-V4 tensor for this config")
    return table[name]


def hf_tensor_shapes(cfg: DeepseekV4ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every "hf" tensor (what `DeepseekV4ForCausalLM.state_dict()` holds)."""
    specs = hub_tensor_specs(cfg, dtype=torch.float32, quantized=False, mtp=False)
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size  # noqa: E741
    D = cfg.hidden_size
    shapes = {}
    for hf, places in _hf_to_hub(cfg).items():
        if places[0][1].expert is None:
            shapes[hf] = specs[places[0][0]].shape
        else:
            shapes[hf] = (E, 2 * I, D) if hf.endswith("gate_up_proj") else (E, D, I)
    return shapes


def hub_state_from_hf(
    state: dict[str, torch.Tensor], cfg: DeepseekV4ModelConfig
) -> dict[str, torch.Tensor]:
    """Hub-named views of a transformers state dict (experts sliced, no copies)."""
    out = {}
    for hf, tensor in state.items():
        for hub, place in hub_names_of_hf(hf, cfg):
            out[hub] = place.take(tensor)
    return out


def hf_state_from_hub(
    state: dict[str, torch.Tensor], cfg: DeepseekV4ModelConfig
) -> dict[str, torch.Tensor]:
    """A transformers state dict from float hub tensors (experts stacked; `mtp.*` dropped)."""
    out = {}
    hf_shapes = hf_tensor_shapes(cfg)
    for hf, places in _hf_to_hub(cfg).items():
        if places[0][1].expert is None:
            out[hf] = state[places[0][0]]
            continue
        first = state[places[0][0]]
        stacked = first.new_empty(hf_shapes[hf])
        for hub, place in places:
            place.take(stacked).copy_(state[hub])
        out[hf] = stacked
    return out


_TABLES: dict[DeepseekV4ModelConfig, tuple[dict, dict, dict, set]] = {}


def _tables(cfg: DeepseekV4ModelConfig) -> tuple[dict, dict, dict, set]:
    """(hub -> HfPlace or None, hf -> [(hub, HfPlace)], saved -> hub, the hub `.scale`
    names), built once per config."""
    if cfg in _TABLES:
        return _TABLES[cfg]
    hub_to_hf: dict[str, HfPlace | None] = {}
    I = cfg.moe_intermediate_size  # noqa: E741

    def block(prefix: str, hf_prefix: str | None, ratio: int, hashed: bool) -> None:
        for _, hub, hf in _block_leaves(cfg, ratio, hashed):
            hub_to_hf[prefix + hub] = None if hf_prefix is None else HfPlace(hf_prefix + hf)
        for j in range(cfg.n_routed_experts):
            for w, (hf, half) in _EXPERT_HF.items():
                place = None
                if hf_prefix is not None:
                    rows = None if half is None else (half * I, (half + 1) * I)
                    place = HfPlace(f"{hf_prefix}mlp.experts.{hf}", j, rows)
                hub_to_hf[f"{prefix}ffn.experts.{j}.{w}.weight"] = place

    for i in range(cfg.num_hidden_layers):
        block(f"layers.{i}.", f"model.layers.{i}.", cfg.compress_ratios[i], cfg.is_hash_layer(i))
    for _, hub, hf in _GLOBAL:
        hub_to_hf[hub] = HfPlace(hf)
    for k in range(cfg.num_nextn_predict_layers):
        block(f"mtp.{k}.", None, cfg.compress_ratios[cfg.num_hidden_layers + k], False)
        for _, leaf in _MTP_EXTRA:
            hub_to_hf[f"mtp.{k}.{leaf}"] = None
    hf_to_hub: dict[str, list[tuple[str, HfPlace]]] = {}
    for hub, place in hub_to_hf.items():
        if place is not None:
            hf_to_hub.setdefault(place.name, []).append((hub, place))
    saved = {_saved_name(hub): hub for hub in hub_to_hf}
    saved.pop(None, None)
    scales = {n for n in hub_tensor_specs(cfg, quantized=True) if n.endswith(".scale")}
    _TABLES[cfg] = (hub_to_hf, hf_to_hub, saved, scales)
    return _TABLES[cfg]


def _hub_to_hf(cfg: DeepseekV4ModelConfig) -> dict[str, HfPlace | None]:
    return _tables(cfg)[0]


def _hf_to_hub(cfg: DeepseekV4ModelConfig) -> dict[str, list[tuple[str, HfPlace]]]:
    return _tables(cfg)[1]


def _saved_to_hub(cfg: DeepseekV4ModelConfig) -> dict[str, str]:
    return _tables(cfg)[2]


def _check_hub_name(name: str, cfg: DeepseekV4ModelConfig, *, allow_scale: bool) -> None:
    tables = _tables(cfg)
    if name in tables[0] or (allow_scale and name in tables[3]):
        return
    raise KeyError(f"{name!r} is not a DeepSeek-V4 hub tensor for this config")
