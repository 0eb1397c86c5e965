"""Token sampling on the GPU with per-row parameters and no host sync.

logits [B, V] (float32/bf16); every parameter is a [B] tensor, so one captured graph serves
any mix of greedy and sampled rows:
  temperature float32 (<= 0: greedy), top_k int32 (<= 0: off), top_p float32 (>= 1: off),
  min_p float32 (<= 0: off), seed int64, step int64 (the row's output position).
Random numbers come from Philox keyed by (seed, step, round), drawn inside the kernel, so a
row's tokens depend only on its own seed and logits, never on the batch it ran in (nor on
how many programs the first pass is split over: the noise is keyed by vocabulary index).
Returns token ids [B] int64.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._sampling_kernels import gumbel_noise_kernel, sample_kernel

MAX_ROUNDS = 32
# Programs the first pass (max, normaliser, argmax) spreads over, all rows together: a
# batch-1 row of 160K logits in 4096-wide blocks gets one block per program.
FIRST_PASS_PROGRAMS = 256


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    block_v: int = 4096,
) -> torch.Tensor:
    """See the module docstring."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be a row-major [B, V]"
    b, v = logits.shape
    want = {
        "temperature": (temperature, torch.float32),
        "top_k": (top_k, torch.int32),
        "top_p": (top_p, torch.float32),
        "min_p": (min_p, torch.float32),
        "seed": (seed, torch.int64),
        "step": (step, torch.int64),
    }
    for name, (t, dtype) in want.items():
        assert t.shape == (b,), f"{name} must be [{b}], got {list(t.shape)}"
        assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"
    check_device(logits, temperature, top_k, top_p, min_p, seed, step)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if not b:
        return out
    block = max(4, min(block_v, 1 << (v - 1).bit_length()))  # the noise comes in fours
    blocks = triton.cdiv(v, block)
    # enough programs to fill the GPU at batch 1; whole blocks per split, none empty
    per_split = triton.cdiv(blocks, max(1, min(blocks, triton.cdiv(FIRST_PASS_PROGRAMS, b))))
    splits = triton.cdiv(blocks, per_split)
    block_s = next_pow2(splits)
    if splits > 1:
        part_f = torch.empty((b, 3, block_s), dtype=torch.float32, device=logits.device)
        part_i = torch.empty((b, 2, block_s), dtype=torch.int32, device=logits.device)
        counters = arrival_counters(logits.device, b)
    else:  # never touched: one program per row keeps everything in registers
        part_f = part_i = counters = out
    sample_kernel[(b, splits)](
        logits, temperature, top_k, top_p, min_p, seed, step, out, part_f, part_i, counters,
        v, logits.stride(0), per_split * block,
        MAX_ROUNDS=MAX_ROUNDS, BLOCK_V=block, SPLITS=splits, BLOCK_S=block_s,
        ASM=not interpreting(), num_warps=8,
    )  # fmt: skip
    return out


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32: the first-round noise `sample` draws for these rows."""
    check_device(seed, step)
    out = torch.empty((seed.shape[0], vocab), dtype=torch.float32, device=seed.device)
    if seed.shape[0]:
        block = max(4, min(4096, 1 << (vocab - 1).bit_length()))
        gumbel_noise_kernel[(seed.shape[0],)](
            seed, step, out, vocab, out.stride(0), BLOCK_V=block, ASM=not interpreting()
        )
    return out
