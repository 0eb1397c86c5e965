"""CPU matmuls and attention whose result for one row does not depend on the other rows
of the call: how many there are, what they hold, or how the context was padded.

A row's output must not depend on its batch (a seeded row samples the same text alone, in
any batch, after a preemption or a resume). Plain torch on the CPU does not give that:

- float32 `F.linear` / `bmm` (MKL's sgemm) takes another code path for a call of fewer
  than 12 rows unless the count is a multiple of 4: the same row then differs in its last
  bits. float32 linears therefore run `fixed_order_linear` (kernels/cpu/
  fixed_order_linear.py), whose summation order is fixed per output by construction and
  which reads the weight once at any row count: a 1-row call costs a GEMV, not the 4-row
  sgemm that padding would need. A `bmm` is padded with zero rows to INVARIANT_MIN_ROWS,
  which keeps it on sgemm's main path, where a row's dot products run in one order
  whatever M is; the same holds for its columns (the keys of an attention score), so
  keys are padded too.
- A reduction's order depends on its length: summing the same 200 probabilities padded
  with zeros to 256 or to 320 gives different bits. Attention therefore reduces over the
  keys in blocks of `KEY_BLOCK`, each of fixed length, and adds the blocks in key order:
  a query's result is the same whatever length its context was padded to, so it is the
  same computed in a prefill chunk of any size or as a decode step.

bfloat16 on the CPU (oneDNN) is row-invariant at every row count; its linears are padded
to `invariant_rows(M)` all the same, since that costs little and does not rely on which
library runs the call.
`tests/kernels/test_batch_invariant.py` checks all of this on fresh random inputs; it is
the check to run on a new CPU or BLAS build.

Legend: S = independent problems (sequence x kv head), M = query rows of one problem,
L = keys, D = query/key width, E = value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.fixed_order_linear import fixed_order_linear

# Calls with at least this many rows, or a multiple of ROW_MULTIPLE, take sgemm's main path
# (bf16 linears and bmm are padded by this rule; float32 linears need no padding).
INVARIANT_MIN_ROWS = 12
ROW_MULTIPLE = 4
KEY_BLOCK = 64
# float32 elements per step of ATen's vectorised elementwise loop: two AVX-512 vectors
LANES = 32


def lanes(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn (sigmoid, exp, cos, ...) with x's last dim padded to a
    multiple of LANES, so every element takes the vectorised path. ATen's loop steps two
    vectors at a time and computes the tail of a tensor whose size is not a multiple of
    that step with scalar code whose transcendentals round differently: sigmoid of a
    [T, 4] slice then gives a row other bits at T = 1 than at T = 27."""
    width = x.shape[-1]
    padded = -(-width // LANES) * LANES
    if x.device.type != "cpu" or padded == width:
        return fn(x)
    return fn(_pad_dim(x, x.dim() - 1, padded))[..., :width]


def invariant_rows(m: int) -> int:
    """The row count to pad a call of m rows to."""
    if m >= INVARIANT_MIN_ROWS:
        return m
    return max(ROW_MULTIPLE, -(-m // ROW_MULTIPLE) * ROW_MULTIPLE)


def padded_keys(length: int) -> int:
    """The key count `attention` pads a context of `length` keys to. Callers that gather
    keys can gather this many (extra slots pointing anywhere finite) and save the copy."""
    return max(1, -(-length // KEY_BLOCK)) * KEY_BLOCK


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], each row as if computed alone: float32 by
    `fixed_order_linear`, other dtypes by F.linear over rows padded to `invariant_rows`.
    Tensors on other devices go straight to F.linear (their kernels keep their own
    invariants)."""
    if x.device.type != "cpu":
        return F.linear(x, weight)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return fixed_order_linear(x, weight)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    m = x2.shape[0]
    y = F.linear(_pad_dim(x2, 0, invariant_rows(m)), weight)[:m]
    return y.reshape(*lead, weight.shape[0])


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [S, M, K] @ b [S, K, N] -> [S, M, N], each row of a as if computed alone. A bmm
    takes its main path from INVARIANT_MIN_ROWS rows and columns on, multiples of 4
    below that do not suffice as they do for F.linear, so both are padded to it."""
    m, n = a.shape[1], b.shape[2]
    if a.device.type != "cpu":
        return torch.bmm(a, b)
    a = _pad_dim(a, 1, max(m, INVARIANT_MIN_ROWS))
    b = _pad_dim(b, 2, max(n, INVARIANT_MIN_ROWS))
    return torch.bmm(a, b)[:, :m, :n]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention, float32, invariant to how many rows, problems and padded keys a
    call holds. q [S, M, D], k [S, L, D], v [S, L, E], visible [S, M, L] bool (every row
    must see at least one key, or have a sink) -> out [S, M, E] float32. `sink` [S, M]:
    a logit per row in the softmax's denominator with no value (DeepSeek-V4's attention
    sinks), so the row's probabilities sum to less than 1.

    Scores are exact per (row, key) whatever L is; the row's maximum is exact; then the
    probabilities' sum and their weighted sum of values are accumulated block by block of
    KEY_BLOCK keys, in key order, each block of fixed length (keys past L are zero and
    masked, so they add exact zeros); the sink's share is added last."""
    if q.device.type != "cpu":
        # GPU kernels are not batch-invariant (docs/batch-invariance.md): the plain form,
        # without the block loop's launches
        scores = torch.bmm(q.float(), k.float().transpose(1, 2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        if sink is None:
            return torch.bmm(scores.softmax(dim=-1), v.float())
        logits = torch.cat([scores, sink.float()[..., None]], dim=-1)
        return torch.bmm(logits.softmax(dim=-1)[..., :-1], v.float())
    S, M, _ = q.shape
    L, E = k.shape[1], v.shape[2]
    Lp = padded_keys(L)
    blocks = Lp // KEY_BLOCK
    q = q.float()
    k = _pad_dim(k.float(), 1, Lp)
    v = _pad_dim(v.float(), 1, Lp)
    visible = _pad_dim(visible, 2, Lp)
    rows = max(M, INVARIANT_MIN_ROWS)
    qp = _pad_dim(q, 1, rows)  # [S, Mp, D]
    scores = torch.bmm(qp, k.transpose(1, 2))[:, :M] * scale  # [S, M, Lp]
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)  # [S, M, 1]
    if sink is not None:
        peak = torch.maximum(peak, sink.float()[..., None])
    p = torch.exp(scores - peak)  # masked keys: exp(-inf) = 0
    # One bmm over all (problem, block) pairs: every pair is a [Mp, KEY_BLOCK] x
    # [KEY_BLOCK, E] product of the same shape.
    p_blocks = _pad_dim(p, 1, rows).view(S, rows, blocks, KEY_BLOCK).transpose(1, 2)
    v_blocks = v.view(S, blocks, KEY_BLOCK, E)
    partial = torch.bmm(
        p_blocks.reshape(S * blocks, rows, KEY_BLOCK), v_blocks.reshape(S * blocks, KEY_BLOCK, E)
    ).view(S, blocks, rows, E)[:, :, :M]  # [S, blocks, M, E]
    sums = p.view(S, M, blocks, KEY_BLOCK).sum(dim=-1)  # [S, M, blocks]
    acc = partial[:, 0].clone()
    den = sums[..., 0].clone()
    for j in range(1, blocks):  # key order, whatever the padding
        acc += partial[:, j]
        den += sums[..., j]
    if sink is not None:
        den += torch.exp(sink.float() - peak[..., 0])
    return acc / den[..., None]
