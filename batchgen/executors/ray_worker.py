"""A Ray worker: one engine per actor process, built once, running one input block per
call through the same RunLoop the local executor runs, into one staged part.

Ray Data calls `BlockWorker` with batches of one row, a block as the read task packed it
(batchgen.executors.block_source: its index and its rows still to run) and gets back, per block, a JSON string in column `staged`: the part's
manifest line (or none when no row of the block finished), the loop's end state and the
block's counters. The driver commits the part (batchgen.executors.staging)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchgen.executors.blocks import InputBlock, read_row_range, unpack_blocks
from batchgen.executors.staging import new_worker_key, register_worker, staging_dir
from batchgen.job_context import open_job
from batchgen.job_engine import load_llm
from batchgen.job_spec import JobSpec
from batchgen.planner import ClusterLabels
from batchgen.rows import ResultRow
from batchgen.run import (
    RunLoop,
    make_renderer,
    save_routing_stats,
    start_routing_stats,
    supervise_engine,
)
from batchgen.run_dir import RunDir
from batchgen.stats import RunStats
from batchgen.store_path import StorePath
from batchgen.writer import results_table, write_part


@dataclass(frozen=True)
class WorkerLabels:
    """How a worker gets its rows' cluster ids, fixed by the driver before any work:
    `column` mode carries the driver's label -> id map (made in input order, as the local
    executor makes it), `auto` the path of the assignments the driver's clustering wrote
    (one row per input row, in input order)."""

    mode: str  # "off" | "column" | "auto"
    column: str | None = None
    ids: dict[str, int] | None = None
    assignments: Path | StorePath | None = None

    def for_block(self, block: InputBlock):
        if self.mode == "column":
            labels = ClusterLabels(self.column)  # no path: a worker never writes the map
            labels.ids = dict(self.ids or {})
            return labels
        if self.mode == "auto":
            table = read_row_range(
                self.assignments,
                block.first_seq,
                block.first_seq + block.count,
                ["id", "cluster_id"],
            )
            return BlockAssignments(block.first_seq, table)
        return None


class BlockAssignments:
    """The stored cluster of each row of one block (the planner's labels interface)."""

    def __init__(self, first_seq: int, table: pa.Table) -> None:
        self.first_seq = first_seq
        self.ids = table.column("id").to_pylist()
        self.clusters = table.column("cluster_id").to_pylist()

    def assign(self, row) -> int | None:
        i = row.seq - self.first_seq
        if not 0 <= i < len(self.ids) or self.ids[i] != row.id:
            raise ValueError(
                f"the stored cluster assignments do not hold row {row.id!r} at input "
                f"position {row.seq}: the input changed since clustering"
            )
        return self.clusters[i]

    def largest_group(self) -> int | None:
        return None  # a block is planned in windows, cluster by cluster within each

    def names(self) -> dict[int, str]:
        return {}


class BlockCollector:
    """The writer a worker's RunLoop fills: a block's result rows are held until the
    block ends, then written as one part (a block is at most one part's rows)."""

    def __init__(self) -> None:
        self.rows: list[ResultRow] = []

    def expect(self, seq: int) -> None:
        pass

    def add(self, rows) -> None:
        self.rows.extend(rows)

    def flush(self) -> None:
        pass

    def commit_ready(self) -> None:
        pass


class _Quiet:
    """Progress for a worker's loop: the driver shows the run's progress."""

    def update(self, stats, force: bool = False) -> None:
        pass


class BlockWorker:
    def __init__(
        self,
        job: JobSpec,
        run_path: Path | StorePath,
        session: str,
        schema: pa.Schema,
        labels: WorkerLabels,
        blocks: list[InputBlock],
        threads: int | None = None,
        expected_seq_len: int | None = None,
    ) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.key = new_worker_key()
        self.run_dir = RunDir(run_path)
        register_worker(self.run_dir, self.key)
        self.job = job
        self.session = session
        self.schema = schema
        self.labels = labels
        self.blocks = blocks
        self.ctx = open_job(job, check_ids=False)  # the driver checked the ids
        # the driver's estimate of the job's lengths sizes max_num_seqs "auto" alike on
        # every worker
        llm = load_llm(job, expected_seq_len=expected_seq_len)
        self.model = getattr(llm, "model_name", job.model.path)
        self.recording = start_routing_stats(job, llm)
        self.renderer = make_renderer(self.ctx, llm)
        # Engine faults and routing files carry the worker in their session name.
        self.engine_session = f"{session}.{self.key}"
        self.engine = supervise_engine(llm, job, self.run_dir, self.engine_session, self.recording)
        del llm

    def __call__(self, batch: pa.Table) -> dict:
        staged = []
        for index, rows in unpack_blocks(batch):
            staged.append(self.run_block(self.blocks[index], rows))
        return {"staged": staged}

    def run_block(self, block: InputBlock, table: pa.Table) -> str:
        rows = block.rows(self.ctx.input, table)
        collector = BlockCollector()
        stats = RunStats(rows_total=len(rows), n=self.job.sampling.n)
        restarts = self.engine.restarts
        # The error budget is the driver's: a worker runs its whole block.
        loop = RunLoop(
            self.ctx,
            self.engine,
            self.renderer,
            collector,
            stats,
            _Quiet(),
            rows,
            self.labels.for_block(block),
            None,
            budget_rows=math.inf,
        )
        state = loop.run()
        entry = None
        if collector.rows:
            results = sorted(collector.rows, key=lambda r: (r.seq, r.n_index))
            table = results_table(results, self.schema, self.model, self.job.fingerprint)
            stage = staging_dir(self.run_dir, self.key)
            (stage / "errors").mkdir(parents=True, exist_ok=True)
            entry = write_part(
                table,
                block.part,
                self.job.fingerprint,
                self.session,
                stage,
                stage / "errors",
                worker=self.key,
            )
        if self.recording and self.engine.llm is not None:
            save_routing_stats(self.run_dir, self.engine_session, self.engine.llm.routing_stats())
        return json.dumps(
            {
                "block": block.index,
                "worker": self.key,
                "entry": None if entry is None else dataclasses.asdict(entry),
                "state": state,
                "gave_up": loop.gave_up,
                "rows": stats.rows_done,
                "ok": stats.ok,
                "error": stats.error,
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": stats.completion_tokens,
                "prefilled_prompt_tokens": stats.prefilled_prompt_tokens,
                "cached_prompt_tokens": stats.cached_prompt_tokens,
                "finish_reasons": dict(stats.finish_reasons),
                "engine_restarts": self.engine.restarts - restarts,
            }
        )
