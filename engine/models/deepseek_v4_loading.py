"""Loading a DeepSeek-V4 checkpoint into `DeepseekV4ForCausalLM`, strictly, from any of
the three layouts of engine/models/deepseek_v4_names.py: the hub's (FP8 / MXFP4 tensors
with E8M0 `.scale`, or float), transformers' `save_pretrained` files, and transformers'
module names (a `state_dict()`, experts stacked). A tensor's layout is told by its name,
so shards of one checkpoint need no declared layout. A block scale may also carry
transformers' name `*.weight_scale_inv` (E8M0, or float32 powers of two) in any of them.

Every tensor goes to one parameter (or one expert's slice of a stacked one) as stored:
quantized storage takes only its own kind of tensor, float parameters only float tensors,
and the shapes must agree. The hub's FP8 `wo_a` is the exception: it is dequantized once
into the engine's float parameter when both its weight and scale have been seen. Missing
and unexpected tensors are named in the hub's spelling.

The MTP layer (`mtp.{k}.*`, only in the hub's layout: transformers has none) loads as
strictly as the rest when the model built it. A checkpoint that holds none of its tensors
drops it unless the model requires it (`enable_mtp=True`); a model built without it
(`enable_mtp=False`) skips its tensors; `mtp.*` in a checkpoint whose config declares no
MTP layer is unexpected.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.deepseek_v4_names import from_layout, hub_names_of_hf
from engine.models.weights import CheckpointMismatch, raise_on_mismatch, run_after_loading_hooks
from kernels.formats.e8m0 import e8m0_to_float, float_to_e8m0_ceil
from kernels.formats.fp8 import dequantize_fp8_block

E8M0 = getattr(torch, "float8_e8m0fnu", None)
SHARED_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_LEAVES = ("weight", "scale")


@dataclass(frozen=True)
class Target:
    """Where a hub tensor goes: a parameter, or routed expert `expert`'s tensor `leaf` of
    an ExpertProjection (its device slot, or host staging: the projection says)."""

    param: torch.Tensor | None = None
    projection: nn.Module | None = None
    leaf: str | None = None
    expert: int | None = None

    def view(self) -> torch.Tensor:
        if self.projection is None:
            return self.param
        return self.projection.expert_tensor(self.leaf, self.expert)

    def loaded(self) -> None:
        if self.projection is not None:
            self.projection.expert_loaded(self.expert)


def hub_targets(model) -> dict[str, Target]:
    """Every parameter of the model under its hub name."""
    targets: dict[str, Target] = {}
    add = _adder(targets)
    add({"embed.weight": model.embed.weight, "norm.weight": model.norm.weight})
    add({"head.weight": model.head.weight})
    add(model.hc_head.checkpoint_tensors())
    for layer in model.layers:
        _block_targets(layer, targets)
    for mtp in model.mtp or []:
        add(mtp.checkpoint_tensors())
        _block_targets(mtp.block, targets)
    return targets


def _adder(targets: dict[str, Target]):
    def add(tensors: dict[str, nn.Parameter]) -> None:
        targets.update({name: Target(p) for name, p in tensors.items()})

    return add


def _block_targets(layer, targets: dict[str, Target]) -> None:
    """A decoder layer's parameters (a main layer's, or an MTP layer's block) by hub name."""
    add = _adder(targets)
    p = layer.prefix
    add({f"{p}attn_norm.weight": layer.attn_norm.weight})
    add({f"{p}ffn_norm.weight": layer.ffn_norm.weight})
    add(layer.attn.checkpoint_tensors())
    add(layer.hc_attn.checkpoint_tensors())
    add(layer.hc_ffn.checkpoint_tensors())
    ffn = layer.ffn
    add({f"{p}ffn.gate.weight": ffn.gate.weight})
    if ffn.gate.e_score_correction_bias is not None:
        add({f"{p}ffn.gate.bias": ffn.gate.e_score_correction_bias})
    if ffn.gate.tid2eid is not None:
        add({f"{p}ffn.gate.tid2eid": ffn.gate.tid2eid})
    for hub, ours in SHARED_EXPERT_PROJ.items():
        proj = getattr(ffn.shared_experts, ours)
        add({f"{p}ffn.shared_experts.{hub}.{n}": t for n, t in proj.named_parameters()})
        stacked = getattr(ffn.experts, ours)
        for leaf, _ in stacked.named_parameters():
            for j in range(stacked.num_experts):
                targets[f"{p}ffn.experts.{j}.{hub}.{leaf}"] = Target(
                    projection=stacked, leaf=leaf, expert=j
                )


