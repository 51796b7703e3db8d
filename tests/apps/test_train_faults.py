"""Faults during training end in one line with nothing lost: signals, stops and crashes keep every logged window,
a full disk names itself and publishes nothing, a planted link is not followed, validation sizes are checked before
the first step, and a dataset whose captions are all empty trains. Most runs here are in-process (a tiny DiT, a few
steps); one dit-train is signalled for real."""

import csv
import errno
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from dit_train import preemption
from dit_train import train as training
from ditcore import probe, runs
from ditcore.diffusion import EDMLoss

BIN = Path(sys.executable).parent
TINY = ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
        "train.micro_batch=2", "train.global_batch=2", "optim.lr=1e-3", "logging.every=1", "logging.tensorboard=false",
        "validation.steps=1"]


def mock_data(root: Path, text_len: int) -> Path:
    """16 random latents (images and 2-frame clips) with text states of width 16 and text_len tokens."""
    from dit_prepare.cli import mock

    mock(out=root, num=16, latent_shape="4,1,8,8", video_latent_shape="4,2,4,4", video_ratio=0.5, text_len=text_len,
         text_dim=16, seed=0, shard_size=1000, overwrite=False, keep_partial=False, val_samples=0)
    return root


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return mock_data(tmp_path_factory.mktemp("faults") / "data", text_len=3)


@pytest.fixture(scope="module")
def empty_text_data(tmp_path_factory) -> Path:
    """Text states of width 16 with no token: every caption encoded empty."""
    return mock_data(tmp_path_factory.mktemp("faults") / "empty-text", text_len=0)


def config(data: Path, run: Path, *overrides: str):
    from dit_train.cli import find_config
    from dit_train.config import load_config

    return load_config(find_config("demo"), [*TINY, f"data.path={data}", f"train.run_dir={run}", *overrides])


@pytest.fixture
def in_process(request):
    """Runs dit-train's train() in this process; afterwards its process group and Fabric's environment variables
    (which later dit-train processes would inherit) are gone again."""
    from ditcore.parallel.dims import destroy

    environ = dict(os.environ)

    def restore():
        destroy()
        os.environ.clear()
        os.environ.update(environ)

    request.addfinalizer(restore)
    return training.train


def logged_steps(run: Path) -> list[int]:
    """The steps of every row of the run's metrics.csv files."""
    return [int(row["step"]) for f in sorted((run / "csv").glob("*/metrics.csv")) for row in csv.DictReader(f.open())]


def test_empty_captions_train_and_a_planted_link_is_not_followed(empty_text_data, tmp_path, in_process):
    """Before: DDP failed step 2, "parameters that were not used" (the cross-attention's weights, with no text token
    to attend to); and the planted .tmp-step-0000003 link made the save fail with FileExistsError (rmtree refuses a
    link, silently; tests/ditcore/test_runs.py has the unit case)."""
    run, outside = tmp_path / "run", tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    (run / runs.CHECKPOINTS).mkdir(parents=True)
    (run / runs.CHECKPOINTS / f"{runs.TMP_PREFIX}step-0000003").symlink_to(outside, target_is_directory=True)
    result = in_process(config(empty_text_data, run, "train.steps=4", "train.stop_at=3", "checkpoint.every=100"))
    assert result["step"] == 3 and [p.name for p in (run / runs.CHECKPOINTS).iterdir()] == ["step-0000003"]
    assert (outside / "keep.txt").read_text() == "not the run's"


def test_a_run_stopped_at_stop_at_keeps_every_window(text_data, tmp_path, in_process):
    """Before: no metrics.csv (Lightning's CSV logger wrote at its 100th call or at the end of train.steps)."""
    run = tmp_path / "run"
    result = in_process(config(text_data, run, "train.steps=6", "train.stop_at=3", "checkpoint.every=100"))
    assert result["stopped"] and result["step"] == 3
    assert logged_steps(run) == [1, 2, 3]


