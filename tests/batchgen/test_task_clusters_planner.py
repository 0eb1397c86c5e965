"""The planner's clustered mode: spill by group, feed largest group first, windows sorted
longest prompt first, error rows at once, nothing lost or duplicated."""

from __future__ import annotations

import random

from batchgen.job_spec import BatchingSpec
from batchgen.planner import plan_rows
from batchgen.rows import PreparedRow, RowError


def _rows(groups: list[int | None], seed: int = 0) -> list[PreparedRow]:
    rng = random.Random(seed)
    return [
        PreparedRow(
            seq=i, id=f"r{i}", carry={"x": i}, prompt_token_ids=[1] * rng.randint(1, 50), group=g
        )
        for i, g in enumerate(groups)
    ]


def test_groups_fed_largest_first_in_sorted_windows(tmp_path):
    groups = [2] * 30 + [0] * 10 + [1] * 45 + [None] * 5
    random.Random(1).shuffle(groups)
    rows = _rows(groups)
    spec = BatchingSpec(cluster="auto", plan_window=8)
    planned = list(plan_rows(iter(rows), spec, tmp_path / "plan"))

    assert sorted(r.seq for r in planned) == list(range(len(rows)))
    order = [r.group for r in planned]
    assert order == [1] * 45 + [2] * 30 + [0] * 10 + [None] * 5
    # Windows of 8 rows inside a group: longest prompt first.
    for start in range(0, 45, 8):
        window = [r.num_prompt_tokens for r in planned[start : min(start + 8, 45)]]
        assert window == sorted(window, reverse=True)
    assert planned[0].carry == {"x": planned[0].seq}  # rows come back whole
    assert not (tmp_path / "plan").exists()  # the spill is cleaned up


def test_error_rows_pass_at_once_and_off_mode_does_not_spill(tmp_path):
    rows = _rows([0, 1, 0, 1])
    rows[2].error = RowError("empty_prompt", "blank")
    spilled = plan_rows(iter(rows), BatchingSpec(cluster="auto"), tmp_path / "plan")
    assert next(spilled).seq == 2  # before any spilled row
    rest = [r.seq for r in spilled]
    assert sorted(rest[:2]) == [1, 3] and rest[2:] == [0]  # group 1 (two rows), then 0
    off = list(plan_rows(iter(_rows([None] * 5)), BatchingSpec(cluster="off"), tmp_path / "p2"))
    assert len(off) == 5 and not (tmp_path / "p2").exists()


def test_a_new_session_starts_from_an_empty_spill(tmp_path):
    leftover = tmp_path / "plan"
    leftover.mkdir()
    (leftover / "group-0.pkl").write_bytes(b"from a killed session")
    planned = list(plan_rows(iter(_rows([0, 0, 1])), BatchingSpec(cluster="auto"), leftover))
    assert sorted(r.seq for r in planned) == [0, 1, 2]


def test_the_first_group_is_fed_while_the_input_is_still_read(tmp_path):
    groups = [2] * 30 + [0] * 10 + [1] * 45 + [None] * 5
    random.Random(1).shuffle(groups)
    rows = _rows(groups)
    spec = BatchingSpec(cluster="auto", plan_window=8)
    read = []

    def reading():
        for row in rows:
            read.append(row.seq)
            yield row

    streamed = plan_rows(reading(), spec, tmp_path / "plan", first_group=1)
    first = next(streamed)
    assert first.group == 1 and len(read) < len(rows)  # fed before the input was read
    planned = [first, *streamed]
    spilled_only = list(plan_rows(iter(_rows(groups)), spec, tmp_path / "plan2"))
    # The same order as spilling everything: group 1 is the largest here.
    assert [r.seq for r in planned] == [r.seq for r in spilled_only]
    # Named first even when it is not the largest: then the others, largest first.
    order = [r.group for r in plan_rows(iter(_rows(groups)), spec, tmp_path / "p3", 0)]
    assert order == [0] * 10 + [1] * 45 + [2] * 30 + [None] * 5
