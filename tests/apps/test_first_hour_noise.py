"""The noise of a user's first hour (issue 47, item 7), gone: no srun advice from Lightning, --help that reads at 80
columns, the --overwrite help that names what it removes, ..."""

import importlib
import os
import shutil
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



def snapshot(folder: Path) -> dict:
    """Every path in `folder` with its time and size, but the lock file (whoever holds it writes their record)."""
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")
            if p.name != ".lock"}


@pytest.mark.parametrize(("change", "differs"), [
    ("optim.lr=3e-3", "optim.lr 0.002 → 0.003"),  # the demo's 2e-3
    ("validation.prompts=[a blue square]", "validation.prompts [a red butterfly] → [a blue square]"),
])
def test_a_finished_run_is_not_resumed_by_a_command_with_another_config(finished, dataset, cli_in_process, tmp_path,
                                                                        change, differs):
    """The README's examples once shared runs/demo: `torchrun ... parallel.tp=2` "resumed" the finished demo, trained
    nothing and rewrote its samples and export. Now: one line naming the run, what differs and both ways on, exit 2,
    and nothing in the folder changed."""
    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    before = snapshot(run)
    proc = cli_in_process("train", *TINY, f"data.path={dataset}", f"train.run_dir={run}", "train.steps=2", change)
    assert proc.returncode == 2 and snapshot(run) == before, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line == (f"error: train.run_dir {run} holds a finished run (its checkpoint step-0000002: step 2 of "
                    f"train.steps=2), which this command would not train further (train.steps=2) but resume with "
                    f"another config: {differs} — continue that run with --resume auto and its own config (raise "
                    "train.steps to train it longer), or start a new run with --overwrite (removes the old run's "
                    "outputs) or in another train.run_dir"), line


def test_what_may_resume_a_run_with_nothing_left_to_train():
    """Its own config (a requeued job whose run had ended: the export is written again, the same), its own config with
    train.steps lowered (stop a run where it is) or raised (train it longer, with other settings too): resumed. Any
    other change with nothing to train: refused, naming the changes."""
    from dit_train.config import TrainConfig
    from dit_train.resume_config import compare, nothing_to_train

    saved = TrainConfig()
    saved.train.steps = 400

    def verdict(step: int, **changes) -> str | None:
        ckpt = Path(f"runs/demo/checkpoints/step-{step:07d}")
        cfg = TrainConfig.model_validate(saved.to_dict())
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return nothing_to_train(compare(saved.to_dict(), cfg, ckpt), step, saved.to_dict(), cfg)

    assert verdict(400) is None
    assert verdict(300, train__steps=300) is None  # a run stopped at 300 of 400, ended there: its export
    assert verdict(400, train__steps=500, optim__lr=1e-3) is None  # trains 100 more steps at the new rate
    assert verdict(300, optim__lr=1e-3) is None  # 100 steps left to train: the change applies (its own summary line)
    refused = verdict(400, parallel__tp=2)
    assert refused.startswith("train.run_dir runs/demo holds a finished run (its checkpoint step-0000400: step 400 of "
                              "train.steps=400), which this command would not train further (train.steps=400) but "
                              "resume with another config: parallel.tp 1 → 2 — "), refused
    refused = verdict(300, train__steps=300, parallel__tp=2)  # not finished, but nothing left to train
    assert refused.startswith("train.run_dir runs/demo holds a run whose checkpoint step-0000300 is at step 300, "
                              "which this command would not train further (train.steps=300) but resume with another "
                              "config: parallel.tp 1 → 2 — "), refused


