"""Triton kernel tests run for real on a CUDA machine and in Triton's CPU interpreter
otherwise. TRITON_INTERPRET must be set before triton is first imported, hence here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
