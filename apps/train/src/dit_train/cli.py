"""The `dit-train` command line."""

import typer

from ditcore.cli import version_option

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


@app.callback(invoke_without_command=True)
def main(version_: bool = version_option("dit-train")) -> None:
    """Train a diffusion transformer with the EDM objective (Lightning Fabric + Megatron-Core parallelism)."""
