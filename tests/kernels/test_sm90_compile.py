"""Every launch the kernel tests below make under the interpreter also goes through Triton's
compiler front end for an H100/H200 (sm_90), on a machine without a GPU: it type-checks
what the interpreter runs unchecked (a runtime branch may not retype a variable, for one)
and builds the kernel's Triton IR. The lowering to PTX is left out (~10x the time here).
Two child processes: the tests with the launches recorded
(tests/kernels/_launch_recorder.py), then the front end, without TRITON_INTERPRET, which
must be unset before triton is first imported.

    python tests/kernels/test_sm90_compile.py RECORDS.jsonl   # the compiling child
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# The batch-invariant path's kernels, through tests that take seconds under the
# interpreter (~1 min in all on the 2-core machine); test_fused_moe.py's tuned-path
# variants would add ~1 min and are left out.
RECORDED_TESTS = [
    "tests/kernels/test_matmul.py",
    "tests/kernels/test_fp8_linear.py",
    "tests/kernels/test_fused_moe_ordered.py",
    "tests/kernels/test_mla_decode.py",
]
# Interpreter-only constexprs and the value a GPU launch passes.
ON_THE_GPU = {"F32_DOT": False}


def _front_end(line: str, backend, target) -> str | None:
    """None if the recorded launch's Triton IR builds for sm_90, else what failed."""
    from triton._C.libtriton import ir
    from triton.compiler import ASTSource

    module, name, types, constants, options = json.loads(line)
    constants = {k: ON_THE_GPU.get(k, v) for k, v in constants.items()}
    names = [arg for arg, _ in types]
    source = ASTSource(
        fn=getattr(importlib.import_module(module), name),
        signature=dict(types),
        constexprs={(names.index(k),): v for k, v in constants.items()},
    )
    try:
        opts = backend.parse_options(options)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        codegen = backend.get_codegen_implementation(opts)
        source.make_ir(target, opts, codegen, backend.get_module_map(), context)
    except Exception as e:  # noqa: BLE001 - the report names the launch and the error
        return f"{name} {constants} {options}: {str(e)[-1500:]}"
    return None


def _child_env(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles them for real")
def test_recorded_launches_build_for_sm90(tmp_path):
    records = tmp_path / "launches.jsonl"
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=900)
    recorded = subprocess.run(
        [sys.executable, "-m", "tests.kernels._launch_recorder", str(records), *RECORDED_TESTS],
        env=_child_env(interpret=True), **run,
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stdout[-3000:]
    assert len(records.read_text().splitlines()) > 10, "the tests launched next to nothing"
    compiled = subprocess.run(
        [sys.executable, __file__, str(records)], env=_child_env(interpret=False), **run
    )
    assert compiled.returncode == 0, compiled.stdout[-6000:] + compiled.stderr[-2000:]


def main(records: str) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    lines = Path(records).read_text().splitlines()
    failures = [f for f in (_front_end(line, backend, target) for line in lines) if f]
    for failure in failures:
        print("FAILED", failure)
    print(f"{len(lines) - len(failures)} of {len(lines)} launches built for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
