"""Engine settings chosen by the user, resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from engine.expert_placement import HOST_COMPUTE

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# From 64 tokens per step the bf16 decode of FP8 weights into the MMA is compute-bound;
# native FP8 decodes Moonlight FP8 + MXFP4 4-7% faster there on the H200 (batch 128 and
# 256, docs/notes-gpu-engine.md), with logits within 6e-2 of the float32 path
# (tests/engine/test_gpu_engine.py). Below 64 the decode path is as fast and exact against
# the bf16 activations.
FP8_NATIVE_MIN_TOKENS = 64


@dataclass(frozen=True)
class CudaTuning:
    """How the CUDA backend runs the model: choices that change speed, not what a row
    means (each default is the measured winner on the H200, docs/notes-gpu-engine.md).
    The CPU ignores them. Passed whole to the backend when the model is prepared."""

    # GPUs with FP8 tensor cores (compute capability 8.9+): dense FP8 linears of steps with
    # at least this many tokens quantize their activations to E4M3 per token per 128 (as
    # DeepSeek's own inference does everywhere) and multiply FP8 x FP8. None: never; the
    # activations stay bf16 and the weights are decoded to bf16 (exact against them). A
    # decode step replayed from a CUDA graph counts its bucket's padded batch.
    fp8_native_min_tokens: int | None = FP8_NATIVE_MIN_TOKENS
    # In steps of up to 64 tokens (where the fused MoE launches add the shared expert;
    # engine/backends/cuda/moe.py SHARED_FUSED_MAX_TOKENS) the shared expert runs on a
    # second stream, concurrently with the routed experts. False: one stream.
    shared_expert_stream: bool = True
    # Decode graphs of up to 16 sequences (cuda_graph_runner.MAIN_STREAM_FIRST_MAX_BATCH)
    # are captured on a high-priority stream. Graph kernel nodes keep the priority of the
    # stream they were captured on, so when the main chain's kernels (attention, routing,
    # routed experts) and the shared expert's (default priority, on its side stream) both
    # wait for room on an SM, the main chain's blocks go first. False: equal priorities.
    main_stream_first: bool = True
    # MLA's expanded form (prefill) computes keys, values and attention in the model's
    # dtype (bf16 tensor cores, flash attention with a float32 softmax, as transformers'
    # bf16 model does): Moonlight-shape logits within bf16 tolerance and prefill ~13%
    # faster than float32 on the H200. True: in float32. A float32 model computes float32
    # either way.
    mla_expanded_float32: bool = False
    # DeepSeek models: decode steps whose stacked q/kv_a runs the FP8 GEMV (1-8 tokens by
    # the H200's table) compute the layer's input RMSNorm inside it, one launch fewer per
    # layer: ~1% more batch-1 tok/s, FP8 + MXFP4 on the H200.
    fold_input_norm: bool = True

    def __post_init__(self) -> None:
        if self.fp8_native_min_tokens is not None and self.fp8_native_min_tokens < 1:
            raise ValueError(
                f"fp8_native_min_tokens must be >= 1 or None, got {self.fp8_native_min_tokens}"
            )


CUDA_TUNING_FIELDS = frozenset(f.name for f in fields(CudaTuning))


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    # Sequences decoding at once; "auto": the model runner picks it from the KV budget at
    # expected_seq_len tokens per sequence (None: max_model_len), capped per device
    # (engine/batch_size.py), and stores the number here.
    max_num_seqs: int | str = 64
    expected_seq_len: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a share of what the device has free
    max_model_len: int | None = None
    seed: int = 0
    record_routing: bool = False
    speculative_tokens: int = 0  # MTP draft tokens per step (0: off; 1..4)
    # Launch decode step n+1 before reading step n's tokens, so the host's per-step work
    # overlaps the GPU's (engine/pending_step.py). None: on when decode steps replay CUDA
    # graphs. A sequence that stops on a token computes one extra row, which is dropped.
    async_scheduling: bool | None = None
    # Steps all decode or all prefill, waiting sequences admitted in groups of at least
    # min_prefill_seqs (engine/scheduler.py). None: on where decode steps replay CUDA graphs,
    # which a step mixing in a prefill chunk cannot; min_prefill_seqs None: max_num_seqs / 2.
    separate_prefill: bool | None = None
    min_prefill_seqs: int | None = None
    # CPU: attention (and MLA's form choice) whose result for a row does not depend on
    # the rest of its step (docs/batch-invariance.md). False takes the fused forms.
    batch_invariant: bool = True
    # Routed experts computed in host RAM by the CPU (engine/expert_placement.py): "off",
    # "auto" (what does not fit the GPU after the dense weights and reserves), or a
    # placement file. `expert_routing_stats`: a `batchgen bench routing --out` file that
    # "auto" keeps the most routed experts on the GPU by.
    expert_offload: str = "off"
    expert_routing_stats: str | None = None
    # How a step computes the host experts (engine/expert_placement.py HOST_COMPUTE):
    # "cpu" (where they live), or "pcie" (copied to the GPU when routed to: the slow way,
    # for benchmarks; its decode steps are not captured as graphs).
    expert_offload_compute: str = "cpu"
    # Full KV blocks are shared by content between sequences whose tokens start the same
    # way (engine/prefix_cache.py): a shared prompt prefix, and n > 1 completions, are
    # computed once. Outputs are the same either way. Models with fixed per-sequence
    # state (DeepSeek-V4) run without it (docs/prefix-caching.md says why).
    enable_prefix_caching: bool = True
    cuda: CudaTuning = field(default_factory=CudaTuning)

    @classmethod
    def from_options(cls, model: str, **options) -> EngineConfig:
        """EngineConfig from one flat set of keyword options (what `LLM(model, **options)`
        takes): CudaTuning's names go into `cuda`, the rest are EngineConfig's own."""
        own = {f.name for f in fields(cls)} - {"model", "cuda"}
        unknown = sorted(set(options) - own - CUDA_TUNING_FIELDS)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        tuning = {k: options.pop(k) for k in list(options) if k in CUDA_TUNING_FIELDS}
        return cls(model=str(model), cuda=CudaTuning(**tuning), **options)

    def __post_init__(self) -> None:
        if self.max_num_seqs != "auto" and (
            isinstance(self.max_num_seqs, bool)
            or not isinstance(self.max_num_seqs, int)
            or self.max_num_seqs < 1
        ):
            raise ValueError(f"max_num_seqs must be >= 1 or 'auto', got {self.max_num_seqs!r}")
        if self.expected_seq_len is not None and self.expected_seq_len < 1:
            raise ValueError(f"expected_seq_len must be >= 1, got {self.expected_seq_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0 <= self.speculative_tokens <= 4:
            raise ValueError(f"speculative_tokens must be in 0..4, got {self.speculative_tokens}")
        if self.async_scheduling and self.speculative_tokens:
            raise ValueError(
                "async_scheduling does not combine with speculative_tokens: a speculative "
                "step needs its drafts' outcome before the next one is scheduled"
            )
        if self.min_prefill_seqs is not None and self.min_prefill_seqs < 1:
            raise ValueError(f"min_prefill_seqs must be >= 1 or None, got {self.min_prefill_seqs}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto or one of {sorted(_DTYPES)}")
        if self.expert_offload_compute not in HOST_COMPUTE:
            raise ValueError(
                f"expert_offload_compute must be one of {HOST_COMPUTE}, got "
                f"{self.expert_offload_compute!r}"
            )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
        return device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        # CPUs without bf16 matrix units run float32 faster; GPUs run bf16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @property
    def explicit_dtype(self) -> torch.dtype | None:
        return None if self.dtype == "auto" else _DTYPES[self.dtype]
