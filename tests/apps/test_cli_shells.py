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
