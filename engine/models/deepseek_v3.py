"""DeepSeek-V3 family (DeepSeek-V3/R1/V3.1, Kimi-K2, Moonlight; DeepSeek-V2 configs where the
architecture matches): MLA attention over a latent KV cache, DeepSeekMoE, an optional MTP
layer for speculative decoding.

Legend: T = tokens in the step, D = hidden size, V = vocabulary, L = num_hidden_layers.

Checkpoint names are the official ones (README_WEIGHTS of deepseek-ai/DeepSeek-V3):
`model.layers.{i}.self_attn.*`, `.mlp.{gate,up,down}_proj` (dense layers),
`.mlp.gate.weight` + `.mlp.gate.e_score_correction_bias`, `.mlp.experts.{e}.{gate,up,down}_proj.*`,
`.mlp.shared_experts.*`; and the MTP layer(s) at `model.layers.{L + j}`:
`enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` plus a full decoder layer. Experts are
stored stacked per layer ([E, out, in] per projection); the loader fills expert e's slice
from its per-expert tensors, or all of them from transformers' stacked `gate_up_proj`
[E, 2I, D] / `down_proj` [E, D, I] (what `save_pretrained` writes).

KV cache: one `CacheSpec((kv_lora_rank + qk_rope_head_dim,))` per layer, then one per MTP
layer when MTP is on (the MTP layer attends over its own cache; see engine/spec_decode/mtp.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
from torch import nn

from engine.layers.decoder_layer import PreNormDecoderLayer
from engine.layers.deepseek_router import RouterSpec
from engine.layers.linear import Linear
from engine.layers.mla import MultiLatentAttention
from engine.layers.moe import DeepseekMoE, ExpertProjection
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from engine.layers.swiglu_mlp import SwiGluMlp
from engine.models.base import CacheSpec, CausalLM
from engine.models.weights import (
    CheckpointMismatch,
    raise_on_mismatch,
    run_after_loading_hooks,
)
from engine.ops.attention_context import AttentionContext
from engine.ops.mla_forms import MlaDims
from engine.quant.base import QuantConfig
from engine.quant.deepseek_quant_config import DeepseekQuantConfig
from kernels.cpu import batch_invariant

# Defaults where config.json leaves a key out: transformers' DeepseekV3Config, and for
# model_type deepseek_v2 the values DeepSeek-V2's own modeling code assumes.
_V2_DEFAULTS = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 2,
    "num_nextn_predict_layers": 0,
}


@dataclass
class DeepseekV3Config:
    """Field names equal config.json keys (unknown keys are ignored)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 1
    model_type: str = "deepseek_v3"
    rope: dict | None = None  # normalized from rope_theta / rope_scaling / rope_parameters

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV3Config:
        d = dict(d)
        if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
            d["num_nextn_predict_layers"] = d["num_mtp_layers"]  # transformers 5 spelling
        if d.get("model_type") == "deepseek_v2":
            for key, value in _V2_DEFAULTS.items():
                if d.get(key) is None:
                    d[key] = value
        known = {f.name for f in fields(cls)} - {"rope"}
        # None is meaningful for q_lora_rank (no query compression); elsewhere it means unset.
        cfg = cls(
            **{k: v for k, v in d.items() if k in known and (v is not None or k == "q_lora_rank")}
        )
        if d.get("n_group") is None:
            cfg.n_group, cfg.topk_group = 1, 1
        cfg.rope = rope_parameters(d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(
                f"config.json hidden_act {self.hidden_act!r}: only 'silu' is supported"
            )
        if self.moe_layer_freq < 1:
            raise ValueError(f"config.json moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"config.json qk_rope_head_dim must be even, got {self.qk_rope_head_dim}"
            )
        self.router_spec()  # raises on bad routing keys

    def router_spec(self) -> RouterSpec:
        return RouterSpec(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scoring_func=self.scoring_func,
            topk_method=self.topk_method,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.n_routed_experts > 0
            and index >= self.first_k_dense_replace
            and index % self.moe_layer_freq == 0
        )

    def mla_dims(self) -> MlaDims:
        return MlaDims(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            attention_bias=self.attention_bias,
        )

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as DeepSeek's
        and transformers' code do)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.rope or {}
        mscale_all_dim = rope.get("mscale_all_dim") or 0
        if rope.get("rope_type", "default") != "default" and mscale_all_dim:
            m = yarn_mscale(float(rope["factor"]), float(mscale_all_dim))
            scale *= m * m
        return scale


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: DeepseekV3Config, index: int, quant: QuantConfig | None, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rotary = RotaryEmbedding(
            cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings, cfg.rope_interleave
        )
        self.self_attn = MultiLatentAttention(
            cfg.mla_dims(), rotary, cfg.softmax_scale(), quant, f"{prefix}.self_attn"
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(index):
            self.mlp = DeepseekMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.n_shared_experts,
                cfg.router_spec(),
                quant,
                f"{prefix}.mlp",
                index,
            )
        else:
            self.mlp = SwiGluMlp(cfg.hidden_size, cfg.intermediate_size, quant, f"{prefix}.mlp")

    def attend(self, x, residual, positions, ctx):
        if residual is not None:  # the input norm fused into the attention where it can be
            folded = self.self_attn.forward_with_input_norm(
                self.input_layernorm, x, residual, positions, ctx
            )
            if folded is not None:
                return folded
        return super().attend(x, residual, positions, ctx)


class MtpLayer(nn.Module):
    """One multi-token-prediction module: h' = Block(eh_proj([enorm(emb(t_{i+1})) | hnorm(h_i)]))
    and logits = shared_head.head(shared_head.norm(h')). Its embedding is the main model's."""

    def __init__(self, cfg: DeepseekV3Config, index: int, quant: QuantConfig | None):
        super().__init__()
        prefix = f"model.layers.{index}"
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * D, D, False, quant, f"{prefix}.eh_proj")
        self.block = DeepseekDecoderLayer(cfg, index, quant, prefix)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.shared_head.head = Linear(
            D, cfg.vocab_size, False, quant, f"{prefix}.shared_head.head"
        )

    def forward(self, embeds, prev_hidden, positions, ctx):
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden)), dim=-1))
        x, residual = self.block(x, None, positions, ctx)
        return x + residual  # [T, D]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden)).float()


