"""The labelled mixed-task prompt set (data/tasks/mixed_tasks.parquet) for tests."""

from __future__ import annotations

from pathlib import Path

import polars as pl

MIXED_TASKS = Path(__file__).resolve().parents[2] / "data" / "tasks" / "mixed_tasks.parquet"


def mixed_tasks() -> pl.DataFrame:
    return pl.read_parquet(MIXED_TASKS)


def mixed_task_rows(per_task: int, tasks: int) -> list[dict]:
    """`per_task` prompts of each of the first `tasks` task types (by name), in file order
    (the tasks interleaved), as dicts with id, task, prompt."""
    frame = mixed_tasks()
    chosen = sorted(frame["task"].unique().to_list())[:tasks]
    frame = frame.filter(pl.col("task").is_in(chosen))
    frame = frame.with_columns(pl.int_range(pl.len()).over("task").alias("_n"))
    frame = frame.filter(pl.col("_n") < per_task).drop("_n")
    return frame.to_dicts()
