"""Helpers for the batch-API tests: request lines in the OpenAI and Anthropic shapes, JSONL
files of them, and a job dict over such a file."""

from __future__ import annotations

import json
from pathlib import Path

from batchgen.job_spec import parse_job
from batchgen.progress import Progress
from batchgen.run import run_job


def openai_chat(custom_id: str, text: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], **body},
    }


def openai_completion(custom_id: str, prompt, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, **body},
    }


def anthropic_message(custom_id: str, text: str, **params) -> dict:
    return {
        "custom_id": custom_id,
        "params": {
            "model": "claude-3-5-haiku",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
            **params,
        },
    }


def write_jsonl(path: Path, lines: list) -> Path:
    """Each item a dict (written as JSON) or a str (written as it is)."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def batch_job(tmp_path: Path, data: Path, model: str, **sections) -> dict:
    job = {
        "input": {"path": str(data)},
        "model": {"path": model},
        "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 0},
        "batching": {"cluster": "off"},
        "output": {"path": str(tmp_path / "run"), "rows_per_part": 5},
        "errors": {"budget": 0.9},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


class _Quiet:
    def write(self, _):
        pass

    def flush(self):
        pass

    def isatty(self):
        return False


def run(job: dict, llm, job_path="job.yaml", **kwargs):
    progress = Progress(None, tty=False, interval=3600, stream=_Quiet())
    return run_job(parse_job(job), job_path, llm=llm, progress=progress, **kwargs)
