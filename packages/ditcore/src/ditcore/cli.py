"""Pieces the command-line apps share: the `--version` option and the entry point that keeps errors to one line."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import version

import typer
from typer._click import exceptions as click  # typer vendors its own click; its errors are these classes

from ditcore import quiet, stopping


def version_option(dist_name: str):
    """A Typer `--version` option that prints the app's and ditcore's versions and exits."""

    def show(value: bool) -> None:
        if value:
            typer.echo(f"{dist_name} {version(dist_name)} (ditcore {version('ditcore')})")
            raise typer.Exit()

    return typer.Option(False, "--version", callback=show, is_eager=True, help="Print the version and exit.")


def new_app(name: str, **kwargs) -> typer.Typer:
    """A Typer app whose `--help` reads at any terminal width: click's plain layout, which wraps each option's help
    in its own column as wide as the terminal allows (Rich's table, typer's default, squeezes it into ~20 characters
    cut with "…" at 80 columns). No shell-completion commands; errors are ours (`entry_point`), not typer's."""
    return typer.Typer(name=name, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                       context_settings={"max_content_width": 1000}, **kwargs)  # click's cap: 80, whatever the width


def fail(message: str):
    """A problem a command found in what it was given: `error: <message>` on stderr, exit code 2, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def stop_on_signal() -> Iterator[stopping.Signals]:
    """Around a command's work: Ctrl-C, SIGTERM and SIGHUP are recorded (ditcore.stopping) and its loops stop at
    their next check; the interrupt ends in one line, `error: interrupted by SIGNAL — <notes: what was kept or
    removed>`, and exit code 128 + the signal. Printed while the signals are still recorded, so that a second one
    cannot cut the cleanup short. A signal that came after the loop's last check ends the same way."""
    with stopping.Signals() as signals:
        try:
            yield signals
            signals.check()
        except KeyboardInterrupt as e:  # Stopped; any other KeyboardInterrupt ends the same way
            typer.echo(" — ".join([f"error: {e or 'interrupted'}", *getattr(e, "__notes__", [])]), err=True)
            raise typer.Exit(getattr(e, "exit_code", 130)) from None


def entry_point(app: typer.Typer) -> Callable[[], None]:
    """The console-script function for `app`: every usage error is one line on stderr and exit code 2.

    Click's standalone mode prints a usage block and a framed error for a bad option value; a user (or a
    script grepping logs) gets `error: <what was wrong, the value> (see CMD --help)` instead. Errors the
    commands detect themselves already exit 2 with one line (typer.Exit(2)).
    """

    def run() -> None:
        quiet.third_party()  # before the command imports the libraries whose warnings it silences
        try:
            code = app(standalone_mode=False)
        except click.NoArgsIsHelpError as e:
            e.show()  # no arguments at all: the help is the answer
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = f" — see {e.ctx.command_path} --help" if e.ctx is not None else ""
            message = e.format_message().rstrip(".")
            seen = _value_seen(e)
            typer.echo(f"error: {message}{'' if seen in message else f' (got {seen})'}{where}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            typer.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    return run


def _value_seen(e: Exception) -> str:
    """Typer validates option values with pydantic, whose error (the cause) holds the value the user gave."""
    errors = getattr(e.__cause__, "errors", None)
    if not callable(errors) or not errors():
        return ""
    return repr(errors()[0].get("input"))
