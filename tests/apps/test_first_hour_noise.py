"""The noise of a user's first hour (issue 47, item 7), gone: --help that reads at 80 columns, the --overwrite help
that names what it removes, ..."""

import importlib

import pytest
from typer.main import get_command

from ditcore import runs

APPS = ("train", "prepare", "sample")


def commands(app: str):
    """(path, click command) of the app and of each of its subcommands."""
    root = get_command(importlib.import_module(f"dit_{app}.cli").app)
    yield [], root
    for name, command in getattr(root, "commands", {}).items():
        yield [name], command


def squeezed(text: str) -> str:
    return "".join(text.split())  # the help as wrapped at any width, hyphen breaks (DiT-XL → "DiT-\nXL") included


@pytest.mark.parametrize("app", APPS)
def test_help_at_80_columns_shows_every_option_s_whole_description(cli_in_process, monkeypatch, app):
    monkeypatch.setenv("COLUMNS", "80")
    checked = 0
    for path, command in commands(app):
        proc = cli_in_process(app, *path, "--help")
        assert proc.returncode == 0, proc.stderr
        helps = [p.help for p in command.params if getattr(p, "help", None)]
        assert max(map(len, proc.stdout.splitlines())) <= 80, (path, proc.stdout)
        # no description cut short: the only "…" are those the texts hold (dit-sample's -0, -1, … file names)
        assert proc.stdout.count("…") == sum(text.count("…") for text in [*helps, command.help or ""]), path
        for text in helps:
            assert squeezed(text) in squeezed(proc.stdout), (path, text)
            checked += 1
    assert checked > 10  # the walk reached the subcommands' options


def test_overwrite_help_names_everything_it_removes(cli_in_process, monkeypatch):
    """The help lists ditcore.runs.OUTPUTS, which dit_train.rundir.remove_outputs removes: wandb/ and heldout.png
    were missing when the list was written out by hand."""
    monkeypatch.setenv("COLUMNS", "1000")
    lines = cli_in_process("train", "--help").stdout.splitlines()
    (line,) = [line for line in lines if line.startswith("  --overwrite")]
    removed = line.split("there: ")[1].rstrip(".").split(", ")
    assert removed == ["checkpoints/", "export/", "samples/", "csv/", "tensorboard/", "wandb/", "loss.png",
                       "heldout.png"]
    assert [name.rstrip("/") for name in removed] == list(runs.OUTPUTS)
