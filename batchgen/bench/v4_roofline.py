"""The bytes a DeepSeek-V4 decode step must read, by layer and part, counted from the hub's
tensor table (`hub_tensor_specs`: every tensor's shape and dtype in the checkpoint's
formats), and the extrapolation of a few measured layers to the whole model.

A decode step of B sequences reads, per layer:
- every tensor of the attention, the compressor, the indexer, mHC, the router's weight
  and bias, the shared expert and the two norms, once whatever B is;
- the routed experts the batch chose: E * (1 - (1 - K/E)^B) distinct ones expected when
  each row picks K of E uniformly at random, <= min(E, K * B);
- one row per sequence of the tables indexed by a token: `tid2eid` (hash layers, by the
  token id) and the compressors' `ape` (by position mod m), at most all their rows;
- per sequence, its KV at its context length (`kv_read_bytes`) and its compressors'
  pooling states, read whole when a window closes, once every m steps
  (`state_read_bytes`; the row a step writes is not counted).
Globally: the head whole, the final norm and `hc_head_*`, one embedding row per sequence.

MODELS.md section 4's V4-Flash table counts the same weights and KV (tests/batchgen/
test_bench_decode_v4.py holds its rows against these counts). The engine stores `wo_a`
dequantized (the grouped product reads it whole), so its attention reads twice the hub
table's FP8 `wo_a` bytes; the counts here are the format's, a lower bound for any engine.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from engine.models.deepseek_v4_config import CSA_RATIO, DeepseekV4ModelConfig
from engine.models.deepseek_v4_names import TensorSpec, hub_tensor_specs

# a layer's parts, in report order
PARTS = ("attention", "compressor", "indexer", "mhc", "router", "shared_expert",
         "routed_experts", "norms")  # fmt: skip
# the part of each tensor, by the first prefix of its name after `layers.{i}.` that matches
_PART_OF_PREFIX = (
    ("ffn.experts.", "routed_experts"),
    ("ffn.shared_experts.", "shared_expert"),
    ("ffn.gate.", "router"),
    ("attn.indexer.", "indexer"),
    ("attn.compressor.", "compressor"),
    ("attn.", "attention"),
    ("hc_attn_", "mhc"),
    ("hc_ffn_", "mhc"),
    ("attn_norm.", "norms"),
    ("ffn_norm.", "norms"),
)
# tables a step reads one row of per sequence, by tensor name suffix
_ROW_TABLES = (".ffn.gate.tid2eid", ".compressor.ape")


def _nbytes(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * spec.dtype.itemsize


def part_of(leaf: str) -> str:
    """The part of a layer tensor named `leaf` (its hub name after `layers.{i}.`)."""
    for prefix, part in _PART_OF_PREFIX:
        if leaf.startswith(prefix):
            return part
    raise ValueError(f"DeepSeek-V4 layer tensor {leaf!r} belongs to no part of the count")


@dataclass(frozen=True)
class LayerReads:
    """One decoder layer's weights as the hub stores them, split by how a step reads them.

    `whole`: bytes per part read whole every step; `rows`: per part, (bytes per row,
    rows) of each token-indexed table; `expert_bytes`: one routed expert (w1, w3, w2 and
    their scales); `total`: every tensor of the layer (the hub table's sum)."""

    index: int
    compress_ratio: int
    hash_routing: bool
    whole: dict[str, int]
    rows: dict[str, list[tuple[int, int]]]
    expert_bytes: int
    num_experts: int
    top_k: int
    total: int

    @property
    def kind(self) -> str:
        return {0: "sliding", CSA_RATIO: "csa"}.get(self.compress_ratio, "hca")

    def step_bytes(self, batch: int) -> dict[str, float]:
        """Bytes per part a decode step of `batch` sequences reads (KV not included)."""
        out = {part: float(self.whole.get(part, 0)) for part in PARTS}
        for part, tables in self.rows.items():
            out[part] += sum(row * min(batch, n) for row, n in tables)
        out["routed_experts"] = expected_experts(self.num_experts, self.top_k, batch) * (
            self.expert_bytes
        )
        return out


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch reads when each row picks `top_k` of `num_experts` at
    random: E * (1 - (1 - K/E)^B)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def layer_reads(
    cfg: DeepseekV4ModelConfig, specs: dict[str, TensorSpec] | None = None
) -> list[LayerReads]:
    """Every decoder layer of `cfg`, in order, from `specs` (default: the hub table of
    `cfg`'s formats with bf16 floats)."""
    specs = specs or hub_tensor_specs(cfg, mtp=False)
    per_layer: list[dict[str, TensorSpec]] = [{} for _ in range(cfg.num_hidden_layers)]
    for name, spec in specs.items():
        if name.startswith("layers."):
            index, leaf = name[len("layers.") :].split(".", 1)
            per_layer[int(index)][leaf] = spec
    out = []
    for i, tensors in enumerate(per_layer):
        whole: dict[str, int] = {}
        rows: dict[str, list[tuple[int, int]]] = {}
        experts = 0
        for leaf, spec in tensors.items():
            nbytes, part = _nbytes(spec), part_of(leaf)
            if part == "routed_experts":
                experts += nbytes
            elif ("." + leaf).endswith(_ROW_TABLES):
                rows.setdefault(part, []).append((nbytes // spec.shape[0], spec.shape[0]))
            else:
                whole[part] = whole.get(part, 0) + nbytes
        out.append(
            LayerReads(
                index=i,
                compress_ratio=cfg.compress_ratios[i],
                hash_routing=cfg.is_hash_layer(i),
                whole=whole,
                rows=rows,
                expert_bytes=experts // cfg.n_routed_experts,
                num_experts=cfg.n_routed_experts,
                top_k=cfg.num_experts_per_tok,
                total=sum(_nbytes(s) for s in tensors.values()),
            )
        )
    return out


def kv_read_bytes(cfg: DeepseekV4ModelConfig, layer: int, context: int, kv_bytes: int = 2) -> int:
    """KV bytes one sequence's decode query at `context` tokens reads in `layer`: its window
    (min(context, sliding_window) keys), the HCA entries (context // m), or the CSA
    selection (min(index_topk, context // 4) entries) plus the indexer's scan of every
    CSA key (context // 4 of index_head_dim). `kv_bytes`: bytes per stored value."""
    ratio = cfg.compress_ratios[layer]
    keys = min(context, cfg.sliding_window) * cfg.head_dim
    if ratio == CSA_RATIO:
        committed = context // ratio
        keys += min(cfg.index_topk, committed) * cfg.head_dim + committed * cfg.index_head_dim
    elif ratio:
        keys += context // ratio * cfg.head_dim
    return keys * kv_bytes


def state_read_bytes(cfg: DeepseekV4ModelConfig, layer: int) -> float:
    """Pooling-state bytes one sequence's decode step reads in `layer`, amortised: each
    compressor's float32 state [2, R, W] (R = m for HCA, 2m for CSA's overlapping pair of
    windows; W = head_dim, 2 x head_dim for CSA, 2 x index_head_dim for its indexer) is
    read whole when a window closes, once every m tokens."""
    ratio = cfg.compress_ratios[layer]
    if ratio == 0:
        return 0.0
    if ratio != CSA_RATIO:
        return 2 * ratio * cfg.head_dim * 4 / ratio
    rows = 2 * ratio
    return 2 * rows * (2 * cfg.head_dim + 2 * cfg.index_head_dim) * 4 / ratio


class DecodeReads:
    """What a decode step of the model `cfg` describes must read, counted once from its hub
    tensor table (formats from `cfg.quantization_config`, floats and KV in `float_dtype`)."""

    def __init__(self, cfg: DeepseekV4ModelConfig, float_dtype=torch.bfloat16) -> None:
        specs = hub_tensor_specs(cfg, dtype=float_dtype, mtp=False)
        self.cfg = cfg
        self.layers = layer_reads(cfg, specs)
        self.kv_bytes = torch.finfo(float_dtype).bits // 8
        outside = {n: _nbytes(s) for n, s in specs.items() if not n.startswith("layers.")}
        self.head = outside.pop("head.weight")
        embed = outside.pop("embed.weight")
        self.embed_row, self.vocab = embed // cfg.vocab_size, cfg.vocab_size
        self.final = sum(outside.values())  # the final norm and hc_head_*

    def step(self, batch: int, context: int) -> dict:
        """A decode step of `batch` sequences at `context` tokens each: `layers` (per layer
        its `parts`, `kv` and `state` included, and `total`), `globals` (the head whole, one
        embedding row per sequence, the final norm and hc_head_*), `parts` summed over
        both, `total`."""
        layers = []
        for reads in self.layers:
            parts = reads.step_bytes(batch)
            kv = kv_read_bytes(self.cfg, reads.index, context, self.kv_bytes)
            parts["kv"] = float(batch * kv)
            parts["state"] = batch * state_read_bytes(self.cfg, reads.index)
            layers.append({"parts": parts, "total": sum(parts.values())})
        globals_ = {
            "head": float(self.head),
            "embed_rows": float(self.embed_row * min(batch, self.vocab)),
            "final": float(self.final),
        }
        parts = {p: sum(la["parts"][p] for la in layers) for p in (*PARTS, "kv", "state")}
        parts |= globals_
        return {"layers": layers, "globals": globals_, "parts": parts, "total": sum(parts.values())}


LayerKind = tuple[int, bool]  # (compress_ratio, hash_routing)


def extrapolate_step_ms(
    step_ms: float,
    eager_step_ms: float,
    measured: list[tuple[LayerKind, float]],
    full: list[LayerKind],
) -> tuple[float, dict[str, str]]:
    """The step time of the model whose layers are `full` (kinds in order), from a measured
    model's step (`step_ms`) and its layers' times (`measured`: kind, ms) in eager steps
    whose median was `eager_step_ms`.

    Each full layer takes the median time of the measured layers of its kind; a kind not
    measured takes that of its compress ratio's layers, else the median of all measured
    layers. The eager step less its layers is the time outside them (embedding, head,
    sampling, host work), kept; the step then scales by full / measured eager time. When
    the measured steps were the eager ones this is that rest plus the full layers' sum;
    when they replayed CUDA graphs it assumes the graphs save the same share of every
    layer. Returns the ms and, per full kind, which measurements stood in for it."""
    if not measured:
        raise ValueError("no measured layer to extrapolate from")

    def median_of(pick) -> float | None:
        times = [ms for kind, ms in measured if pick(kind)]
        return statistics.median(times) if times else None

    layers_ms, sources = 0.0, {}
    for kind in full:
        label = _kind_label(kind)
        ms = median_of(lambda k, kind=kind: k == kind)
        source = label
        if ms is None:
            ms = median_of(lambda k, kind=kind: k[0] == kind[0])
            source = f"{_kind_label((kind[0], not kind[1]))} (routing differs)"
        if ms is None:
            ms = median_of(lambda k: True)
            source = "all measured layers (kind not measured)"
        layers_ms += ms
        sources[label] = source
    measured_ms = sum(ms for _, ms in measured)
    rest_ms = max(eager_step_ms - measured_ms, 0.0)
    return step_ms * (rest_ms + layers_ms) / (rest_ms + measured_ms), sources


def _kind_label(kind: LayerKind) -> str:
    ratio, hashed = kind
    name = {0: "sliding", CSA_RATIO: "csa"}.get(ratio, f"hca{ratio}")
    return f"{name}+{'hash' if hashed else 'topk'}"