def test_a_metric_recorded_where_it_is_computed_is_logged_as_its_window_mean(text_data, tmp_path, in_process,
                                                                            monkeypatch):
    """A developer's new device metric (the weights' norm after each step) is one record() where it is computed; its
    window mean is a column of metrics.csv, and so is grad_norm's. Before: a metric took five edits in train.py, and
    grad_norm was logged as the last step's value."""
    import torch

    step = training.train_step
    recorded = {"grad_norm": [], "weight_norm": []}

    def step_and_weight_norm(run, t, it, i, metrics):
        micro = step(run, t, it, i, metrics)
        metrics.record("weight_norm", torch.linalg.vector_norm(torch.stack([p.detach().norm()
                                                                            for p in t.model.parameters()])))
        for name, values in recorded.items():
            values.append(float(metrics.recorded[name]))  # the test reads them back; train() never does
        return micro

    monkeypatch.setattr(training, "train_step", step_and_weight_norm)
    run = tmp_path / "run"
    in_process(config(text_data, run, "train.steps=4", "train.stop_at=4", "logging.every=2", "checkpoint.every=100"))
    rows = list(csv.DictReader(next((run / "csv").glob("*/metrics.csv")).open()))
    assert [int(r["step"]) for r in rows] == [2, 4]
    for name, values in recorded.items():
        assert len(set(values)) == 4  # a mean that is no single step's value
        assert [float(r[name]) for r in rows] == [(values[0] + values[1]) / 2, (values[2] + values[3]) / 2], name


