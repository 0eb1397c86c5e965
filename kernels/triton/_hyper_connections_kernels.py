"""@triton.jit bodies of kernels/triton/hyper_connections.py. Legend: docs/shapes.md (T tokens,
C streams, D hidden); K = C * D is the flattened stream, M the rows of fn ((2 + C) * C for a
sublayer's mix, C for the head's), M_PAD its power-of-two tile."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def hc_project_kernel(
    x_ptr,  # [T, K] the flattened streams (K contiguous)
    fn_ptr,  # [M, K] float32
    part_ptr,  # [SPLITS, T, M_PAD] float32 out: this split's x . fn rows, sum of x^2 at M
    T,
    K,
    M,
    K_PER_SPLIT,
    stride_xt,
    stride_fn,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    SUM_DOT: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T), SPLITS): BLOCK_T tokens against one K_PER_SPLIT slice of fn,
    so a launch reads fn cdiv(T, BLOCK_T) times (from memory once, then from L2), not per token.
    Each split writes its own partials: no atomics, and a token's sums do not depend on T.
    The sum of squares goes in the row's spare column M (M_PAD > M), one store per row.
    SUM_DOT (the interpreter only): the dot as a product summed over K. The interpreter's
    tl.dot is numpy's matmul, whose OpenBLAS kernels give a row other bits at another row
    of the tile, so a token alone would differ from the same token in a batch."""
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, M_PAD)
    t_mask = offs_t < T
    m_mask = offs_m < M
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        x = x.to(tl.float32)  # [BLOCK_T, BLOCK_K]
        w = tl.load(
            fn_ptr + offs_m[None, :] * stride_fn + offs_k[:, None],
            mask=k_mask[:, None] & m_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, M_PAD]
        if SUM_DOT:
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        sq += tl.sum(x * x, axis=1)
    acc = tl.where(offs_m[None, :] == M, sq[:, None], acc)
    offs_s = split.to(tl.int64) * T + offs_t
    tl.store(part_ptr + offs_s[:, None] * M_PAD + offs_m[None, :], acc, mask=t_mask[:, None])


