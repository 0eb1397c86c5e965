"""The CUDA backend: Triton kernels over the weights in their stored format, registered
as the "cuda" ops of each layer type (engine/ops/device_layer.py).

  norm_linear.py      RMSNorm (residual add fused), FP8 block linears, stacked linears
  moe.py              router kernel + fused MoE (bf16 / FP8 / MXFP4), decode prologue
  expert_stacking.py  experts' gate and up stacked as views for the fused kernel
  mla.py              MLA decode (rope + cache write + absorption, absorbed decode kernel)
                      and prefill projections
  memory.py           the KV cache's share of GPU memory after a warm-up forward

The Triton kernels take bf16/fp16 activations. A float32 model (exactness tests) keeps
the torch code except where it would sync the host (decode attention; experts).
"""

from engine.backends.cuda import hyper_connections, mla, moe, norm_linear, v4_attention  # noqa: F401  (they register)
