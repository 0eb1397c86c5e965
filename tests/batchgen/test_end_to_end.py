"""Real jobs through the real engine: a tiny random llama for hostile rows and determinism,
the embedded default model for the sample jobs (a few rows each, to keep CI fast)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import yaml

from batchgen.job_spec import parse_job
from batchgen.progress import Progress
from batchgen.run import EXIT_OK, EXIT_SOME_ERRORS, run_job
from engine import LLM
from tests.batchgen.conftest import sentence_rows, write_parquet

REPO = Path(__file__).resolve().parents[2]


class _Quiet:
    def write(self, _):
        pass

    def flush(self):
        pass

    def isatty(self):
        return False


def _run(job: dict, llm, job_path="job.yaml", **kwargs):
    progress = Progress(None, tty=False, interval=3600, stream=_Quiet())
    return run_job(parse_job(job), job_path, llm=llm, progress=progress, **kwargs)


HOSTILE = {
    "empty": "",
    "blank": "  \t \n ",
    "null": None,
    "huge": "revenue " * 25_000,  # 200k characters, far over the context
    "emoji": "Ship it 🚀🔥 by Friday 👍🏽 ✅",
    "rtl": "הפגישה נדחתה ליום חמישי. الاجتماع تأجل إلى يوم الخميس.",
    "cjk": "会议改到星期四上午十点。会議は木曜日に延期されました。",
    "zero_width": "in\u200bvoice\u200d total\ufeff due\u2060 now",
    "control": "line\x00one\x07\x1b[31mred\x1b[0m\rtab\there",
    "braces": "Literal {{ 7*7 }} and {% if true %}block{% endif %} stay",
}
EXPECTED_ERRORS = {
    "empty": "empty_prompt",
    "blank": "empty_prompt",
    "null": "null_input",
    "huge": "prompt_too_long",
}


def test_hostile_rows(tiny_model_dir, tmp_path):
    rows = [{"id": k, "text": v} for k, v in HOSTILE.items()]
    data = write_parquet(tmp_path / "hostile.parquet", rows)
    job = {
        "input": {"path": str(data)},
        "prompt": {"template": "Translate into French:\n{{ text }}"},
        "model": {"path": str(tiny_model_dir)},
        "sampling": {"temperature": 0.0, "max_tokens": 6},
        "batching": {"cluster": "off"},
        "output": {"path": str(tmp_path / "run"), "rows_per_part": 4},
        "errors": {"budget": 0.5},
    }
    llm = LLM(str(tiny_model_dir), max_num_seqs=4)
    assert _run(job, llm).exit_code == EXIT_SOME_ERRORS
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert sorted(df["id"].to_list()) == sorted(HOSTILE)
    for row in df.iter_rows(named=True):
        if row["id"] in EXPECTED_ERRORS:
            assert row["status"] == "error", row
            assert row["error_type"] == EXPECTED_ERRORS[row["id"]]
        else:
            assert row["status"] == "ok", row
            assert row["completion_tokens"] > 0 and row["text"] is not None
        assert row["input_text"] == HOSTILE[row["id"]]  # carried through untouched

    # The row with literal braces reaches the model verbatim.
    from batchgen.job_context import open_job
    from batchgen.run import make_renderer

    job["output"]["path"] = str(tmp_path / "unused")
    ctx = open_job(parse_job(job))
    renderer = make_renderer(ctx, llm)
    braces = next(r for r in ctx.input.rows() if r.id == "braces")
    ids = renderer.prepare(braces).prompt_token_ids
    assert HOSTILE["braces"] in llm.tokenizer.decode(ids, skip_special_tokens=False)

    # With truncation the 200k-character row runs instead of failing.
    job["prompt"]["overflow"] = "truncate_middle"
    job["output"]["path"] = str(tmp_path / "run2")
    assert _run(job, llm).exit_code == EXIT_SOME_ERRORS
    df2 = pl.read_parquet(tmp_path / "run2" / "results" / "*.parquet")
    assert df2.filter(pl.col("id") == "huge")["status"].item() == "ok"


def test_determinism_across_batch_sizes(tiny_model_dir, tmp_path):
    """temperature 0.8: each completion's seed comes from (job seed, id, n_index), so the
    same rows give the same texts whether the engine runs 1 or 16 sequences at a time."""
    data = write_parquet(tmp_path / "in.parquet", sentence_rows(24))
    texts = []
    for seqs in (1, 16):
        job = {
            "input": {"path": str(data)},
            "prompt": {"template": "{{ text }}"},
            "model": {"path": str(tiny_model_dir)},
            "sampling": {"temperature": 0.8, "max_tokens": 8, "seed": 7, "n": 2},
            "batching": {"cluster": "off", "max_num_seqs": seqs},
            "output": {"path": str(tmp_path / f"run{seqs}"), "rows_per_part": 10},
        }
        llm = LLM(str(tiny_model_dir), max_num_seqs=seqs)
        assert _run(job, llm).exit_code == EXIT_OK
        df = pl.read_parquet(tmp_path / f"run{seqs}" / "results" / "*.parquet")
        texts.append(df.sort("id", "n_index").select("id", "n_index", "text", "seed"))
    assert texts[0].equals(texts[1])
    assert texts[0]["text"].n_unique() > 24  # sampling did vary across rows and n_index


@pytest.fixture
def default_llm(default_model_llm):
    """The session's default model (tests/conftest.py), up to 8 sequences at once."""
    return default_model_llm


@pytest.mark.parametrize("name", ["translate", "summarize", "dataset", "dataset_json"])
def test_sample_job_runs_every_id_once(name, default_llm, tmp_path):
    """Each sample job as committed, on its first rows and with short completions."""
    job = yaml.safe_load((REPO / "jobs" / f"{name}.yaml").read_text())
    source = pl.read_parquet(REPO / job["input"]["path"]).head(3)
    subset = tmp_path / "subset.parquet"
    source.write_parquet(subset)
    job["input"]["path"] = str(subset)
    job["output"]["path"] = str(tmp_path / "run")
    job["sampling"]["max_tokens"] = 4
    assert _run(job, default_llm, job_path=f"jobs/{name}.yaml").exit_code == EXIT_OK
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    id_col = job["input"].get("id_column", "id")
    expected = sorted(str(v) for v in source[id_col].to_list()) * job["sampling"].get("n", 1)
    assert sorted(df["id"].to_list()) == sorted(expected)
    assert set(df["status"]) == {"ok"}
    assert (tmp_path / "run" / "report.md").exists() and (tmp_path / "run" / "_SUCCESS").exists()
