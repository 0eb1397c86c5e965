"""Triton GPU kernels. Each public op is a small wrapper module (`<op>.py`: layout asserts,
allocation, grid, launch) with its `@triton.jit` bodies in `_<op>_kernels.py` (or the same
file when small) and a plain torch twin in kernels/reference/<op>.py.

Ops (all plain functions on tensors, shapes documented on each):
  fp8_linear.fp8_block_linear      y = x W^T with FP8 E4M3 weights and 128x128 block scales
  fused_moe.fused_moe              routed experts (bf16 / FP8 block / MXFP4) in two launches
  moe_align.moe_align              tokens grouped by expert (the sort step of fused_moe)
  moe_router.moe_route             sigmoid / sqrtsoftplus, bias, group-limited top-k
  moe_router.moe_gate_route        the same with the float32 gate GEMV inside (one launch)
  rmsnorm.rmsnorm                  RMSNorm with an optional fused residual add
  rope.apply_rope_                 rotary embedding in place, interleaved or neox layout
  mla_decode.mla_decode            absorbed MLA decode over a paged compressed cache
  sampling.sample                  temperature / top-k / top-p / min-p, seeded per row

Under TRITON_INTERPRET=1 (CPU tests) the same kernels run in Triton's interpreter; see
_common.py for the one behaviour we work around there.
"""
