"""Triton kernels run for real on a CUDA machine and in Triton's CPU interpreter otherwise.
TRITON_INTERPRET must be set before triton is first imported by any test module (a kernel
module imported without it defines its helpers for the GPU, and interpreted kernels then
cannot call them), hence here, at the root of the tests."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
