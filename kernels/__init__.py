"""Compute kernels. Every kernel has a plain torch reference twin and a test comparing them.
GPU kernels are Triton (kernels/triton/); CPU kernels are numba or torch (kernels/cpu/).
This package shares its name with Hugging Face's `kernels` hub package: transformers must
never mistake it for that one (tests/kernels/test_name_hazard.py)."""
