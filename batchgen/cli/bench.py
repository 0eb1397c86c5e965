"""`batchgen bench ...`: each benchmark is a module in batchgen/bench/ exposing `command`."""

from __future__ import annotations

import importlib
import pkgutil

import click

import batchgen.bench as bench_pkg


@click.group()
def bench() -> None:
    """Benchmarks: print a table and write JSON to data/benchmarks/."""


for _info in pkgutil.iter_modules(bench_pkg.__path__):
    _module = importlib.import_module(f"batchgen.bench.{_info.name}")
    if hasattr(_module, "command"):
        bench.add_command(_module.command)

commands = [bench]
