"""DeepSeek-V4 family (DeepSeek-V4-Flash): a C-stream residual mixed by hyper-connections
around every sublayer, MQA attention over a sliding window plus compressed entries (CSA with
the lightning indexer, HCA), DeepSeekMoE with sqrtsoftplus routing (hash-routed in the first
layers) and clamped SwiGLU. MODELS.md section 2 has the architecture; docs/notes-v4.md what
was checked against transformers.

Legend (docs/shapes.md): T tokens in the step, C streams (`hc_mult`), D hidden, V vocabulary.

Parameters carry the hub checkpoint's names (`layers.{i}.attn.wq_a.weight`, `embed.weight`,
`hc_head_fn`, ...) through each module's `checkpoint_tensors()`; the MoE's are mapped in
engine/models/deepseek_v4_loading.py, which also reads transformers' two layouts.

Formats: with `quantization_config`, the hub's FP8 linears stay FP8 (E8M0 block scales)
and the routed experts MXFP4 (or FP8), decoded on the fly; `wo_a` is dequantized once at
load (DeepSeek's own conversion does the same: the grouped product reads it whole). The
compressors, the indexer's weights_proj, the router, the head and every norm stay in the
checkpoint's float dtype; the sinks, `ape`, the router bias and mHC are float32.

`forward` returns the final C streams [T, C, D] (the hidden state each row carries);
`compute_logits` collapses the rows it is given (hc_head, norm) and applies the head. The
MTP layer (engine/models/deepseek_v4_mtp.py) reads those streams, not the collapse.

Decode state per layer (engine/layers/v4_attention.py), the MTP layers' after the main
ones: the window ring and the pooling states per sequence slot (`state_specs`), the
compressed entries and CSA's indexer keys paged (`cache_specs`).

Under speculative decoding (`reserve_lookahead(K)`) the ring holds sliding_window + K keys
and each pooling state R + K rows. A verify step writes the keys and pooling rows of K
drafts; a rejected draft's, at position q, overwrites the row of position q - size, which
with K spare rows lies before every later query's window (and pooling reach), so nothing
the next step reads is lost. Its own rows are rewritten when the real token at q runs. A
compressed entry a rejected draft closed is recommitted by the step whose real token
closes that window, and written before that step's queries read it; a query never sees an
entry whose window closes after it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.layers.deepseek_router import RouterSpec
from engine.layers.hyper_connections import HyperConnection, HyperHead
from engine.layers.linear import Linear
from engine.layers.moe import DeepseekMoE
from engine.layers.norm import RMSNorm
from engine.layers.v4_attention import V4Attention, v4_rope_parameters
from engine.models.base import CacheSpec, CausalLM, StateSpec
from engine.models.deepseek_v4_config import DeepseekV4ModelConfig
from engine.models.deepseek_v4_loading import SHARED_EXPERT_PROJ, load_v4_weights
from engine.models.deepseek_v4_mtp import V4MtpLayer
from engine.models.deepseek_v4_names import hub_tensor_specs
from engine.ops.attention_context import AttentionContext
from engine.quant.base import QuantConfig
from engine.quant.deepseek_quant_config import DeepseekQuantConfig

# hub linears kept in float in the engine although the hub stores them FP8
DEQUANTIZED_AT_LOAD = (".attn.wo_a",)


def quant_config_for(cfg: DeepseekV4ModelConfig) -> DeepseekQuantConfig | None:
    """The engine's formats for a V4 checkpoint: exactly the hub's FP8 linears (those with
    a `.scale`, named by their engine prefix) except `wo_a`, and its expert format."""
    qc = cfg.quantization_config
    if qc is None:
        return None
    prefixes = set()
    for name in hub_tensor_specs(cfg, quantized=True):
        if not name.endswith(".scale") or ".ffn.experts." in name:
            continue
        prefix = name[: -len(".scale")]
        if prefix.endswith(DEQUANTIZED_AT_LOAD):
            continue
        head, _, leaf = prefix.rpartition(".")
        if head.endswith(".ffn.shared_experts"):
            prefix = f"{head}.{SHARED_EXPERT_PROJ[leaf]}"
        prefixes.add(prefix)
    return DeepseekQuantConfig(
        dense="fp8",
        experts="fp4" if qc.expert_dtype == "fp4" else "fp8",
        fp8_scale_format="e8m0",
        quantized_prefixes=prefixes,
    )


class V4DecoderLayer(nn.Module):
    """streams -> hc_attn(attn(attn_norm(.))) -> hc_ffn(ffn(ffn_norm(.))), each sublayer
    reading the C streams collapsed by its hyper-connection and written back by it."""

    def __init__(
        self, cfg: DeepseekV4ModelConfig, index: int, quant: QuantConfig | None, prefix: str
    ) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        ratio = cfg.compress_ratios[index]
        self.prefix = prefix
        self.attn_norm = RMSNorm(D, eps)
        self.attn = V4Attention(
            hidden_size=D,
            num_attention_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            q_lora_rank=cfg.q_lora_rank,
            o_groups=cfg.o_groups,
            o_lora_rank=cfg.o_lora_rank,
            sliding_window=cfg.sliding_window,
            rms_norm_eps=eps,
            rope=v4_rope_parameters(hub_rope_config(cfg), compressed=ratio > 0),
            max_position_embeddings=cfg.max_position_embeddings,
            quant_config=quant,
            prefix=f"{prefix}attn.",
            compress_ratio=ratio,
            index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim,
            index_topk=cfg.index_topk,
        )
        self.ffn_norm = RMSNorm(D, eps)
        hashed = cfg.is_hash_layer(index)
        spec = RouterSpec(
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            scoring_func=cfg.scoring_func,
            topk_method=cfg.topk_method,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            hash_routing=hashed,
            vocab_size=cfg.vocab_size if hashed else 0,
        )
        self.ffn = DeepseekMoE(
            D,
            cfg.moe_intermediate_size,
            cfg.n_shared_experts,
            spec,
            quant,
            f"{prefix}ffn",
            index,
            cfg.swiglu_limit,
        )
        hc = (D, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.hc_attn = HyperConnection(*hc, name="hc_attn", prefix=prefix)
        self.hc_ffn = HyperConnection(*hc, name="hc_ffn", prefix=prefix)

    def forward(
        self,
        streams: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        input_ids: torch.Tensor,
    ) -> torch.Tensor:
        """streams [T, C, D] -> [T, C, D]; `input_ids` [T] feed the hash-routed layers."""
        streams = self.hc_attn(streams, lambda x: self.attn(self.attn_norm(x), positions, ctx))
        return self.hc_ffn(streams, lambda x: self.ffn(self.ffn_norm(x), input_ids))


def hub_rope_config(cfg: DeepseekV4ModelConfig) -> dict:
    """The rope keys of cfg in the hub's config.json spelling, for v4_rope_parameters."""
    rs = cfg.rope_scaling
    return {
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_scaling": None
        if rs is None
        else {
            "type": rs.type,
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
        },
    }