class DeepseekModel(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, quant: QuantConfig | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, quant, f"model.layers.{i}")
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class DeepseekV3ForCausalLM(CausalLM):
    """`enable_mtp`: None loads the MTP layer(s) when config.json declares them and the
    checkpoint holds them (silently dropped when it holds none of their tensors, as
    transformers' save_pretrained writes); True requires them; False skips them."""

    def __init__(
        self,
        config: dict,
        quant_config: QuantConfig | None = None,
        enable_mtp: bool | None = None,
    ):
        super().__init__()
        self.config = cfg = DeepseekV3Config.from_dict(config)
        if not isinstance(quant_config, DeepseekQuantConfig) or (
            quant_config.quantized_prefixes is None and config.get("expert_dtype") is not None
        ):
            # The generic loader knows `quantization_config` only; the expert format may be a
            # top-level `expert_dtype` (DeepSeek-V4 style), so read the whole config.json.
            quant_config = DeepseekQuantConfig.from_config(config) or quant_config
        self.quant_config = quant_config
        self.model = DeepseekModel(cfg, quant_config)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, quant_config, "lm_head")
        self.mtp_required = enable_mtp is True
        n_mtp = cfg.num_nextn_predict_layers if enable_mtp is not False else 0
        if enable_mtp and n_mtp == 0:
            raise ValueError("enable_mtp=True but config.json declares no MTP layer")
        self.mtp = (
            nn.ModuleList(
                MtpLayer(cfg, cfg.num_hidden_layers + j, quant_config) for j in range(n_mtp)
            )
            if n_mtp
            else None
        )
        self._routing_recorder = None

    # -- the CausalLM contract ---------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, D]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, ctx)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return batch_invariant.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # [N, V]

    def cache_specs(self) -> list[CacheSpec]:
        """One latent cache per decoder layer, then one per MTP layer (when on)."""
        spec = CacheSpec((self.config.kv_lora_rank + self.config.qk_rope_head_dim,))
        return [spec] * (self.config.num_hidden_layers + self.num_mtp_layers)

    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        attns = [layer.self_attn for layer in self.model.layers]
        attns += [m.block.self_attn for m in (self.mtp or [])]
        if len(caches) != len(attns):
            raise ValueError(
                f"expected {len(attns)} cache tensors (cache_specs), got {len(caches)}"
            )
        for attn, cache in zip(attns, caches, strict=True):
            attn.kv_cache = cache

    # -- MTP -----------------------------------------------------------------------------
    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp) if self.mtp is not None else 0

    def mtp_forward(
        self,
        prev_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        depth: int = 0,
    ) -> torch.Tensor:
        """MTP layer `depth` at rows whose previous hidden state (target's final hidden, or
        the previous MTP output) is prev_hidden [T, D] and whose next token is input_ids."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP layer loaded")
        return self.mtp[depth](self.model.embed_tokens(input_ids), prev_hidden, positions, ctx)

    def mtp_logits(self, mtp_hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.mtp[depth].logits(mtp_hidden)  # [N, V] float32

    # -- routing statistics ----------------------------------------------------------------
    @property
    def routing_recorder(self):
        return self._routing_recorder

    @routing_recorder.setter
    def routing_recorder(self, recorder) -> None:
        self._routing_recorder = recorder
        for module in self.modules():
            if isinstance(module, DeepseekMoE):
                module.routing_recorder = recorder

    def set_mla_mode(self, mode: str) -> None:
        """ "auto" | "absorbed" | "expanded" for every MLA layer (tests and benchmarks)."""
        for module in self.modules():
            if isinstance(module, MultiLatentAttention):
                module.mode = mode

    # -- loading -------------------------------------------------------------------------
    def _param_name(self, name: str) -> str | None:
        """Checkpoint name -> our parameter name (None: skip on purpose)."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # derived from the config
        if self.lm_head is None and name == "lm_head.weight":
            return None
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            depth, rest = int(m.group(1)) - self.config.num_hidden_layers, m.group(2)
            if depth >= self.num_mtp_layers:
                return None  # MTP switched off, or more MTP layers than we host
            if rest == "embed_tokens.weight":
                return None  # the official checkpoint's copy of model.embed_tokens
            if rest.startswith(_MTP_OWN):
                return f"mtp.{depth}.{rest}"
            return f"mtp.{depth}.block.{rest}"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = _StrictLoader(self)
        for ckpt_name, tensor in weights:
            loader.add(ckpt_name, tensor)
        loader.finish()


