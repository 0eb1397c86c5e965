"""`batchgen bench routing --model DIR --input PROMPTS.parquet [--batch 64]`: what task-aware
batching saves in expert reads.

The same prompts go through the engine twice at a fixed batch size (max_num_seqs):
- arrival: in input order, no group hint;
- planned: in the order `batchgen run` feeds them with `cluster: auto` (the planner's
  cluster-by-cluster order: largest cluster first, windows sorted by prompt length) with
  Request.group = cluster, so the scheduler keeps the running batch in one cluster.

Both runs are greedy with ignore_eos and the same max_tokens, so they decode the same
number of tokens. The engine's routing recorder gives, per MoE layer and decode step, the
distinct experts the batch selected and the expert bytes that step read; the table shows
the means over decode steps, per layer and overall, decode tok/s, and the relative
reduction planned vs arrival. Works on any model directory the engine loads (a random
checkpoint from `batchgen models make-random`, or a real one).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click

from batchgen.bench.common import write_result


def load_prompts(path: Path, column: str, id_column: str | None, limit: int | None):
    """(ids, texts) from a Parquet file, in file order."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if column not in table.column_names:
        raise click.UsageError(f"{path}: no column '{column}' (columns: {table.column_names})")
    texts = table.column(column).to_pylist()
    if id_column is not None and id_column not in table.column_names:
        raise click.UsageError(f"{path}: no id column '{id_column}'")
    ids = (
        [str(v) for v in table.column(id_column).to_pylist()]
        if id_column
        else [str(i) for i in range(len(texts))]
    )
    if limit is not None:
        ids, texts = ids[:limit], texts[:limit]
    keep = [i for i, t in enumerate(texts) if t is not None and t.strip()]
    return [ids[i] for i in keep], [texts[i] for i in keep]


def planned_order(
    token_ids: list[list[int]], clusters: list[int | None], window: int, spill_dir: Path
) -> list[int]:
    """Indices in the order the batchgen planner feeds rows with these clusters."""
    from batchgen.job_spec import BatchingSpec
    from batchgen.planner import plan_by_cluster
    from batchgen.rows import PreparedRow

    rows = (
        PreparedRow(seq=i, id=str(i), carry={}, prompt_token_ids=ids, group=cluster)
        for i, (ids, cluster) in enumerate(zip(token_ids, clusters))
    )
    spec = BatchingSpec(cluster="auto", plan_window=window)
    return [row.seq for row in plan_by_cluster(rows, spec, spill_dir)]


def cluster_prompts(ids, texts, batch: int, scratch: Path) -> tuple[list[int], list[dict]]:
    """Embed and cluster here, with the same rule as a run: a cluster must fill a batch."""
    import pyarrow.parquet as pq

    from batchgen.task_clusters import ClusterSettings, build_task_clusters

    settings = ClusterSettings(min_cluster_size=batch)
    clusters = build_task_clusters(zip(ids, texts), scratch / "clusters", settings)
    assigned = pq.read_table(clusters.assignments_path).column("cluster_id").to_pylist()
    return assigned, [
        {"id": c.cluster_id, "name": c.name, "size": c.size} for c in clusters.clusters
    ]


