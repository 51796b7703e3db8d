import contextlib
import subprocess
import sys

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--cpu-load", type=int, default=0, metavar="N",
                     help="Run N CPU-bound processes beside the tests for the whole session (the load of a busy CI "
                          "machine: races that one test alone never shows).")


@contextlib.contextmanager
def cpu_bound_processes(n: int):
    """n processes that each keep a core busy, stopped (killed and reaped) however the block ends. Each also ends
    by itself once its parent is gone, so that not even a killed pytest leaves one spinning."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _cpu_load(request):
    with cpu_bound_processes(request.config.getoption("--cpu-load")):
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# Seconds the longest test files took in the default run on 2 cores (pytest --durations=0 summed by file, at
# 3840292 with nothing else running; files now slow-only keep their time from before: the order is what counts).
# `make test` runs two files at a time (pytest-xdist --dist loadfile --no-loadscope-reorder: files are handed out in
# collection order, as a worker frees up; xdist's own reordering, by the number of tests in a file, would put files
# of one or two long tests last, where one worker ran them alone for minutes): the longest go first, so that none
# of them starts last while the other worker has nothing left to do. Within a file, and among the others,
# pytest-randomly's order stays (the sort is stable).
LONGEST_FILES = {
    "tests/apps/test_train.py": 369, "tests/ditcore/parallel/test_equivalence.py": 241,
    "tests/ditcore/parallel/test_fabric_checkpoint.py": 150, "tests/ditcore/test_memory.py": 130,
    "tests/ditcore/parallel/test_compile.py": 112, "tests/apps/test_sample_abuse.py": 94,
    "tests/apps/test_prepare.py": 88, "tests/ditcore/parallel/test_compile_stdit.py": 81,
    "tests/apps/test_no_code_runs.py": 68, "tests/apps/test_bad_inputs.py": 63, "tests/apps/test_cli_shells.py": 62,
    "tests/apps/test_train_faults.py": 58, "tests/apps/test_resume_config.py": 55, "tests/apps/test_sample.py": 55,
    "tests/ditcore/data/test_loader.py": 52, "tests/ditcore/models/test_attention.py": 45,
    "tests/apps/test_memory_plan.py": 45, "tests/ditcore/test_init_from.py": 42, "tests/ditcore/test_interop.py": 25,
    "tests/apps/test_recipe.py": 25, "tests/ditcore/data/test_energon_cli.py": 25,
    # new since: their own runs' sums on 2 cores
    "tests/apps/test_blend_train.py": 190, "tests/apps/test_train_lost_peer.py": 60,
    "tests/ditcore/parallel/test_watchdog.py": 25, "tests/ditcore/data/test_blend_loader.py": 22,
    "tests/apps/test_flow_train.py": 100, "tests/apps/test_wan_finetune.py": 40, "tests/apps/test_wan_interop.py": 20,
    "tests/test_readme.py": 90, "tests/apps/test_sample_from_checkpoint.py": 30, "tests/apps/test_own_folder.py": 25,
    "tests/apps/test_first_hour_noise.py": 24,
}


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONGEST_FILES.get(item.nodeid.split("::")[0], 0))
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
