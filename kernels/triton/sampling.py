"""Token sampling on the GPU with per-row parameters and no host sync.

logits [B, V] (float32/bf16); every parameter is a [B] tensor, so one captured graph serves
any mix of greedy and sampled rows:
  temperature float32 (<= 0: greedy), top_k int32 (<= 0: off), top_p float32 (>= 1: off),
  min_p float32 (<= 0: off), seed int64, step int64 (the row's output position).
Random numbers come from Philox keyed by (seed, step, round), drawn inside the kernel, so a
row's tokens depend only on its own seed and logits, never on the batch it ran in.
Returns token ids [B] int64.
"""

from __future__ import annotations

import torch

from kernels.triton._common import check_device
from kernels.triton._sampling_kernels import gumbel_noise_kernel, sample_kernel

MAX_ROUNDS = 32


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
    if b:
        sample_kernel[(b,)](
            logits, temperature, top_k, top_p, min_p, seed, step, out, v, logits.stride(0),
            MAX_ROUNDS=MAX_ROUNDS, BLOCK_V=min(block_v, 1 << (v - 1).bit_length()),
            num_warps=8,
        )  # fmt: skip
    return out


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32: the first-round noise `sample` draws for these rows."""
    check_device(seed, step)
    out = torch.empty((seed.shape[0], vocab), dtype=torch.float32, device=seed.device)
    if seed.shape[0]:
        block = min(4096, 1 << (vocab - 1).bit_length())
        gumbel_noise_kernel[(seed.shape[0],)](seed, step, out, vocab, out.stride(0), BLOCK_V=block)
    return out