def test_divergence_keeps_every_window_and_names_the_data_this_early(text_data, tmp_path, in_process,
                                                                      monkeypatch):
    """A loss that is not finite at step 3: the windows of steps 1 and 2 are on disk, and the message names the
    dataset beside the learning rate (a finite but absurd latent used to be blamed on the learning rate alone)."""
    calls, probing = [], []
    loss, probe_run = EDMLoss.__call__, probe._run

    def nan_at_third_step(self, *args, **kwargs):
        value = loss(self, *args, **kwargs)
        if probing:  # the planner's and FLOP count's probe (ditcore.probe) runs the loss too: not a step
            return value
        calls.append(1)
        return value * float("nan") if len(calls) == 3 else value

    def probed(*args, **kwargs):
        probing.append(1)
        try:
            return probe_run(*args, **kwargs)
        finally:
            probing.pop()

    monkeypatch.setattr(EDMLoss, "__call__", nan_at_third_step)
    monkeypatch.setattr(probe, "_run", probed)
    run = tmp_path / "run"
    with pytest.raises(training.Diverged) as e:
        in_process(config(text_data, run, "train.steps=6", "checkpoint.every=100"))
    assert logged_steps(run) == [1, 2]
    assert str(e.value).startswith("the loss is not finite at step 3 (this rank: nan): training diverged — lower "
                                   "optim.lr (now 0.001)")
    assert f"this early it may also be the data: check dataset {text_data}" in str(e.value)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_publishes_nothing(text_data, tmp_path, in_process,
                                                                           monkeypatch):
    """DCP's write of the second checkpoint fails with ENOSPC. Before: a CheckpointException (a BaseException) with
    every rank's traceback, which never said "disk"."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    write = dcp_files._write_item
    saves = []

    def full_on_second_save(*args, **kwargs):
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(*args, **kwargs)

    save = training.checkpoint.save

    def counting_save(*args, **kwargs):
        saves.append(1)
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp_files, "_write_item", full_on_second_save)
    monkeypatch.setattr(training.checkpoint, "save", counting_save)
    run = tmp_path / "run"
    with pytest.raises(runs.CheckpointError) as e:
        in_process(config(text_data, run, "train.steps=4", "checkpoint.every=2"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"rank 0 could not write its part of checkpoint {runs.step_dir(run, 4)}: the disk is full (")
    assert f"free in {run / runs.CHECKPOINTS})" in message and message.endswith("nothing was published; the newest "
                                                                              "complete checkpoint is kept")
    assert [p.name for p in (run / runs.CHECKPOINTS).iterdir()] == ["step-0000002"]  # its partial folder removed
    assert logged_steps(run) == [1, 2, 3, 4]


def test_a_second_ctrl_c_during_a_checkpoint_exits_at_once_and_publishes_nothing(text_data, tmp_path,
                                                                                  in_process, monkeypatch):
    """The first Ctrl-C asks for a checkpoint; one pressed again (more than Preempted.REPEAT_S later) while it is
    written raises Interrupted, which no `except Exception` on the way swallows: the half-written folder is never
    published (a .tmp-step-* folder, which resolve_resume ignores and the next save removes)."""
    from ditcore import runs

    save, saves = runs.save_tensors, []

    def pressed_twice_during_second_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(preemption.Preempted.REPEAT_S + 0.2)
            os.kill(os.getpid(), signal.SIGINT)
        return save(*args, **kwargs)

    monkeypatch.setattr(runs, "save_tensors", pressed_twice_during_second_save)
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(preemption.Interrupted, match="second Ctrl-C: nothing half-written was published"):
        in_process(config(text_data, run, "train.steps=6", "checkpoint.every=2"))
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back
    assert [p.name for p in runs.complete_checkpoints(run)] == ["step-0000002"]
    assert (run / runs.CHECKPOINTS / f"{runs.TMP_PREFIX}step-0000004").is_dir()
    assert logged_steps(run) == [1, 2, 3, 4]


def test_ctrl_c_sighup_and_sigusr1_ask_for_a_stop_and_only_a_later_ctrl_c_exits_at_once(capfd):
    """Under torchrun one Ctrl-C arrives twice within milliseconds (the terminal's, and the agent's copy): that is
    one press; a press after REPEAT_S is a second one."""
    preempted = preemption.Preempted(world_size=1, on_gpu=False)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert preempted.signalled()
        preempted.flag = False
        os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's, before the time limit (infra/slurm/train.sbatch)
        assert preempted.signalled() and preempted.signals.received == [signal.SIGHUP, signal.SIGUSR1]
        preempted.flag = False
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same press, forwarded
        assert preempted.signalled()
        assert "Ctrl-C: stopping after this step with a checkpoint" in capfd.readouterr().err
        time.sleep(preempted.REPEAT_S + 0.1)
        with pytest.raises(preemption.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes
    finally:
        preempted.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_validation_size_the_model_cannot_sample_is_refused_before_training(tmp_path):
    """Before: the sizes were first used after the last step, which then failed with no export."""
    from dit_train.validation import Validator
    from ditcore.data.schema import DatasetInfo
    from ditcore.errors import ConfigError
    from ditcore.models import preset

    info = DatasetInfo(codec={"kind": "pixel", "factor": 4}, latent_stats={"mean": [0.0] * 48, "std": [0.5] * 48},
                       text_encoder={"name": "minilm", "dim": 384}, latent_channels=48, spatial_factor=4,
                       temporal_factor=1)
    model_cfg = preset("DiT-Tiny", in_channels=48, text_dim=384, patch_size=2, max_grid=(4, 16, 16))
    for override, message in [
        ("validation.size=36", "validation.size=36 is invalid: expected a size the model can sample: 36x36 pixels "
                               "cannot be sampled: use heights and widths that are multiples of 8"),
        ("validation.size=256", "validation.size=256 is invalid: expected a size the model can sample: height too "
                                "large: 32 tokens along it, the model supports up to 16"),
        ("validation.clip_frames=9", "validation.clip_frames=9 is invalid: expected a size the model can sample: "
                                     "frames too large"),
    ]:
        cfg = config(tmp_path, tmp_path / "run", override)
        with pytest.raises(ConfigError) as e:
            Validator(cfg, info, model_cfg, fabric=None, groups=None)
        assert str(e.value).startswith(message), str(e.value)


def steps_logged_so_far(run: Path) -> int:
    """The CSV is written at every log call: logged steps are steps taken. 0 while its first row is being written."""
    try:
        return len(logged_steps(run))
    except (ValueError, TypeError):  # a row half-written as it is read
        return 0


STOP_S = 30  # the most seconds from a signal to the exit: the step it is in, a checkpoint, the loggers' last writes


# SIGTERM: the same recorder as Ctrl-C (Preempted), and test_train's slow tests signal it too
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_ctrl_c_saves_a_checkpoint_exits_0_and_keeps_every_window(signalled, text_data, tmp_path, sig):
    """A real dit-train and a real SIGINT (or SIGTERM), as a terminal (or `timeout`, `docker stop`) sends it to the
    whole process group, loader workers included. Before: no checkpoint, no message, no metrics.csv."""
    run = tmp_path / "run"
    args = ["--config", "demo", *TINY, f"data.path={text_data}", f"train.run_dir={run}", "train.steps=100000",
            "checkpoint.every=100000", "data.num_workers=1"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = signalled([BIN / "dit-train", *args], sig, lambda err: steps_logged_so_far(run) >= 3, group=True, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.err, proc.err[-3000:]
    saved = runs.complete_checkpoints(run)
    step = runs.step_of(saved[0])
    assert len(saved) == 1 and f"stopped by signal at step {step}; checkpoint saved — continue with --resume auto" in (
        proc.out + proc.err)
    assert logged_steps(run) == list(range(1, step + 1))  # every step, each its own window
    assert proc.seconds < STOP_S
