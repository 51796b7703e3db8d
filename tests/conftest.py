import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def full_disk(tmp_path):
    """A folder on its own 64 KiB tmpfs, filled up: writes there fail with ENOSPC as on a real full disk, whatever
    the writer (Python, safetensors' Rust, ffmpeg). Mounting needs root: skipped otherwise."""
    import os
    import subprocess

    folder = tmp_path / "full-disk"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("a full disk is a small tmpfs: needs root and mount")
    try:
        with open(folder / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:  # ENOSPC: full
                pass
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
