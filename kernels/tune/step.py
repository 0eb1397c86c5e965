"""Tuning the fused MoE table entries a decode step reads, by the time of the whole step
rather than of each kernel alone.

Why: at a few tokens the shared expert's launches run on a side stream beside the routed
experts', and a tile tuned alone (fused_moe.py here) can be the worst one beside them. On
the H200 (Moonlight shape, FP8 + MXFP4, batch 1) the shared expert's FP8 down runs ~3x
longer in the step than alone, and the DOWN tile chosen in the step (32 rows, K in 4
splits) makes decode ~9% faster than the tile chosen alone (docs/notes-gpu-engine.md, "v10
results"). So `tune_entries` patches
one entry at a time (coordinate descent over a few stages of candidates, configs.store) and
asks the caller to time the step with it; the caller owns the step (capturing its graph
again, replaying it on real decode inputs), this module only the configs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.triton import configs, fused_moe

OP = fused_moe.OP


@dataclass(frozen=True)
class MoeEntry:
    """One fused_moe table entry a decode step reads: the routed experts' or the shared
    expert's (one expert taken by every token)."""

    role: str  # "routed" | "shared"
    top_k: int
    experts: int
    d: int
    i: int
    fmt: str

    def key(self, bucket: int) -> str:
        return fused_moe.shape_key(bucket, self.top_k, self.experts, self.d, self.i, self.fmt)

    def base(self, bucket: int, device: torch.device) -> dict:
        """The config the engine launches now: the table's entry, else the heuristic."""
        if self.role == "shared":
            return fused_moe.dense_config(bucket, self.d, self.i, self.fmt, device)
        return fused_moe.choose_config(
            bucket, self.top_k, self.experts, self.d, self.i, self.fmt, device
        )


def _shared_down_tiles(best: dict) -> list[dict]:
    # the launch that ran long beside the routed kernels
    return [
        dict(best, DOWN={"BLOCK_N": bn, "SPLIT_K": sk}) for bn in (32, 64) for sk in (1, 2, 4, 8)
    ]


def _shared_gate_up_tiles(best: dict) -> list[dict]:
    # K splits (arrival counters; the SWAP_AB tile only) and rows per program
    splits = [dict(best, GU_SPLIT_K=g) for g in (1, 2, 4, 8)] if best.get("SWAP_AB") else []
    return splits + [dict(best, BLOCK_N=bn) for bn in (32, 64, 128)]


def _int8_prefetch(best: dict) -> list[dict]:
    # Next step's loads before this step's math, or each tile just before its own: the
    # first wins alone, the second can win beside the shared expert (the H200's one-token
    # entry has PREFETCH off)
    return [dict(best, PREFETCH=not best.get("PREFETCH", True))]


def _int8_tiles(best: dict) -> list[dict]:
    return [dict(best, BLOCK_N=bn, num_warps=w) for bn in (32, 64) for w in (4, 8)]


def _int8_down_tiles(best: dict) -> list[dict]:
    return [dict(best, DOWN={"BLOCK_N": bn, "num_warps": w}) for bn in (32, 64) for w in (4, 8)]


def _mma_tiles(best: dict) -> list[dict]:
    return [dict(best, BLOCK_N=bn) for bn in (32, 64, 128)]


def _mma_down_splits(best: dict) -> list[dict]:
    return [dict(best, DOWN={"SPLIT_K": s}) for s in (1, 2, 4)]


def candidate_stages(entry: MoeEntry, base: dict) -> list[Callable[[dict], list[dict]]]:
    """Stages of candidates, each a function of the best config so far -> configs to time.
    Kept small: each costs a graph capture (and a compile where the tile is new)."""
    if entry.role == "shared":
        return [_shared_down_tiles, _shared_gate_up_tiles]
    if base.get("KERNEL") == "int8":
        return [_int8_prefetch, _int8_tiles, _int8_down_tiles]
    return [_mma_tiles, _mma_down_splits]


def tune_entries(
    entries: list[MoeEntry],
    bucket: int,
    device: torch.device,
    step_ms: Callable[[], float],
    log: Callable[[str], None] = print,
) -> tuple[dict, list[dict]]:
    """Coordinate descent over each entry's stages at decode bucket `bucket`: each
    candidate is stored (configs.store) and step_ms() times the step with it (inf when it
    does not compile, launch or validate). Returns ({key: best}, every timed row). The
    best configs stay stored, so later entries are timed beside the earlier ones' best;
    the caller clears them (configs.clear_stored) when done."""
    tuned, rows = {}, []
    for entry in entries:
        key = entry.key(bucket)

        def timed(cfg: dict, key: str = key) -> float:
            configs.store(OP, key, cfg, device)
            return step_ms()

        best = entry.base(bucket, device)
        best_ms = timed(best)
        rows.append(dict(bucket=bucket, role=entry.role, key=key, config=best, ms=best_ms,
                         base=True))  # fmt: skip
        log(f"batch {bucket} {entry.role} base {best_ms:.3f} ms {best}")
        for stage in candidate_stages(entry, best):
            for cfg in stage(best):
                if cfg == best:
                    continue
                ms = timed(cfg)
                rows.append(dict(bucket=bucket, role=entry.role, key=key, config=cfg, ms=ms))
                log(f"batch {bucket} {entry.role} {ms:.3f} ms {cfg}")
                if ms < best_ms:
                    best, best_ms = cfg, ms
        configs.store(OP, key, best, device)
        tuned[key] = best
        log(f"batch {bucket} {entry.role} best {best_ms:.3f} ms {best}")
    return tuned, rows
