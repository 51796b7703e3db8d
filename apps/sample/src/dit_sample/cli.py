"""The `dit-sample` command line."""

import typer

from ditcore.cli import version_option

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


@app.callback(invoke_without_command=True)
def main(version_: bool = version_option("dit-sample")) -> None:
    """Sample a trained DiT checkpoint and decode latents to images and video (Gradio UI and CLI)."""
