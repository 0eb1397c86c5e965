"""The morning report: report.json, report.md and report.png from the run directory alone
(the live parts, read a few columns at a time, and the manifest), so `batchgen report`
can rebuild it for any run, finished or not."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from pathlib import Path

from batchgen.engine_faults import EngineFaultLog, summarize
from batchgen.job_spec import JobSpec
from batchgen.run_dir import RunDir, write_atomic
from batchgen.store_path import parquet_file

EXIT_MEANINGS = {
    0: "finished, every row ok",
    3: "finished, some rows failed within the error budget",
    4: "stopped: the error budget was exceeded",
    5: "interrupted: rerun the same command to resume",
}
_SAMPLE_IDS = 5
_SCAN_COLUMNS = [
    "id",
    "n_index",
    "status",
    "finish_reason",
    "error",
    "error_type",
    "prompt_tokens",
    "completion_tokens",
    "cluster_id",
    "cached_prompt_tokens",
]


def _session_start(session: str) -> float | None:
    try:
        return time.mktime(time.strptime(session.split("-")[0], "%Y%m%dT%H%M%S"))
    except ValueError:
        return None


def throughput_timeline(run_dir: RunDir) -> list[dict]:
    """One point per committed part: when, how many rows and tokens, and the output tok/s
    since the previous commit of the same session (or the session's start)."""
    points = []
    last_by_session: dict[str, float] = {}
    for e in run_dir.entries():
        if e.replaces:
            continue
        since = last_by_session.get(e.session) or _session_start(e.session)
        span = e.time - since if since is not None else None
        points.append(
            {
                "part": e.part,
                "span_s": span,
                "time": e.time,
                "session": e.session,
                "rows": e.rows,
                "prompt_tokens": e.prompt_tokens,
                "completion_tokens": e.completion_tokens,
                "output_tok_s": round(e.completion_tokens / span, 2) if span else None,
                "total_tok_s": (
                    round((e.prompt_tokens + e.completion_tokens) / span, 2) if span else None
                ),
            }
        )
        last_by_session[e.session] = e.time
    return points


def collect(run_dir: RunDir) -> dict:
    """Counts over every live part, reading only the small columns, batch by batch."""
    status = Counter()
    finish = Counter()
    error_types: dict[str, dict] = {}
    clusters: dict[str, Counter] = defaultdict(Counter)
    ids: set[str] = set()
    tokens = Counter()
    for entry in run_dir.live_parts():
        pf = parquet_file(run_dir.results / entry.part)
        # parts written before the cached_prompt_tokens column read as 0 cached
        columns = [c for c in _SCAN_COLUMNS if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(columns=columns, batch_size=8192):
            for r in batch.to_pylist():
                ids.add(r["id"])
                status[r["status"]] += 1
                cluster = "none" if r["cluster_id"] is None else str(r["cluster_id"])
                clusters[cluster][r["status"]] += 1
                clusters[cluster]["completion_tokens"] += r["completion_tokens"] or 0
                if r["status"] == "ok":
                    finish[r["finish_reason"]] += 1
                    tokens["completion"] += r["completion_tokens"] or 0
                    # every completion prefills its prompt: the cache's share of those
                    prefilled, cached = r["prompt_tokens"] or 0, r.get("cached_prompt_tokens") or 0
                    tokens["prefilled_prompt"] += prefilled
                    tokens["cached_prompt"] += cached
                    clusters[cluster]["prefilled_prompt_tokens"] += prefilled
                    clusters[cluster]["cached_prompt_tokens"] += cached
                    if r["n_index"] == 0:
                        tokens["prompt"] += r["prompt_tokens"] or 0
                else:
                    et = error_types.setdefault(
                        r["error_type"] or "error",
                        {"count": 0, "sample_ids": [], "sample_message": r["error"]},
                    )
                    et["count"] += 1
                    if len(et["sample_ids"]) < _SAMPLE_IDS and r["id"] not in et["sample_ids"]:
                        et["sample_ids"].append(r["id"])
    ok = status.get("ok", 0)
    return {
        "rows_committed": len(ids),
        "result_rows": sum(status.values()),
        "status": dict(status),
        "finish_reason": dict(finish),
        "max_tokens_share": round(finish.get("length", 0) / ok, 4) if ok else 0.0,
        "error_types": error_types,
        "tokens": {"prompt": tokens["prompt"], "completion": tokens["completion"]},
        "prefix_cache": _prefix_cache(tokens["prefilled_prompt"], tokens["cached_prompt"]),
        "clusters": {
            k: {
                **v,
                "prefix_cache_hit_rate": _hit_rate(
                    v["prefilled_prompt_tokens"], v["cached_prompt_tokens"]
                ),
            }
            for k, v in sorted(clusters.items())
        },
    }


def _hit_rate(prefilled: int, cached: int) -> float | None:
    return round(cached / prefilled, 4) if prefilled else None


def _prefix_cache(prefilled: int, cached: int) -> dict:
    """Prompt tokens of the ok completions, those read from the engine's prefix cache, and
    the share they make (the hit rate)."""
    return {
        "prefilled_prompt_tokens": prefilled,
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": prefilled - cached,
        "hit_rate": _hit_rate(prefilled, cached),
    }


def _per_cluster(run_dir: RunDir, labels: dict[int, str] | None) -> list[dict]:
    from batchgen.task_clusters import cluster_section

    live = {e.part for e in run_dir.live_parts()}
    parts = [
        (run_dir.results / p["part"], p["span_s"])
        for p in throughput_timeline(run_dir)
        if p["part"] in live
    ]
    table = cluster_section(run_dir.path / "clusters", parts, labels)
    experts = routing_by_cluster(run_dir)
    for row in table:
        row["mean_distinct_experts"] = experts.get(row["cluster_id"])
    return table


def routing_by_cluster(run_dir: RunDir) -> dict:
    """Mean distinct experts per MoE layer per decode step, per cluster and overall (key
    "all"), merged over the sessions' routing files (MoE models only; empty otherwise).
    A decode step counts for the cluster that dominated its batch."""
    sums: dict = defaultdict(lambda: [0.0, 0])
    for path in sorted((run_dir.path / "routing").glob("*.json")):
        summary = json.loads(path.read_text())
        parts = [("all", summary.get("decode", {}))]
        parts += [(int(g), s) for g, s in summary.get("decode_by_group", {}).items()]
        for key, stats in parts:
            if stats.get("steps"):
                sums[key][0] += stats["mean_distinct_experts"] * stats["steps"]
                sums[key][1] += stats["steps"]
    return {key: round(total / steps, 2) for key, (total, steps) in sums.items() if steps}


def per_worker(run_dir: RunDir) -> dict[str, dict]:
    """Result rows and tokens per Ray worker, over the live parts (empty for a run the
    local executor did alone; its parts count under "local" next to workers' parts)."""
    workers: dict[str, Counter] = defaultdict(Counter)
    for e in run_dir.live_parts():
        w = workers[e.worker or "local"]
        w["parts"] += 1
        w["rows"] += e.rows
        w["error"] += e.error
        w["completion_tokens"] += e.completion_tokens
    if set(workers) <= {"local"}:
        return {}
    return {k: dict(v) for k, v in sorted(workers.items())}


def build_report(
    run_dir: RunDir,
    job: JobSpec | None,
    job_path: str | Path | None,
    exit_code: int | None,
    total_rows: int | None,
    labels: dict[int, str] | None = None,
) -> dict:
    stored = json.loads(run_dir.job_file.read_text()) if run_dir.job_file.exists() else {}
    report = {
        "run_dir": str(run_dir.path),
        "job_file": str(job_path) if job_path else stored.get("job_path"),
        "model": (job.model.path if job else stored.get("job", {}).get("model", {}).get("path")),
        "fingerprint": job.fingerprint if job else stored.get("fingerprint"),
        "exit_code": exit_code,
        "outcome": EXIT_MEANINGS.get(exit_code, "unknown") if exit_code is not None else None,
        "rows_total": total_rows,
        **collect(run_dir),
        "throughput": throughput_timeline(run_dir),
        "cluster_names": {str(k): v for k, v in (labels or {}).items()},
        "per_cluster": _per_cluster(run_dir, labels),
        "mean_distinct_experts": routing_by_cluster(run_dir).get("all"),
        "expert_placement": run_dir.engine_choice("expert_placement"),
        "batch_size": run_dir.engine_choice("batch_size"),
        "workers": per_worker(run_dir),
        **summarize(EngineFaultLog(run_dir.path).events()),
        "generated": time.time(),
    }
    timeline = report["throughput"]
    if timeline:
        sessions = {p["session"] for p in timeline}
        starts = [s for s in (_session_start(x) for x in sessions) if s is not None]
        report["wall_s"] = round(timeline[-1]["time"] - min(starts), 1) if starts else None
    job_ref = report["job_file"] or "JOB.yaml"
    report["resume_command"] = f"batchgen run {job_ref}"
    report["retry_errors_command"] = f"batchgen run {job_ref} --retry-errors"
    return report


def render_markdown(report: dict) -> str:
    lines = [f"# batchgen run report: {report['run_dir']}", ""]
    lines.append(f"- job: `{report['job_file']}`  model: `{report['model']}`")
    lines.append(f"- fingerprint: `{report['fingerprint']}`")
    if report["exit_code"] is not None:
        lines.append(f"- outcome: **{report['outcome']}** (exit {report['exit_code']})")
    total = report["rows_total"]
    done = report["rows_committed"]
    lines.append(f"- rows: {done:,} committed" + (f" of {total:,}" if total is not None else ""))
    if report.get("wall_s") is not None:
        lines.append(f"- wall time: {report['wall_s']:.0f} s")
    placement = report.get("expert_placement")
    if placement:
        share = placement.get("expected_host_route_share")
        lines.append(
            f"- routed experts: {placement['experts_on_device']:,} on the GPU, "
            f"{placement['experts_on_host']:,} computed on the host "
            f"({placement['host_expert_bytes'] / 2**30:.1f} GiB); expected share of routes "
            "on the host: " + ("unknown" if share is None else f"{share:.1%}")
        )
    batch = report.get("batch_size")
    if batch:
        lines.append(
            f"- max_num_seqs: {batch['max_num_seqs']:,}, chosen by the engine: its KV cache "
            f"holds {batch['kv_holds']:,} sequences of {batch['expected_seq_len']:,} tokens "
            f"(the job's mean prompt + max_tokens), at most {batch['cap']:,}"
        )
    lines += ["", "## Status", "", "| status | result rows |", "|---|---|"]
    for k, v in sorted(report["status"].items()):
        lines.append(f"| {k} | {v:,} |")
    lines += ["", "## Finish reasons (ok rows)", "", "| finish_reason | rows |", "|---|---|"]
    for k, v in sorted(report["finish_reason"].items(), key=lambda kv: str(kv[0])):
        lines.append(f"| {k} | {v:,} |")
    share = report["max_tokens_share"]
    flag = " **- raise sampling.max_tokens?**" if share > 0.1 else ""
    lines.append("")
    lines.append(f"{share:.1%} of ok rows stopped at max_tokens (finish_reason length){flag}.")
    lines += ["", "## Errors", ""]
    if report["error_types"]:
        lines += ["| error type | rows | sample ids | sample message |", "|---|---|---|---|"]
        for k, v in sorted(report["error_types"].items(), key=lambda kv: -kv[1]["count"]):
            msg = (v["sample_message"] or "").replace("|", "\\|").replace("\n", " ")[:160]
            ids = ", ".join(f"`{i}`" for i in v["sample_ids"])
            lines.append(f"| {k} | {v['count']:,} | {ids} | {msg} |")
    else:
        lines.append("No errors.")
    lines += _engine_section(report)
    if report.get("workers"):
        lines += [
            "",
            "## Workers (Ray)",
            "",
            "| worker | parts | result rows | error rows | output tokens |",
            "|---|---|---|---|---|",
        ]
        for name, w in report["workers"].items():
            lines.append(
                f"| {name} | {w['parts']:,} | {w['rows']:,} | {w.get('error', 0):,} | "
                f"{w.get('completion_tokens', 0):,} |"
            )
    t = report["tokens"]
    lines += [
        "",
        "## Tokens",
        "",
        f"- prompt: {t['prompt']:,}",
        f"- completion: {t['completion']:,}",
        _prefix_cache_line(report.get("prefix_cache")),
        "",
        "## Throughput over time (one point per committed part)",
        "",
        "| part committed | rows | output tokens | output tok/s | total tok/s |",
        "|---|---|---|---|---|",
    ]
    for p in report["throughput"]:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p["time"]))
        lines.append(
            f"| {stamp} | {p['rows']:,} | {p['completion_tokens']:,} | "
            f"{p['output_tok_s'] if p['output_tok_s'] is not None else '-'} | "
            f"{p['total_tok_s'] if p['total_tok_s'] is not None else '-'} |"
        )
    lines += [
        "",
        "## Clusters",
        "",
        "| cluster | name | ok | error | output tokens | prefix cache hit rate |",
    ]
    lines.append("|---|---|---|---|---|---|")
    names = report.get("cluster_names", {})
    for k, v in report["clusters"].items():
        hit = v.get("prefix_cache_hit_rate")
        lines.append(
            f"| {k} | {names.get(k, '-')} | {v.get('ok', 0):,} | {v.get('error', 0):,} | "
            f"{v.get('completion_tokens', 0):,} | {'-' if hit is None else f'{hit:.1%}'} |"
        )
    if any(c["cluster_id"] is not None for c in report.get("per_cluster", [])):
        lines += [
            "",
            "### Per cluster",
            "",
            "| cluster | name | planned rows | rows done | prompt tokens | output tokens "
            "| output tok/s | distinct experts / layer / step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in report["per_cluster"]:
            cluster = "-" if c["cluster_id"] is None else c["cluster_id"]
            size = "-" if c["size"] is None else f"{c['size']:,}"
            rate = "-" if c["output_tok_s"] is None else c["output_tok_s"]
            experts = c.get("mean_distinct_experts")
            lines.append(
                f"| {cluster} | {c['name']} | {size} | {c['rows']:,} | {c['prompt_tokens']:,} "
                f"| {c['completion_tokens']:,} | {rate} | {'-' if experts is None else experts} |"
            )
    if report.get("mean_distinct_experts") is not None:
        lines += [
            "",
            f"MoE routing: {report['mean_distinct_experts']} distinct experts per layer per "
            "decode step on average (a step counts for the cluster that dominated its batch).",
        ]
    lines += [
        "",
        "## Resume",
        "",
        "Rerun the same command; committed rows are skipped:",
        "",
        f"    {report['resume_command']}",
        "",
        "To run the error rows again:",
        "",
        f"    {report['retry_errors_command']}",
        "",
    ]
    return "\n".join(lines)


def _prefix_cache_line(cache: dict | None) -> str:
    if not cache or cache["hit_rate"] is None:
        return "- prompt tokens read from the prefix cache: -"
    return (
        f"- prompt tokens read from the prefix cache: {cache['cached_prompt_tokens']:,} of "
        f"{cache['prefilled_prompt_tokens']:,} prefilled ({cache['hit_rate']:.1%}; "
        f"{cache['computed_prompt_tokens']:,} computed)"
    )


def _engine_section(report: dict) -> list[str]:
    restarts = report.get("engine_restarts", 0)
    faults = report.get("engine_faults", [])
    lines = ["", "## Engine", ""]
    if not faults:
        return lines + ["No engine faults."]
    lines.append(
        f"{restarts:,} engine restarts after {len(faults):,} faults (rows in flight at a "
        "fault were run again; a row that failed alone became an `engine_error` row)."
    )
    lines += ["", "| time | event | row | error |", "|---|---|---|---|"]
    for f in faults:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["time"] or 0))
        error = (f.get("error") or "").replace("|", "\\|")[:160]
        row = f"`{f['id']}`" if f.get("id") is not None else "-"
        lines.append(f"| {stamp} | {f['event']} | {row} | {error} |")
    return lines


