"""Shared by the app tests: a tiny exported model, and `dit-sample serve` in a subprocess on a free port."""

import contextlib
import importlib
import importlib.util
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from ditcore.data.schema import DatasetInfo
from ditcore.export import export_model
from ditcore.models import DiT, preset

_spec = importlib.util.spec_from_file_location("inprocess", Path(__file__).with_name("inprocess.py"))
inprocess = importlib.util.module_from_spec(_spec)  # tests are no package: loaded by path
_spec.loader.exec_module(inprocess)

BIN = Path(sys.executable).parent


def env(**extra) -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "GRADIO_ANALYTICS_ENABLED": "False", **extra}


def run_in_process(app: str, *args) -> subprocess.CompletedProcess:
    """`dit-APP ARGS` as its console script runs it (the function ditcore.cli.entry_point made: usage errors on one
    line, exit codes), but in this process: a subprocess spends ~3 s on 2 cores starting Python and importing torch
    before it reads its first argument. Its stdout and stderr are what the command writes to sys.stdout and
    sys.stderr; warnings go to pytest, as PYTHONWARNINGS=ignore hides them in the subprocesses. For commands that
    stop before they start anything that lasts (processes, a server); test_cli_shells.py checks that the console script
    prints the same."""
    argv = [str(BIN / f"dit-{app}"), *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    run = importlib.import_module(f"dit_{app}.cli").run
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run()
            code = 0
        except SystemExit as e:  # what the console script exits with
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_export(run: Path, num_classes: int = 0, prompts: list[str] | None = None,
                latent_shapes: dict[str, int] | None = None) -> Path:
    """Export a small random DiT with a pixel codec to run/export (no training needed to test plumbing):
    text-conditioned (minilm), or class-conditional when num_classes > 0. `prompts`: the validation prompts the
    export records; `latent_shapes`: the dataset's sample shapes ("CxTxHxW": count). Returns the run directory."""
    data = run.parent / f"{run.name}-data"
    data.mkdir(parents=True)
    text = {"name": "null", "dim": 0} if num_classes else {"name": "minilm", "dim": 384}
    info = DatasetInfo(codec={"kind": "pixel", "factor": 4}, latent_stats={"mean": [0.0] * 48, "std": [0.5] * 48},
                       text_encoder=text, latent_channels=48, spatial_factor=4, temporal_factor=1,
                       num_classes=num_classes, counts={"latent_shapes": latent_shapes} if latent_shapes else {})
    info.write(data)
    cfg = preset("DiT-Tiny", in_channels=48, text_dim=text["dim"], num_classes=num_classes, patch_size=2,
                 max_grid=(32, 16, 16))
    torch.manual_seed(0)
    model = DiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_model(run / "export", model.state_dict(), cfg, data,
                 extra={"step": 1} | ({"prompts": prompts} if prompts else {}))
    return run


PROMPTS = ["a green leaf on sand", "a grey stone"]  # the tiny run's validation prompts


@dataclass
class WandBRun:
    id: str
    resume: bool  # started to continue a W&B run (resume="allow"), as `wandb sync` then uploads it
    config: dict
    history: dict[int, dict]  # step → {name: value}; a media value is W&B's record of its file (_type, path, ...)
    files: Path  # where those paths are


def wandb_records(data: bytes) -> list | None:
    """The records of a W&B transaction log (None where its end is not written yet): after a 7-byte header (":W&B",
    0xBEE1, version), LevelDB's log format — 32 KiB blocks of chunks (CRC-32C, length, type: 1 full, 2 first,
    3 middle, 4 last; a block's last < 7 bytes are padding) — each record a wandb_internal_pb2.Record."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if pos + 7 + length > len(data):
            return None
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            try:
                records.append(pb.Record.FromString(chunks))
            except DecodeError:
                return None
            chunks = b""
    return records


def finished_wandb_records(folder: Path) -> list | None:
    """The records of the one transaction log in `folder`, once its last record is the run's exit record; None
    before (no log yet, a chunk half written, no record at all, or not the exit yet)."""
    logs = list(Path(folder).glob("run-*.wandb"))
    if len(logs) != 1:
        return None
    records = wandb_records(logs[0].read_bytes())
    return records if records and records[-1].HasField("exit") else None


def read_wandb_run(folder: Path, timeout: float = 60.0) -> WandBRun:
    """An offline W&B run (RUN_DIR/wandb/offline-run-*) read back from its transaction log, run-ID.wandb, as `wandb
    sync` reads it (wandb 0.31 reads it in Go, so here it is in Python), once it is complete: wandb-core creates and
    finishes writing it a moment after run.finish() returns, so the read waits for its exit record (the completion
    marker) with a deadline generous enough for a loaded machine."""
    deadline = time.monotonic() + timeout
    while (records := finished_wandb_records(folder)) is None:
        assert time.monotonic() < deadline, f"{folder} has no W&B transaction log ending in an exit record after " \
                                            f"{timeout} s: {sorted(p.name for p in Path(folder).iterdir())}"
        time.sleep(0.05)
    (run,) = [r.run for r in records if r.HasField("run")]
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    history = {}
    for r in (r.history for r in records if r.HasField("history")):
        row = history.setdefault(r.step.num, {})
        for item in r.item:
            *path, name = list(item.nested_key) or [item.key]
            where = row
            for key in path:
                where = where.setdefault(key, {})
            where[name] = json.loads(item.value_json)
    return WandBRun(run.run_id, run.resume, config, history, Path(folder) / "files")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A run directory: the export of a tiny text-conditioned DiT that trained on 32x48 pixels (most) and 32x32,
    one validation sample image and a contact sheet (prompts x seeds, drawn as dit-train draws it)."""
    import imageio.v3 as iio

    from ditcore.media import contact_sheet

    run = tiny_export(tmp_path_factory.mktemp("ckpt") / "run", prompts=PROMPTS,
                      latent_shapes={"48x1x8x12": 20, "48x1x8x8": 5, "48x1x9x9": 2})  # 9x9: not a patch multiple
    (run / "samples" / "step-0000001").mkdir(parents=True)
    iio.imwrite(run / "samples" / "step-0000001" / "00-a-green-leaf-on-sand.png", np.zeros((32, 32, 3), np.uint8))
    tiles = np.random.default_rng(0).integers(0, 256, (2, 2, 32, 32, 3), dtype=np.uint8)
    iio.imwrite(run / "samples" / "grid.png", contact_sheet(tiles, PROMPTS, ["seed 0", "seed 1"]))
    return run


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen


@contextlib.contextmanager
def launch(checkpoint: Path, *args, extra_env: dict | None = None):
    """`dit-sample serve --checkpoint CHECKPOINT ARGS` on a free port, until it answers HTTP; stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    # output to a file, not a pipe: a pipe nobody reads fills up and blocks the server
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(BIN / "dit-sample"), "serve", "--checkpoint", str(checkpoint), "--port",
                                 str(port), *map(str, args)],
                                stdout=log, stderr=subprocess.STDOUT, text=True, env=env(**(extra_env or {})))
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(url, timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(log.read()) from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"dit-sample serve did not answer on {url} within 120 s") from None
                    time.sleep(0.5)
            yield Server(url, port, proc)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@dataclass
class Signalled:
    returncode: int
    out: str
    err: str
    seconds: float  # from the first signal to the process's exit


def signal_when_ready(cmd: list, sig: int, ready, *, group: bool = False, env: dict | None = None,
                      wait_s: float = 180, exit_s: float = 120) -> Signalled:
    """Run `cmd`; once `ready(stderr so far)` is true (a progress marker the command wrote: a shard, a logged step, a
    sampler step; polled, up to wait_s) send it `sig` — to its whole process group with `group`, as a terminal's
    Ctrl-C, `timeout` or Slurm do — and time it until it exits. Every process it started must be gone by then. The
    command is killed however the test ends. Output goes to files: a pipe nobody reads can fill and stall it."""
    import psutil

    with tempfile.TemporaryDirectory() as logs:
        out, err = Path(logs) / "out", Path(logs) / "err"  # read by name: a shared file offset would move theirs
        with out.open("w") as stdout, err.open("w") as stderr:
            # a shell starts background jobs with SIGINT ignored; a user's Ctrl-C reaches a foreground process:
            # restore it
            proc = subprocess.Popen(list(map(str, cmd)), stdout=stdout, stderr=stderr, env=env,
                                    start_new_session=group,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + wait_s
            while not ready(err.read_text(errors="replace")):
                assert proc.poll() is None, f"it ended (exit {proc.returncode}) before the signal: {err.read_text()}"
                assert time.monotonic() < deadline, f"no progress within {wait_s} s: {err.read_text()[-3000:]}"
                time.sleep(0.05)
            children = psutil.Process(proc.pid).children(recursive=True)
            t0 = time.monotonic()
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            proc.wait(timeout=exit_s)
            seconds = time.monotonic() - t0
            _, alive = psutil.wait_procs(children, timeout=1)
            alive = [p for p in alive if _running(p)]  # a zombie has ended: its parent went before reaping it
            assert not alive, f"{len(alive)} of its processes outlived it: {alive}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
                proc.wait()
        print(f"{Path(cmd[0]).name} {signal.Signals(sig).name}: {seconds:.2f} s from the signal to the exit")
        return Signalled(proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace"), seconds)


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def signalled():
    return signal_when_ready


@pytest.fixture
def restored_process():
    """For a test that runs dit-train's setup in this process: afterwards its process group and Fabric's environment
    variables (MASTER_PORT & co., which later dit-train processes would inherit) are gone again."""
    with inprocess.process_restored(signals=()):
        yield


@pytest.fixture(scope="session")
def cli_in_process():
    return run_in_process


@pytest.fixture(scope="session")
def make_export():
    return tiny_export


@pytest.fixture(scope="session")
def read_wandb():
    return read_wandb_run


@pytest.fixture(scope="session")
def serve():
    return launch


@pytest.fixture(scope="module")
def server(checkpoint):
    with launch(checkpoint) as s:
        yield s.url
