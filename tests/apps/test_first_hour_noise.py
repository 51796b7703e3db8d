"""The noise of a user's first hour (issue 47, item 7), gone: no srun advice from Lightning, --help that reads at 80
columns, the --overwrite help that names what it removes, ..."""

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.main import get_command

from dit_train.train import cluster_environment
from ditcore import runs

APPS = ("train", "prepare", "sample")
BIN = Path(sys.executable).parent
TINY = ["--config", "demo", "model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32",
        "data.num_workers=0", "train.micro_batch=2", "train.global_batch=2", "optim.warmup_steps=0",
        "checkpoint.every=2", "logging.every=1", "validation.steps=1", "validation.size=16",
        "validation.prompts=[a red butterfly]", "validation.heldout.samples=0", "logging.tensorboard=false"]


def slurm_installed(tmp: Path) -> dict:
    """The environment of a login node where Slurm is installed: an `srun` on PATH (one that never runs), no job."""
    bin_dir = tmp / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text("#!/bin/sh\necho 'this srun is a test fake' >&2\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    # Python's default warning filters, as in a user's shell (the other app tests set PYTHONWARNINGS=ignore)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "PYTHONWARNINGS"}
    return clean | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def dit_train(*args, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "dit-train"), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dataset(cli_in_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("noise") / "data"
    proc = cli_in_process("prepare", "synthetic", "--out", out, "--num", 8, "--size", 32, "--frames", 2,
                          "--fit-samples", 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def finished(dataset, tmp_path_factory):
    """A tiny run trained to its end (2 steps) where Slurm is installed: (run dir, its command's output)."""
    tmp = tmp_path_factory.mktemp("finished")
    run = tmp / "run"
    proc = dit_train(*TINY, f"data.path={dataset}", f"train.run_dir={run}", "train.steps=2", env=slurm_installed(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_a_run_where_slurm_is_installed_gets_no_srun_advice(finished):
    """Lightning's SLURMEnvironment.detect() advises prepending srun on every run where an srun is on PATH; dit-train
    picks its cluster environment itself (dit_train.train.cluster_environment)."""
    run, proc = finished
    assert (run / "export").is_dir() and "done: 2 steps" in proc.stdout, proc.stdout
    assert "srun" not in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.parametrize(("variables", "chosen"), [
    ({}, "LightningEnvironment"),  # one process, or Fabric starts parallel.devices
    # train.sbatch: srun starts one torchrun per node, which sets these in each process it starts
    ({"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "dit-train", "TORCHELASTIC_RUN_ID": "7", "RANK": "1", "WORLD_SIZE": "4",
      "LOCAL_RANK": "1", "GROUP_RANK": "0", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, "TorchElasticEnvironment"),
    # srun started every process itself
    ({"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "dit-train"}, "SLURMEnvironment"),
    ({"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "interactive"}, "LightningEnvironment"),  # salloc's shell
])
def test_the_cluster_environment_follows_the_launcher(monkeypatch, tmp_path, variables, chosen):
    """Chosen from the launcher's variables, where an srun is on PATH, with no warning (Lightning's srun advice
    included)."""
    launchers = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in launchers]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", slurm_installed(tmp_path)["PATH"])
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(cluster_environment()).__name__ == chosen


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

