"""The `batchgen` command. Each command group lives in its own module here and only parses
arguments and calls into the library; the logic stays importable for tests."""

from __future__ import annotations

import importlib
import pkgutil

import click

from batchgen import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchgen")
def main() -> None:
    """Offline batch generation: Parquet prompts in, Parquet results out."""


def _register_commands() -> None:
    # Every module in batchgen/cli/ that defines `commands` (a list of click commands)
    # contributes them; adding a command never touches this file.
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for command in getattr(module, "commands", []):
            main.add_command(command)


_register_commands()
