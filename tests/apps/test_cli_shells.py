import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

APPS = ["prepare", "train", "sample"]


@pytest.mark.parametrize("app", APPS)
def test_console_script_help_and_version(app):
    exe = Path(sys.executable).parent / f"dit-{app}"
    exe = str(exe) if exe.exists() else shutil.which(f"dit-{app}")
    assert exe, f"dit-{app} is not installed: run `make install`"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    assert f"dit-{app}" in out and "--version" in out
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith(f"dit-{app} 0.1.0 (ditcore 0.1.0)")


@pytest.mark.parametrize("app", APPS)
def test_unknown_command_fails_cleanly(app):
    exe = Path(sys.executable).parent / f"dit-{app}"
    res = subprocess.run([str(exe), "frobnicate"], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_the_apps_fail_through_ditcore_s_one_fail():
    """`fail` (one line, exit code 2) is defined once, in ditcore.cli, and each app's command line imports it."""
    import ast

    root = Path(__file__).resolve().parents[2]
    for app in APPS:
        tree = ast.parse((root / f"apps/{app}/src/dit_{app}/cli.py").read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not defined & {"fail", "_fail"}, f"dit-{app} defines its own fail"
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "ditcore.cli"
                    for a in n.names}
        assert "fail" in imported, f"dit-{app} does not use ditcore.cli.fail"


# The kinds of case that the app tests run in process (tests/apps/conftest.py: run_in_process), each a subprocess of
# the console script here: a usage error that Click finds (ditcore.cli's entry_point words it, for every app alike),
# and each app's deepest check that runs in process, which imports what the shallower ones import and more: dit-train's
# dataset check (its config errors come first; then the training loop and its libraries), dit-prepare's unreadable
# samples, dit-sample's refusal of a request to a loaded export.
SAME_LINES = [
    ("train", ["--config", "demo", "data.path={tmp}/nope", "train.run_dir={tmp}/run"]),
    ("prepare", ["synthetic", "--out", "{tmp}/o", "--num", "0"]),
    ("prepare", ["folder", "{tmp}/bad", "--out", "{tmp}/o"]),
    ("sample", ["generate", "--checkpoint", "{tmp}/run", "--prompt", "a red butterfly", "--steps", "0"]),
]


@pytest.mark.parametrize(("app", "args"), SAME_LINES, ids=[f"{app}-{i}" for i, (app, _) in enumerate(SAME_LINES)])
def test_in_process_runs_print_what_the_console_script_prints(cli_in_process, make_export, tmp_path, app, args):
    """The same exit code, stdout and stderr, to the character: the console script adds nothing on its way in
    (interpreter, imports, entry point) that the in-process runs would miss."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for name, data in (("a.png", b"not a png"), ("b.mp4", b"")):
        (bad / name).write_bytes(data)
        (bad / name).with_suffix(".txt").write_text("a caption")
    make_export(tmp_path / "run")
    args = [a.format(tmp=tmp_path) for a in args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    script = subprocess.run([str(Path(sys.executable).parent / f"dit-{app}"), *args], capture_output=True, text=True,
                            env=env, timeout=180)
    mine = cli_in_process(app, *args)
    assert script.returncode == 2 and script.stderr.startswith("error: "), script.stderr[-3000:]
    assert (mine.returncode, mine.stdout, mine.stderr) == (script.returncode, script.stdout, script.stderr)