def render_png(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    # matplotlib logs chart-axis notes at INFO; they are noise in a run's log
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    points = [p for p in report["throughput"] if p["output_tok_s"] is not None]
    if points:
        t0 = min(p["time"] for p in report["throughput"])
        ax1.plot(
            [(p["time"] - t0) / 60 for p in points],
            [p["output_tok_s"] for p in points],
            marker="o",
        )
    ax1.set_xlabel("minutes since the first part")
    ax1.set_ylabel("output tok/s")
    ax1.set_title("throughput per committed part")
    clusters = report["clusters"]
    names = list(clusters)
    ax2.bar(names, [clusters[c].get("ok", 0) for c in names], label="ok")
    ax2.bar(
        names,
        [clusters[c].get("error", 0) for c in names],
        bottom=[clusters[c].get("ok", 0) for c in names],
        label="error",
    )
    ax2.set_xlabel("cluster")
    ax2.set_ylabel("result rows")
    ax2.set_title("rows per cluster")
    ax2.legend()
    fig.tight_layout()
    with path.open("wb") as f:
        fig.savefig(f, dpi=80, format="png")
    plt.close(fig)


def write_report(
    run_dir: RunDir,
    job: JobSpec | None,
    job_path: str | Path | None,
    exit_code: int | None,
    total_rows: int | None,
    labels: dict[int, str] | None = None,
) -> dict:
    """Write report.json, report.md and report.png into the run directory."""
    report = build_report(run_dir, job, job_path, exit_code, total_rows, labels)
    write_atomic(run_dir.path / "report.json", json.dumps(report, indent=2, default=str))
    write_atomic(run_dir.path / "report.md", render_markdown(report))
    render_png(report, run_dir.path / "report.png")
    return report
