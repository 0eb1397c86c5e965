"""`batchgen bench`: every benchmark is a command whose help works through the top-level CLI
(its module imported only then), and the CPU-runnable ones are importable functions that
return what the command writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from batchgen.bench.common import PeakRss
from batchgen.bench.kernels import parse_shapes
from batchgen.bench.pipeline_memory import command as pipeline_memory_command
from batchgen.bench.pipeline_memory import run_benchmark
from batchgen.cli import main

BENCHMARKS = {
    "clustering",
    "cpu-experts",
    "decode",
    "decode-moe",
    "invariant-linear",
    "kernels",
    "mla-decode",
    "peer",
    "pipeline-memory",
    "prefix-cache",
    "ray",
    "routing",
    "step-tune",
    "structured",
    "v4-kernels",
}


def test_every_benchmark_is_listed_and_its_help_works():
    runner = CliRunner()
    listed = runner.invoke(main, ["bench", "--help"])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.split("Commands:")[1].splitlines()
    assert {line.split()[0] for line in lines if line.strip()} == BENCHMARKS  # no helpers
    for name in sorted(BENCHMARKS):
        result = runner.invoke(main, ["bench", name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert f"Usage: main bench {name} [OPTIONS]" in result.output, name


def test_the_cli_starts_without_importing_a_benchmark():
    code = (
        "import sys\n"
        "from batchgen.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('batchgen.bench.'))\n"
        "print('LOADED', loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout, out.stdout


def test_parse_shapes():
    assert parse_shapes("") == ()
    assert parse_shapes("36864x7168, 4096X32768") == ((36864, 7168), (4096, 32768))
    for bad in ("36864", "1x2x3", "axb"):
        with pytest.raises(Exception, match="expected NxK"):
            parse_shapes(bad)


def test_peak_rss_sees_memory_held_while_sampling():
    with PeakRss(interval_s=0.01) as rss:
        held = bytearray(64 << 20)
        for i in range(0, len(held), 4096):  # touch every page so it is resident
            held[i] = 1
        time.sleep(0.1)
        del held
    assert rss.peak - rss.start_rss >= 48 << 20
    assert rss.peak_anon == 0 or rss.peak_anon - rss.start_anon >= 48 << 20


def test_pipeline_memory_runs_a_job_and_reports_its_peak(tmp_path, monkeypatch):
    payload = run_benchmark(rows=300, max_num_seqs=16, base=tmp_path / "run300")
    assert payload["exit_code"] == 0 and payload["rows"] == 300
    assert payload["peak_rss_mb"] >= payload["rss_after_model_load_mb"]
    assert payload["peak_above_model_mb"] >= 0 and payload["within_bound"]
    results = list((tmp_path / "run300" / "run" / "results").glob("*.parquet"))
    assert results, "the job wrote no parts"

    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path / "bench")
    args = ["--rows", "200", "--max-num-seqs", "8", "--workdir", str(tmp_path / "run200")]
    result = CliRunner().invoke(pipeline_memory_command, args)
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "bench" / "pipeline-memory-200.json").read_text())
    assert written["rows"] == 200 and written["exit_code"] == 0
    assert written["command"] and written["machine"]["cpu_count"]


def test_clustering_bench_on_a_thousand_prompts(tmp_path, monkeypatch):
    from batchgen.bench.clustering import command as clustering_command

    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path / "bench")
    args = ["--rows", "1000", "--embed-sample", "100", "--device", "cpu", "--name", "t"]
    result = CliRunner().invoke(clustering_command, [*args, "--work-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "bench" / "t.json").read_text())
    m = payload["measured"]
    assert payload["rows"] == m["pipeline_rows"] == 1000 and m["embed_sample_rows"] == 100
    assert m["clusters"] >= 2 and m["embed_prompts_per_s"] > 0
    assert payload["estimated"]["embed_all_s"] == pytest.approx(
        1000 / m["embed_prompts_per_s"], 0.01
    )
    assert "estimated total" in result.output
