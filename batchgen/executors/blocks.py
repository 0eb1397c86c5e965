"""Input blocks: the unit of work of a distributed run.

A block is a slice of one row group of one input file, at most `block_rows` rows: one
Ray Data read task reads it alone (no machine reads the whole input), one worker runs it
and writes its results as one part. The driver plans the blocks from the files' row-group
sizes, reading no data for a fresh run; on a resume it reads each row group's ids to
leave the committed rows out, and drops a block whose rows are all committed before any
work is sent out.

Each block gets the name of its part in results/ when it is planned, in input order, so
`order: input` holds across parts read in name order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.reader import ParquetInput
from batchgen.rows import InputRow
from batchgen.store_path import StorePath, parquet_file

# The input position of each row of a block on its way to a worker; a block travels as
# one Ray Data row: its index and its rows as one Arrow IPC stream.
SEQ_COLUMN = "__batchgen_seq"
BLOCK_COLUMN = "__batchgen_block"
ROWS_COLUMN = "__batchgen_rows"


def pack_block(index: int, table: pa.Table) -> pa.Table:
    """The one-row table a read task gives for a block: so a map_batches batch of one row
    is one whole block (Ray Data slices batches across its blocks at batch_size, which it
    requires for GPU actors, and a block is the unit of commit)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    rows = pa.array([sink.getvalue().to_pybytes()], pa.large_binary())
    return pa.table({BLOCK_COLUMN: pa.array([index], pa.int64()), ROWS_COLUMN: rows})


def unpack_blocks(batch: pa.Table) -> list[tuple[int, pa.Table]]:
    """(block index, its rows) for each row of a batch of packed blocks."""
    indices = batch.column(BLOCK_COLUMN).to_pylist()
    payloads = batch.column(ROWS_COLUMN).to_pylist()
    return [(i, pa.ipc.open_stream(p).read_all()) for i, p in zip(indices, payloads)]


@dataclass(frozen=True)
class InputBlock:
    index: int  # in this session's plan: a retried block's second output is told apart
    part: str  # the name of its part in results/
    file: int  # into ParquetInput.files
    row_group: int
    offset: int  # of its first row in the row group
    count: int
    first_seq: int  # the input position of its first row
    file_row: int  # the position of its first row in its file
    skip_ids: tuple[str, ...] = ()  # committed by an earlier session

    @property
    def rows_to_run(self) -> int:
        return self.count - len(self.skip_ids)

    def read(self, source: ParquetInput) -> pa.Table:
        """The block's rows that still have to run, in input order: the columns the job
        reads, and their input positions in SEQ_COLUMN."""
        table = source.read_slice(self.file, self.row_group, self.offset, self.count)
        table = table.append_column(
            SEQ_COLUMN, pa.array(range(self.first_seq, self.first_seq + self.count), pa.int64())
        )
        if self.skip_ids:
            skip = set(self.skip_ids)
            ids = source.table_ids(table)
            table = table.filter(pa.array([i not in skip for i in ids]))
        return table

    def rows(self, source: ParquetInput, table: pa.Table) -> list[InputRow]:
        """The InputRows of what `read` gave (after its trip through Ray Data)."""
        seqs = table.column(SEQ_COLUMN).to_pylist()
        if len(seqs) != self.rows_to_run:
            raise ValueError(
                f"block {self.index} ({self.part}) arrived with {len(seqs)} of its "
                f"{self.rows_to_run} rows: a block must reach one worker whole"
            )
        rows = source.table_rows(self.file, self.file_row, table.drop([SEQ_COLUMN]), seqs)
        return list(rows)


def plan_blocks(
    source: ParquetInput, done_ids: set[str], block_rows: int, first_part_number: int
) -> Iterator[InputBlock]:
    """The blocks of every input row not in `done_ids`, in input order."""
    index = 0
    seq = 0
    for file_index, path in enumerate(source.files):
        pf = pq.ParquetFile(path)
        file_row = 0
        for group in range(pf.num_row_groups):
            size = pf.metadata.row_group(group).num_rows
            ids = source.row_group_ids(file_index, group) if done_ids else None
            for offset in range(0, size, block_rows):
                count = min(block_rows, size - offset)
                skip: tuple[str, ...] = ()
                if ids is not None:
                    skip = tuple(i for i in ids[offset : offset + count] if i in done_ids)
                if len(skip) < count:
                    yield InputBlock(
                        index=index,
                        part=f"part-{first_part_number + index:05d}.parquet",
                        file=file_index,
                        row_group=group,
                        offset=offset,
                        count=count,
                        first_seq=seq + offset,
                        file_row=file_row + offset,
                        skip_ids=skip,
                    )
                    index += 1
            seq += size
            file_row += size


def read_row_range(path: Path | StorePath, start: int, stop: int, columns: list[str]) -> pa.Table:
    """Rows [start, stop) of a Parquet file, reading only the row groups that hold them."""
    pf = parquet_file(path)
    pieces = []
    first = 0
    for group in range(pf.num_row_groups):
        size = pf.metadata.row_group(group).num_rows
        if first < stop and first + size > start:
            lo, hi = max(start - first, 0), min(stop - first, size)
            pieces.append(pf.read_row_group(group, columns=columns).slice(lo, hi - lo))
        first += size
        if first >= stop:
            break
    if not pieces:
        return pf.schema_arrow.empty_table().select(columns)
    return pa.concat_tables(pieces)
