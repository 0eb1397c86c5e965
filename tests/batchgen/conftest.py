"""Shared fixtures for the pipeline tests: a tiny tokenizer and random llama checkpoint
(made on the spot, nothing downloaded), Parquet inputs, job files, and a fake engine for
the tests of the pipeline's own logic (writer, resume, order) that must not depend on the
engine's speed."""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.bench.tiny_llama import train_bpe_tokenizer, write_tiny_llama
from engine.outputs import CompletionOutput, RequestOutput
from engine.tokenizer import Tokenizer

_CORPUS = [
    "Translate the following sentence into French.",
    "The quarterly report shows revenue growth of twelve percent.",
    "Summarize this document for the board in two sentences.",
    "Please confirm the delivery date for order number 4471.",
    "Write a question and answer pair about supply chain risk.",
    "Our team will present the new pricing model next Tuesday.",
]


def build_hf_tokenizer():
    """A byte-level BPE tokenizer (any unicode encodes) with a ChatML chat template."""
    return train_bpe_tokenizer(_CORPUS * 20)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 2-layer llama in Hugging Face layout with its tokenizer (~1 MB)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), _CORPUS * 20)


class HFTokenizerAdapter(Tokenizer):
    """The engine's tokenizer over a transformers tokenizer that, like Llama's, puts BOS
    before a plain prompt (fake engine only)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        return [self.hf.bos_token_id, *ids] if add_special_tokens else ids


class FakeLLM:
    """Stands in for engine.LLM where the test is about the pipeline, not the model: pulls
    requests lazily like the engine, runs up to `max_num_seqs` at once, finishes them in
    a shuffled order, and makes each completion a function of (seed, prompt) only."""

    def __init__(self, max_num_seqs: int = 8, max_model_len: int = 256, order_seed: int = 0):
        self.tokenizer = HFTokenizerAdapter(build_hf_tokenizer())
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.model_name = "fake"
        self.pulled = 0
        self.max_waiting = 0
        self._order = random.Random(order_seed)

    def _complete(self, req) -> RequestOutput:
        ids = list(req.prompt)
        if len(ids) >= self.max_model_len:
            return RequestOutput(req.request_id, None, ids, [], True, "prompt too long")
        params = req.sampling_params
        rng = random.Random(f"{params.seed}:{ids}")
        out_ids = [rng.randrange(3, 300) for _ in range(params.max_tokens)]
        text = self.tokenizer.decode(out_ids)
        return RequestOutput(
            req.request_id, None, ids, [CompletionOutput(0, text, out_ids, "length")]
        )

    def stream(self, requests):
        source = iter(requests)
        waiting: deque = deque()
        exhausted = False
        while True:
            while not exhausted and len(waiting) < 2 * self.max_num_seqs:
                req = next(source, None)
                if req is None:
                    exhausted = True
                    break
                self.pulled += 1
                waiting.append(req)
            self.max_waiting = max(self.max_waiting, len(waiting))
            if not waiting:
                return
            running = [waiting.popleft() for _ in range(min(self.max_num_seqs, len(waiting)))]
            self._order.shuffle(running)
            for req in running:
                yield self._complete(req)


@pytest.fixture
def fake_llm() -> FakeLLM:
    return FakeLLM()


def write_parquet(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=64)
    return path


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False, allow_unicode=True))
    return path


def sentence_rows(count: int) -> list[dict]:
    return [
        {"id": f"r{i:04d}", "text": f"{_CORPUS[i % len(_CORPUS)]} (item {i})", "lang": "fr"}
        for i in range(count)
    ]


@pytest.fixture
def make_job(tmp_path):
    """make_job(rows=..., **section overrides) -> (job dict, job path): a job over a fresh
    Parquet input in tmp_path, writing to tmp_path/run."""

    def make(rows: list[dict] | None = None, model: str | None = None, **sections) -> tuple:
        data = write_parquet(tmp_path / "input.parquet", rows or sentence_rows(40))
        job = {
            "input": {"path": str(data), "id_column": "id"},
            "prompt": {"template": "Translate into French:\n{{ text }}"},
            "model": {"path": model or str(tmp_path)},
            "sampling": {"temperature": 0.0, "max_tokens": 4, "seed": 0},
            "batching": {"cluster": "off"},
            "output": {"path": str(tmp_path / "run"), "rows_per_part": 10},
            "errors": {"budget": 0.5},
        }
        for name, values in sections.items():
            job[name] = {**job.get(name, {}), **values}
        return job, write_job(tmp_path / "job.yaml", job)

    return make
