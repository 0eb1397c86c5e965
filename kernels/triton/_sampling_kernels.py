"""Triton bodies for sampling.py."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gumbel(seed, step, rnd, offs):
    """Gumbel(0, 1) noise for vocabulary slots `offs`, a pure function of
    (seed, step, round, slot): the same numbers on every run and batch layout."""
    key = seed * 1000003 + step * 64 + rnd
    u = tl.rand(key, offs)
    return -tl.log(-tl.log(u))


@triton.jit
def gumbel_noise_kernel(seed_ptr, step_ptr, out_ptr, V, stride_o, BLOCK_V: tl.constexpr):
    """Round-0 noise of `sample_kernel`, for tests and the reference."""
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        tl.store(out_ptr + row * stride_o + offs, _gumbel(seed, step, 0, offs), mask=offs < V)


@triton.jit
def sample_kernel(
    # pointers
    logits_ptr,  # [B, V]
    temp_ptr,  # [B] float32; <= 0 means greedy
    top_k_ptr,  # [B] int32; <= 0 means off
    top_p_ptr,  # [B] float32; >= 1 means off
    min_p_ptr,  # [B] float32; <= 0 means off
    seed_ptr,  # [B] int64
    step_ptr,  # [B] int64: the row's token index, so every step draws fresh numbers
    out_ptr,  # [B] int64 sampled ids
    # sizes
    V,
    stride_l,
    # meta-parameters
    MAX_ROUNDS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Rejection sampling from the filtered distribution without sorting.

    Let z = logits / T - max. The allowed set A (top-k, top-p, min-p) is an upper set of z.
    Each round draws from {z > pivot} by Gumbel-max (one pass); if the draw w is in A
    (count(z > z_w) < k and mass(z > z_w) < p, one pass) it is returned, else pivot = z_w
    and the next round draws again. A stays inside the candidate set, so an accepted draw
    is distributed exactly as the filtered softmax. Rounds are few in practice (each
    rejection removes the candidate and everything less likely); after MAX_ROUNDS the
    most likely token, always in A, is returned."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    top_k = tl.load(top_k_ptr + row)
    top_k = tl.where(top_k <= 0, V, top_k)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)

    # Pass 1: max and normaliser of z, and the argmax (greedy answer and the fallback).
    m = float("-inf")
    z_sum = 0.0
    best = 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        blk_max = tl.max(z, axis=0)
        blk_arg = tl.argmax(z, axis=0) + v0
        best = tl.where(blk_max > m, blk_arg, best)
        m_new = tl.maximum(m, blk_max)
        z_sum = z_sum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    # min-p keeps p >= min_p * p_max, i.e. z - m >= log(min_p): start the pivot there.
    pivot = tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    pivot = pivot - 1e-6 * tl.abs(pivot)  # keep the boundary token (z == log(min_p))

    result = best
    done = greedy.to(tl.int32)
    rnd = 0
    while (done == 0) & (rnd < MAX_ROUNDS):
        # Draw: argmax of z + Gumbel over z > pivot.
        race_best = float("-inf")
        winner = best
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t - m
            key = tl.where(z > pivot, z + _gumbel(seed, step, rnd, offs), float("-inf"))
            blk_max = tl.max(key, axis=0)
            blk_arg = tl.argmax(key, axis=0) + v0
            winner = tl.where(blk_max > race_best, blk_arg, winner)
            race_best = tl.maximum(race_best, blk_max)
        z_w = tl.load(base + winner).to(tl.float32) * inv_t - m
        # Check: how many tokens, and how much mass, are strictly more likely than w.
        above = 0
        mass = 0.0
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t - m
            more = z > z_w
            above += tl.sum(more.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(more, tl.exp(z), 0.0), axis=0)
        ok = (above < top_k) & (mass / z_sum < top_p)
        ok = ok | (race_best == float("-inf"))  # nothing left above the pivot: cannot happen
        result = tl.where(ok, winner, result)
        done = ok.to(tl.int32)
        pivot = z_w
        rnd += 1
    tl.store(out_ptr + row, result.to(tl.int64))
