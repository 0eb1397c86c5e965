"""`batchgen validate`: every check `run` makes, plus counts over the whole input (rows,
prompt tokens, rows over the context) and a time estimate from a short calibration, all
without writing a run directory."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from batchgen.job_context import JobContext
from batchgen.job_spec import JobError
from batchgen.planner import cluster_mode
from batchgen.row_preparer import RowPreparer

CALIBRATION_ROWS = 4
CALIBRATION_MAX_TOKENS = 16
# Rows rendered before the full count: a template that fails on all of them is refused
# at once rather than after a pass over the whole input.
SAMPLE_ROWS = 16


@dataclass
class ValidationReport:
    rows: int
    runnable_rows: int
    prompt_tokens: int
    max_prompt_tokens: int
    truncated_rows: int
    errors: Counter = field(default_factory=Counter)
    error_samples: dict[str, list[str]] = field(default_factory=dict)
    calibration_tok_s: float | None = None
    calibration_output_tok_s: float | None = None
    estimated_s: float | None = None
    estimated_max_s: float | None = None
    # batchgen.task_clusters.EmbeddingEstimate for a `cluster: auto` job
    embedding: object | None = None

    def lines(self) -> list[str]:
        out = [
            f"rows: {self.rows:,} ({self.runnable_rows:,} runnable)",
            f"prompt tokens: {self.prompt_tokens:,} total, {self.max_prompt_tokens:,} longest",
            f"truncated by the overflow policy: {self.truncated_rows:,}",
        ]
        for kind, count in self.errors.most_common():
            samples = ", ".join(self.error_samples[kind])
            out.append(f"would be error rows ({kind}): {count:,}, e.g. {samples}")
        if self.embedding is not None and self.embedding.rows:
            out.append(
                f"embedding (cluster: auto): {self.embedding.rows:,} rows at "
                f"{self.embedding.rows_s:,.1f} rows/s, {self.embedding.seconds / 60:,.1f} min "
                "before the first generation (included in the estimate)"
            )
        if self.calibration_tok_s is not None:
            out.append(
                f"calibration: {self.calibration_tok_s:,.1f} tok/s (prompt + output), "
                f"{self.calibration_output_tok_s:,.1f} output tok/s"
            )
            out.append(
                f"estimated time: {self.estimated_s / 60:,.1f} min if completions run as in "
                f"calibration; at most {self.estimated_max_s / 60:,.1f} min if every "
                "completion reaches max_tokens"
            )
        return out


def count_rows(ctx: JobContext, renderer: RowPreparer) -> ValidationReport:
    report = ValidationReport(0, 0, 0, 0, 0)
    for row in ctx.input.rows():
        prepared = renderer.prepare(row)
        report.rows += 1
        if prepared.error is not None:
            report.errors[prepared.error.type] += 1
            samples = report.error_samples.setdefault(prepared.error.type, [])
            if len(samples) < 5:
                samples.append(repr(row.id))
            continue
        report.runnable_rows += 1
        report.prompt_tokens += prepared.num_prompt_tokens
        report.max_prompt_tokens = max(report.max_prompt_tokens, prepared.num_prompt_tokens)
        report.truncated_rows += prepared.truncated
    return report


def check_template_sample(ctx: JobContext, renderer: RowPreparer) -> None:
    """Refuse a template that fails (in the sandbox, or past its limits) on every one of
    the first SAMPLE_ROWS rows, apart from rows it never sees (null or blank values)."""
    failures: list[tuple[str, str]] = []
    for row in islice(ctx.input.rows(), SAMPLE_ROWS):
        error = renderer.prepare(row).error
        if error is None or error.type not in ("render_error", "null_input", "empty_prompt"):
            return  # the template rendered this row
        if error.type == "render_error":
            failures.append((row.id, error.message))
    if failures:
        row_id, message = failures[0]
        raise JobError(
            f"prompt.template: fails on every one of the first {len(failures)} rows it "
            f"renders, e.g. row {row_id!r}: {message}"
        )


def refuse_unrunnable(report: ValidationReport) -> None:
    """A job none of whose rows can run would only write error rows: refuse it."""
    if report.runnable_rows:
        return
    if not report.rows:
        raise JobError("input: the input has no rows; there is nothing to run")
    kinds = ", ".join(
        f"{kind}: {count:,} (e.g. {', '.join(report.error_samples[kind][:3])})"
        for kind, count in report.errors.most_common()
    )
    raise JobError(
        f"input: none of the {report.rows:,} rows can run; all would be error rows ({kinds})"
    )


def calibrate(ctx: JobContext, renderer: RowPreparer, llm, report: ValidationReport) -> None:
    """Run a few rows with a short max_tokens and extrapolate to the whole job. This is an
    estimate: batching more rows at once usually runs faster than the calibration."""
    from engine import SamplingParams

    prompts = []
    for row in ctx.input.rows():
        prepared = renderer.prepare(row)
        if prepared.error is None:
            prompts.append(prepared.prompt_token_ids)
        if len(prompts) >= CALIBRATION_ROWS:
            break
    if not prompts:
        return
    s = ctx.job.sampling
    max_tokens = min(s.max_tokens, CALIBRATION_MAX_TOKENS)
    params = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        max_tokens=max_tokens, seed=s.seed, stop=list(s.stop or []),
    )  # fmt: skip
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = max(time.perf_counter() - start, 1e-6)
    prompt_tokens = sum(len(p) for p in prompts)
    completions = [len(o.outputs[0].token_ids) for o in outs if o.outputs]
    output_tokens = sum(completions)
    report.calibration_tok_s = (prompt_tokens + output_tokens) / elapsed
    report.calibration_output_tok_s = output_tokens / elapsed
    # Completions that stopped at the calibration cap say nothing about their real length:
    # count them as reaching the job's max_tokens.
    expected = [s.max_tokens if c >= max_tokens else c for c in completions] or [s.max_tokens]
    mean_completion = sum(expected) / len(expected)
    outputs = report.runnable_rows * s.n
    report.estimated_s = (
        report.prompt_tokens + outputs * mean_completion
    ) / report.calibration_tok_s
    report.estimated_max_s = (
        report.prompt_tokens + outputs * s.max_tokens
    ) / report.calibration_tok_s
    if cluster_mode(ctx.job.batching) == "auto":
        from batchgen.task_clusters import estimate_embedding  # pulls in scikit-learn

        clusters_dir = Path(ctx.job.output.path) / "clusters"
        report.embedding = estimate_embedding(
            ctx.job, ctx.input.rows(), ctx.total_rows, clusters_dir
        )
        report.estimated_s += report.embedding.seconds
        report.estimated_max_s += report.embedding.seconds
