"""The V4 decode attention kernel against its torch twin, and the twin against the engine's
sink_attention and window_mask over each sequence's whole history (no ring, no pages)."""

from __future__ import annotations

import pytest
import torch

from engine.ops.v4_attention import sink_attention, window_mask
from kernels.reference.v4_attention import v4_attention_reference
from kernels.triton.v4_attention import num_splits_for, v4_attention_decode
from tests.kernels._helpers import DEVICE

WINDOW, BLOCK_SIZE, HEADS = 8, 16, 4


def make_state(positions, mode, ratio, head_dim=32, ring_size=11, index_topk=36,
               dtype=torch.float32, seed=0):  # fmt: skip
    """The decode state of len(positions) sequences, one query each, plus every
    sequence's history for the oracle: keys [t + 1, head_dim] of all its positions and
    entries [n, head_dim] of all its windows (uncommitted ones too; the oracle masks
    them). Every slot and page a query must not read holds NaN: never-written ring slots,
    the ring slots of positions older than the window, uncommitted entries."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(positions)
    max_blocks = (max(positions) + 1) // BLOCK_SIZE + 2
    slots = torch.randperm(bsz + 2, generator=g)[:bsz]
    pages = torch.randperm(bsz * max_blocks + 3, generator=g)[: bsz * max_blocks]
    tables = pages.view(bsz, max_blocks).to(torch.int32)
    ring = torch.full((bsz + 2, ring_size, head_dim), float("nan"))
    cache = torch.full((bsz * max_blocks + 3, BLOCK_SIZE // ratio, head_dim), float("nan"))
    sel = torch.full((bsz, index_topk), -1, dtype=torch.int32)
    history, entries = [], []
    for b, t in enumerate(positions):
        keys = torch.randn(t + 1, head_dim, generator=g).to(dtype).float()
        kept = torch.arange(max(0, t - ring_size + 1), t + 1)  # the ring's last writes
        ring[slots[b], kept % ring_size] = keys[kept]
        stale = torch.arange(max(0, t - ring_size + 1), max(0, t - WINDOW + 1))
        ring[slots[b], stale % ring_size] = float("nan")
        n = max_blocks * BLOCK_SIZE // ratio
        ents = torch.randn(n, head_dim, generator=g).to(dtype).float()
        committed = (t + 1) // ratio
        for w in range(committed):
            cache[tables[b, w * ratio // BLOCK_SIZE], (w * ratio % BLOCK_SIZE) // ratio] = ents[w]
        # CSA: up to index_topk - 1 - b % 2 committed entries, unsorted, at random
        # columns, the rest -1 (so every row has padding, some between chosen ones).
        chosen = torch.randperm(committed, generator=g)[: index_topk - 1 - b % 2]
        cols = torch.randperm(index_topk, generator=g)[: chosen.numel()]
        sel[b, cols] = chosen.to(torch.int32)
        history.append(keys)
        entries.append(ents)
    q = torch.randn(bsz, HEADS, head_dim, generator=g).to(dtype)
    sinks = torch.randn(HEADS, generator=g) * 2
    args = [q, ring.to(dtype), cache.to(dtype), torch.tensor(positions), slots, tables, sinks]
    state = dict(
        window=WINDOW, ratio=ratio, mode=mode, sel=sel.to(DEVICE) if mode == "csa" else None
    )
    return [a.to(DEVICE) for a in args], state, history, entries


def oracle(q, sinks, positions, history, entries, state):
    """engine.ops.v4_attention over each sequence's whole history: window_mask over its
    keys, w < (t + 1) // ratio (HCA) or the selection (CSA) over its entries."""
    out = []
    for b, t in enumerate(positions):
        keys, visible = history[b], window_mask(torch.tensor([t]), torch.arange(t + 1), WINDOW)
        if state["mode"] != "sliding":
            w = torch.arange(entries[b].shape[0])
            if state["mode"] == "hca":
                seen = w < (t + 1) // state["ratio"]
            else:
                seen = torch.isin(w, state["sel"][b].long().cpu())
            keys = torch.cat([keys, entries[b]])
            visible = torch.cat([visible, seen[None]], dim=1)
        scale = keys.shape[-1] ** -0.5
        out.append(sink_attention(q[b : b + 1].float().cpu(), keys, visible, sinks.cpu(), scale))
    return torch.cat(out)


# t < window, t = window - 1, window, window + 1, and rows whose entries span several
# blocks (t = 70: 17 entries at ratio 4, 4 per 16-token block; 8 at ratio 8; t = 130:
# 8 + 32 keys at ratio 4, three 16-key tiles).
POSITIONS = [[3, 8, 70, 0, 37], [7, 9, 130, 16, 1]]
MODES = [("sliding", 4), ("hca", 4), ("hca", 8), ("csa", 4)]


