"""One training run per run directory (dit_train.rundir), and rotation and --resume auto along checkpoint lineage
(dit_train.checkpoint) — on folders made here; dit-train itself on them: test_train.py (one run per directory)."""

import contextlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from dit_train import checkpoint, rundir
from ditcore import runs


def fake_checkpoint(run_dir, name: str, run: str, seq: int, parent=None):
    """A complete checkpoint folder as far as lineage goes: its manifest."""
    ckpt = runs.step_dir(run_dir, 0).with_name(name)
    ckpt.mkdir(parents=True)
    lineage = {"run": run, "seq": seq, "parent": runs.parent_ref(parent) if parent else None}
    runs.write_manifest(ckpt, runs.step_of(ckpt), {"world_size": 1}, {}, lineage)
    return ckpt


def names(paths):
    return [p.name for p in paths]


def test_a_new_run_among_higher_numbered_old_checkpoints_keeps_its_own(tmp_path):
    """The issue's case: an old run left steps 20 and 40; a new run from scratch writes 10, 20, 30 with keep=2. By step
    number its every checkpoint was the oldest and was deleted right after it was written; by lineage rotation deletes
    only the new run's own older ones, and --resume auto continues the new run."""
    old20 = fake_checkpoint(tmp_path, "step-0000020", "old", 1)
    fake_checkpoint(tmp_path, "step-0000040", "old", 2, old20)
    new10 = fake_checkpoint(tmp_path, "step-0000010", "new", 3)
    assert checkpoint.rotate(tmp_path, new10, keep=2) == []
    new20 = fake_checkpoint(tmp_path, runs.free_step_dir(tmp_path, 20).name, "new", 4, new10)
    assert new20.name == "step-0000020-2"
    assert checkpoint.rotate(tmp_path, new20, keep=2) == []
    new30 = fake_checkpoint(tmp_path, "step-0000030", "new", 5, new20)
    assert names(checkpoint.rotate(tmp_path, new30, keep=2)) == ["step-0000010"]
    assert names(runs.complete_checkpoints(tmp_path)) == ["step-0000020", "step-0000020-2", "step-0000030",
                                                          "step-0000040"]
    assert names(checkpoint.resolve_resume(tmp_path, "auto")) == ["step-0000030", "step-0000020-2"]


def test_a_branch_keeps_its_branch_point_until_it_has_newer_checkpoints_and_auto_follows_it(tmp_path):
    """Steps 5, 10, 20 written; resumed from 10 (keep=2): the branch's step 15 rotates 5 away, not its branch point 10,
    and not 20 (another trajectory: never deleted). --resume auto then continues 15, falling back to 10."""
    a5 = fake_checkpoint(tmp_path, "step-0000005", "A", 1)
    a10 = fake_checkpoint(tmp_path, "step-0000010", "A", 2, a5)
    fake_checkpoint(tmp_path, "step-0000020", "A", 3, a10)
    b15 = fake_checkpoint(tmp_path, "step-0000015", "A", 4, a10)
    assert names(checkpoint.rotate(tmp_path, b15, keep=2)) == ["step-0000005"]
    assert names(runs.complete_checkpoints(tmp_path)) == ["step-0000010", "step-0000015", "step-0000020"]
    assert names(checkpoint.resolve_resume(tmp_path, "auto")) == ["step-0000015", "step-0000010"]
    assert names(checkpoint.rotate(tmp_path, b15, keep=1)) == ["step-0000010"]  # keep=1: the newest only, still


def test_next_lineage_continues_the_run_of_the_checkpoint_resumed(tmp_path):
    a5 = fake_checkpoint(tmp_path, "step-0000005", "A", 1)
    assert runs.next_lineage(a5) == {"run": "A", "parent": {"name": "step-0000005", "run": "A", "seq": 1,
                                                                   "path": str(a5.absolute())}}
    fresh = runs.next_lineage(None)
    assert fresh["parent"] is None and fresh["run"] != runs.next_lineage(None)["run"]


def outputs_of_a_run(run_dir):
    a = fake_checkpoint(run_dir, "step-0000020", "A", 1)
    fake_checkpoint(run_dir, "step-0000040", "A", 2, a)
    for folder in (runs.EXPORT, runs.SAMPLES, f"{runs.CSV}/run-1", runs.TENSORBOARD, "mine"):
        (run_dir / folder).mkdir(parents=True)
        (run_dir / folder / "file").write_text("x")
    (run_dir / runs.LOSS_PLOT).write_bytes(b"png")
    (run_dir / "notes.txt").write_text("the user's")