class _StrictLoader:
    """Copies tensors one at a time into (slices of) parameters, tracking what was filled."""

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.expert_params = {
            f"{mod_name}.{p_name}": module.num_experts
            for mod_name, module in model.named_modules()
            if isinstance(module, ExpertProjection)
            for p_name, _ in module.named_parameters(recurse=False)
        }
        self.filled: set[str] = set()
        self.experts_filled: dict[str, set[int]] = {n: set() for n in self.expert_params}
        self.unexpected: list[str] = []
        self.mtp_seen = False

    def add(self, ckpt_name: str, tensor: torch.Tensor) -> None:
        name = self.model._param_name(ckpt_name)
        if name is None:
            return
        if name.startswith("mtp."):
            self.mtp_seen = True
        if ".shared_experts." in name and tensor.numel() == 0 and name not in self.params:
            return  # transformers writes empty shared experts when n_shared_experts == 0
        m = _EXPERT.match(name)
        if m:
            target = f"{m.group(1)}.{m.group(3)}.{m.group(4)}"
            expert = int(m.group(2))
            if target in self.expert_params and expert < self.expert_params[target]:
                projection = self.model.get_submodule(target.rsplit(".", 1)[0])
                leaf = target.rsplit(".", 1)[1]
                _copy(projection.expert_tensor(leaf, expert), tensor, ckpt_name)
                projection.expert_loaded(expert)
                self.experts_filled[target].add(expert)
                return
            self.unexpected.append(ckpt_name)
            return
        m = _STACKED.match(name)
        if m:
            self._add_stacked(m.group(1), m.group(2), tensor, ckpt_name)
            return
        target = self.params.get(name)
        if target is None or name in self.expert_params:
            self.unexpected.append(ckpt_name)
            return
        _copy(target, tensor, ckpt_name)
        self.filled.add(name)

    def _add_stacked(self, experts: str, kind: str, tensor: torch.Tensor, ckpt_name: str) -> None:
        weights = [f"{experts}.gate_proj.weight", f"{experts}.up_proj.weight"]
        if kind == "down_proj":
            weights = [f"{experts}.down_proj.weight"]
        if any(w not in self.params for w in weights):
            self.unexpected.append(ckpt_name)
            return
        module = self.model.get_submodule(weights[0].rsplit(".", 1)[0])
        if module.format.name != "unquantized":
            raise CheckpointMismatch(
                f"tensor {ckpt_name!r}: stacked expert tensors are only supported unquantized; "
                f"this model stores experts as {module.format.name}"
            )
        parts = tensor.chunk(2, dim=1) if kind == "gate_up_proj" else (tensor,)
        for w, part in zip(weights, parts, strict=True):
            _copy(self.params[w], part, ckpt_name)
            self.experts_filled[w].update(range(self.expert_params[w]))

    def finish(self) -> None:
        model = self.model
        if model.mtp is not None and not self.mtp_seen and not model.mtp_required:
            # The checkpoint has no MTP layer (e.g. written by save_pretrained): run without.
            model.mtp = None
            self.params = dict(model.named_parameters())
            self.expert_params = {k: v for k, v in self.expert_params.items() if k in self.params}
        missing = [n for n in self.params if n not in self.expert_params and n not in self.filled]
        for name, count in self.expert_params.items():
            done = self.experts_filled[name]
            if len(done) < count:
                head, leaf = name.rsplit(".", 1)
                owner, proj = head.rsplit(".", 1)
                missing += [f"{owner}.{e}.{proj}.{leaf}" for e in range(count) if e not in done]
        raise_on_mismatch([_ckpt_name(model, n) for n in missing], self.unexpected)
        run_after_loading_hooks(model)


