"""BATCHGEN_FAULT_INJECT: the spec parser, and faults raised from inside a real engine's
step (once per process for step faults, every step for row faults)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, Request, SamplingParams
from engine.fault_injection import (
    ENV_VAR,
    Fault,
    FaultInjector,
    FaultSpecError,
    from_environment,
    parse_faults,
)


def test_parse_faults():
    assert parse_faults(" oom@step=5, crash@step=3,crash@row=r0007 ,crash@step=every") == [
        Fault("oom", "step", 5),
        Fault("crash", "step", 3),
        Fault("crash", "row", "r0007"),
        Fault("crash", "step", "every"),
    ]
    assert parse_faults("") == []


@pytest.mark.parametrize(
    "spec, named",
    [
        ("oom@step", "'oom@step'"),
        ("boom@step=3", "'boom@step=3'"),
        ("crash@tick=3", "'crash@tick=3'"),
        ("crash@row=", "'crash@row='"),
        ("oom@step=5,crash", "'crash'"),
        ("oom@step=0", "'oom@step=0'"),
        ("crash@step=x", "'crash@step=x'"),
    ],
)
def test_malformed_spec_names_the_entry(spec, named):
    with pytest.raises(FaultSpecError) as info:
        parse_faults(spec)
    message = str(info.value)
    assert message.startswith(ENV_VAR) and named in message
    assert "\n" not in message


def test_step_fault_fires_once_row_fault_every_time():
    injector = FaultInjector(parse_faults("oom@step=2,crash@row=bad"))
    injector.before_step(1, {"a"})
    with pytest.raises(torch.OutOfMemoryError, match="oom@step=2"):
        injector.before_step(2, {"a"})
    injector.before_step(2, {"a"})  # fired already
    for step in (3, 4):
        with pytest.raises(RuntimeError, match="crash@row=bad") as info:
            injector.before_step(step, {"a", "bad"})
        assert not isinstance(info.value, torch.OutOfMemoryError)


def test_engine_step_raises_and_a_rebuilt_engine_does_not(tiny_llama, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "crash@step=2,crash@row=poison")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = "translate into french: good morning"
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=4 << 20)
    assert llm.engine.faults is from_environment()  # one injector for the process
    with pytest.raises(RuntimeError, match=r"crash@step=2 .* at step 2"):
        list(llm.stream([Request("a", prompt, params, tag="ok")]))
    assert llm.requests_in_step == {"a"}  # the failed step's requests

    rebuilt = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=4 << 20)
    out = list(rebuilt.stream([Request("a", prompt, params, tag="ok")]))
    assert len(out[0].outputs[0].token_ids) == 4  # its step 2 ran: the fault fired once

    with pytest.raises(RuntimeError, match="holds row poison"):
        list(rebuilt.stream([Request("b", prompt, params, tag="poison")]))


def test_engine_refuses_a_malformed_spec(tiny_llama, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "oom@step=five")
    with pytest.raises(FaultSpecError, match="oom@step=five"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=4 << 20)
