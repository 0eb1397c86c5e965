"""`batchgen bench ...`: each benchmark is a module in batchgen/bench/ exposing `command`,
named after the module (`decode_moe` -> `batchgen bench decode-moe`). Modules are imported
only when their command runs or help lists it, so every other CLI command starts without
importing torch."""

from __future__ import annotations

import importlib
import pkgutil

import click

import batchgen.bench as bench_pkg

# Modules whose command is not their name: `ray` would shadow the package of that name.
_COMMAND_NAMES = {"ray_executor": "ray"}


def _modules() -> dict[str, str]:
    """Command name -> module name, for every bench module that is not a helper."""
    helpers = {
        "common",
        "tiny_llama",
        "v4_roofline",
        "peer_workloads",
        "prefix_workloads",
        "offload_figures",
    }
    return {
        _COMMAND_NAMES.get(info.name, info.name.replace("_", "-")): info.name
        for info in pkgutil.iter_modules(bench_pkg.__path__)
        if info.name not in helpers
    }


class _LazyBench(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_modules())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = _modules().get(name)
        if module is None:
            return None
        return importlib.import_module(f"batchgen.bench.{module}").command


@click.group(cls=_LazyBench)
def bench() -> None:
    """Benchmarks: print a table and write JSON to data/benchmarks/."""


commands = [bench]
