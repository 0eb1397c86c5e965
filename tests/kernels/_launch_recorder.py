"""Records the Triton launches a test run makes under the interpreter (TRITON_INTERPRET=1):
each kernel with its arguments' types, its constexpr values and its launch options, once
per distinct combination, so that test_sm90_compile can compile exactly those launches for
the GPU.

    python -m tests.kernels._launch_recorder RECORDS.jsonl tests/kernels/test_x.py ...

runs pytest on the given tests with the recorder on and writes one JSON line per launch.
"""

from __future__ import annotations

import inspect
import json
import sys

import torch

POINTEE = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv", torch.int64: "i64", torch.int32: "i32",
    torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip
OPTIONS = ("num_warps", "num_stages")


def _describe(fn, args: tuple, kwargs: dict) -> str:
    """One launch as a JSON line: [module, name, [(arg, type)], {constexpr: value}, options].
    A runtime int is typed i32 (i64 past its range) even where the GPU's JIT would make a
    value of 1 a constant: the compile then checks the general form."""
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    types, constants = [], {}
    for name, param in sig.parameters.items():
        value = bound.arguments[name]
        if "constexpr" in str(param.annotation) or value is None:
            types.append((name, "constexpr"))
            constants[name] = getattr(value, "value", value)
        elif isinstance(value, torch.Tensor):
            types.append((name, "*" + POINTEE[value.dtype]))
        elif isinstance(value, bool):
            types.append((name, "i1"))
        elif isinstance(value, int):
            types.append((name, "i32" if -(2**31) <= value < 2**31 else "i64"))
        elif isinstance(value, float):
            types.append((name, "fp32"))
        else:
            raise TypeError(f"{fn.__name__}: argument {name} is a {type(value).__name__}")
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    return json.dumps([fn.__module__, fn.__name__, types, constants, options])


def install() -> set[str]:
    """Record every interpreted launch from now on into the returned set."""
    from triton.runtime.interpreter import InterpretedFunction

    records: set[str] = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        records.add(_describe(self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return records


def main(out: str, tests: list[str]) -> int:
    import pytest

    records = install()
    code = pytest.main(["-q", *tests])
    with open(out, "w") as f:
        f.writelines(line + "\n" for line in sorted(records))
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
