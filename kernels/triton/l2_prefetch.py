"""Warm the GPU's L2 cache with weights a later kernel will read: `l2_prefetch(plan)`.

Why: a decode step at a few tokens is a chain of latency-bound kernels (H200, Moonlight
batch 1: every kernel of the attention half reads DRAM at under a fifth of its peak; the
MoE's two chains at ~1.5 TB/s of 4.3). Each one waits on DRAM round trips for weights that
were known long before its turn. Issued on a side stream while an earlier kernel of the
chain runs, a prefetch moves those weights into L2 with the DRAM bandwidth that kernel
leaves idle; the consumer then meets L2 latency instead of DRAM's.

A plan is the list of (address, bytes) chunks covering some tensors (`PrefetchPlan`),
built once; a launch gives each chunk to one thread. On Hopper and newer each thread issues
one `cp.async.bulk.prefetch.L2` for its whole chunk (the copy engine walks it; nothing
lands in registers or shared memory, so the kernel exits as soon as the requests are
issued). Older GPUs take `prefetch.global.L2` per 128-byte line.

A prefetch is only a hint: it changes no value, and under the CPU interpreter (which has
no inline assembly) `l2_prefetch` launches nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_device, interpreting

# Bytes per chunk (one thread's request). 32 KB keeps a 16 MB plan at ~500 requests, over
# ~16 one-warp programs, so the requests enter the memory system from several SMs at once.
CHUNK_BYTES = 32 << 10
LINE_BYTES = 128  # the per-line path's stride (an L2 line)
ALIGN = 16  # the bulk prefetch wants 16-byte aligned addresses and sizes
THREADS = 32  # one warp per program


@dataclass(frozen=True)
class PrefetchPlan:
    """chunks [n, 2] int64 (address, bytes) on the tensors' device; `nbytes` their sum,
    `max_chunk` the largest (host-side, so a launch reads nothing back from the device).
    The tensors must outlive the plan (the addresses are baked in, as a graph's are)."""

    chunks: torch.Tensor
    nbytes: int
    max_chunk: int

    @property
    def num_chunks(self) -> int:
        return self.chunks.shape[0]


def byte_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The [start, end) address ranges the tensors span, in first-seen order,
    with overlapping or touching ranges merged (views of one stacked weight count once)."""
    ranges: list[list[int]] = []
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        # the span from the first element to the last (a strided view's gaps included)
        assert all(st >= 0 for st in t.stride()), "negative strides are not supported"
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        start = t.data_ptr()
        end = start + (last + 1) * t.element_size()
        for r in ranges:
            if start <= r[1] and r[0] <= end:  # overlaps or touches: widen in place
                r[0], r[1] = min(r[0], start), max(r[1], end)
                break
        else:
            ranges.append([start, end])
    return [(s, e) for s, e in ranges]


def build_plan(
    tensors: Iterable[torch.Tensor], max_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES
) -> PrefetchPlan | None:
    """A plan over the tensors' bytes, in the given order, stopping at `max_bytes` (the
    earliest-read weights first, so a cap drops the latest). Ranges are trimmed inward to
    16-byte boundaries (the bulk prefetch's alignment; at most 30 bytes of a tensor go
    unfetched). None when nothing is left to fetch."""
    assert chunk_bytes % ALIGN == 0 and chunk_bytes > 0, (
        f"chunk_bytes must be a multiple of {ALIGN}"
    )
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return None
    device = tensors[0].device
    budget = max_bytes if max_bytes is not None else 1 << 62
    chunks: list[tuple[int, int]] = []
    total = 0
    for start, end in byte_ranges(tensors):
        start = -(-start // ALIGN) * ALIGN
        end = min(end // ALIGN * ALIGN, start + (budget - total) // ALIGN * ALIGN)
        for lo in range(start, end, chunk_bytes):
            size = min(chunk_bytes, end - lo)
            chunks.append((lo, size))
            total += size
        if total >= budget:
            break
    if not chunks:
        return None
    table = torch.tensor(chunks, dtype=torch.int64, device=device)
    return PrefetchPlan(table, total, max(size for _, size in chunks))


@triton.jit
def _bulk_prefetch(addr, size):
    """cp.async.bulk.prefetch.L2 of `size` bytes at `addr` (skipped where size is 0)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _line_prefetch(addr, valid):
    """prefetch.global.L2 of the line at `addr` (skipped where valid is 0)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.s32 p, $2, 0;
        @p prefetch.global.L2 [$1];
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [addr, valid],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def l2_prefetch_kernel(
    chunks_ptr,  # [n, 2] int64: address, bytes
    n,
    BULK: tl.constexpr,
    LINES: tl.constexpr,  # lines per chunk on the per-line path
    LINE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    addr = tl.load(chunks_ptr + offs * 2, mask=mask, other=0)
    size = tl.load(chunks_ptr + offs * 2 + 1, mask=mask, other=0).to(tl.int32)
    if BULK:
        _bulk_prefetch(addr, size)
    else:
        for line in range(LINES):
            at = line * LINE
            _line_prefetch(addr + at, (at < size).to(tl.int32))


def bulk_supported(device: torch.device) -> bool:
    """cp.async.bulk exists from sm_90 (Hopper) on."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def l2_prefetch(plan: PrefetchPlan | None, bulk: bool | None = None) -> None:
    """Ask L2 to fetch the plan's bytes; returns once the requests are launched (stream
    ordered like any kernel). `bulk` None: the bulk path where the GPU has it."""
    if plan is None or interpreting():
        return
    check_device(plan.chunks)
    if bulk is None:
        bulk = bulk_supported(plan.chunks.device)
    n = plan.num_chunks
    l2_prefetch_kernel[(triton.cdiv(n, THREADS),)](
        plan.chunks,
        n,
        BULK=bulk,
        LINES=1 if bulk else triton.cdiv(plan.max_chunk, LINE_BYTES),
        LINE=LINE_BYTES,
        BLOCK=THREADS,
        num_warps=1,
    )