def load_assignments(path: Path, ids: list[str]) -> tuple[list[int], list[dict]]:
    """Cluster ids from a `batchgen cluster --out` file (id, cluster_id, cluster_name), so a
    machine without the embedding model (e.g. a GPU box) can run the benchmark."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["id", "cluster_id", "cluster_name"]).to_pylist()
    by_id = {str(r["id"]): r for r in table}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise click.UsageError(f"{path}: no cluster for ids {missing[:5]} ({len(missing)} in all)")
    assigned = [int(by_id[i]["cluster_id"]) for i in ids]
    sizes: dict[int, int] = {}
    names: dict[int, str] = {}
    for i in ids:
        c = int(by_id[i]["cluster_id"])
        sizes[c] = sizes.get(c, 0) + 1
        names[c] = by_id[i]["cluster_name"]
    return assigned, [{"id": c, "name": names[c], "size": n} for c, n in sorted(sizes.items())]


def run_order(llm, token_ids, order, groups, max_tokens: int) -> dict:
    """Stream the prompts in `order` and return routing means and decode speed."""
    from engine import SamplingParams
    from engine.outputs import Request

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = (
        Request(request_id=str(i), prompt=token_ids[i], sampling_params=params, group=groups[i])
        for i in order
    )
    llm.engine.routing_recorder.reset()
    started = time.perf_counter()
    completion_tokens = 0
    for out in llm.stream(requests):
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        completion_tokens += len(out.outputs[0].token_ids)
    wall_s = time.perf_counter() - started
    stats = llm.routing_stats()
    decode = stats["decode"]
    return {
        "wall_s": round(wall_s, 2),
        "completion_tokens": completion_tokens,
        "tok_s": round(completion_tokens / wall_s, 2),
        "decode_steps": decode["steps"],
        "mean_tokens_per_decode_step": round(decode["mean_tokens_per_step"], 2),
        "mean_distinct_experts_per_layer": round(decode["mean_distinct_experts"], 3),
        "expert_bytes_per_step": round(decode["expert_bytes_per_step"]),
        "per_layer": {
            str(layer): round(v["mean_distinct_experts"], 3)
            for layer, v in decode["layers"].items()
        },
        "expert_routes": {str(layer): c for layer, c in stats["expert_routes"].items()},
    }


def run_benchmark(
    model: str,
    input_path: Path,
    batch: int,
    max_tokens: int,
    column: str,
    id_column: str | None,
    limit: int | None,
    device: str,
    dtype: str,
    assignments: Path | None = None,
) -> dict:
    from engine import LLM

    ids, texts = load_prompts(input_path, column, id_column, limit)
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=batch, record_routing=True)
    if llm.engine.routing_recorder is None:
        raise click.UsageError(f"{model}: the model records no routing (not a MoE model?)")
    token_ids = [llm.tokenizer.encode(t) for t in texts]
    with tempfile.TemporaryDirectory() as scratch:
        if assignments is not None:
            assigned, cluster_list = load_assignments(assignments, ids)
        else:
            assigned, cluster_list = cluster_prompts(ids, texts, batch, Path(scratch))
        order = planned_order(
            token_ids, assigned, window=4 * batch, spill_dir=Path(scratch) / "plan"
        )
    arrival = run_order(llm, token_ids, list(range(len(texts))), [None] * len(texts), max_tokens)
    planned = run_order(llm, token_ids, order, assigned, max_tokens)

    def reduction(key: str) -> float:
        return round(1.0 - planned[key] / arrival[key], 4) if arrival[key] else 0.0

    config = llm.engine.runner.model.config if hasattr(llm.engine.runner, "model") else None
    return {
        "model": model,
        "input": str(input_path),
        "prompts": len(texts),
        "batch": batch,
        "max_tokens": max_tokens,
        "device": device,
        "routed_experts": getattr(config, "n_routed_experts", None),
        "experts_per_token": getattr(config, "num_experts_per_tok", None),
        "clusters": cluster_list,
        "arrival": arrival,
        "planned": planned,
        "reduction": {
            "distinct_experts_per_layer": reduction("mean_distinct_experts_per_layer"),
            "expert_bytes_per_step": reduction("expert_bytes_per_step"),
        },
    }


@click.command("routing")
@click.option("--model", required=True, help="Model directory (a MoE model) or alias.")
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--column", default="prompt", show_default=True, help="Prompt column.")
@click.option("--id-column", default="id", show_default=True)
@click.option("--limit", type=click.IntRange(min=1), help="Use only the first N prompts.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--name", default=None, help="JSON name (default: routing-<model dir name>).")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the routes per expert per layer here: the routing-statistics file "
    "`expert_offload: auto` places experts by (model.expert_routing_stats).",
)
@click.option(
    "--assignments",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Cluster assignments from `batchgen cluster --out` instead of embedding here.",
)
def command(
    model,
    input_path,
    batch,
    max_tokens,
    column,
    id_column,
    limit,
    device,
    dtype,
    name,
    out,
    assignments,
):
    """Distinct experts per layer per step: arrival order vs planned (clustered) order."""
    payload = run_benchmark(
        model,
        Path(input_path),
        batch,
        max_tokens,
        column,
        id_column,
        limit,
        device,
        dtype,
        assignments,
    )
    path = write_result(name or f"routing-{Path(model).name}", payload)
    if out is not None:
        routes = payload["planned"]["expert_routes"]
        stats = {"model": model, "prompts": payload["prompts"], "expert_routes": routes}
        out.write_text(json.dumps(stats) + "\n")
        click.echo(f"wrote {out}")
    print_table(payload)
    click.echo(f"wrote {path}")


def print_table(payload: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    arrival, planned = payload["arrival"], payload["planned"]
    title = f"routing: {payload['prompts']} prompts, batch {payload['batch']}, {payload['model']}"
    table = Table(title=title)
    table.add_column("")
    table.add_column("arrival", justify="right")
    table.add_column("planned", justify="right")
    table.add_column("reduction", justify="right")
    red = payload["reduction"]
    table.add_row(
        "distinct experts / layer / step",
        f"{arrival['mean_distinct_experts_per_layer']:.2f}",
        f"{planned['mean_distinct_experts_per_layer']:.2f}",
        f"{red['distinct_experts_per_layer']:.1%}",
    )
    table.add_row(
        "expert MB read / step",
        f"{arrival['expert_bytes_per_step'] / 2**20:,.1f}",
        f"{planned['expert_bytes_per_step'] / 2**20:,.1f}",
        f"{red['expert_bytes_per_step']:.1%}",
    )
    table.add_row("decode tok/s", f"{arrival['tok_s']:,.1f}", f"{planned['tok_s']:,.1f}", "")
    table.add_row(
        "tokens / decode step",
        f"{arrival['mean_tokens_per_decode_step']:.1f}",
        f"{planned['mean_tokens_per_decode_step']:.1f}",
        "",
    )
    for layer in arrival["per_layer"]:
        table.add_row(
            f"  layer {layer}",
            f"{arrival['per_layer'][layer]:.2f}",
            f"{planned['per_layer'].get(layer, 0):.2f}",
            "",
        )
    Console().print(table)
