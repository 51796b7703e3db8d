"""The `dit-prepare` command line."""

from importlib.metadata import version

import typer

app = typer.Typer(
    name="dit-prepare",
    help=(
        "Turn images/videos + captions into an Energon dataset of precomputed latents and text embeddings.\n\n"
        "This release ships the command shell only (--help, --version); "
        "its subcommands arrive in later releases."
    ),
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dit-prepare {version('dit-prepare')} (ditcore {version('ditcore')})")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    version_: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Turn images/videos + captions into an Energon dataset of precomputed latents and text embeddings."""
