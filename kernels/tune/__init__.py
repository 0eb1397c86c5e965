"""The kernels' autotuner: on a GPU, time candidate launch configs for a shape and keep the
fastest, for kernels/triton/configs/<op>.json (written through configs.write_entries).

  timing.py     CUDA-graph timing and the copy bandwidth the benchmarks compare against
  fused_moe.py  fused MoE candidates and `tune` for one shape, each kernel timed alone
  fp8_linear.py FP8 linear candidates and `tune`, timed as a chain over weight copies
  step.py       fused MoE entries tuned inside a whole decode step (the caller times it)

A run never imports this package; `batchgen bench kernels --tune` and `bench step-tune`
drive it.
"""