@triton.jit
def _split_sum(part_ptr, t, T, cols, col_mask, SPLITS, M_PAD, SPLIT_CHUNK: tl.constexpr):
    """cols [N] -> sum over the splits of part[s, t, cols]: SPLIT_CHUNK splits per load
    (registers bounded for any SPLITS), the chunks added in split order."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s0 in range(0, SPLITS, SPLIT_CHUNK):
        offs_s = s0 + tl.arange(0, SPLIT_CHUNK)
        rows = (offs_s.to(tl.int64) * T + t) * M_PAD  # [SPLIT_CHUNK]
        mask = (offs_s < SPLITS)[:, None] & col_mask[None, :]
        part = tl.load(part_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(part, axis=0)
    return acc


@triton.jit
def _pick(vec, offs, idx):
    """vec [N] -> vec[idx] for an index tile of any shape (a masked sum: registers cannot
    be indexed)."""
    hit = tl.expand_dims(idx, len(idx.shape)) == offs
    return tl.sum(tl.where(hit, vec, 0.0), axis=len(idx.shape))


@triton.jit
def hc_mix_collapse_kernel(
    x_ptr,  # [T, C, D] streams (D contiguous)
    part_ptr,  # [SPLITS, T, M_PAD] float32 (column M: the split's sum of squares)
    base_ptr,  # [M] float32
    scale_ptr,  # [3] float32 ([1] for the head)
    out_ptr,  # [T, D] the collapse, streams' dtype
    post_ptr,  # [T, C] float32 out (HAS_COMB)
    comb_ptr,  # [T, C, C] float32 out (HAS_COMB)
    T,
    C,
    D,
    K,
    M,
    SPLITS,
    sinkhorn_iters,
    hc_eps,
    norm_eps,
    stride_xt,
    stride_xc,
    stride_out,
    M_PAD: tl.constexpr,
    C_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_COMB: tl.constexpr,
):
    """Grid (T, cdiv(D, BLOCK_D) + HAS_COMB): a token's first cdiv(D, BLOCK_D) programs
    each add the pre mixes and the sum of squares over the splits and collapse BLOCK_D
    columns; its last (HAS_COMB) adds all M_PAD columns and writes post and comb, so the
    serial Sinkhorn runs beside the collapse, not before it. The collapse programs all add
    the same [SPLIT_CHUNK, P_PAD] tiles, so pre is the same bits in each; the mix program's
    rstd (a wider tile, another reduction tree) may round apart from theirs, which is still
    a function of the token alone. The Sinkhorn order
    is engine/ops/hyper_connections.py's: row softmax + eps, a column normalisation, then
    sinkhorn_iters - 1 rounds of (rows, columns). Launched with one warp: a [C, C] tile's
    sums are then shuffles, not shared-memory round trips, 2 * sinkhorn_iters times."""
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_c = tl.arange(0, C_PAD)
    c_mask = offs_c < C
    n_dblocks = tl.cdiv(D, BLOCK_D)

    if HAS_COMB and pid_d == n_dblocks:  # the mix program
        offs_m = tl.arange(0, M_PAD)
        mix = _split_sum(part_ptr, t, T, offs_m, offs_m <= M, SPLITS, M_PAD, SPLIT_CHUNK)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.where(offs_m == M, mix, 0.0)) / K + norm_eps)
        mix_post = _pick(mix, offs_m, C + offs_c)  # [C_PAD]
        base_post = tl.load(base_ptr + C + offs_c, mask=c_mask, other=0.0)
        post = 2.0 * tl.sigmoid(mix_post * rstd * tl.load(scale_ptr + 1) + base_post)
        tl.store(post_ptr + t.to(tl.int64) * C + offs_c, post, mask=c_mask)

        cell = offs_c[:, None] * C + offs_c[None, :]  # [C_PAD, C_PAD]: (row i, column k)
        valid = c_mask[:, None] & c_mask[None, :]
        mix_comb = _pick(mix, offs_m, 2 * C + cell)  # [C_PAD, C_PAD]
        base_comb = tl.load(base_ptr + 2 * C + cell, mask=valid, other=0.0)
        logits = mix_comb * rstd * tl.load(scale_ptr + 2) + base_comb
        # Padded cells: -1e30 keeps a padded row's softmax finite and a real row's zero.
        logits = tl.where(valid, logits, -1e30)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = tl.where(valid, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t.to(tl.int64) * C * C + cell, comb, mask=valid)
    else:
        # the C pre columns and the sum of squares (column M) in one tile of C + 1
        offs_p = tl.arange(0, P_PAD)
        cols = tl.where(offs_p < C, offs_p, M)
        sums = _split_sum(part_ptr, t, T, cols, offs_p <= C, SPLITS, M_PAD, SPLIT_CHUNK)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.where(offs_p == C, sums, 0.0)) / K + norm_eps)
        mix_pre = _pick(sums, offs_p, offs_c)  # [C_PAD]
        scale_pre = tl.load(scale_ptr)
        base_pre = tl.load(base_ptr + offs_c, mask=c_mask, other=0.0)
        pre = tl.sigmoid(mix_pre * rstd * scale_pre + base_pre) + hc_eps
        pre = tl.where(c_mask, pre, 0.0)  # [C_PAD]

        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        x = tl.load(
            x_ptr + t.to(tl.int64) * stride_xt + offs_c[:, None] * stride_xc + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [C_PAD, BLOCK_D]
        out = tl.sum(pre[:, None] * x, axis=0)
        tl.store(
            out_ptr + t.to(tl.int64) * stride_out + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


@triton.jit
def hc_post_kernel(
    y_ptr,  # [T, D] the sublayer's output
    x_ptr,  # [T, C, D] the streams its input came from
    post_ptr,  # [T, C] float32
    comb_ptr,  # [T, C, C] float32, [input stream j, output stream k]
    out_ptr,  # [T, C, D] the next streams, streams' dtype
    C,
    D,
    stride_yt,
    stride_xt,
    stride_xc,
    stride_ot,
    stride_oc,
    C_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (T, cdiv(D, BLOCK_D)): out_k = post_k * y + sum_j comb[j, k] * x_j, rounded to
    the streams' dtype where the torch op rounds: the coefficients, the mixed sum, the
    product, and their sum."""
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    offs_c = tl.arange(0, C_PAD)
    c_mask = offs_c < C
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    x = tl.load(
        x_ptr + t * stride_xt + offs_c[:, None] * stride_xc + offs_d[None, :],
        mask=c_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [C_PAD (j), BLOCK_D]
    cell = offs_c[:, None] * C + offs_c[None, :]
    comb = tl.load(comb_ptr + t * C * C + cell, mask=c_mask[:, None] & c_mask[None, :], other=0.0)
    comb = comb.to(dtype).to(tl.float32)  # [C_PAD (j), C_PAD (k)]
    post = tl.load(post_ptr + t * C + offs_c, mask=c_mask, other=0.0).to(dtype).to(tl.float32)
    y = tl.load(y_ptr + t * stride_yt + offs_d, mask=d_mask, other=0.0)
    y = y.to(dtype).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [C_PAD (k), BLOCK_D]
    mixed = mixed.to(dtype).to(tl.float32)
    scaled = (post[:, None] * y[None, :]).to(dtype).to(tl.float32)
    tl.store(
        out_ptr + t * stride_ot + offs_c[:, None] * stride_oc + offs_d[None, :],
        (scaled + mixed).to(dtype),
        mask=c_mask[:, None] & d_mask[None, :],
    )
