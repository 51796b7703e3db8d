"""The `dit-train` command line."""

from importlib.metadata import version

import typer

app = typer.Typer(
    name="dit-train",
    help=(
        "Train a diffusion transformer with the EDM objective (Lightning Fabric + Megatron-Core parallelism).\n\n"
        "This release ships the command shell only (--help, --version); "
        "its subcommands arrive in later releases."
    ),
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dit-train {version('dit-train')} (ditcore {version('ditcore')})")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    version_: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Train a diffusion transformer with the EDM objective (Lightning Fabric + Megatron-Core parallelism)."""
