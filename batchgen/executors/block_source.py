"""The Ray Data datasource of a distributed run: one read task per input block.

Ray Data schedules the reads (anywhere in the cluster, as the actor pool asks for work,
with its own backpressure), so the input is read block by block where it is needed and
neither the driver nor a worker holds more of it than its blocks in flight. Each read
task gives one row (blocks.pack_block): the block's index, so the worker that gets it
knows which part to write, and the block's rows still to run (committed ones left out by
InputBlock.read) with their input positions, as one Arrow IPC stream.
"""

from __future__ import annotations

import functools

import pyarrow as pa
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

from batchgen.executors.blocks import InputBlock, pack_block
from batchgen.reader import ParquetInput


def read_block(source: ParquetInput, block: InputBlock) -> list[pa.Table]:
    return [pack_block(block.index, block.read(source))]


class BlockSource(Datasource):
    def __init__(self, source: ParquetInput, blocks: list[InputBlock]) -> None:
        self.source = source
        self.blocks = blocks

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, **_) -> list[ReadTask]:
        # One task per block whatever the parallelism asked: a block is the unit of
        # commit, so two blocks never share a task's output and one is never split.
        return [
            ReadTask(
                functools.partial(read_block, self.source, block),
                BlockMetadata(
                    num_rows=1,  # the packed block
                    size_bytes=None,
                    exec_stats=None,
                    input_files=(str(self.source.files[block.file]),),
                ),
            )
            for block in self.blocks
        ]