@pytest.mark.parametrize("mode,ratio", MODES)
@pytest.mark.parametrize("positions", POSITIONS)
def test_reference_matches_the_engine_over_the_whole_history(mode, ratio, positions):
    args, state, history, entries = make_state(positions, mode, ratio)
    # the twin on the CPU: the bit-equality below is between two CPU computations
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    state = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    got = v4_attention_reference(*args, **state)
    want = oracle(args[0], args[6], positions, history, entries, state)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    # Only the visible keys, in the twin's order: the same arithmetic, so the same bits.
    q, sinks = args[0].float().cpu(), args[6].cpu()
    for b, t in enumerate(positions):
        keys = [history[b][max(0, t - WINDOW + 1) :]]
        if mode == "hca":
            keys.append(entries[b][: (t + 1) // ratio])
        elif mode == "csa":
            chosen = state["sel"][b].cpu()
            keys.append(entries[b][chosen[chosen >= 0].long()])
        keys = torch.cat(keys)
        seen = torch.ones(1, keys.shape[0], dtype=torch.bool)
        alone = sink_attention(q[b : b + 1], keys, seen, sinks, keys.shape[-1] ** -0.5)
        assert torch.equal(got[b : b + 1].cpu(), alone), f"row {b} at position {t}"


@pytest.mark.parametrize("mode,ratio", MODES)
@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("split_tiles,max_splits", [(1, 16), (1, 2), (8, 16)])
def test_kernel_matches_reference_float32(mode, ratio, positions, split_tiles, max_splits):
    # 16-key tiles, one tile per split: rows of 1 to 3 splits (CSA: 8 + 36 columns, 3);
    # max_splits 2 caps those at two uneven splits; 8 tiles per split makes every row
    # one split (finished in the split kernel).
    args, state, _, _ = make_state(positions, mode, ratio, seed=sum(positions))
    out = v4_attention_decode(*args, **state, max_position=max(positions), block_n=16,
                              split_tiles=split_tiles, max_splits=max_splits)  # fmt: skip
    torch.testing.assert_close(out, v4_attention_reference(*args, **state), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,ratio", [("hca", 4), ("csa", 4)])
def test_kernel_matches_reference_bfloat16(mode, ratio):
    args, state, _, _ = make_state([70, 5, 9], mode, ratio, head_dim=64, dtype=torch.bfloat16)
    args[3], args[4] = args[3].int(), args[4].int()  # int32 positions and slots
    out = v4_attention_decode(*args, **state, max_position=70, block_n=16, split_tiles=1)
    assert out.dtype == torch.bfloat16
    want = v4_attention_reference(*args, **state)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode,ratio", MODES)
def test_a_row_alone_equals_the_row_in_a_batch(mode, ratio):
    # The batch's grid has more splits (its longest position is larger) and more rows;
    # each row alone gets its own smaller grid. The bits must not change.
    positions = [70, 3, 37, 9]
    args, state, _, _ = make_state(positions, mode, ratio, seed=5)
    split = dict(block_n=16, split_tiles=1, max_splits=16)
    batch = v4_attention_decode(*args, **state, max_position=200, **split)
    q, ring, cache, pos, slots, tables, sinks = args
    for b, t in enumerate(positions):
        rows = slice(b, b + 1)
        alone = dict(state, sel=None if state["sel"] is None else state["sel"][rows])
        one = v4_attention_decode(q[rows], ring, cache, pos[rows], slots[rows], tables[rows],
                                  sinks, **alone, max_position=t, **split)  # fmt: skip
        assert torch.equal(one, batch[rows]), f"row {b} at position {t}"


@pytest.mark.parametrize("mode,ratio", [("sliding", 4), ("hca", 4), ("csa", 4)])
def test_a_query_seeing_only_its_own_key(mode, ratio):
    # Position 0: one window key, no committed entry (CSA: every column -1). The sinks are
    # far larger and smaller than the score, so the shift by the larger one matters.
    args, state, history, _ = make_state([0, 0], mode, ratio, seed=3)
    q, sinks = args[0], torch.tensor([40.0, -40.0, 0.0, 3.0], device=DEVICE)
    args[6] = sinks
    assert (state["sel"] is None) or bool((state["sel"] == -1).all())
    out = v4_attention_decode(*args, **state, max_position=0, block_n=16)
    for b in range(2):
        key = history[b][0].to(DEVICE)
        s = (q[b] @ key) * q.shape[-1] ** -0.5  # [H]
        p = torch.sigmoid(s - sinks)  # e^s / (e^s + e^sink)
        torch.testing.assert_close(out[b], p[:, None] * key, rtol=1e-5, atol=1e-6)


def test_num_splits_for_bounds_every_shorter_row():
    # The grid's split axis must cover the split rule's count for every row up to the
    # layer's longest; the rule's count is not monotone once capped (longer splits).
    def rule(keys, block_n, split_tiles, max_splits):
        tiles = -(-keys // block_n)
        per = -(-tiles // min(-(-tiles // split_tiles), max_splits))
        return -(-tiles // per)

    for block_n, split_tiles, max_splits in ((16, 1, 16), (32, 8, 16), (16, 3, 5)):
        for max_keys in range(1, 3000, 7):
            grid = num_splits_for(max_keys, block_n, split_tiles, max_splits)
            assert grid <= max_splits
            assert all(rule(k, block_n, split_tiles, max_splits) <= grid
                       for k in range(1, max_keys + 1, 5))  # fmt: skip
    assert num_splits_for(128, 32, 8, 16) == 1  # V4-Flash sliding: one split
    assert num_splits_for(128 + 512, 32, 8, 16) == 3  # CSA
