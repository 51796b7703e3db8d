"""dit-train as a user runs it: configs, exact resume (1 process and TP=2), signals, outputs."""

import contextlib
import csv
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dit_train import checkpoint
from dit_train.cli import find_config
from dit_train.config import SHIPPED_NAMES, load_config
from ditcore import durable, runs
from ditcore.media import read_video

BIN = Path(sys.executable).parent
TINY = ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
        "train.micro_batch=2", "train.global_batch=4", "optim.lr=3e-3", "optim.warmup_steps=0", "checkpoint.every=3",
        "logging.every=1", "validation.steps=2", "validation.size=32", "validation.prompts=[a red butterfly]",
        "logging.tensorboard=false"]
# all three logs (W&B's written locally, for `wandb sync`): test_csv_tensorboard_and_wandb_hold_the_same_figures
ALL_LOGS = ["logging.tensorboard=true", "logging.wandb.project=ditcore-test", "logging.wandb.mode=offline"]


def env():
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def dit_train(*args, timeout=300, warnings="ignore"):
    return subprocess.run([str(BIN / "dit-train"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env() | {"PYTHONWARNINGS": warnings})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(*args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           str(BIN / "dit-train"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


@pytest.fixture(scope="module")
def dataset(cli_in_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "data"
    proc = cli_in_process("prepare", "synthetic", "--out", out, "--num", 48, "--size", 32, "--frames", 4,
                          "--fit-samples", 48)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_args(dataset, run_dir, steps, *extra):
    return ["--config", "demo", *TINY, f"data.path={dataset}", f"train.run_dir={run_dir}", f"train.steps={steps}",
            *extra]


def final_state(run_dir: Path, step: int) -> dict:
    """A checkpoint's one-device tensors (model, EMA, AdamW state) and its loss history, whatever layout wrote it."""
    ckpt = runs.step_dir(run_dir, step)
    state = {part: runs.read_full(ckpt, part) for part in (runs.MODEL, runs.EMA, runs.OPTIM)}
    return state | {"history": runs.read_values(ckpt)["history"]}


def assert_same_training(a: Path, b: Path, step: int):
    x, y = final_state(a, step), final_state(b, step)
    assert x["history"] == y["history"]  # every step's loss, exactly
    for part in (runs.MODEL, runs.EMA, runs.OPTIM):
        assert x[part].keys() == y[part].keys()
        for k in x[part]:
            assert torch.equal(x[part][k], y[part][k]), f"{part}.{k}"


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_every_shipped_config_validates(name):
    cfg = load_config(find_config(name))
    assert cfg.train.steps >= 1


def test_print_config_shows_the_resolved_values(cli_in_process):
    proc = cli_in_process("train", "--config", "demo", "train.steps=123", "parallel.tp=2", "--print-config")
    assert proc.returncode == 0
    assert "steps: 123" in proc.stdout and "tp: 2" in proc.stdout and "preset: DiT-Demo" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "demo", "train.stepz=3"], "train.stepz=3 is invalid: expected one of the known keys"),
        (["--config", "demo", "train.steps=-1"], "train.steps=-1 is invalid: expected an integer >= 1"),
        (["--config", "demo", "model.preset=DiT-XXL"], "model.preset='DiT-XXL' is invalid: expected one of DiT-S/2"),
        (["--config", "demo", "train.global_batch=5"], "train.global_batch=5 is invalid: expected a multiple of"),
        (["--config", "nope.yaml"], "--config='nope.yaml' is invalid: expected an existing YAML file"),
        (["--config", "demo", "data.path=/no/such/data"], "dataset path '/no/such/data' does not exist — run dit-prep"),
    ],
)
def test_bad_configs_give_one_clear_line(cli_in_process, args, message):
    proc = cli_in_process("train", *args)  # found before any process starts: the console script's lines, in process
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert lines == [f"error: {lines[0][7:]}"] and message in lines[0], proc.stderr[-2000:]


# ---------------------------------------------------------------- training


def heldout_args(dataset) -> list[str]:
    """The held-out loss (dit_train.heldout) on the first 5 samples of the training set itself (a dataset with the
    same latents), at 3 noise levels, every 2 steps and at the end."""
    return [f"data.val_path={dataset}", "validation.heldout.samples=5", "validation.heldout.buckets=3",
            "validation.heldout.every=2"]


def csv_rows(run_dir: Path) -> list[dict]:
    """Every row of the run's CSV metrics, over its segments (oldest first), with the values that row holds."""
    return [{k: v for k, v in row.items() if v} for log in sorted((run_dir / runs.CSV).glob("*/metrics.csv"))
            for row in csv.DictReader(log.open())]


def heldout_logged(run_dir: Path) -> dict[int, dict[str, str]]:
    """step → the held-out losses logged at it (as the CSV writes them: every digit)."""
    return {int(row["step"]): {k: v for k, v in row.items() if k.startswith("heldout/")}
            for row in csv_rows(run_dir) if "heldout/ema/total" in row}


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
    """An uninterrupted 6-step run: every interrupted-and-resumed run must end exactly like it. With held-out losses
    (steps 2, 4 and 6) logged to CSV and TensorBoard."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = dit_train(*run_args(dataset, run, 6, *heldout_args(dataset), *ALL_LOGS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_straight_equals_stop_and_resume_one_process(dataset, straight, tmp_path, read_wandb):
    """... and so do the held-out losses: the resumed segment logs exactly the uninterrupted run's figures."""
    resumed = tmp_path / "resumed"
    logs = [*heldout_args(dataset), *ALL_LOGS]
    first = dit_train(*run_args(dataset, resumed, 6, "train.stop_at=3", *logs))  # same run, stopped after step 3
    assert first.returncode == 0, first.stderr[-3000:]
    assert [p.name for p in runs.complete_checkpoints(resumed)] == ["step-0000003"]
    second = dit_train(*run_args(dataset, resumed, 6, *logs), "--resume", "auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    # the second segment logs into the first one's W&B run, from the step after the checkpoint on
    a, b = (read_wandb(f) for f in sorted((resumed / runs.WANDB).glob("offline-run-*")))
    assert b.id == a.id and b.resume and not a.resume
    assert [s for s in a.history if "loss" in a.history[s]] == [1, 2, 3]
    assert [s for s in b.history if "loss" in b.history[s]] == [4, 5, 6]
    assert f"upload it with `wandb sync {resumed / runs.WANDB}/offline-run-*-{a.id}`" in second.stderr
    assert_same_training(straight, resumed, 6)
    a, b = load_file(straight / "export" / "model.safetensors"), load_file(resumed / "export" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = heldout_logged(straight)
    assert sorted(logged) == [2, 4, 6] and len(logged[6]) == 2 * (3 + 1)  # EMA and raw: 3 levels and the total
    assert heldout_logged(resumed) == logged  # bitwise: every digit, at step 2 before the stop and 4, 6 after it
    assert runs.read_values(runs.step_dir(resumed, 6))["heldout"] == runs.read_values(runs.step_dir(straight, 6))[
        "heldout"]  # the curve a resumed run plots (heldout.png) has every point
    assert (straight / runs.HELDOUT_PLOT).is_file()


def test_heldout_losses_reach_tensorboard_as_the_csv_holds_them(straight):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    tb = EventMultiplexer().AddRunsFromDirectory(str(straight / runs.TENSORBOARD))
    tb.Reload()
    (run,) = tb.Runs()
    for step, values in heldout_logged(straight).items():
        for name, value in values.items():
            (event,) = [e for e in tb.Scalars(run, name) if e.step == step]
            assert event.value == pytest.approx(float(value), rel=1e-7)  # TensorBoard keeps float32


@pytest.fixture(scope="module")
def stopped_tp2(dataset, tmp_path_factory):
    """A TP=2 + SP run to 4 steps, and the same run stopped at step 2 (its checkpoint)."""
    root = tmp_path_factory.mktemp("tp2")
    straight, stopped = root / "straight", root / "stopped"
    tp = ["parallel.tp=2", "parallel.sequence_parallel=true", "checkpoint.every=2"]
    for run, extra in ((straight, []), (stopped, ["train.stop_at=2"])):
        proc = torchrun_train(*run_args(dataset, run, 4, *tp, *extra))
        assert proc.returncode == 0, proc.stderr[-4000:]
    return straight, stopped


# slow: the suite's time on 2 cores; test_fabric_checkpoint.py resumes TP=2 pieces in other layouts in the default run
@pytest.mark.slow
def test_written_with_tp2_resumed_on_one_process_continues_the_same_run(dataset, stopped_tp2, tmp_path):
    straight, stopped = stopped_tp2
    resumed = tmp_path / "resumed"
    shutil.copytree(stopped, resumed)
    proc = dit_train(*run_args(dataset, resumed, 4, "checkpoint.every=2"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {runs.step_dir(resumed, 2)} at step 2" in proc.stdout + proc.stderr
    a, b = final_state(straight, 4)["history"], final_state(resumed, 4)["history"]
    assert a[:2] == b[:2] and [s for s, _ in b] == [1, 2, 3, 4]
    # the same data (one data-parallel rank both times, its loader position restored) through another split of
    # every reduction: the losses agree to float32 rounding
    for (_, x), (_, y) in zip(a[2:], b[2:], strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (x, y)


@pytest.mark.slow
def test_written_with_tp2_resumed_with_fsdp_over_dp2(dataset, stopped_tp2, tmp_path):
    """Each of 2 ranks now holds half of every weight, gradient, AdamW moment and EMA value."""
    _, stopped = stopped_tp2
    resumed = tmp_path / "resumed"
    shutil.copytree(stopped, resumed)
    args = run_args(dataset, resumed, 4, "parallel.fsdp=true", "checkpoint.every=2")
    proc = torchrun_train(*args, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = proc.stdout + proc.stderr
    assert f"resumed from {runs.step_dir(resumed, 2)} at step 2" in said
    assert "written with 1 data-parallel ranks, this job has 2" in said  # the loader's position cannot carry over
    manifest = json.loads((runs.step_dir(resumed, 4) / runs.MARKER).read_text())
    assert manifest["layout"] == {"world_size": 2, "tp": 1, "cp": 1, "pp": 1, "dp": 2, "fsdp": True}
    history = final_state(resumed, 4)["history"]
    assert [s for s, _ in history] == [1, 2, 3, 4] and all(math.isfinite(loss) for _, loss in history)


# slow: the suite's time; test_equivalence.py's and test_init_from.py's pipeline cases stay in the default run
@pytest.mark.slow
def test_pipeline_of_two_stages_trains_like_one_process(dataset, straight, tmp_path):
    """parallel.pp=2: one block per stage, 1F1B over the step's 2 micro-batches; validation samples and the export
    go through the stages too. The same data and draws as one process: the same losses to float32 rounding, and a
    checkpoint whose one-device tensors are the one process's."""
    run = tmp_path / "pp2"
    proc = torchrun_train(*run_args(dataset, run, 6, "parallel.pp=2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("done: 6 steps") == 1  # one summary, from rank 0
    manifest = json.loads((runs.step_dir(run, 6) / runs.MARKER).read_text())
    assert manifest["layout"] == {"world_size": 2, "tp": 1, "cp": 1, "pp": 2, "dp": 1, "fsdp": False}
    a, b = final_state(straight, 6), final_state(run, 6)
    assert [s for s, _ in b["history"]] == [1, 2, 3, 4, 5, 6]
    for (_, x), (_, y) in zip(a["history"], b["history"], strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (x, y)
    for part in (runs.MODEL, runs.EMA):  # every block, from both stages, and the embedders once
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            scale = a[part][k].abs().max().clamp(min=1e-30)
            assert (a[part][k] - b[part][k]).abs().max() <= 1e-4 * scale, f"{part}.{k}"
    exported = load_file(run / "export" / "model.safetensors")
    assert exported.keys() == load_file(straight / "export" / "model.safetensors").keys()
    # the validation image, sampled through the stages (each denoiser call: hidden states on, output broadcast
    # back), is the one process's to a level of 8 bits; a scrambled hand-off would not be
    ours = sorted((run / "samples" / "step-0000006").glob("*.png"))
    theirs = sorted((straight / "samples" / "step-0000006").glob("*.png"))
    assert [p.name for p in ours] == [p.name for p in theirs] and ours
    for a_png, b_png in zip(ours, theirs, strict=True):
        a_px, b_px = (torch.from_numpy(read_video(p)).int() for p in (a_png, b_png))
        assert (a_px - b_px).abs().max() <= 1, (a_png.name, (a_px - b_px).abs().max())


@pytest.mark.slow
def test_pipeline_trains_in_bf16(dataset, tmp_path):
    """Under bf16 autocast the stages hand bf16 hidden states on, and the backward of a stage's output runs outside
    Fabric's wrapper."""
    run = tmp_path / "pp2-bf16"
    proc = torchrun_train(*run_args(dataset, run, 2, "parallel.pp=2", "train.precision=bf16", "validation.steps=1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    history = final_state(run, 2)["history"]
    assert [s for s, _ in history] == [1, 2] and all(math.isfinite(loss) for _, loss in history)


@pytest.mark.slow
def test_written_with_tp2_resumed_as_a_pipeline_of_two_stages(dataset, stopped_tp2, tmp_path):
    """A checkpoint of TP=2 + SP (every block split over 2 ranks) resumes with each block whole on one stage."""
    straight, stopped = stopped_tp2
    resumed = tmp_path / "resumed"
    shutil.copytree(stopped, resumed)
    proc = torchrun_train(*run_args(dataset, resumed, 4, "parallel.pp=2", "checkpoint.every=2"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {runs.step_dir(resumed, 2)} at step 2" in proc.stdout + proc.stderr
    a, b = final_state(straight, 4)["history"], final_state(resumed, 4)["history"]
    assert a[:2] == b[:2] and [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a[2:], b[2:], strict=True):  # the same data, the loader's position restored
        assert abs(x - y) <= 1e-6 * abs(x), (x, y)


@pytest.mark.slow
def test_tp2_to_sharded_pipeline_stages_to_one_process_continues_the_same_run(dataset, stopped_tp2, tmp_path):
    """parallel.pp=2 with parallel.fsdp=true (each stage's blocks and embedders FSDP2-sharded, gathered once per step)
    resumes TP=2 + SP's checkpoint and writes one that one process resumes: the same data each time (one data-parallel
    rank), every loss the uninterrupted TP=2 run's to float32 rounding, and the EMA weights too."""
    straight, stopped = stopped_tp2
    run = tmp_path / "resumed"
    shutil.copytree(stopped, run)
    sharded = ["parallel.pp=2", "parallel.fsdp=true", "parallel.fsdp_sync=step", "checkpoint.every=2"]
    proc = torchrun_train(*run_args(dataset, run, 4, *sharded, "train.stop_at=3"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {runs.step_dir(run, 2)} at step 2" in proc.stdout + proc.stderr
    manifest = json.loads((runs.step_dir(run, 3) / runs.MARKER).read_text())
    assert manifest["layout"] == {"world_size": 2, "tp": 1, "cp": 1, "pp": 2, "dp": 1, "fsdp": True}
    proc = dit_train(*run_args(dataset, run, 4, "checkpoint.every=2"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resumed from {runs.step_dir(run, 3)} at step 3" in proc.stdout + proc.stderr
    a, b = final_state(straight, 4), final_state(run, 4)
    assert a["history"][:2] == b["history"][:2] and [s for s, _ in b["history"]] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a["history"][2:], b["history"][2:], strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (x, y)
    for k in a[runs.EMA]:
        scale = a[runs.EMA][k].abs().max().clamp(min=1e-30)
        assert (a[runs.EMA][k] - b[runs.EMA][k]).abs().max() <= 1e-4 * scale, k


@pytest.mark.slow
def test_expert_parallel_training_logs_its_routing_and_scores_the_held_out_set_in_lockstep(dataset, tmp_path):
    """parallel.ep=2 over the 2 data-parallel ranks of a MoE DiT: it trains, logs the routing (aux loss, balance,
    dropped share, every expert's share) and ends with its held-out loss, which every EP rank scores whole: EP peers
    must run the same batches in lockstep (the dispatch's all-to-alls), which shares of the set would not give (a
    rank with one batch more waited for its peer forever)."""
    moe = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.capacity_factor=2", *heldout_args(dataset),
           "validation.heldout.samples=7"]  # 7 samples: the two ranks' shares would differ
    run = tmp_path / "ep2"
    proc = torchrun_train(*run_args(dataset, run, 2, *moe, "parallel.ep=2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = csv_rows(run)
    logged = {k for r in rows for k in r}
    assert {"moe_aux_loss", "moe_balance", "moe_dropped", *(f"expert_share_{e}" for e in range(4))} <= logged
    for r in rows:
        if r.get("expert_share_0"):
            assert sum(float(r[f"expert_share_{e}"]) for e in range(4)) == pytest.approx(1, rel=1e-5)
    (last,) = [values for step, values in heldout_logged(run).items() if step == 2]
    assert last and all(math.isfinite(float(v)) for v in last.values())


def test_loss_decreases_and_outputs_are_written(dataset, tmp_path):
    run = tmp_path / "run"
    proc = dit_train(*run_args(dataset, run, 40, "validation.frames=4", "checkpoint.every=20", "train.micro_batch=4",
                               "train.global_batch=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(next((run / "csv").glob("*/metrics.csv")).open()))
    losses = [float(r["loss"]) for r in rows if r.get("loss")]
    assert {"step", "loss", "tokens_per_s", "mfu"} <= rows[0].keys()
    # per-sample log-normal sigma makes single-step losses noisy: compare means of the first and last ten steps
    assert sum(losses[-10:]) / 10 < 0.95 * sum(losses[:10]) / 10, losses  # measured: 0.937 (seeded, repeatable)
    assert all(float(r["mfu"]) > 0 for r in rows if r.get("mfu"))
    video = next((run / "samples" / "step-0000040").glob("*.mp4"))
    frames = read_video(video)
    assert frames.shape == (4, 32, 32, 3)
    assert (run / "loss.png").stat().st_size > 1000
    assert [p.name for p in runs.complete_checkpoints(run)] == ["step-0000020", "step-0000040"]
    for name in ("model.safetensors", "model.json", "ditcore.json", "codec_pca.safetensors"):
        assert (run / "export" / name).is_file()
    exported = json.loads((run / "export" / "model.json").read_text())
    assert exported["guidance"] == load_config(find_config("demo")).validation.guidance  # dit-sample's default
    assert exported["prompts"] == ["a red butterfly"] and exported["size"] == 32  # dit-sample's examples
    shipped = load_config(find_config("demo")).validation
    total = (shipped.seeds + (1 if shipped.clip_frames else 0)) * 2  # sample() calls x validation.steps=2
    assert re.search(rf"validation samples, step 40: .*\| \d+/{total} ", proc.stderr)  # the sampler's progress bar
    # every file of the run and of its dataset as the umask says (the export's and codec's safetensors were 0600)
    mask = durable.umask()
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in [*run.rglob("*"), *dataset.rglob("*")]
             if p.name != runs.LOCK_FILE and p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~mask}
    assert not wrong, wrong  # the run dir's lock is 0644 less the umask, on purpose (dit_train.rundir)


@pytest.mark.slow  # 52 s on 2 cores: make test-slow, which CI runs
def test_skipped_samples_are_reported_per_window_and_in_total_across_a_resume(dataset, tmp_path):
    """Clips (16 tokens) do not fit rows of 8 tokens, images (4) do: the loader passes over every clip it meets. The
    metrics' skipped column counts them per window, and the run's total (kept in checkpoints) is printed at the end."""
    run, extra = tmp_path / "run", ("data.seq_length=8", "checkpoint.every=2", "validation.frames=1")
    first = dit_train(*run_args(dataset, run, 2, *extra), warnings="default")  # every warning shows
    assert first.returncode == 0, first.stderr[-3000:]
    said = first.stdout + first.stderr
    # at the start, from the shapes and keys dit-prepare recorded: which samples will be skipped, and why
    clips = json.loads((dataset / "ditcore.json").read_text())["counts"]["latent_shape_keys"]["16x4x4x4"]
    assert (f"skip      {said.split('samples; ')[1].split()[0]} longer than seq length (latent 16x4x4x4: 16 tokens > "
            f"data.seq_length=8; e.g. {', '.join(clips)})") in said, said[-3000:]
    named = [ln.split()[2] for ln in said.splitlines() if ln.startswith("skipping sample ")]
    assert named and len(named) == len(set(named))  # each skipped sample named once
    for noise in ("Transformer Engine and Apex are not installed", "'pin_memory' argument", "Filling reading buffer"):
        assert noise not in said  # third-party notes that say nothing to a user (ditcore.quiet)
    again = dit_train(*run_args(dataset, run, 4, *extra), "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    totals = []
    for proc in (first, again):
        line = next(ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("skipped "))
        assert "longer than seq length" in line, line
        totals.append(int(line.split()[1]))
    column = [int(r["skipped"]) for f in sorted((run / "csv").glob("*/metrics.csv"))
              for r in csv.DictReader(f.open()) if r.get("skipped")]
    assert len(column) == 4 and totals[0] == sum(column[:2]) > 0 and totals[1] == sum(column) > totals[0]


# 34 s and more a case on 2 cores: make test-slow, which CI runs (test_equivalence.py has both architectures' steps
# against one process by default)
@pytest.mark.slow
@pytest.mark.parametrize(("arch", "size", "frames"), [("moviegen", "MovieGen-Tiny", 1), ("stdit", "ST-DiT-Tiny", 4)])
def test_other_architectures_train_and_their_exports_sample(cli_in_process, dataset, tmp_path, arch, size, frames):
    """model.arch=moviegen (MovieGen's Llama-style blocks) and stdit (spatial and temporal blocks, on the dataset's
    images and 4-frame clips) through the same loop, export and sampler (ST-DiT samples a clip)."""
    run = tmp_path / "run"
    proc = dit_train(*run_args(dataset, run, 30, f"model.arch={arch}", f"model.preset={size}",
                               "checkpoint.every=30", "train.micro_batch=4", "train.global_batch=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(r["loss"]) for r in csv.DictReader(next((run / "csv").glob("*/metrics.csv")).open())
              if r.get("loss")]
    assert sum(losses[-8:]) / 8 < 0.95 * sum(losses[:8]) / 8, losses
    assert json.loads((run / "export" / "model.json").read_text())["arch"] == arch
    out = tmp_path / ("red.png" if frames == 1 else "red.mp4")
    sample = cli_in_process("sample", "generate", "--checkpoint", run, "--prompt", "a red butterfly", "--steps", 2,
                            "--height", 32, "--width", 32, "--frames", frames, "--out", out)
    assert sample.returncode == 0 and out.stat().st_size > 0, sample.stderr[-3000:]


@pytest.mark.slow  # 35 s on 2 cores: make test-slow, which CI runs
def test_a_dit_with_block_embedders_trains_and_its_export_samples(cli_in_process, dataset, tmp_path):
    """model.block_embedders (diffusers' DiT layout: every later block embeds the noise level itself) through the
    same loop: each later block's own embedders get gradients (AdamW's first moments), the export holds them, and
    it samples."""
    from ditcore.export import load_export

    run = tmp_path / "run"
    proc = dit_train(*run_args(dataset, run, 4, "model.block_embedders=true", "checkpoint.every=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    optim = final_state(run, 4)["optim"]
    model = load_export(run / "export").model
    assert model.cfg.block_embedders and model.cfg.depth > 1
    for i in range(1, model.cfg.depth):
        for name in ("t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight"):
            moments = [t for k, t in optim.items() if f"blocks.{i}.{name}" in k and "exp_avg" in k]
            assert moments and all(m.abs().sum() > 0 for m in moments), (i, name, sorted(optim)[:4])
            assert model.blocks[i].get_parameter(name).abs().sum() > 0
    out = tmp_path / "own.png"
    sample = cli_in_process("sample", "generate", "--checkpoint", run, "--prompt", "a red butterfly", "--steps", 2,
                            "--height", 32, "--width", 32, "--out", out)
    assert sample.returncode == 0 and out.stat().st_size > 0, sample.stderr[-3000:]


@pytest.mark.slow  # 91 s on 2 cores: make test-slow, which CI runs
def test_st_dit_trains_with_context_parallelism_on_two_processes(dataset, tmp_path):
    """model.arch=stdit parallel.cp=2: training rows (images and 4-frame clips, split by the all-to-all where every
    rank's half holds whole frames and lines) and the validation samples (a 2x2-token image, whose half would cut
    its frame: gathered instead) go through the split model, the export through rank 0."""
    run = tmp_path / "cp2"
    proc = torchrun_train(*run_args(dataset, run, 4, "model.arch=stdit", "model.preset=ST-DiT-Tiny", "parallel.cp=2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifest = json.loads((runs.step_dir(run, 4) / runs.MARKER).read_text())
    assert manifest["layout"]["cp"] == 2
    assert json.loads((run / "export" / "model.json").read_text())["arch"] == "stdit"
    assert list((run / "samples").glob("step-*/*.png"))


STOP_S = 30  # the most seconds from a signal to the exit: the step it is in, a checkpoint, the loggers' last writes


def metrics_written(run: Path) -> bool:
    """Training is under way: the first step's metrics are on disk (the CSV is written at every log call)."""
    return any(f.stat().st_size and f.read_text().count("\n") >= 2 for f in (run / "csv").glob("*/metrics.csv"))


@pytest.mark.slow
def test_sigterm_saves_a_complete_checkpoint_and_exits_0(dataset, tmp_path, signalled):
    run = tmp_path / "run"
    proc = signalled([BIN / "dit-train", *run_args(dataset, run, 100000, "checkpoint.every=100000")], signal.SIGTERM,
                     lambda err: metrics_written(run), env=env())
    out, err = proc.out, proc.err
    assert proc.returncode == 0 and proc.seconds < STOP_S, err[-3000:]
    saved = runs.complete_checkpoints(run)
    assert len(saved) == 1 and "stopped by signal" in out + err
    step = int(saved[0].name.split("-")[1])
    resumed = dit_train(*run_args(dataset, run, step + 2, "checkpoint.every=100000"), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout + resumed.stderr


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_with_loader_workers_saves_and_exits_0(dataset, tmp_path, signalled):
    """Slurm's cancel, `docker stop` and `timeout` signal the process group: the loader workers get SIGTERM too."""
    run = tmp_path / "run"
    args = run_args(dataset, run, 100000, "checkpoint.every=100000", "data.num_workers=2")
    # its own process group, as under setsid; kill -TERM -- -PID
    proc = signalled([BIN / "dit-train", *args], signal.SIGTERM, lambda err: metrics_written(run), group=True,
                     env=env())
    out, err = proc.out, proc.err
    assert proc.returncode == 0 and proc.seconds < STOP_S, err[-3000:]
    assert "killed by signal" not in err
    saved = runs.complete_checkpoints(run)
    assert len(saved) == 1 and "stopped by signal" in out + err
    step = runs.step_of(saved[0])
    resumed = dit_train(*run_args(dataset, run, step + 2, "checkpoint.every=100000", "data.num_workers=2"),
                        "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout + resumed.stderr


@pytest.mark.slow  # the default run keeps test_an_infinite_gradient_norm_diverges_like_a_nan_loss, in process
def test_a_diverging_loss_stops_with_one_line_and_no_checkpoint_of_it(dataset, tmp_path):
    run = tmp_path / "run"
    proc = dit_train(*run_args(dataset, run, 50, "optim.lr=1e30", "train.grad_clip=0", "checkpoint.every=1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: the loss is not finite at step" in proc.stderr and "lower optim.lr (now 1e+30)" in proc.stderr
    nan_step = int(proc.stderr.split("not finite at step ")[1].split()[0])
    saved = [runs.step_of(p) for p in runs.complete_checkpoints(run)]
    assert saved == sorted(saved) and all(s < nan_step for s in saved)  # none of the broken weights


def test_a_checkpoint_without_its_marker_is_never_resumed(tmp_path):
    for step in (3, 6):
        d = runs.step_dir(tmp_path, step)
        d.mkdir(parents=True)
        (d / runs.MARKER).write_text("done")
    unfinished = runs.step_dir(tmp_path, 9)
    shutil.copytree(runs.step_dir(tmp_path, 6), unfinished)
    (unfinished / runs.MARKER).unlink()
    (tmp_path / "checkpoints" / ".tmp-step-0000012").mkdir()
    assert checkpoint.resolve_resume(tmp_path, "auto") == [runs.step_dir(tmp_path, s) for s in (6, 3)]
    assert checkpoint.resolve_resume(tmp_path, "none") == []
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.resolve_resume(tmp_path, str(unfinished))


# ---------------------------------------------------------------- durability: kill -9, damaged checkpoints


def assert_every_checkpoint_is_whole(run: Path):
    """The invariant kill -9 must never break: a step-* folder exists only complete, and its files verify."""
    from ditcore import durable

    root = run / "checkpoints"
    for d in (root.iterdir() if root.is_dir() else []):
        if runs.step_of(d) is None:
            assert d.name.startswith((runs.TMP_PREFIX, durable.TRASH_PREFIX)), d
            continue
        manifest = json.loads((d / runs.MARKER).read_text())
        assert set(manifest["files"]) == {p.name for p in d.iterdir()} - {runs.MARKER}
        for name, expected in manifest["files"].items():
            assert durable.verify(d / name, expected) is None, (d, name)


def kill_during_save(dataset, run: Path, save_step: int, delay: float) -> None:
    """Start a 6-step run that checkpoints every step; kill -9 it `delay` s after save `save_step` began. Its
    temporary files must all be inside the run directory: nothing is left in its TMPDIR."""
    tmp = run.with_name(f"{run.name}-tmpdir")
    tmp.mkdir(parents=True)
    proc = subprocess.Popen([str(BIN / "dit-train"), *run_args(dataset, run, 6, "checkpoint.every=1")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env() | {"TMPDIR": str(tmp)})
    started = run / "checkpoints" / f"{runs.TMP_PREFIX}step-{save_step:07d}"
    deadline = time.monotonic() + 240
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(delay)
    proc.kill()
    proc.wait(timeout=60)
    assert not [p for p in tmp.rglob("*") if p.is_file()], "kill -9 left files in TMPDIR"


def resume_after_kill(dataset, straight: Path, run: Path) -> str:
    assert_every_checkpoint_is_whole(run)
    complete = [p.name for p in runs.complete_checkpoints(run)]
    proc = dit_train(*run_args(dataset, run, 6, "checkpoint.every=1"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "warning" not in said  # kill -9 never leaves a damaged checkpoint to fall back from
    if complete:
        assert f"resumed from {run / 'checkpoints' / complete[-1]} at step" in said
    assert_same_training(straight, run, 6)
    return complete[-1] if complete else "fresh start"


@pytest.mark.slow  # test_kill_9_at_random_moments_of_saving covers it 16 times
def test_kill_9_during_a_save_then_resume_equals_the_uninterrupted_run(dataset, straight, tmp_path):
    # Save 3 began: step 2 is complete, step 3 is being written; 10 ms in, the shard is half written.
    kill_during_save(dataset, tmp_path / "run", save_step=3, delay=0.010)
    resume_after_kill(dataset, straight, tmp_path / "run")


@pytest.mark.slow
def test_kill_9_at_random_moments_of_saving(dataset, straight, tmp_path):
    """Saves take ~25 ms here (the first ~250 ms); kill -9 anywhere in [0, 80 ms] after one began, 16 times."""
    import random

    rng = random.Random(9)
    outcomes = []
    for trial in range(16):
        run = tmp_path / f"run{trial}"
        step, delay = rng.randint(1, 5), rng.uniform(0, 0.08)
        kill_during_save(dataset, run, save_step=step, delay=delay)
        outcomes.append((step, round(delay * 1000, 1), resume_after_kill(dataset, straight, run)))
    print("kill -9 trials (save step, ms after it began, resumed from):", outcomes)


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(dataset, straight, tmp_path):
    run = tmp_path / "run"
    proc = dit_train(*run_args(dataset, run, 6, "checkpoint.every=2", "train.stop_at=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in runs.complete_checkpoints(run)] == ["step-0000002", "step-0000004"]
    broken_copy = tmp_path / "both-damaged"
    shutil.copytree(run, broken_copy)

    shard = runs.step_dir(run, 4) / "__0_0.distcp"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    proc = dit_train(*run_args(dataset, run, 6, "checkpoint.every=2"), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and f"checkpoint {shard.parent} is damaged: {shard.name} has" in warnings[0]
    assert "trying step-0000002 instead" in warnings[0]
    assert f"resumed from {runs.step_dir(run, 2)} at step 2" in proc.stdout + proc.stderr
    assert_same_training(straight, run, 6)

    # Both damaged (one truncated, one with flipped bytes of the same size): refuse, never start over.
    for step, damage in ((4, "truncate"), (2, "flip")):
        f = runs.step_dir(broken_copy, step) / ("__0_0.distcp" if step == 4 else runs.rng_file(0))
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            del data[len(data) // 3:]
        else:
            data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    proc = dit_train(*run_args(dataset, broken_copy, 6, "checkpoint.every=2"), "--resume", "auto")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "none of the 2 complete checkpoints" in errors[0] and "--resume none" in errors[0]
    assert f"{runs.rng_file(0)} is corrupted" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in runs.complete_checkpoints(broken_copy)] == ["step-0000002", "step-0000004"]


# ---------------------------------------------------------------- one run per directory, and checkpoint lineage


@pytest.fixture(scope="module")
def two_checkpoints(dataset, tmp_path_factory):
    """A finished 4-step run that kept its checkpoints of steps 2 and 4 (tests work on copies)."""
    run = tmp_path_factory.mktemp("lineage") / "run"
    proc = dit_train(*run_args(dataset, run, 4, "checkpoint.every=2", "checkpoint.keep=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in runs.complete_checkpoints(run)] == ["step-0000002", "step-0000004"]
    return run


def snapshot(folder: Path) -> dict:
    """Every path in `folder` with its time and size, but the lock file (whoever holds it writes their record)."""
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")
            if p.name != ".lock"}


def test_a_second_run_on_a_held_run_dir_is_refused_in_one_line_and_touches_nothing(two_checkpoints, dataset, tmp_path):
    """The run dir is held (here by this test process, as a first dit-train would hold it) in the middle of a save:
    a second dit-train names the holder and leaves its temporary folder, checkpoints and logs alone."""
    from dit_train.rundir import RunDirLock

    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    (run / "checkpoints" / ".tmp-step-0000006").mkdir()
    (run / "checkpoints" / ".tmp-step-0000006" / "__0_0.distcp").write_bytes(b"half written")
    lock = RunDirLock.acquire(run)
    try:
        before = snapshot(run)
        proc = dit_train(*run_args(dataset, run, 6), "--resume", "auto")
        assert snapshot(run) == before
    finally:
        lock.release()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"error: train.run_dir {run} is in use by another training run (pid {os.getpid()} on "
                                f"host {socket.gethostname()}, since "), errors[0]


def test_a_branch_keeps_the_other_trajectory_and_auto_follows_the_branch(two_checkpoints, dataset, tmp_path):
    """Resumed from step 2 while step 4 exists, checkpointing every step with keep=2: the branch writes step 3 and its
    own step 4 beside the first (step-0000004-2), rotation deletes only its own step 2 once it has two newer ones, and
    --resume auto continues the branch, not the higher-numbered first trajectory."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    first4 = (runs.step_dir(run, 4) / runs.MARKER).read_text()
    proc = dit_train(*run_args(dataset, run, 4, "checkpoint.every=1", "checkpoint.keep=2"), "--resume",
                     runs.step_dir(run, 2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("note: resumed from")]
    assert len(notes) == 1 and "branches off" in notes[0] and "(step-0000004)" in notes[0], proc.stderr
    assert [p.name for p in runs.complete_checkpoints(run)] == ["step-0000003", "step-0000004", "step-0000004-2"]
    assert (runs.step_dir(run, 4) / runs.MARKER).read_text() == first4  # the first trajectory's, untouched
    three, branch4 = runs.lineage(runs.step_dir(run, 3)), runs.lineage(run / "checkpoints" / "step-0000004-2")
    assert three["parent"]["name"] == "step-0000002" and branch4["parent"]["name"] == "step-0000003"
    assert three["run"] == branch4["run"] == runs.lineage(runs.step_dir(run, 4))["run"]  # one run, two trajectories
    assert branch4["seq"] > three["seq"] > runs.lineage(runs.step_dir(run, 4))["seq"]
    assert [p.name for p in checkpoint.resolve_resume(run, "auto")] == ["step-0000004-2", "step-0000003"]
    assert runs.read_values(run / "checkpoints" / "step-0000004-2")["step"] == 4


@pytest.mark.slow  # 34 s on 2 cores: make test-slow, which CI runs
def test_resume_none_over_checkpoints_needs_overwrite_which_says_what_it_removes(two_checkpoints, dataset, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    (run / "notes.txt").write_text("the user's")
    old_run = runs.lineage(runs.step_dir(run, 4))["run"]
    before = snapshot(run)
    refused = dit_train(*run_args(dataset, run, 2, "checkpoint.every=2"), "--resume", "none")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "2 checkpoints (the newest: step-0000004)" in errors[0], refused.stderr
    assert "--resume auto" in errors[0] and "another train.run_dir" in errors[0] and "--overwrite" in errors[0]
    assert snapshot(run) == before

    proc = dit_train(*run_args(dataset, run, 1), "--resume", "none", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    removed = [ln for ln in proc.stderr.splitlines() if ln.startswith("--overwrite:")]
    assert removed == [f"--overwrite: removed what an earlier run wrote in {run}: checkpoints/ (2 checkpoints, the "
                       "newest step-0000004), export/, samples/, csv/, loss.png"], proc.stderr
    assert [p.name for p in runs.complete_checkpoints(run)] == ["step-0000001"]
    lineage = runs.lineage(runs.step_dir(run, 1))
    assert lineage["parent"] is None and lineage["run"] != old_run and lineage["seq"] == 1
    assert len(list((run / "csv").iterdir())) == 1 and (run / "notes.txt").read_text() == "the user's"


# ---------------------------------------------------------------- the metrics of a log window


def test_a_window_s_throughput_mfu_and_step_time_and_no_memory_column_without_a_gpu():
    from dit_train.metrics import Window
    from ditcore.parallel import ParallelDims

    w = Window()
    w.add(1.5, {"loss": 0.4}, 300, 3e9)
    w.add(0.5, {"loss": 0.2}, 100, 1e9)
    m = w.metrics(1e10, ParallelDims(tp=2))
    assert m["loss"] == pytest.approx(0.3) and m["tokens_per_s"] == 200 and m["step_s"] == 1.0
    assert m["mfu"] == pytest.approx(4e9 / 2 / (1e10 * 2))  # the batch's FLOPs are shared by 2 TP ranks
    if not torch.cuda.is_initialized():
        assert "peak_mem_gib" not in m


def test_tensorboard_names_a_run_after_its_folder_and_each_resumed_segment(tmp_path):
    """Before: TensorBoard (--logdir RUN_DIR/tensorboard, as `make demo` prints it) showed the run as "."."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    from dit_train.train import make_loggers

    cfg, run_dir = load_config(find_config("demo")), tmp_path / "demo"
    for step, segment in enumerate(("run-20260101-120000", "run-20260101-130000")):  # a run, then its resume
        for logger in make_loggers(cfg, run_dir, segment):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            logger.finalize("success")
    tb = EventMultiplexer().AddRunsFromDirectory(str(run_dir / runs.TENSORBOARD))
    tb.Reload()
    assert sorted(tb.Runs()) == ["demo/run-20260101-120000", "demo/run-20260101-130000"]
    assert [e.value for e in tb.Scalars("demo/run-20260101-130000", "loss")] == [0.5]
    assert (run_dir / runs.CSV / "run-20260101-130000" / "metrics.csv").is_file()  # the CSV log's segment alike


def test_csv_tensorboard_and_wandb_hold_the_same_figures(straight, read_wandb):
    """The straight run logged to all three (W&B offline, read back from its transaction log): the same scalars at the
    same steps, the contact sheet pixel for pixel and the clip in TensorBoard and W&B, the resolved config in W&B."""
    import imageio.v3 as iio
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dit_train.media_log import frame_strip
    from dit_train.validation import Clip

    (table,) = (straight / runs.CSV).glob("*/metrics.csv")
    logged = {}
    for row in csv.DictReader(table.open()):
        logged.setdefault(int(row.pop("step")), {}).update({k: float(v) for k, v in row.items() if v})
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and {"loss", "lr", "grad_norm"} <= logged[6].keys()

    (events,) = (straight / runs.TENSORBOARD).glob("*/*/events.out.tfevents.*")
    tb = EventAccumulator(str(events.parent), size_guidance={"scalars": 0, "images": 0})
    tb.Reload()
    board = {}
    for tag in tb.Tags()["scalars"]:
        for event in tb.Scalars(tag):
            board.setdefault(event.step, {})[tag] = event.value
    assert board == {step: pytest.approx(values, rel=1e-6) for step, values in logged.items()}  # TB keeps float32

    (folder,) = (straight / runs.WANDB).glob("offline-run-*")
    wb = read_wandb(folder)
    scalars = {step: {k: v for k, v in row.items() if not k.startswith(("_", "samples/"))}
               for step, row in wb.history.items()}
    assert scalars == logged  # exactly: both keep the float64 values
    assert wb.config == runs.read_config(runs.step_dir(straight, 6))  # the resolved config, as the checkpoint has it

    sheet = iio.imread(straight / runs.SAMPLES / runs.SHEET)
    (image,) = tb.Images("samples/grid")
    assert image.step == 6 and np.array_equal(iio.imread(image.encoded_image_string), sheet)
    media = wb.history[6]["samples/grid"]
    assert media["_type"] == "image-file" and np.array_equal(iio.imread(wb.files / media["path"]), sheet)

    (mp4,) = runs.samples_dir(straight, 6).glob("*.mp4")  # the clip: a frame strip in TensorBoard, the mp4 in W&B
    (strip,) = tb.Images(f"samples/{mp4.stem}")
    expected = frame_strip(Clip(mp4.stem, "a red butterfly", read_video(mp4), mp4))  # from the mp4's lossy frames
    shown = iio.imread(strip.encoded_image_string)
    assert strip.step == 6 and shown.shape == expected.shape
    assert np.abs(shown.astype(int) - expected).mean() < 4
    media = wb.history[6][f"samples/{mp4.stem}"]
    assert media["_type"] == "video-file" and (wb.files / media["path"]).read_bytes() == mp4.read_bytes()


def test_wandb_online_without_a_login_stops_in_one_line(cli_in_process, dataset, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")  # what the logger sets in the process, gone again after the test
    proc = cli_in_process("train", *run_args(dataset, tmp_path / "run", 1, "logging.wandb.project=ditcore-test"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "error: W&B could not start a run (logging.wandb.mode=online): No API key configured. Use `wandb login` to log "
        "in. — set WANDB_API_KEY (or run `wandb login`) and check the network, or set logging.wandb.mode=offline and "
        f"upload the run from {tmp_path / 'run' / runs.WANDB} later with `wandb sync`"]


@pytest.mark.gpu
def test_a_window_reports_the_gpu_memory_peak():
    from dit_train.metrics import Window
    from ditcore.parallel import ParallelDims

    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    w = Window()
    w.add(1.0, {"loss": 0.1}, 10, 1e6)
    assert w.metrics(1e12, ParallelDims())["peak_mem_gib"] >= 0.25
    del x


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda case runs it for real "
                                                 "here (ditcore's CPU shims apply only where CUDA is absent)")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_training_step_never_waits_for_the_device(dataset, tmp_path, monkeypatch, restored_process, device):
    """Between logging steps the host only queues work: any read of a device value in train_step raises here. On a
    GPU torch.cuda.set_sync_debug_mode("error") watches too; on the CPU, HostReads treats the CPU as the device,
    except where the host reads by design: the loader's batch before its copy (MicroBatches._next_on_host), the
    model's check of CPU positions (check_positions: on a GPU the caller checks them before the copy) and torch's
    step counters of a non-fused AdamW (on the host beside GPU parameters too; on a GPU dit-train's AdamW is fused)."""
    from dit_train import train
    from dit_train.config import load_config
    from dit_train.metrics import Metrics
    from ditcore.models import dit
    from ditcore.testing import HostReads

    cfg = load_config(find_config("demo"), [*TINY, f"data.path={dataset}", f"train.run_dir={tmp_path / 'run'}",
                                            "train.steps=4", "train.grad_clip=1.0",
                                            f"parallel.accelerator={'gpu' if device == 'cuda' else 'cpu'}"])
    run = train.setup(cfg)
    trainee = train.build(run)
    it = iter(trainee.loader)
    for step in range(3):  # warm-up: allocations, lazy initialisation, DDP rebuilding its buckets (step 2)
        train.train_step(run, trainee, it, step, Metrics())
    steps = [s["step"] for g in trainee.optimizer.param_groups if not (g["fused"] or g["capturable"])
             for s in map(trainee.optimizer.state.get, g["params"])]
    assert bool(steps) == (device == "cpu")
    watch = HostReads(device, host=steps)
    monkeypatch.setattr(train.MicroBatches, "_next_on_host", watch.unwatched(train.MicroBatches._next_on_host))
    monkeypatch.setattr(dit, "check_positions", watch.unwatched(dit.check_positions))
    metrics = Metrics()
    with watched(watch, device):
        micro = train.train_step(run, trainee, it, 3, metrics)
    loss, grad_norm = metrics.recorded["loss"], metrics.recorded["grad_norm"]
    assert loss.device.type == device and grad_norm.device.type == device
    assert math.isfinite(loss.item()) and micro.tokens > 0 and micro.flops > 0

    # the watch sees the step's device work: reading the gradient norm back, a usual slip, is caught
    clip = train.clip_grad_norm_
    monkeypatch.setattr(train, "clip_grad_norm_", lambda *args: torch.tensor(float(clip(*args))))
    with pytest.raises(RuntimeError, match=r"makes the host wait|synchronizing"), watched(watch, device):
        train.train_step(run, trainee, it, 4, Metrics())


@contextlib.contextmanager
def watched(watch, device: str):
    """`watch` (a HostReads), and on a GPU torch's own sync check as well."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with watch:
            yield
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def test_an_infinite_gradient_norm_diverges_like_a_nan_loss():
    """A finite loss with inf gradients (a bf16 overflow in backward) would write NaN weights: it stops too."""
    from tqdm import tqdm

    from dit_train.metrics import Metrics
    from dit_train.train import Diverged, check_finite

    class OneRank:
        def any_rank(self, flag: bool) -> bool:
            return flag

    norm = functools.partial(torch.tensor, dtype=torch.float64)
    metrics = Metrics()
    for step, loss, grad_norm in ((1, 0.5, 1.0), (2, 0.25, float("inf"))):
        metrics.record("loss", torch.tensor(loss))
        metrics.record("grad_norm", norm(grad_norm))
        metrics.end_step(step, 0.1, 10, 1.0, 0)
    read = metrics.read_back()
    with pytest.raises(Diverged, match=r"the gradient norm is not finite at step 2 \(this rank: inf\)"):
        check_finite(read, OneRank(), tqdm(disable=True), 1e-3)
    check_finite(read[:1], OneRank(), tqdm(disable=True), 1e-3)


@pytest.mark.slow
def test_a_compiled_tp2_sp_checkpointed_run_trains_compiled(dataset, tmp_path):
    """The layout that Megatron-Core's linears made dynamo skip entirely (TP + SP + selective checkpointing) trains
    with compiled blocks: dit-train's own check after the first step (check_compiled) would stop it otherwise."""
    run = tmp_path / "run"
    proc = torchrun_train(*run_args(dataset, run, 3, "parallel.tp=2", "parallel.sequence_parallel=true",
                                    "model.activation_checkpointing=selective", "model.compile=true"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "torch.compile made no graph" not in proc.stderr and "graph break" not in proc.stdout + proc.stderr
    assert [s for s, _ in final_state(run, 3)["history"]] == [1, 2, 3]