def _ckpt_name(model: DeepseekV3ForCausalLM, name: str) -> str:
    """Our parameter name back in the checkpoint's spelling (for error messages)."""
    m = re.match(r"^mtp\.(\d+)\.(block\.)?(.*)$", name)
    if m:
        return f"model.layers.{model.config.num_hidden_layers + int(m.group(1))}.{m.group(3)}"
    return name


_QUANT_STORAGE = {torch.uint8, torch.float8_e4m3fn}


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy as stored: quantized storage takes only the same kind of tensor (bit views for
    E8M0 / packed FP4 saved as float8_e8m0fnu or int8); float targets take float tensors."""
    if target.dtype == torch.uint8:
        if tensor.dtype in (torch.int8, getattr(torch, "float8_e8m0fnu", torch.int8)):
            tensor = tensor.view(torch.uint8)
        if tensor.dtype != torch.uint8:
            raise CheckpointMismatch(
                f"tensor {name!r} is {tensor.dtype}; the model expects packed uint8 / E8M0 "
                "(config.json's quantization does not match the checkpoint)"
            )
    elif target.dtype == torch.float8_e4m3fn:
        if tensor.dtype != torch.float8_e4m3fn:
            raise CheckpointMismatch(
                f"tensor {name!r} is {tensor.dtype}; the model expects float8_e4m3fn "
                "(config.json's quantization does not match the checkpoint)"
            )
    elif (
        not tensor.is_floating_point()
        or tensor.dtype in _QUANT_STORAGE
        or tensor.element_size() == 1
    ):
        raise CheckpointMismatch(
            f"tensor {name!r} is {tensor.dtype}; the model expects {target.dtype} "
            "(a quantized tensor where config.json declares none?)"
        )
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointMismatch(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)
