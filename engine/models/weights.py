"""Strict, streamed weight loading shared by the model families."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


def _fmt(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def raise_on_mismatch(missing: list[str], unexpected: list[str]) -> None:
    """Raise CheckpointMismatch naming the missing and the unexpected checkpoint tensors
    (the first 20 of each, sorted), if there are any."""
    problems = []
    if missing:
        problems.append(f"missing tensors: {_fmt(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_fmt(unexpected)}")
    if problems:
        raise CheckpointMismatch("checkpoint does not match the model; " + "; ".join(problems))


def run_after_loading_hooks(model: nn.Module) -> None:
    """Call each submodule's process_weights_after_loading (repacking, fused views), once
    every tensor is in place."""
    for sub in model.modules():
        hook = getattr(sub, "process_weights_after_loading", None)
        if callable(hook) and sub is not model:
            hook()


def load_strict(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | tuple[str, int] | None] = lambda name: name,
    optional: Callable[[str], bool] = lambda name: False,
    fused_sources: Callable[[str], list[str]] | None = None,
) -> None:
    """Copy each (name, tensor) into the parameter or persistent buffer of that name.

    `rename` maps a checkpoint name to a parameter name (None: skip it on purpose), or to
    (parameter name, first row) for a parameter that fuses several checkpoint tensors
    along its rows (q/k/v or gate/up projections): the tensor fills rows
    first..first+len; `fused_sources(name)` lists the checkpoint tensors a fused
    parameter is made of, so a missing one is reported by its own name. Unexpected names,
    shape mismatches and parameters never filled (every row, for fused ones) unless
    `optional` raise CheckpointMismatch naming them.
    Tensors are consumed one at a time, so the checkpoint is never held twice in memory.
    """
    targets: dict[str, torch.Tensor] = dict(module.named_parameters())
    for name, buf in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if leaf not in sub._non_persistent_buffers_set:
            targets[name] = buf
    unexpected: list[str] = []
    seen: set[str] = set()
    filled_rows: dict[str, int] = {}
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        name, first = name if isinstance(name, tuple) else (name, None)
        target = targets.get(name)
        if target is None:
            unexpected.append(ckpt_name)
            continue
        if first is not None:
            target = target[first : first + tensor.shape[0]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointMismatch(
                f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        seen.add(ckpt_name)
        filled_rows[name] = filled_rows.get(name, 0) + (target.shape[0] if target.dim() else 1)
    missing = []
    for n, t in targets.items():
        if filled_rows.get(n, 0) < (t.shape[0] if t.dim() else 1) and not optional(n):
            parts = fused_sources(n) if fused_sources else []
            missing.extend([p for p in parts if p not in seen] if parts else [n])
    raise_on_mismatch(missing, unexpected)
    run_after_loading_hooks(module)