class DeepseekV4ForCausalLM(CausalLM):
    """`enable_mtp`: None builds the MTP layer(s) when config.json declares them and keeps
    them when the checkpoint holds them (dropped when it holds none of their tensors, as
    transformers' save_pretrained writes); True requires them; False skips them."""

    def __init__(
        self,
        config: dict,
        quant_config: QuantConfig | None = None,
        enable_mtp: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg = DeepseekV4ModelConfig.from_dict(config)
        # The family knows its checkpoint's formats tensor by tensor; the loader's
        # generic reading of `quantization_config` does not.
        self.quant_config = quant = quant_config_for(cfg)
        D, L = cfg.hidden_size, cfg.num_hidden_layers
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, quant, f"layers.{i}.") for i in range(L))
        self.hc_head = HyperHead(D, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.head = Linear(D, cfg.vocab_size, False, None, "head")
        self.mtp_required = enable_mtp is True
        n_mtp = cfg.num_nextn_predict_layers if enable_mtp is not False else 0
        if enable_mtp and n_mtp == 0:
            raise ValueError("enable_mtp=True but config.json declares no MTP layer")
        self.mtp = None
        if n_mtp:
            self.mtp = nn.ModuleList(
                V4MtpLayer(
                    V4DecoderLayer(cfg, L + k, quant, f"mtp.{k}."),
                    D,
                    cfg.hc_mult,
                    cfg.hc_eps,
                    cfg.rms_norm_eps,
                    quant,
                    f"mtp.{k}.",
                )
                for k in range(n_mtp)
            )
        self.lookahead = 0  # reserve_lookahead

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def ring_size(self) -> int:
        """Keys a window ring holds: the window, plus the drafts a verify step writes."""
        return self.config.sliding_window + self.lookahead

    def reserve_lookahead(self, tokens: int) -> None:
        """Size the decode state for speculative steps that write up to `tokens` drafts
        past a sequence's last accepted token (module docstring). Called before the state
        is allocated: the sizes are what state_specs reports."""
        if getattr(self, "_bind_state", None) is not None:
            raise RuntimeError("reserve_lookahead after the decode state was bound")
        if tokens < 0:
            raise ValueError(f"lookahead must be >= 0, got {tokens}")
        self.lookahead = tokens

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, D]
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()  # [T, C, D]
        for layer in self.layers:
            streams = layer(streams, positions, ctx, input_ids)
        return streams  # [T, C, D]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, C, D] (rows of forward's streams) -> [N, V] float32."""
        return self.head(self.norm(self.hc_head(hidden))).float()

    # -- MTP -------------------------------------------------------------------------------
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
        """MTP layer `depth` at rows whose previous streams (the target's forward output,
        or the previous MTP output) are prev_hidden [T, C, D] and whose next token is
        input_ids [T] -> [T, C, D]."""
        if self.mtp is None:
            raise RuntimeError("this model has no MTP layer loaded")
        layer = self.mtp[depth]
        return layer(self.embed(input_ids), prev_hidden, positions, ctx, input_ids)

    def mtp_logits(self, mtp_hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """mtp_hidden [N, C, D] -> [N, V] float32 through the MTP layer's collapse and the
        model's head."""
        return self.head(self.mtp[depth].collapse(mtp_hidden)).float()

    # -- decode state ------------------------------------------------------------------------
    def _attentions(self) -> list[V4Attention]:
        blocks = list(self.layers) + [m.block for m in (self.mtp or [])]
        return [block.attn for block in blocks]

    def cache_specs(self) -> list[CacheSpec]:
        """Per layer in order (the MTP layers last): its compressed entries, then (CSA)
        its indexer keys."""
        return [
            CacheSpec(shape, tokens_per_entry=span)
            for attn in self._attentions()
            for shape, span in attn.cache_shapes()
        ]

    def state_specs(self) -> list[StateSpec]:
        """Per layer in order (the MTP layers last): its window ring, then its compressors'
        pooling states."""
        return [
            StateSpec(shape, torch.float32 if f32 else None)
            for attn in self._attentions()
            for shape, f32 in attn.state_shapes(self.ring_size, self.lookahead)
        ]

    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        self._bind_kv = list(caches)
        self._bind()

    def bind_state(self, states: list[torch.Tensor]) -> None:
        self._bind_state = list(states)
        self._bind()

    def _bind(self) -> None:
        """Hand each layer its slice of the cache and state lists once both are known (the
        runner binds the state first, then the caches, and a warm-up rebinds caches)."""
        caches, states = getattr(self, "_bind_kv", None), getattr(self, "_bind_state", None)
        if caches is None or states is None:
            return
        attns = self._attentions()
        want = (len(self.cache_specs()), len(self.state_specs()))
        if (len(caches), len(states)) != want:
            raise ValueError(
                f"expected {want[0]} cache and {want[1]} state tensors, "
                f"got {len(caches)} and {len(states)}"
            )
        for attn in attns:
            nc = len(attn.cache_shapes())
            ns = len(attn.state_shapes(self.ring_size, self.lookahead))
            attn.bind(caches[:nc], states[:ns])
            caches, states = caches[nc:], states[ns:]

    # -- routing statistics ----------------------------------------------------------------
    @property
    def routing_recorder(self):
        """Set by the engine when routing statistics are on (engine/routing_stats.py);
        handed to every MoE layer, the MTP block's included."""
        return getattr(self, "_routing_recorder", None)

    @routing_recorder.setter
    def routing_recorder(self, recorder) -> None:
        self._routing_recorder = recorder
        for module in self.modules():
            if isinstance(module, DeepseekMoE):
                module.routing_recorder = recorder

    # -- loading ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_v4_weights(self, weights)
