"""max_num_seqs "auto": how many sequences run at once when the user leaves it to the engine.

The most that the KV budget holds at the expected sequence length (the job's prompt plus
output tokens), capped where a bigger batch stops paying: on a GPU at the largest decode
graph bucket measured to still raise throughput, on the CPU at the engine's fixed default
(a CPU step's time grows with its rows, so a larger batch buys little).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# The CUDA cap: Moonlight-16B-A3B on one H200, sampled, still gains from 512 to 1,024
# sequences (end to end, bf16 +10%, FP8 + MXFP4 +6%: data/benchmarks/peer-short-bf16.json,
# peer-short-fp8-mxfp4.json; docs/notes-vllm-peer.md).
AUTO_MAX_NUM_SEQS_CUDA = 1024
DEFAULT_MAX_NUM_SEQS = 64  # also the CPU's "auto"


def auto_cap(device: torch.device) -> int:
    """The most sequences "auto" picks on this device."""
    return AUTO_MAX_NUM_SEQS_CUDA if device.type == "cuda" else DEFAULT_MAX_NUM_SEQS


@dataclass
class BatchSizeChoice:
    """What "auto" chose and why (the engine's log, a job's report)."""

    max_num_seqs: int
    cap: int
    kv_holds: int  # sequences of expected_seq_len the KV budget holds
    expected_seq_len: int
    per_sequence_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def choose_max_num_seqs(
    budget_bytes: int,
    per_block_bytes: int,
    state_bytes_per_seq: int,
    block_size: int,
    expected_seq_len: int,
    cap: int,
) -> BatchSizeChoice:
    """The batch size for `budget_bytes` of KV cache and sequence state: as many sequences
    of `expected_seq_len` tokens (whole blocks each) as fit, at most `cap`."""
    blocks = -(-expected_seq_len // block_size)
    per_seq = blocks * per_block_bytes + state_bytes_per_seq
    holds = max(0, budget_bytes) // per_seq
    if holds < 1:
        raise ValueError(
            f"max_num_seqs auto: {max(0, budget_bytes)} bytes of KV memory do not hold one "
            f"sequence of {expected_seq_len} tokens ({per_seq} bytes); give the engine more "
            "memory or a shorter max_model_len"
        )
    return BatchSizeChoice(min(cap, holds), cap, holds, expected_seq_len, per_seq)
