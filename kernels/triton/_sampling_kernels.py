"""Triton bodies for sampling.py."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _log2(x, ASM: tl.constexpr):
    """log2 by the hardware's approximation (lg2.approx: ~2^-22 absolute error) instead of
    the ~20-instruction accurate one; tl.log2 under the interpreter. Only for arguments
    whose log2 is not tiny: near x = 1 an absolute error that size is all of the result."""
    if ASM:
        out = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                        is_pure=True, pack=1)  # fmt: skip
    else:
        out = tl.log2(x)
    return out


@triton.jit
def _gumbel(seed, step, rnd, v0, BLOCK_V: tl.constexpr, ASM: tl.constexpr):
    """Gumbel(0, 1) noise for vocabulary slots v0 .. v0 + BLOCK_V - 1 (v0 a multiple of 4,
    BLOCK_V >= 4), a pure function of (seed, step, round, slot): the same numbers on every
    run and batch layout. One Philox evaluation (10 rounds, ~80 instructions) makes four
    numbers: slots 4q .. 4q + 3 take the four of counter q (tl.rand would use one of the
    four per slot, and its Philox would be most of a sampling pass's instructions)."""
    key = seed * 1000003 + step * 64 + rnd
    u0, u1, u2, u3 = tl.rand4x(key, v0 // 4 + tl.arange(0, BLOCK_V // 4))
    lane = tl.arange(0, 4)[None, :]
    u = tl.where(lane < 2, tl.where(lane == 0, u0[:, None], u1[:, None]),
                 tl.where(lane == 2, u2[:, None], u3[:, None]))  # fmt: skip
    # -log(-log(u)): the inner log accurate (u close to 1 makes it tiny, where the fast
    # one's absolute error could turn it to 0 and the noise to +inf), the outer one fast
    return tl.reshape(-0.6931471805599453 * _log2(-tl.log(u), ASM), [BLOCK_V])


@triton.jit
def gumbel_noise_kernel(
    seed_ptr, step_ptr, out_ptr, V, stride_o, BLOCK_V: tl.constexpr, ASM: tl.constexpr
):
    """Round-0 noise of `sample_kernel`, for tests and the reference."""
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        tl.store(
            out_ptr + row * stride_o + offs, _gumbel(seed, step, 0, v0, BLOCK_V, ASM), mask=offs < V
        )


@triton.jit
def _first_pass(base, lo, hi, inv_t, draw, seed, step, BLOCK_V: tl.constexpr, ASM: tl.constexpr):
    """Over z = logits[lo:hi] * inv_t: (max, sum of exp(z - max), first index of the max,
    and when `draw` the first round's Gumbel race: its best key and winner among finite z).
    A span of -inf only gives (-inf, 0, lo, -inf, lo): no NaN from exp(-inf - -inf). The
    race's keys leave out the global max that the rounds subtract: the same argmax."""
    m = float("-inf")
    z_sum = 0.0
    best = lo
    race = float("-inf")
    winner = lo
    for v0 in range(lo, hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_t
        blk_max = tl.max(z, axis=0)
        blk_arg = tl.argmax(z, axis=0) + v0
        best = tl.where(blk_max > m, blk_arg, best)
        m_new = tl.maximum(m, blk_max)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        z_sum = z_sum * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if draw:
            key = tl.where(
                z > float("-inf"), z + _gumbel(seed, step, 0, v0, BLOCK_V, ASM), float("-inf")
            )
            key_max = tl.max(key, axis=0)
            winner = tl.where(key_max > race, tl.argmax(key, axis=0) + v0, winner)
            race = tl.maximum(race, key_max)
    return m, z_sum, best, race, winner


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
    part_f_ptr,  # [B, 3, BLOCK_S] float32: each split's max, normaliser, race (SPLITS > 1)
    part_i_ptr,  # [B, 2, BLOCK_S] int32: each split's first argmax and winner (SPLITS > 1)
    counters_ptr,  # [B] int32, zero between launches (_arrival_counters; SPLITS > 1)
    # sizes
    V,
    stride_l,
    SPAN,  # vocabulary entries per split, a multiple of BLOCK_V
    # meta-parameters
    MAX_ROUNDS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLITS: tl.constexpr,  # grid axis 1: programs sharing the first pass of a row
    BLOCK_S: tl.constexpr,  # next power of two >= SPLITS
    ASM: tl.constexpr,  # the noise's PTX log (off under the interpreter)
):
    """Rejection sampling from the filtered distribution without sorting.

    Let z = logits / T - max. The allowed set A (top-k, top-p, min-p) is an upper set of z.
    Each round draws from {z > pivot} by Gumbel-max (one pass); if the draw w is in A
    (count(z > z_w) < k and mass(z > z_w) < p, one pass) it is returned, else pivot = z_w
    and the next round draws again. A stays inside the candidate set, so an accepted draw
    is distributed exactly as the filtered softmax. Rounds are few in practice (each
    rejection removes the candidate and everything less likely); after MAX_ROUNDS the
    most likely token, always in A, is returned.

    The first pass (max, normaliser, argmax: all a greedy row needs; without min-p also
    the first draw) is split over SPLITS programs per row, each over SPAN entries: one
    program walking a 160K vocabulary is a chain of 40 dependent loads (~40 us on an H200
    at any batch). Each stores its partial and counts itself in; the last to arrive merges
    them (the first split holding the max gives the argmax, so ties go to the lowest index
    as in one pass) and goes on alone. Each later pass checks one draw and makes the next
    (the draw a rejection asks for is known before the check ends: pivot = z_w), so a
    round costs one pass, and a row with no filter takes its first draw without any."""
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

    # min-p keeps p >= min_p * p_max, i.e. z - m >= log(min_p): the first pivot. Without
    # min-p it is -inf, and the first draw needs no global max: the first pass makes it.
    draw0 = (not greedy) & (min_p <= 0.0)
    # Pass 1: max and normaliser of z, the argmax (greedy answer and the fallback), and
    # without min-p the first round's draw.
    if SPLITS == 1:
        m, z_sum, best, race, winner = _first_pass(
            base, 0, V, inv_t, draw0, seed, step, BLOCK_V, ASM
        )
    else:
        split = tl.program_id(1)
        lo = split * SPAN
        m_s, z_s, best_s, race_s, winner_s = _first_pass(
            base, lo, tl.minimum(lo + SPAN, V), inv_t, draw0, seed, step, BLOCK_V, ASM
        )
        part_f = part_f_ptr + row * 3 * BLOCK_S
        part_i = part_i_ptr + row * 2 * BLOCK_S
        tl.store(part_f + split, m_s)
        tl.store(part_f + BLOCK_S + split, z_s)
        tl.store(part_f + 2 * BLOCK_S + split, race_s)
        tl.store(part_i + split, best_s)
        tl.store(part_i + BLOCK_S + split, winner_s)
        # Every thread's stores before the counter's release (acq_rel at gpu scope).
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLITS - 1:
            return
        # .cg: read at L2, past this SM's L1, which may hold stale lines of these buffers
        offs_s = tl.arange(0, BLOCK_S)
        live = offs_s < SPLITS
        m_all = tl.load(part_f + offs_s, mask=live, other=float("-inf"), cache_modifier=".cg")
        z_all = tl.load(part_f + BLOCK_S + offs_s, mask=live, other=0.0, cache_modifier=".cg")
        race_all = tl.load(part_f + 2 * BLOCK_S + offs_s, mask=live, other=float("-inf"),
                           cache_modifier=".cg")  # fmt: skip
        best_all = tl.load(part_i + offs_s, mask=live, other=0, cache_modifier=".cg")
        winner_all = tl.load(part_i + BLOCK_S + offs_s, mask=live, other=0, cache_modifier=".cg")
        m = tl.max(m_all, axis=0)
        shift = tl.where(m == float("-inf"), 0.0, m)
        z_sum = tl.sum(tl.where(m_all == float("-inf"), 0.0, z_all * tl.exp(m_all - shift)), axis=0)
        # the first split holding the max: ties go to the lowest index, as in one pass
        first = tl.min(tl.where(m_all == m, offs_s, BLOCK_S), axis=0)
        best = tl.sum(tl.where(offs_s == first, best_all, 0), axis=0)
        race = tl.max(race_all, axis=0)
        first = tl.min(tl.where(race_all == race, offs_s, BLOCK_S), axis=0)
        winner = tl.sum(tl.where(offs_s == first, winner_all, 0), axis=0)
        tl.atomic_xchg(counters_ptr + row, 0)  # zero again for the next launch
    if race == float("-inf"):
        winner = best  # no draw made (or nothing finite to draw from)
    pivot = tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    pivot = pivot - 1e-6 * tl.abs(pivot)  # keep the boundary token (z == log(min_p))

    result = best
    done = greedy.to(tl.int32)
    # No filter at all: every draw is accepted, so the first is the answer.
    if draw0 & (top_k >= V) & (top_p >= 1.0):
        result = winner
        done = 1
    if (done == 0) & (min_p > 0.0):
        # The first draw over z > pivot, which needed the global max: one pass.
        race = float("-inf")
        winner = best
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t - m
            key = tl.where(z > pivot, z + _gumbel(seed, step, 0, v0, BLOCK_V, ASM), float("-inf"))
            key_max = tl.max(key, axis=0)
            winner = tl.where(key_max > race, tl.argmax(key, axis=0) + v0, winner)
            race = tl.maximum(race, key_max)
    rnd = 0
    while (done == 0) & (rnd < MAX_ROUNDS):
        # Check the draw w: how many tokens, and how much mass, are strictly more likely.
        # The same pass makes the next round's draw, over z > z_w with its own noise,
        # which is the draw a rejection asks for (unused when w is accepted).
        z_w = tl.load(base + winner).to(tl.float32) * inv_t - m
        above = 0
        mass = 0.0
        next_race = float("-inf")
        next_winner = best
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t - m
            more = z > z_w
            above += tl.sum(more.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(more, tl.exp(z), 0.0), axis=0)
            key = tl.where(more, z + _gumbel(seed, step, rnd + 1, v0, BLOCK_V, ASM), float("-inf"))
            key_max = tl.max(key, axis=0)
            next_winner = tl.where(key_max > next_race, tl.argmax(key, axis=0) + v0, next_winner)
            next_race = tl.maximum(next_race, key_max)
        ok = (above < top_k) & (mass / z_sum < top_p)
        ok = ok | (race == float("-inf"))  # nothing left above the pivot: cannot happen
        result = tl.where(ok, winner, result)
        done = ok.to(tl.int32)
        winner, race = next_winner, next_race
        rnd += 1
    tl.store(out_ptr + row, result.to(tl.int64))
