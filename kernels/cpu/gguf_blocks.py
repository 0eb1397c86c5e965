"""GGUF (ggml) block formats Q8_0, Q4_0 and Q4_1: decode stored blocks into their parts
and into float32.

Every format stores 32 weights per block, blocks laid along a row (the input dimension):

    Q8_0: d: fp16,          q: 32 x int8           34 bytes   w = d * q
    Q4_0: d: fp16,          q: 16 bytes of nibbles 18 bytes   w = d * (q - 8)
    Q4_1: d: fp16, m: fp16, q: 16 bytes of nibbles 20 bytes   w = d * q + m

Nibble order: byte j holds element j in its low nibble and element j + 16 in its high
nibble. The float32 results equal gguf-py's `gguf.quants.dequantize` bit for bit: the
same fp16 -> fp32 casts and the same single rounding of each product and sum (tests
check this on random blocks).

Legend: R = rows (output features), B = blocks per row, K = B * 32 values per row.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """View raw bytes [R, B * block_bytes] as [R, B, block_bytes]."""
    if raw.dtype != torch.uint8:
        raise TypeError(f"{qtype} blocks must be uint8 bytes, got {raw.dtype}")
    nbytes = BLOCK_BYTES[qtype]
    if raw.shape[-1] % nbytes:
        raise ValueError(
            f"{qtype} row of {raw.shape[-1]} bytes is not a whole number of {nbytes}-byte blocks"
        )
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes, nbytes)


def _fp16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 stored at byte `offset` of each block, as float32 [R, B]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> 32 values in 0..15, low nibbles first: [R, B, 32] uint8."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def split_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes [R, B*34] -> (q int8 [R, B, 32], d float32 [R, B])."""
    blocks = _blocks(raw, "Q8_0")
    d = _fp16_at(blocks, 0)
    q = blocks[..., 2:].contiguous().view(torch.int8)
    return q, d


def split_q4(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 bytes -> (q uint8 in 0..15 [R, B, 32], d [R, B], m [R, B]) with
    w = d * q + m; Q4_0's fixed offset of -8 becomes m = -8 d (exact in float32)."""
    blocks = _blocks(raw, qtype)
    d = _fp16_at(blocks, 0)
    if qtype == "Q4_0":
        return _nibbles(blocks[..., 2:]), d, -8.0 * d
    if qtype == "Q4_1":
        return _nibbles(blocks[..., 4:]), d, _fp16_at(blocks, 2)
    raise ValueError(f"split_q4 takes Q4_0 or Q4_1, got {qtype}")


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes [R, B*34] -> float32 [R, B*32]."""
    q, d = split_q8_0(raw)
    w = q.float() * d[..., None]  # [R, B, 32]
    return w.reshape(*raw.shape[:-1], -1)


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """Q4_0 bytes [R, B*18] -> float32 [R, B*32]."""
    blocks = _blocks(raw, "Q4_0")
    d = _fp16_at(blocks, 0)
    q = _nibbles(blocks[..., 2:]).to(torch.int8) - 8
    w = d[..., None] * q.float()  # [R, B, 32]
    return w.reshape(*raw.shape[:-1], -1)


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_1 bytes [R, B*20] -> float32 [R, B*32]."""
    q, d, m = split_q4(raw, "Q4_1")
    w = d[..., None] * q.float() + m[..., None]  # [R, B, 32]
    return w.reshape(*raw.shape[:-1], -1)


DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}


def dequantize_blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """Any supported block type's bytes [R, B*bytes] -> float32 [R, B*32]."""
    if qtype not in DEQUANTIZE:
        raise ValueError(f"no block decoder for {qtype}; supported: {sorted(DEQUANTIZE)}")
    return DEQUANTIZE[qtype](raw)


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes one row of `in_features` values takes in a block type."""
    if in_features % BLOCK_SIZE:
        raise ValueError(f"{qtype} needs rows of a multiple of 32 values, got {in_features}")
    return in_features // BLOCK_SIZE * BLOCK_BYTES[qtype]