def test_prepare_names_the_images_it_enlarged_and_those_its_crop_cut(cli_in_process, tmp_path):
    """dit-prepare folder at --size 64 --fit crop: a 20x20 image made 64x64 and non-square photos centre-cropped are
    counted and named in the summary, the held-out split's too (c-wide.png, held out by --val-samples 1)."""
    import imageio.v3 as iio
    import numpy as np

    src = tmp_path / "photos"
    src.mkdir()
    noise = np.random.default_rng(0)
    sizes = {"a-square": (64, 64), "b-tiny": (20, 20), "c-wide": (96, 64), "d-tall": (64, 80), "e-small": (40, 48)}
    for name, (w, h) in sizes.items():
        iio.imwrite(src / f"{name}.png", noise.integers(0, 256, (h, w, 3), dtype=np.uint8))
        (src / f"{name}.txt").write_text("a red square")
    proc = cli_in_process("prepare", "folder", src, "--out", tmp_path / "data", "--size", 64, "--codec", "pixel",
                          "--text-encoder", "null", "--val-samples", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reframed = [line for line in proc.stdout.splitlines() if line.startswith(("upscaled", "cropped"))]
    # e-small: 40x48 scaled 1.6x to 64x77, of which 13 rows are cut: 1 - 64/77 = 17% < c-wide's 1 - 64/96 = 33%
    assert reframed == [
        "upscaled  2 samples smaller than their frame, enlarged up to 3.2x (20x20 → 64x64): b-tiny.png, e-small.png "
        "— they train blurry: use larger images or a smaller --size",
        "cropped   3 samples cut to their frame's shape by a centre crop, up to 33% of a side (96x64 → 64x64): "
        "d-tall.png, e-small.png, c-wide.png — --fit resize or buckets keeps their aspect"], proc.stdout


def test_the_moviegen_plan_assumes_nemo_s_inputs_and_names_its_links_plainly(cli_in_process, tmp_path):
    """Without a dataset --plan takes the latent channels and text width from the preset, which for MovieGen are
    NeMo's DiTConfig's (16, 1024: the README's `preset("MovieGen-30B", in_channels=16, text_dim=1024)`), not the
    DiTs' 4 and MiniLM's 384; the FSDP ring over whole nodes is labelled with its NICs, not "InfiniBand 360 GB/s"."""
    from ditcore.models import preset
    from ditcore.speed import Cluster

    proc = cli_in_process("train", "--config", "moviegen-30b", f"data.path={tmp_path / 'absent'}", "--plan",
                          "--world-size", 64)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"data   data.path {tmp_path / 'absent'} does not exist yet: assumed 16 latent channels, text states of " \
           "width 1024, no classes" in lines
    assert (preset("MovieGen-30B").in_channels, preset("MovieGen-30B").text_dim) == (16, 1024)
    c = Cluster()
    (fsdp,) = [line for line in lines if line.startswith("  fsdp ")]
    assert fsdp.split()[1:4] == ["8×IB", f"{min(c.nvlink, 8 * c.infiniband) / 1e9:.0f}", "GB/s"], fsdp
    assert "  8×IB: the group's ranks in a node send through their 8 InfiniBand NICs at once, 8 x 46 GB/s, capped at " \
           "NVLink's 360 GB/s" in lines
    assert not any("InfiniBand 360" in line for line in lines)


def test_the_fid_install_line_is_a_command_that_works_in_this_repository(monkeypatch):
    """ditcore is not on PyPI: the line installs the fid extra from the repository, as `make install` installed
    ditcore, with the constraints that keep torch."""
    import tomllib

    from ditcore.eval.features import install_fid_command

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    python = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else \
        sys.executable
    assert install_fid_command() == f"{python} -m pip install -c constraints.txt -e 'packages/ditcore[fid]'"
    extras = tomllib.loads((repo / "packages/ditcore/pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("torch-fidelity") for r in extras["fid"])


@pytest.fixture
def no_hub(monkeypatch):
    """A machine without the network, whatever this one has: the hub's endpoint a local port nothing listens on."""
    import socket

    import huggingface_hub

    from ditcore.codecs import hub

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: a connection to it is refused at once
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")  # an empty cache
    hub._unreachable.cache_clear()
    yield port
    hub._unreachable.cache_clear()


HINT = ("pass a local folder that holds its files instead (one written by save_pretrained, or `hf download bogus/model "
        "--local-dir DIR` on a machine with network), or pre-download it into the Hugging Face cache (`hf download "
        "bogus/model`, HF_HOME) and set HF_HUB_OFFLINE=1 so that no look-up waits for the network")


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")  # diffusers 0.42 passes it
def test_hub_look_ups_fail_at_once_offline_and_say_how_to_work_offline(no_hub, monkeypatch):
    """huggingface_hub retries each request five times (25-45 s a file) before the one-line error; offline, the loaders
    read the cache alone and fail in well under a second, with the HF_HUB_OFFLINE hint."""
    import time

    import diffusers
    import transformers

    from ditcore.codecs import DiffusersVAECodec, HubLoadError
    from ditcore.codecs.text import load_text_encoder

    for imported in (transformers.AutoTokenizer, transformers.T5EncoderModel, transformers.UMT5EncoderModel,
                     diffusers.AutoencoderKL):  # their imports (seconds on a busy machine) before the clock starts
        assert imported is not None
    start = time.perf_counter()
    with pytest.raises(HubLoadError) as info:
        load_text_encoder("t5:bogus/model").load()
    assert str(info.value) == (f"could not load t5 tokenizer 'bogus/model' from the Hugging Face hub (offline: the hub "
                               f"(127.0.0.1) is unreachable: Connection refused; not in its local cache) — {HINT}")
    with pytest.raises(HubLoadError) as info:
        DiffusersVAECodec("bogus/model")
    assert str(info.value).startswith("could not load VAE 'bogus/model' from the Hugging Face hub (offline: the hub "
                                      "(127.0.0.1) is unreachable: Connection refused; not in its local cache) — ")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set by the user: no probe at all
    with pytest.raises(HubLoadError) as info:
        load_text_encoder("umt5:bogus/model").load()
    assert str(info.value) == (f"could not load umt5 tokenizer 'bogus/model' from the Hugging Face hub (offline: "
                               f"HF_HUB_OFFLINE is set; not in its local cache) — {HINT}")
    assert time.perf_counter() - start < 5  # three look-ups: 25-45 s each before, retried
