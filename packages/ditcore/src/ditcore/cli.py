"""Pieces the command-line apps share."""

from importlib.metadata import version

import typer


def version_option(dist_name: str):
    """A Typer `--version` option that prints the app's and ditcore's versions and exits."""

    def show(value: bool) -> None:
        if value:
            typer.echo(f"{dist_name} {version(dist_name)} (ditcore {version('ditcore')})")
            raise typer.Exit()

    return typer.Option(False, "--version", callback=show, is_eager=True, help="Print the version and exit.")
