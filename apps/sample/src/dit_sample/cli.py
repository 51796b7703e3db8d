"""The `dit-sample` command line."""

from importlib.metadata import version

import typer

app = typer.Typer(
    name="dit-sample",
    help=(
        "Sample a trained DiT checkpoint and decode latents to images and video (Gradio UI and CLI).\n\n"
        "This release ships the command shell only (--help, --version); "
        "its subcommands arrive in later releases."
    ),
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dit-sample {version('dit-sample')} (ditcore {version('ditcore')})")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    version_: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Sample a trained DiT checkpoint and decode latents to images and video (Gradio UI and CLI)."""
