"""Input blocks for distributed runs: the blocks of a fresh run cover every input row
once, in input order, each read alone exactly as the whole-input reader gives it; on a
resume the committed rows are left out and a block with nothing left is not planned."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.executors.blocks import plan_blocks, read_row_range, unpack_blocks
from batchgen.job_spec import InputSpec
from batchgen.reader import ParquetInput


def _input(tmp_path, sizes: list[int], row_group: int, id_column: str | None = "id"):
    """Files of `sizes` rows with random texts, split into row groups of `row_group`."""
    rng = random.Random(len(sizes) * 100 + row_group)
    seq = 0
    for n, size in enumerate(sizes):
        ids = [f"x{seq + i}-{rng.randrange(10**6)}" for i in range(size)]
        texts = [" ".join(rng.choice("abcdefg") for _ in range(rng.randrange(1, 6))) for _ in ids]
        table = pa.table({"id": ids, "text": texts, "k": [rng.randrange(9) for _ in ids]})
        pq.write_table(table, tmp_path / f"in-{n}.parquet", row_group_size=row_group)
        seq += size
    spec = InputSpec(path=str(tmp_path), **({"id_column": id_column} if id_column else {}))
    if id_column is None:
        spec = InputSpec(path=str(tmp_path), id="content_hash")
    return ParquetInput(spec)


def _block_rows(source, blocks):
    return [row for block in blocks for row in block.rows(source, block.read(source))]


@pytest.mark.parametrize("sizes, row_group, block_rows", [([37], 10, 4), ([5, 23, 1], 7, 3)])
@pytest.mark.parametrize("id_column", ["id", None])
def test_fresh_blocks_cover_every_row_once_in_order(
    tmp_path, sizes, row_group, block_rows, id_column
):
    source = _input(tmp_path, sizes, row_group, id_column)
    blocks = list(plan_blocks(source, set(), block_rows, first_part_number=7))
    assert [b.index for b in blocks] == list(range(len(blocks)))
    assert blocks[0].part == "part-00007.parquet"
    assert len({b.part for b in blocks}) == len(blocks)
    assert all(0 < b.count <= block_rows for b in blocks)
    got = _block_rows(source, blocks)
    want = list(source.rows())
    assert [(r.seq, r.id, r.values) for r in got] == [(r.seq, r.id, r.values) for r in want]


def test_resumed_blocks_skip_committed_rows_and_empty_blocks(tmp_path):
    source = _input(tmp_path, [40], 10)
    rows = list(source.rows())
    rng = random.Random(3)
    done = {r.id for r in rows[:12]} | {r.id for r in rng.sample(rows[12:], 9)}
    blocks = list(plan_blocks(source, done, 4, first_part_number=1))
    # Blocks stay inside a row group of 10: rows 0-9 are committed, so no block holds
    # them; the block from row 10 leaves out rows 10 and 11.
    assert blocks[0].first_seq == 10
    assert set(blocks[0].skip_ids) >= {rows[10].id, rows[11].id}
    got = _block_rows(source, blocks)
    assert [r.id for r in got] == [r.id for r in rows if r.id not in done]
    # what a block skips is only ever committed ids
    assert all(set(b.skip_ids) <= done for b in blocks)


@pytest.mark.parametrize("start, stop", [(0, 5), (3, 17), (9, 10), (20, 30), (29, 30)])
def test_read_row_range_matches_a_full_read(tmp_path, start, stop):
    values = list(range(30))
    random.Random(start).shuffle(values)
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"v": values}), path, row_group_size=4)
    assert read_row_range(path, start, stop, ["v"]).column("v").to_pylist() == values[start:stop]


def test_block_file_rows_locate_each_block_in_its_file(tmp_path):
    source = _input(tmp_path, [5, 23, 1], 7)
    for block in plan_blocks(source, set(), 3, first_part_number=1):
        ids = pq.read_table(source.files[block.file]).column("id").to_pylist()
        got = [r.id for r in block.rows(source, block.read(source))]
        assert got == ids[block.file_row : block.file_row + block.count]


def test_a_block_that_arrives_in_pieces_is_refused(tmp_path):
    source = _input(tmp_path, [20], 10)
    block = next(plan_blocks(source, set(), 8, first_part_number=1))
    with pytest.raises(ValueError, match=r"block 0 \(part-00001.parquet\) arrived with 5 of its 8"):
        block.rows(source, block.read(source).slice(0, 5))


def test_block_source_gives_one_read_task_per_block(tmp_path):
    pytest.importorskip("ray")
    from batchgen.executors.block_source import BlockSource

    source = _input(tmp_path, [5, 23, 1], 7)
    rows = list(source.rows())
    done = {r.id for r in rows[4:9]}
    blocks = list(plan_blocks(source, done, 3, first_part_number=1))
    tasks = BlockSource(source, blocks).get_read_tasks(parallelism=2)
    assert len(tasks) == len(blocks)
    got = []
    for block, task in zip(blocks, tasks):
        (packed,) = list(task())
        assert packed.num_rows == task.metadata.num_rows == 1  # one whole block per row
        ((index, table),) = unpack_blocks(packed)
        assert index == block.index and table.num_rows == block.rows_to_run
        got += block.rows(source, table)
    want = [r for r in rows if r.id not in done]
    assert [(r.seq, r.id, r.values) for r in got] == [(r.seq, r.id, r.values) for r in want]


def test_one_column_read_alone_matches_the_rows(tmp_path):
    # The driver gives cluster-label ids from this column without reading the others.
    source = _input(tmp_path, [5, 23, 1], 7)
    assert list(source.column_values("k")) == [r.values["k"] for r in source.rows()]
