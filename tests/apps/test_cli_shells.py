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
