"""Device backends for the engine's layers. The layer classes stay the same on every
device; when their inputs are CUDA tensors they call the functions in `cuda.py` (Triton
kernels over the weights in their stored format)."""