class V4Loader:
    def __init__(self, model) -> None:
        self.model = model
        self.cfg = model.config
        self.targets = hub_targets(model)
        self.filled: set[str] = set()
        self.unexpected: list[str] = []
        self.mtp_seen = False
        # hub `...attn.wo_a.weight` name -> its FP8 codes or E8M0 scale, until both are here
        self.wo_a_parts: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        for hub, part in self._hub_tensors(name, tensor):
            self._fill(hub, part, name)

    def _hub_tensors(self, name: str, tensor: torch.Tensor):
        """The (hub name, tensor) pairs a checkpoint tensor holds ([] when skipped)."""
        if name.endswith(SCALE_INV):
            # transformers' name for a block scale (`.scale` in the hub), in any layout
            pairs = self._hub_tensors(name[: -len(SCALE_INV)] + ".weight", tensor)
            scale = e8m0_scale(tensor, name)
            return [(hub[: -len("weight")] + "scale", scale) for hub, _ in pairs]
        if name.startswith("mtp."):
            if self.model.mtp is not None:
                self.mtp_seen = True
                return [(name, tensor)]
            if self.cfg.num_nextn_predict_layers:
                return []  # built without the MTP layer (enable_mtp=False): skipped
            self.unexpected.append(name)
            return []
        if name in self.targets or name.endswith(".wo_a.scale"):
            return [(name, tensor)]
        try:
            return [(from_layout(name, "hf_saved", self.cfg), tensor)]
        except KeyError:
            pass
        try:
            return [(hub, place.take(tensor)) for hub, place in hub_names_of_hf(name, self.cfg)]
        except KeyError:
            self.unexpected.append(name)
            return []

    def _fill(self, hub: str, tensor: torch.Tensor, ckpt_name: str) -> None:
        if hub.endswith(".wo_a.weight") and tensor.dtype == torch.float8_e4m3fn:
            self._wo_a_part(hub, "weight", tensor)
            return
        if hub.endswith(".wo_a.scale"):
            weight = hub[: -len("scale")] + "weight"
            if weight not in self.targets:
                self.unexpected.append(ckpt_name)
                return
            self._wo_a_part(weight, "scale", tensor)
            return
        target = self.targets.get(hub)
        if target is None:
            self.unexpected.append(ckpt_name)
            return
        copy_as_stored(target.view(), tensor, ckpt_name)
        target.loaded()
        self.filled.add(hub)

    def _wo_a_part(self, weight_name: str, part: str, tensor: torch.Tensor) -> None:
        parts = self.wo_a_parts.setdefault(weight_name, {})
        parts[part] = tensor
        if len(parts) == 2:
            scale = parts["scale"]
            if scale.dtype != torch.uint8:
                scale = scale.view(torch.uint8)
            dense = dequantize_fp8_block(parts["weight"], scale, dtype=torch.float32)
            copy_as_stored(self.targets[weight_name].view(), dense, weight_name)
            self.filled.add(weight_name)
            del self.wo_a_parts[weight_name]

    def finish(self) -> None:
        model = self.model
        if model.mtp is not None and not self.mtp_seen and not model.mtp_required:
            # The checkpoint has no MTP layer (save_pretrained writes none): run without.
            model.mtp = None
            self.targets = hub_targets(model)
        missing = [n for n in self.targets if n not in self.filled]
        for weight_name, parts in self.wo_a_parts.items():
            lacking = "scale" if "weight" in parts else "weight"
            missing.append(weight_name[: -len("weight")] + lacking)
        raise_on_mismatch(missing, self.unexpected)
        run_after_loading_hooks(model)


SCALE_INV = ".weight_scale_inv"


def e8m0_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    """A block scale as E8M0 bits (uint8): E8M0 as is; float32 only where every value is a
    power of two (what `scale_fmt: ue8m0` promises), else refused naming the tensor."""
    if scale.dtype in (torch.uint8, E8M0):
        return scale.view(torch.uint8)
    if not scale.is_floating_point():
        raise CheckpointMismatch(f"tensor {name!r} is {scale.dtype}; expected a block scale")
    bits = float_to_e8m0_ceil(scale.float())
    if not torch.equal(e8m0_to_float(bits), scale.float()):
        raise CheckpointMismatch(
            f"tensor {name!r} holds block scales that are not powers of two; DeepSeek-V4's "
            "ue8m0 format needs them exactly"
        )
    return bits


def load_v4_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    loader = V4Loader(model)
    for name, tensor in weights:
        loader.add(name, tensor)
    loader.finish()


def copy_as_stored(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy `tensor` into `target` without changing its format: packed / E8M0 storage
    (uint8) takes int8, uint8 or float8_e8m0fnu bits; FP8 takes FP8; integer targets
    (tid2eid) take integers; float targets take float tensors that are not quantized."""
    if target.dtype == torch.uint8:
        if tensor.dtype in (torch.int8, E8M0):
            tensor = tensor.view(torch.uint8)
        ok = tensor.dtype == torch.uint8
        want = "packed int8 / E8M0"
    elif target.dtype == torch.float8_e4m3fn:
        ok, want = tensor.dtype == torch.float8_e4m3fn, "float8_e4m3fn"
    elif not target.is_floating_point():
        ok = not tensor.is_floating_point() and tensor.dtype != torch.bool
        want = "an integer tensor"
    else:
        ok = tensor.is_floating_point() and tensor.element_size() > 1
        want = f"a float tensor ({target.dtype})"
    if not ok:
        raise CheckpointMismatch(
            f"tensor {name!r} is {tensor.dtype}; the model expects {want} "
            "(does config.json's quantization_config match the checkpoint?)"
        )
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointMismatch(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)
