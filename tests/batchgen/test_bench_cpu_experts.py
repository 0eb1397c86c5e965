"""`batchgen bench cpu-experts` at toy sizes: it measures every (shape, tokens) case it is
asked for and reports bandwidth shares and TOPS from what it timed."""

from __future__ import annotations

import pytest

from batchgen.bench import cpu_experts


def test_run_reports_every_case_against_the_measured_bandwidth(monkeypatch):
    monkeypatch.setitem(cpu_experts.SHAPES, "toy", (64, 32, "mxfp4"))
    monkeypatch.setitem(cpu_experts.SHAPES, "toy-fp8", (64, 32, "fp8"))
    payload = cpu_experts.run(["toy", "toy-fp8"], (1, 3), top_k=2, threads=0, pool_gb=0.001,
                              repeats=2, int8_ops_per_cycle=256, torch_tokens=(3,),
                              read_gb=0.01)  # fmt: skip
    assert payload["read_gb_s"] > 0
    rows = payload["results"]
    numba_rows = [(r["shape"], r["tokens_per_expert"]) for r in rows if r["path"] == "numba"]
    assert numba_rows == [("toy", 1), ("toy", 3), ("toy-fp8", 1), ("toy-fp8", 3)]
    assert [r["shape"] for r in rows if r["path"] == "torch-bf16"] == ["toy"]
    for r in rows:
        assert r["ms"] > 0 and r["tops"] > 0
        if r["path"] == "numba":
            assert r["bandwidth_share"] == pytest.approx(r["weights_gb_s"] / payload["read_gb_s"])


def test_unknown_shape_is_refused_by_name():
    from click.testing import CliRunner

    result = CliRunner().invoke(cpu_experts.command, ["--shapes", "v4-flash,nope"])
    assert result.exit_code != 0 and "nope" in result.output
