"""`batchgen models list | pull | make-random`."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def models() -> None:
    """Known model aliases, fetching them, and writing random test checkpoints."""


@models.command("list")
def list_cmd() -> None:
    """Show the model aliases batchgen knows and whether each is available offline."""
    from engine.loader.catalog import list_models

    for entry in list_models():
        state = "ready" if entry["path"] else "not fetched"
        click.echo(f"{entry['name']:<28} {state:<12} {entry['description']}")
        if entry["path"]:
            click.echo(f"{'':<28} {entry['path']}")


@models.command("pull")
@click.argument("name")
def pull_cmd(name: str) -> None:
    """Fetch a model alias into the model cache (BATCHGEN_HOME) so later runs are offline."""
    from engine.loader.catalog import pull_model

    try:
        path = pull_model(name)
    except (KeyError, RuntimeError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


@models.command("make-random")
@click.option(
    "--arch", default="deepseek_v3", show_default=True, help="deepseek_v3, deepseek_v4 or llama."
)
@click.option(
    "--preset",
    type=click.Choice(["tiny", "moonlight-16b-a3b", "deepseek-v3-671b", "v4-flash"]),
    default="tiny",
    show_default=True,
    help="tiny exists for every arch (llama: only tiny); v4-flash is deepseek_v4's, the others "
    "deepseek_v3's.",
)
@click.option("--layers", type=int, default=None, help="Keep real layer shapes, fewer layers.")
@click.option(
    "--dense-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True
)
@click.option(
    "--expert-dtype", type=click.Choice(["bf16", "fp8", "mxfp4"]), default="bf16", show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, help="Where to draw the weights.")
@click.argument("out", type=click.Path(path_type=Path))
def make_random_cmd(arch, preset, layers, dense_dtype, expert_dtype, seed, device, out) -> None:
    """Write a random-weight checkpoint in the official layout to OUT."""
    from engine.checkpoint_maker import make_random_checkpoint

    try:
        path = make_random_checkpoint(
            out,
            arch=arch,
            preset=preset,
            layers=layers,
            dense_dtype=dense_dtype,
            expert_dtype=expert_dtype,
            seed=seed,
            device=device,
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


commands = [models]