def test_resume_none_over_checkpoints_is_refused_and_overwrite_removes_only_what_dit_train_wrote(tmp_path, capsys):
    outputs_of_a_run(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(runs.CheckpointError) as e:
        rundir.start_over(tmp_path, "none", overwrite=False)
    message = str(e.value)
    for part in ("--resume none", "2 checkpoints", "step-0000040", "--resume auto", "another train.run_dir",
                 "--overwrite"):
        assert part in message
    with pytest.raises(runs.CheckpointError, match="cannot be combined with --resume"):
        rundir.start_over(tmp_path, str(runs.step_dir(tmp_path, 20)), overwrite=True)
    rundir.start_over(tmp_path, "auto", overwrite=False)  # continuing is no choice to make
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

    rundir.start_over(tmp_path, "none", overwrite=True)
    said = capsys.readouterr().err.splitlines()
    assert said == [f"--overwrite: removed what an earlier run wrote in {tmp_path}: checkpoints/ (2 checkpoints, the "
                    "newest step-0000040), export/, samples/, csv/, tensorboard/, loss.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "notes.txt"]
    rundir.start_over(tmp_path, "none", overwrite=False)  # nothing left to mix with


def test_csv_folders_of_runs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *args: "20250101-120000")
    first = rundir.csv_version(tmp_path)
    (tmp_path / runs.CSV / first).mkdir(parents=True)  # written by the first run's logger
    second = rundir.csv_version(tmp_path)
    (tmp_path / runs.CSV / second).mkdir()
    assert (first, second, rundir.csv_version(tmp_path)) == ("run-20250101-120000", "run-20250101-120000-2",
                                                             "run-20250101-120000-3")


HOLD = """
import os, sys, time
from dit_train.rundir import RunDirLock
RunDirLock.acquire(sys.argv[1])
worker = os.fork()  # like a data-loader worker: it must not keep the lock once its parent is gone
if worker == 0:
    time.sleep(120)
    os._exit(0)
print(worker, flush=True)
time.sleep(120)
"""


def test_the_lock_names_its_holder_and_kill_9_frees_it_even_with_a_forked_child_alive(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(holder.stdout.readline())
        with pytest.raises(rundir.RunDirInUse) as e:
            rundir.RunDirLock.acquire(tmp_path)
        assert str(e.value).startswith(f"train.run_dir {tmp_path} is in use by another training run (pid "
                                       f"{holder.pid} on host {socket.gethostname()}, since ")
        assert "wait for it to end or stop it, or use another train.run_dir" in str(e.value)
        holder.kill()  # kill -9: no chance to clean up, and its record stays in the file
        holder.wait(timeout=30)
        assert f'"pid": {holder.pid}' in (tmp_path / runs.LOCK_FILE).read_text()
        os.kill(worker, 0)  # the forked worker lives on (ProcessLookupError if not) ...
        lock = rundir.RunDirLock.acquire(tmp_path)  # ... and holds nothing
        assert f'"pid": {os.getpid()}' in (tmp_path / runs.LOCK_FILE).read_text()
        lock.release()
    finally:
        holder.kill()
        if worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_a_lock_file_planted_as_a_link_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("not ours")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / runs.LOCK_FILE).symlink_to(target)
    with pytest.raises(rundir.ConfigError, match=r"train.run_dir=.* is invalid: .*\.lock"):
        rundir.RunDirLock.acquire(tmp_path / "run")
    assert target.read_text() == "not ours"


@pytest.mark.parametrize("plant", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_by_name_without_waiting(tmp_path, plant):
    """A FIFO as .lock was an OSError traceback from ftruncate (and opening it for reading alone would wait for a
    writer); a folder as .lock: both one ConfigError naming the file and saying to remove it."""
    (tmp_path / "run").mkdir()
    plant(tmp_path / "run" / runs.LOCK_FILE)
    with pytest.raises(rundir.ConfigError, match=r"train.run_dir=.* is invalid: .*\.lock.*remove"):
        rundir.RunDirLock.acquire(tmp_path / "run")
