"""A run on a MoE model reports the distinct experts its decode steps read, per cluster."""

import json

from batchgen.job_spec import load_job
from batchgen.run import run_job
from engine.checkpoint_maker import make_random_checkpoint


def test_moe_run_reports_distinct_experts_per_cluster(tmp_path, make_job):
    model = make_random_checkpoint(tmp_path / "moe", preset="tiny", seed=2)
    rows = [
        {"id": f"r{i}", "text": f"{'sum' if i % 2 else 'translate'} item {i}", "task": i % 2}
        for i in range(24)
    ]
    _, job_path = make_job(
        rows=rows,
        model=str(model),
        prompt={"template": "{{ text }}", "chat": False},
        batching={"cluster": "task", "max_num_seqs": 4},
    )
    outcome = run_job(load_job(job_path), job_path)
    assert outcome.exit_code == 0
    report = json.loads((outcome.run_dir / "report.json").read_text())
    per_cluster = {c["cluster_id"]: c for c in report["per_cluster"]}
    assert set(per_cluster) == {0, 1}
    for c in per_cluster.values():
        # tiny preset: 8 routed experts, top-2, batches of up to 4 rows
        assert 2 <= c["mean_distinct_experts"] <= 8
    assert 2 <= report["mean_distinct_experts"] <= 8
    md = (outcome.run_dir / "report.md").read_text()
    assert "distinct experts / layer / step" in md
