"""`batchgen bench mla-decode`: the MLA decode attention kernel (kernels/triton/mla_decode.py)
at the engine's decode shapes, in GB/s of cache read and % of the copy bandwidth, for a
sweep of its launch settings (context tile, warps, pipeline stages, sequence splits).

Why: it is one of a decode step's longest kernels (on the H200 ~10 us per layer at batch
1 for 0.3 MB of cache), and its launch settings (mla_decode's defaults, choose_num_splits,
default_value_blocks) are what this sweep found fastest.

Bytes per call: the cache rows read (context x (kv_lora + rope) x 2), q and the output.
Each call reads its own cache copy, and the copies together exceed the L2, all captured
back to back in one CUDA graph (as the engine replays a decode step).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import click
import torch

from batchgen.bench.common import write_result
from kernels.tune.timing import copy_bandwidth, time_chain

# Moonlight / DeepSeek-V3 MLA: kv_lora 512, rope 64; heads 16 (Moonlight) and 128 (V3).
KVL, ROPE, BLOCK_SIZE = 512, 64, 16
# (name, batch, context per sequence, heads): decode shapes of `bench decode-moe` (prompt
# 128 + up to 128 new tokens) and one long context.
CASES = [
    ("moonlight-b1-ctx256", 1, 256, 16),
    ("moonlight-b1-ctx4096", 1, 4096, 16),
    ("moonlight-b8-ctx256", 8, 256, 16),
    ("moonlight-b32-ctx192", 32, 192, 16),
    ("moonlight-b128-ctx192", 128, 192, 16),
    ("moonlight-b256-ctx192", 256, 192, 16),
    ("v3-b32-ctx1024", 32, 1024, 128),
]
CHAIN_BYTES = 200 << 20  # copies of the cache per timed chain: past the 50 MB L2
CHAIN_MAX = 1024  # batch 1, context 256 reads 0.3 MB per call: ~680 copies


def _case_tensors(batch: int, context: int, heads: int, copies: int, device):
    gen = torch.Generator(device="cpu").manual_seed(batch * 7 + context)
    blocks = -(-context // BLOCK_SIZE)
    caches, tables = [], []
    for _ in range(copies):
        caches.append(torch.randn(batch * blocks, BLOCK_SIZE, KVL + ROPE, device=device,
                                  dtype=torch.bfloat16))  # fmt: skip
        perm = torch.randperm(batch * blocks, generator=gen).to(device)
        tables.append(perm.view(batch, blocks).to(torch.int32))
    q_c = torch.randn(batch, heads, KVL, device=device, dtype=torch.bfloat16)
    q_r = torch.randn(batch, heads, ROPE, device=device, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q_c, q_r, caches, tables, lens


def engine_settings(batch: int, context: int, heads: int, device) -> dict:
    """What the engine launches (mla_decode's defaults, choose_num_splits)."""
    from kernels.triton.mla_decode import (
        choose_num_splits,
        default_num_warps,
        default_value_blocks,
    )

    splits = choose_num_splits(batch, context, heads, device)
    return dict(block_t=32, num_warps=default_num_warps(KVL, splits), num_stages=2,
                splits=splits, prefetch=1,
                value_blocks=default_value_blocks(batch, heads, splits, KVL, device))  # fmt: skip


def _settings(batch: int, context: int, heads: int, device) -> list[dict]:
    """Tile x warps x stages at the split count the engine would choose for that tile,
    then split sequences without the page-index prefetch at 16- and 32-slot tiles and 8
    warps, all with one value block; then the engine's launch with its output columns over
    1, 2, 4 and 8 programs at 4 and 8 warps. bench_case then tries half and twice the best
    one's splits."""
    from kernels.triton.mla_decode import choose_num_splits

    out = []
    for block_t, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 3)):
        splits = choose_num_splits(batch, context, heads, device, block_t)
        out.append(dict(block_t=block_t, num_warps=warps, num_stages=stages, splits=splits,
                        prefetch=1))  # fmt: skip
    for block_t in (16, 32):
        splits = choose_num_splits(batch, context, heads, device, block_t)
        out.append(dict(block_t=block_t, num_warps=8, num_stages=2, splits=splits, prefetch=0))
    engine = engine_settings(batch, context, heads, device)
    for blocks in (1, 2, 4, 8):
        for warps in (4, 8):
            out.append(dict(engine, value_blocks=blocks, num_warps=warps))
    return out


