import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a worker script under torchrun with `nproc` gloo processes on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def run_torchrun():
    return torchrun
