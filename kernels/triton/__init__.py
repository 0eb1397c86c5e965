"""Triton GPU kernels. Each public op is a small wrapper module (`<op>.py`: layout asserts,
allocation, grid, launch) with its `@triton.jit` bodies in the private `_<op>_kernels.py`
(helpers shared by several in `_common.py`) and a plain torch twin in
kernels/reference/<op>.py, the oracle of its tests. Shape letters: docs/shapes.md.

Ops (all plain functions on tensors, shapes documented on each):
  fp8_linear.fp8_block_linear      y = x W^T with FP8 E4M3 weights and 128x128 block scales
  fp8_linear.fp8_gemv_rmsnorm      RMSNorm(x + residual) then the FP8 GEMV, in one launch
  fused_moe.fused_moe              routed experts (bf16 / FP8 block / MXFP4) in two launches
  moe_align.moe_align              tokens grouped by expert (the sort step of fused_moe)
  moe_router.moe_route             sigmoid / sqrtsoftplus / softmax, bias, group-limited
                                   top-k -> (weights, ids)
  moe_router.moe_gate_route        the same with the float32 gate GEMV inside (one launch)
  moe_prologue.moe_prologue        decode-sized router + grouping + int8 x + zeroing, one launch
  mxfp4_dequant.dequant_mxfp4      MXFP4 weights to bf16 (the MoE's prefill path)
  rmsnorm.rmsnorm                  RMSNorm with an optional fused residual add
  rope.apply_rope_                 rotary embedding in place, interleaved or neox layout
  mla_cache.mla_rope_cache_write_  MLA rope + latent norm + cache write (and the W_UK
  mla_cache.mla_decode_prologue_   absorption of q_nope, decode sizes), one launch
  mla_decode.mla_decode            absorbed MLA decode over a paged compressed cache
  matmul.fixed_linear, fixed_bmm   matmuls whose rows do not depend on the batch size
  sampling.sample                  temperature / top-k / top-p / min-p, seeded per row

Under TRITON_INTERPRET=1 (CPU tests) the same kernels run in Triton's interpreter; see
_common.py for the one behaviour we work around there.
"""
