"""The two halves of surviving an engine fault, without a model: the request feed (what
is requeued, in which order, with which seeds; which rows become suspects) and the engine
supervisor (exceptions told apart, the streak, the rebuild and its smaller batch)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from batchgen.engine_faults import EngineFaultLog
from batchgen.engine_supervisor import (
    EngineFailure,
    EngineFault,
    EngineGaveUp,
    EngineSupervisor,
)
from batchgen.job_spec import parse_job
from batchgen.request_feed import RequestFeed, derive_seed
from batchgen.rows import PreparedRow, ResultRow, RowError


def _job(n: int = 1):
    return parse_job(
        {
            "input": {"path": "in.parquet"},
            "prompt": {"template": "{{ text }}"},
            "model": {"path": "m"},
            "sampling": {"temperature": 0.7, "max_tokens": 4, "seed": 3, "n": n},
            "output": {"path": "run"},
        }
    )


def _rows(count: int) -> list[PreparedRow]:
    return [
        PreparedRow(seq=i, id=f"r{i}", carry={}, prompt_token_ids=[5, i + 6]) for i in range(count)
    ]


def _ok(rid: str) -> ResultRow:
    return ResultRow(rid, 0, "ok", "t", "length", 2, 4, None, None, None, 1, {})


def _take(gen, count: int) -> list:
    return [next(gen) for _ in range(count)]


def test_requeued_requests_come_first_with_their_ids_and_seeds():
    job = _job(n=2)
    feed = RequestFeed(job, iter(_rows(5)), on_error_row=None, should_stop=lambda: False)
    first = _take(feed.requests(), 6)  # rows 0, 1, 2: two completions each
    assert [r.request_id for r in first] == ["0:0", "0:1", "1:0", "1:1", "2:0", "2:1"]
    assert feed.complete("1:0", _ok("r1")) is None  # one of two completions
    assert feed.complete("1:1", _ok("r1")) is not None  # the row is done
    feed.complete("2:1", _ok("r2"))

    assert feed.requeue_after_failure(frozenset({"0:0", "2:0"})) == []
    again = list(feed.requests())
    ids = [r.request_id for r in again]
    # in flight first (row 0 whole, row 2's missing completion), then new rows 3 and 4
    assert ids == ["0:0", "0:1", "2:0", "3:0", "3:1", "4:0", "4:1"]
    seeds = {r.request_id: r.sampling_params.seed for r in first + again}
    assert seeds["0:1"] == derive_seed(3, "r0", 1)
    assert {r.tag for r in again} == {"r0", "r2", "r3", "r4"}
    assert feed.exhausted and not feed.done


def test_rows_in_two_failing_steps_become_suspects():
    feed = RequestFeed(_job(), iter(_rows(4)), on_error_row=None, should_stop=lambda: False)
    _take(feed.requests(), 4)
    assert feed.requeue_after_failure(frozenset({"0:0", "1:0"})) == []
    suspects = feed.requeue_after_failure(frozenset({"1:0", "2:0"}))
    assert [p.row.id for p in suspects] == ["r1"]
    assert [r.request_id for r in feed.requests()] == ["0:0", "2:0", "3:0"]
    # unknown failing step: every pending row counts
    suspects = feed.requeue_after_failure(None)
    assert sorted(p.row.id for p in suspects) == ["r0", "r2"]
    assert feed.next_suspect().row.id == "r1"  # oldest first
    assert [r.request_id for r in feed.run_alone(feed.next_suspect())] == ["1:0"]
    assert 1 not in feed.suspects and 1 in feed.pending  # pending until its result is in


def test_planner_error_rows_skip_the_engine_and_stop_is_obeyed():
    rows = _rows(3)
    rows[1].error = RowError("template_error", "bad")
    errors, stop = [], []
    feed = RequestFeed(_job(), iter(rows), on_error_row=errors.append, should_stop=lambda: stop)
    gen = feed.requests()
    assert next(gen).request_id == "0:0"
    stop.append(True)
    assert list(gen) == []  # nothing more is fed after a stop
    assert errors == [] and not feed.exhausted


class _Engine:
    """An engine whose steps raise a kernel error when `failing`."""

    def __init__(self, failing: bool = False, max_num_seqs: int = 8):
        self.failing = failing
        self.max_num_seqs = max_num_seqs
        self.requests_in_step = frozenset({"0:0"})

    def stream(self, requests):
        for req in requests:
            if self.failing:
                raise RuntimeError("kernel")
            yield req.request_id


def _supervisor(tmp_path, engine, build):
    return EngineSupervisor(engine, build, lambda old: None, EngineFaultLog(tmp_path, "s"))


def _fault(oom: bool) -> EngineFault:
    return EngineFault("RuntimeError: x", oom, None, "")


def test_engine_exceptions_become_failures_the_feeds_do_not(tmp_path):
    sup = _supervisor(tmp_path, _Engine(failing=True), build=None)
    with pytest.raises(EngineFailure) as info:
        list(sup.stream(iter([type("R", (), {"request_id": "0:0"})()])))
    fault = info.value.fault
    assert fault.error == "RuntimeError: kernel" and not fault.out_of_memory
    assert fault.in_step == {"0:0"} and info.value.__context__ is None

    def broken_feed():
        raise OSError(28, "No space left on device")
        yield

    sup = _supervisor(tmp_path, _Engine(), build=None)
    with pytest.raises(OSError, match="No space"):
        list(sup.stream(broken_feed()))


def test_out_of_memory_halves_the_batch_and_frees_the_old_engine_first(tmp_path):
    built = []
    old = _Engine(max_num_seqs=6)
    alive = weakref.ref(old)

    def build(max_num_seqs):
        built.append((max_num_seqs, alive()))
        return _Engine(max_num_seqs=max_num_seqs)

    sup = _supervisor(tmp_path, old, build)
    del old
    sup.restart(_fault(oom=True))
    sup.restart(_fault(oom=True))
    sup.restart(_fault(oom=False))  # not out of memory: the size stays
    sup.restart(_fault(oom=True))
    sup.restart(_fault(oom=True))
    assert [m for m, _ in built] == [3, 1, 1, 1, 1]
    assert built[0][1] is None  # the failed engine was gone before its successor was built
    assert sup.restarts == 5
    events = [e["event"] for e in EngineFaultLog(tmp_path).events()]
    assert events == ["restart"] * 5


def test_three_failures_in_a_row_give_up_an_ok_row_resets(tmp_path):
    attempts = []

    def build(max_num_seqs):
        attempts.append(max_num_seqs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    sup = _supervisor(tmp_path, _Engine(), build)
    sup.count_failure("RuntimeError: first")
    sup.count_failure("RuntimeError: the rebuilt engine failed too")
    sup.row_ok()  # a row finished: the streak starts again
    sup.count_failure("RuntimeError: second")
    sup.count_failure("RuntimeError: failed rebuild 1")
    with pytest.raises(EngineGaveUp, match=r"3 rebuilds in a row .*OutOfMemoryError: CUDA out"):
        sup.restart(_fault(oom=False))
    assert len(attempts) == 2  # with the failure above, two failed builds make three
    assert sup.llm is None
    gc.collect()
    events = [e["event"] for e in EngineFaultLog(tmp_path).events()]
    assert events == ["build_failed", "build_failed", "gave_up"]
