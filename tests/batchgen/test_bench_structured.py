"""`batchgen bench structured`: importable without the pipeline's pydantic/polars or the
grammar library (the GPU machine), and a tiny run fills every column."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_imports_without_pydantic_polars_or_llguidance():
    code = (
        "import sys\n"
        "for m in ('pydantic', 'polars', 'llguidance'): sys.modules[m] = None\n"
        "import batchgen.bench.structured\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_tiny_run_fills_the_table(tiny_model_dir):
    pytest.importorskip("llguidance")
    from batchgen.bench.structured import bench_structured

    payload = bench_structured(str(tiny_model_dir), "cpu", "float32", [1, 3], 6)
    assert [r["batch"] for r in payload["rows"]] == [1, 3]
    for row in payload["rows"]:
        assert row["free_tok_s"] > 0 and row["json_tok_s"] > 0
        assert 0 < row["free_tokens"] <= 6 * row["batch"]
        assert 0 <= row["json_tokens"] <= 6 * row["batch"] and 0.0 <= row["valid"] <= 1.0
