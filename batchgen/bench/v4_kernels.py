"""`batchgen bench v4-kernels`: DeepSeek-V4-Flash's decode kernels at their real shapes, in
GB/s and as a fraction of the device-to-device copy bandwidth measured in the same run,
next to the torch form of the same op (the engine's CPU ops run on the GPU).

- attention (kernels/triton/v4_attention.py): one query per sequence, 64 heads of 512,
  over its 128-key window and its compressed entries (CSA: 512 selected; HCA: every
  entry of a context of `--context` tokens). Bytes: the keys a row must read, once per
  row, (window + entries) * 512 * 2, plus q and o.
- mHC (kernels/triton/hyper_connections.py): `pre` (mixes, Sinkhorn, collapse) and
  `post` at T tokens, C = 4, D = 4096. Bytes: the streams read (and written by post),
  fn once per launch (24 x 16384 x 4 = 1.5 MiB), x and y.

Each case is timed over several inputs whose total exceeds the L2, replayed in one CUDA
graph (kernels/tune/timing.time_chain), as a decode step's 43 layers read theirs.
"""

from __future__ import annotations

import click
import torch

from batchgen.bench.common import write_result
from kernels.tune.timing import copy_bandwidth, time_chain

H, HEAD_DIM, WINDOW, TOPK, D, C = 64, 512, 128, 512, 4096, 4
COPIES = 8  # inputs per case, cycled, so the L2 does not hold them


def _attention_case(mode: str, batch: int, context: int, device) -> dict:
    from kernels.triton.v4_attention import v4_attention_decode

    ratio = {"sliding": 1, "csa": 4, "hca": 128}[mode]
    block = 128
    entries_per_seq = context // ratio if mode != "sliding" else 0
    blocks_per_seq = -(-context // block)
    g = torch.Generator(device=device).manual_seed(batch)
    calls, nbytes = [], 0
    for _ in range(COPIES):
        q = torch.randn(batch, H, HEAD_DIM, device=device, generator=g).bfloat16()
        ring = torch.randn(batch, WINDOW, HEAD_DIM, device=device, generator=g).bfloat16()
        positions = torch.full((batch,), context - 1, dtype=torch.int32, device=device)
        slots = torch.arange(batch, dtype=torch.int32, device=device)
        sinks = torch.randn(H, device=device, generator=g)
        cache = tables = sel = None
        if mode != "sliding":
            n_blocks = batch * blocks_per_seq
            cache = torch.randn(
                n_blocks, block // ratio, HEAD_DIM, device=device, generator=g
            ).bfloat16()
            tables = torch.arange(n_blocks, dtype=torch.int32, device=device).view(batch, -1)
        if mode == "csa":
            sel = torch.stack(
                [torch.randperm(entries_per_seq, device=device, generator=g)[:TOPK]
                 for _ in range(batch)]
            ).int()  # fmt: skip
        keys = WINDOW + (min(TOPK, entries_per_seq) if mode == "csa" else entries_per_seq)

        def call(q=q, ring=ring, cache=cache, positions=positions, slots=slots, tables=tables,
                 sinks=sinks, sel=sel):  # fmt: skip
            return v4_attention_decode(
                q, ring, cache, positions, slots, tables, sinks, window=WINDOW,
                ratio=ratio, mode=mode, sel=sel, max_position=context - 1,
            )  # fmt: skip

        calls.append(call)
        nbytes = batch * (keys * HEAD_DIM * 2 + 2 * H * HEAD_DIM * 2)
    ms = time_chain(calls)
    return {"op": f"v4-attention-{mode}", "batch": batch, "context": context,
            "keys_per_row": keys, "bytes": nbytes, "us": ms * 1e3}  # fmt: skip


def _mhc_case(tokens: int, device) -> dict:
    from kernels.triton.hyper_connections import hc_post, hc_pre

    g = torch.Generator(device=device).manual_seed(tokens)
    mix = (2 + C) * C
    fn = torch.randn(mix, C * D, device=device, generator=g) / (C * D) ** 0.5
    base = torch.randn(mix, device=device, generator=g) * 0.5
    scale = torch.rand(3, device=device, generator=g) + 0.5
    pre_calls, post_calls = [], []
    for _ in range(COPIES):
        streams = torch.randn(tokens, C, D, device=device, generator=g).bfloat16()
        y = torch.randn(tokens, D, device=device, generator=g).bfloat16()
        pre_calls.append(lambda s=streams: hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6))
        _, post, comb = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
        post_calls.append(lambda s=streams, y=y, p=post, c=comb: hc_post(y, s, p, c))
    stream_bytes = tokens * C * D * 2
    pre = {"op": "mhc-pre", "batch": tokens, "us": time_chain(pre_calls) * 1e3,
           "bytes": stream_bytes + fn.numel() * 4 + tokens * D * 2}  # fmt: skip
    post = {"op": "mhc-post", "batch": tokens, "us": time_chain(post_calls) * 1e3,
            "bytes": 2 * stream_bytes + tokens * D * 2}  # fmt: skip
    return [pre, post]


def run(batches: tuple[int, ...], context: int) -> dict:
    device = torch.device("cuda")
    copy_bps = copy_bandwidth(device)
    rows = []
    for mode in ("sliding", "csa", "hca"):
        for b in batches:
            rows.append(_attention_case(mode, b, context, device))
    for t in batches:
        rows.extend(_mhc_case(t, device))
    for r in rows:
        r["gb_s"] = r["bytes"] / (r["us"] * 1e-6) / 1e9
        r["copy_fraction"] = r["bytes"] / (r["us"] * 1e-6) / copy_bps
        click.echo(f"{r['op']:20s} batch {r['batch']:4d}  {r['us']:9.1f} us  "
                   f"{r['gb_s']:8.1f} GB/s  {100 * r['copy_fraction']:5.1f}% of copy")  # fmt: skip
    return {"copy_tb_s": copy_bps / 1e12, "context": context, "results": rows,
            "device": torch.cuda.get_device_name(device)}  # fmt: skip


@click.command()
@click.option("--batches", default="1,8,32,128,256", show_default=True)
@click.option("--context", type=int, default=4096, show_default=True,
              help="Tokens of context per row (CSA / HCA entries = context / 4, / 128).")  # fmt: skip
@click.option("--name", default="v4-kernels", show_default=True)
def command(batches: str, context: int, name: str) -> None:
    """DeepSeek-V4 decode attention and mHC kernels: GB/s and % of copy at Flash shapes."""
    counts = tuple(int(v) for v in batches.split(",") if v.strip())
    click.echo(f"wrote {write_result(name, run(counts, context))}")
