"""Shared bits of the Triton kernel tests: the device to run on and a relative error."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# GPU-size cases only make sense on a GPU; the interpreter runs the small ones.
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere fails."""
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "output has NaN"
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    """A buffer full of NaN, so an element the kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
