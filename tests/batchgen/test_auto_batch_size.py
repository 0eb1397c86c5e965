"""A job that leaves max_num_seqs out runs with the engine's choice at the job's lengths,
and its report says what was chosen; a job that sets it gets it."""

import json

from batchgen.job_context import open_job, open_tokenizer
from batchgen.job_lengths import expected_seq_len
from batchgen.job_spec import load_job
from batchgen.run import run_job
from engine.batch_size import DEFAULT_MAX_NUM_SEQS


def test_expected_length_is_the_mean_prompt_plus_max_tokens(tmp_path, make_job, tiny_model_dir):
    rows = [{"id": f"r{i}", "text": "word " * (1 + 4 * i)} for i in range(6)]
    _, job_path = make_job(rows=rows, model=str(tiny_model_dir), prompt={"template": "{{ text }}"},
                           sampling={"max_tokens": 7})  # fmt: skip
    ctx = open_job(load_job(job_path))
    tok, _ = open_tokenizer(ctx.job)
    prompts = [len(tok.encode(r["text"])) for r in rows]
    got = expected_seq_len(ctx)
    # the template adds nothing around the text; chat templating may add a few tokens
    assert sum(prompts) / 6 + 7 <= got <= sum(prompts) / 6 + 7 + 64
    assert expected_seq_len(ctx, sample_rows=1) < got


def test_a_job_without_max_num_seqs_reports_the_engines_choice(tmp_path, make_job, tiny_model_dir):
    _, job_path = make_job(model=str(tiny_model_dir), batching={"cluster": "off"})
    outcome = run_job(load_job(job_path), job_path)
    assert outcome.exit_code == 0
    report = json.loads((outcome.run_dir / "report.json").read_text())
    choice = report["batch_size"]
    assert choice["max_num_seqs"] == min(DEFAULT_MAX_NUM_SEQS, choice["kv_holds"])
    assert choice["expected_seq_len"] > 4  # a prompt plus max_tokens 4
    assert "chosen by the engine" in (outcome.run_dir / "report.md").read_text()


def test_a_job_that_sets_max_num_seqs_gets_it(tmp_path, make_job, tiny_model_dir):
    _, job_path = make_job(model=str(tiny_model_dir), batching={"cluster": "off", "max_num_seqs": 3})
    outcome = run_job(load_job(job_path), job_path)
    assert outcome.exit_code == 0
    assert json.loads((outcome.run_dir / "report.json").read_text())["batch_size"] is None
