"""dit-train on a blend of an image dataset and a clip dataset (ditcore.data.blend): exact resume, the per-dataset
figures, and a blend that changes between a checkpoint and its resume."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditcore import runs
from ditcore.data.blend import parse_spec, write_blend

BIN = Path(sys.executable).parent
TINY = ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=64", "data.num_workers=0",
        "train.micro_batch=2", "train.global_batch=4", "optim.lr=3e-3", "optim.warmup_steps=0", "checkpoint.every=3",
        "logging.every=1", "validation.every=0", "logging.tensorboard=false"]
# each dataset's held-out set (its val/): 3 samples at 2 noise levels, at step 3 and at the end
HELDOUT = ["validation.heldout.samples=3", "validation.heldout.buckets=2", "validation.heldout.every=3"]


def dit_train(*args, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(BIN / "dit-train"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def data(cli_in_process, tmp_path_factory) -> Path:
    """images/ (16-token images), clips/ (4-frame clips of 64 tokens) and extra/ (more images), prepared with the
    pixel codec (each with its own latent statistics), and blend/ of the first two at 0.7 / 0.3."""
    root = tmp_path_factory.mktemp("blend")
    for name, extra in (("images", ["--video-ratio", 0]), ("clips", ["--video-ratio", 1, "--seed", 1]),
                        ("extra", ["--video-ratio", 0, "--seed", 2])):
        proc = cli_in_process("prepare", "synthetic", "--out", root / name, "--num", 40, "--size", 16, "--frames", 4,
                              "--codec", "pixel", "--val-samples", 3, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    write_blend(root / "blend", [parse_spec(f"{root / 'images'}:0.7"), parse_spec(f"{root / 'clips'}:0.3")])
    return root


def run_args(blend: Path, run_dir: Path, steps: int, *extra) -> list:
    return ["--config", "demo", *TINY, f"data.path={blend}", f"train.run_dir={run_dir}", f"train.steps={steps}",
            *extra]


def csv_rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if v} for log in sorted((run_dir / runs.CSV).glob("*/metrics.csv"))
            for row in csv.DictReader(log.open())]


def final_state(run_dir: Path, step: int) -> dict:
    ckpt = runs.step_dir(run_dir, step)
    return {part: runs.read_full(ckpt, part) for part in (runs.MODEL, runs.EMA, runs.OPTIM)} | {
        "values": runs.read_values(ckpt)}


def test_a_blend_trains_resumes_exactly_and_logs_each_datasets_share(data, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    proc = dit_train(*run_args(data / "blend", straight, 6, *HELDOUT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "blend     images: " in proc.stdout + proc.stderr
    first = dit_train(*run_args(data / "blend", stopped, 6, "train.stop_at=3", *HELDOUT))
    assert first.returncode == 0, first.stderr[-3000:]
    again = dit_train(*run_args(data / "blend", stopped, 6, *HELDOUT), "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "note: the blend changed" not in again.stderr  # the same blend: nothing to say
    a, b = final_state(straight, 6), final_state(stopped, 6)
    assert a["values"]["history"] == b["values"]["history"]  # every step's loss, exactly
    assert a["values"]["drawn"] == b["values"]["drawn"]  # the same samples of each dataset
    assert a["values"]["heldout"] == b["values"]["heldout"]  # the held-out losses at steps 3 and 6, each dataset's
    for part in (runs.MODEL, runs.EMA, runs.OPTIM):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k}"
    rows = {int(r["step"]): r for r in csv_rows(stopped) if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    drawn = a["values"]["drawn"]
    for name in ("images", "clips"):  # cumulative over the resume, as the checkpoint counts them
        assert int(float(rows[6][f"data/{name}/samples"])) == drawn[f"{name}/samples"] > 0
        assert int(float(rows[6][f"data/{name}/tokens"])) == drawn[f"{name}/tokens"]
    assert drawn["images/tokens"] == 16 * drawn["images/samples"]
    assert drawn["clips/tokens"] == 64 * drawn["clips/samples"]
    scored = {int(r["step"]): r for r in csv_rows(stopped) if "heldout/ema/total" in r}
    assert sorted(scored) == [3, 6]
    for row in scored.values():  # every held-out sample together, and each dataset's own
        assert {"heldout/images/ema/total", "heldout/clips/ema/total", "heldout/clips/raw/total"} <= row.keys()
    for step, row in rows.items():
        shares = float(row["data/images/share"]) + float(row["data/clips/share"])
        assert abs(shares - 1) < 1e-9, (step, row)


def test_a_resume_may_add_a_dataset_and_change_weights_but_not_drop_one(data, tmp_path):
    blend, run = tmp_path / "blend", tmp_path / "run"
    small = "data.shuffle_buffer=2"  # samples of an added dataset come out soon, not after a buffer of old ones
    write_blend(blend, [parse_spec(f"{data / 'images'}:0.7"), parse_spec(f"{data / 'clips'}:0.3")])
    first = dit_train(*run_args(blend, run, 6, "train.stop_at=3", small))
    assert first.returncode == 0, first.stderr[-3000:]
    # the datasets listed in another order, one added, the weights changed: every dataset keeps its position
    write_blend(blend, [parse_spec(f"{data / 'extra'}:0.5"), parse_spec(f"{data / 'clips'}:0.25"),
                        parse_spec(f"{data / 'images'}:0.25")], overwrite=True)
    grown = dit_train(*run_args(blend, run, 6, small), "--resume", "auto")
    assert grown.returncode == 0, grown.stderr[-3000:]
    notes = [ln for ln in grown.stderr.splitlines() if ln.startswith("note: the blend changed")]
    assert len(notes) == 1 and "dataset extra added" in notes[0] and "images 0.7 → 0.25" in notes[0], grown.stderr
    assert "starts a fresh pass" not in grown.stderr  # the loader's position carried over
    drawn = runs.read_values(runs.step_dir(run, 6))["drawn"]
    assert drawn["extra/samples"] > 0 and drawn["extra/tokens"] == 16 * drawn["extra/samples"]
    # a dataset the checkpoint read is gone: refused, in one line, before anything is trained
    write_blend(blend, [parse_spec(f"{data / 'extra'}:0.5"), parse_spec(f"{data / 'images'}:0.5")], overwrite=True)
    dropped = dit_train(*run_args(blend, run, 9, small), "--resume", "auto")
    assert dropped.returncode != 0
    errors = [ln for ln in dropped.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "dataset 'clips', which the checkpoint's loader read, is not in blend" in errors[0], (
        dropped.stderr[-3000:])


# ~3 min on 2 cores (9 dit-train processes): make test-slow, which CI runs
@pytest.mark.slow
def test_the_three_stage_chain_images_then_image_and_video_then_longer_clips(data, cli_in_process, tmp_path):
    """The staged recipe at CPU scale (README, "The chain on your own data"): stage 1 on 16-token images, stage 2 on a
    blend of images and 64-token clips, stage 3 on a blend of images and 128-token clips, each stage starting from the
    previous one's weights (model.init_from: its run directory) at a longer data.seq_length and a larger grid, and
    each stopped halfway and resumed."""
    long = tmp_path / "long"
    proc = cli_in_process("prepare", "synthetic", "--out", long, "--num", 24, "--size", 16, "--frames", 8,
                          "--codec", "pixel", "--video-ratio", 1, "--seed", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    write_blend(tmp_path / "long-mix", [parse_spec(f"{data / 'images'}:0.2"), parse_spec(f"{long}:0.8")])
    stages = [(data / "images", 16, None), (data / "blend", 64, tmp_path / "stage-1"),
              (tmp_path / "long-mix", 128, tmp_path / "stage-2")]
    for i, (path, seq, init) in enumerate(stages, start=1):
        run = tmp_path / f"stage-{i}"
        args = run_args(path, run, 4, f"data.seq_length={seq}", *([f"model.init_from={init}"] if init else []))
        first = dit_train(*args, "train.stop_at=2")
        assert first.returncode == 0, first.stderr[-3000:]
        said = first.stdout + first.stderr
        if init:  # every tensor of the previous stage's EMA weights, into the new model and its EMA
            taken = [ln for ln in said.splitlines() if ln.startswith(f"init_from {init}")]
            assert len(taken) == 1 and "fresh" not in taken[0], said[-3000:]
        again = dit_train(*args, "--resume", "auto")
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resumed from {runs.step_dir(run, 2)}" in again.stdout + again.stderr
        if init:
            assert "model.init_from" in again.stdout + again.stderr and "is ignored" in again.stdout + again.stderr
        history = runs.read_values(runs.step_dir(run, 4))["history"]
        assert [s for s, _ in history] == [1, 2, 3, 4]
        assert (run / "export" / "model.safetensors").is_file() or any((run / "export").iterdir())
    drawn = runs.read_values(runs.step_dir(tmp_path / "stage-3", 4))["drawn"]
    assert drawn["long/tokens"] == 128 * drawn["long/samples"] > 0  # the 8-frame clips, whole, in rows of 128