def bench_case(name: str, batch: int, context: int, heads: int, copy_bps: float, device):
    from kernels.triton.mla_decode import mla_decode

    nbytes = batch * context * (KVL + ROPE) * 2 + 2 * batch * heads * (2 * KVL + ROPE)
    copies = max(2, min(CHAIN_MAX, math.ceil(CHAIN_BYTES / nbytes)))
    q_c, q_r, caches, tables, lens = _case_tensors(batch, context, heads, copies, device)
    rows: list[dict] = []

    def time(s: dict) -> float:
        calls = [functools.partial(mla_decode, q_c, q_r, c, t, lens, 0.1, s["splits"],
                                   s["block_t"], s["num_warps"], s["num_stages"],
                                   s["prefetch"], s.get("value_blocks", 1))
                 for c, t in zip(caches, tables)]  # fmt: skip
        return time_chain(calls, warmup_ms=5, rep_ms=40)

    def row(s: dict, ms: float, engine: bool = False) -> dict:
        gbs = nbytes / (ms * 1e-3) / 1e9
        return dict(case=name, batch=batch, context=context, heads=heads, bytes=nbytes,
                    us=1e3 * ms, gb_s=gbs, copy_frac=gbs * 1e9 / copy_bps, settings=s,
                    engine=engine)  # fmt: skip

    def record(s: dict) -> None:
        if any(r["settings"] == s for r in rows):
            return
        try:
            rows.append(row(s, time(s)))
        except Exception as err:  # a setting can exceed shared memory or registers
            print(f"  skip {s}: {type(err).__name__}")

    # the engine's own launch first; it must run (a failure there is a real error)
    engine_s = engine_settings(batch, context, heads, device)
    rows.append(row(engine_s, time(engine_s), engine=True))
    for s in _settings(batch, context, heads, device):
        record(s)
    best = min(rows, key=lambda r: r["us"])["settings"]
    for splits in {max(1, best["splits"] // 2), 2 * best["splits"]}:
        record(dict(best, splits=splits))
    engine, best_row = rows[0], min(rows, key=lambda r: r["us"])
    print(f"{name:24} engine {engine['us']:7.1f} us ({100 * engine['copy_frac']:4.1f}%)  "
          f"best {best_row['us']:7.1f} us ({100 * best_row['copy_frac']:4.1f}%) "
          f"{best_row['settings']}")  # fmt: skip
    return rows


def run(only: str = "", on_case: Callable[[dict], None] | None = None) -> dict:
    """Every case (or those whose name contains one of `only`'s comma-separated parts);
    returns {"copy_tb_s", "results"}. `on_case(payload)` is called after each case, so a
    run stopped at its time limit can keep the cases it finished."""
    if not torch.cuda.is_available():
        raise click.ClickException("bench mla-decode needs a CUDA GPU")
    device = torch.device("cuda")
    parts = [p.strip() for p in only.split(",") if p.strip()]
    cases = [c for c in CASES if not parts or any(p in c[0] for p in parts)]
    if not cases:
        raise click.ClickException(f"--only {only!r} matches none of {[c[0] for c in CASES]}")
    copy_bps = copy_bandwidth(device)
    payload: dict = {"copy_tb_s": copy_bps / 1e12, "results": []}
    for case in cases:
        payload["results"] += bench_case(*case, copy_bps, device)
        if on_case is not None:
            on_case(payload)
    return payload


@click.command("mla-decode")
@click.option("--only", default="", help="Cases whose name contains this (comma: any of several).")
@click.option("--name", default="mla-decode-h200", show_default=True, help="JSON file name.")
def command(only: str, name: str) -> None:
    """MLA decode attention: GB/s and % of copy bandwidth over a sweep of launch settings."""
    written = []
    run(only, on_case=lambda payload: written.append(write_result(name, payload)))
    click.echo(f"wrote {written[-1]}")


if __name__ == "__main__":
    command()
