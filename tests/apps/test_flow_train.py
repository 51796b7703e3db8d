"""dit-train with objective=flow as a user runs it: a flow run trains, scores its held-out set per time t, exports
what it was trained with (so dit-sample samples it without flags), resumes exactly, and refuses a change of
objective in one line (issue 45)."""

import csv
import importlib.util
import json
import math
from pathlib import Path

import imageio.v3 as iio
import pytest
import torch

from ditcore import runs
from ditcore.diffusion.flow import TimeShift
from ditcore.export import load_export
from ditcore.sampling import sample

# test_train.py's helpers (tests are no package: pytest imports them by path)
_spec = importlib.util.spec_from_file_location("train_helpers", Path(__file__).with_name("test_train.py"))
train_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_helpers)
TINY, dit_train, heldout_args = train_helpers.TINY, train_helpers.dit_train, train_helpers.heldout_args
heldout_logged, assert_same_training = train_helpers.heldout_logged, train_helpers.assert_same_training

FLOW = ["flow.shift=2"]  # on demo-flow: the demo's recipe under objective flow


@pytest.fixture(scope="module")
def dataset(cli_in_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("flow") / "data"
    proc = cli_in_process("prepare", "synthetic", "--out", out, "--num", 32, "--size", 32, "--frames", 4,
                          "--fit-samples", 32)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_args(dataset, run_dir, steps, *extra):
    return ["--config", "demo-flow", *TINY, *FLOW, f"data.path={dataset}", f"train.run_dir={run_dir}",
            f"train.steps={steps}", *extra]


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
    """An uninterrupted 6-step flow run with held-out losses at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = dit_train(*run_args(dataset, run, 6, *heldout_args(dataset)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_a_flow_run_scores_its_held_out_set_per_time_and_exports_its_objective(straight):
    logged = heldout_logged(straight)
    assert sorted(logged) == [2, 4, 6]
    names = sorted(k for k in logged[6] if k.startswith("heldout/ema/"))
    # three times t, evenly spaced (ditcore.eval.heldout.t_buckets), and the total weighted by the training t's
    assert [n.split("=")[0] for n in names] == ["heldout/ema/t_00", "heldout/ema/t_01", "heldout/ema/t_02",
                                                "heldout/ema/total"]
    assert all(math.isfinite(float(v)) for v in logged[6].values())
    meta = json.loads((straight / "export" / "model.json").read_text())
    assert meta["objective"] == "flow" and TimeShift.from_dict(meta["shift"]) == TimeShift(shift=2.0)
    assert "precond" not in meta  # no VP schedule: a flow network has none
    values = runs.read_values(runs.step_dir(straight, 6))
    assert values["objective"] == "flow"  # what model.init_from=this checkpoint reads back (init_from.read_source)
    assert (straight / "heldout.png").stat().st_size > 1000


def test_a_flow_run_stopped_and_resumed_ends_exactly_as_the_uninterrupted_one(dataset, straight, tmp_path):
    resumed = tmp_path / "resumed"
    first = dit_train(*run_args(dataset, resumed, 6, "train.stop_at=3", *heldout_args(dataset)))
    assert first.returncode == 0, first.stderr[-3000:]
    second = dit_train(*run_args(dataset, resumed, 6, *heldout_args(dataset)), "--resume", "auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_training(straight, resumed, 6)
    assert heldout_logged(resumed)[6] == heldout_logged(straight)[6]


def test_resuming_a_flow_run_as_edm_is_refused_in_one_line(dataset, straight, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    ckpt = runs.step_dir(straight, 6)
    proc = dit_train(*run_args(dataset, copy, 8, "objective=edm"), "--resume", str(ckpt))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("error:"))
    assert f"checkpoint {ckpt} was trained with objective=flow, this config has objective=edm — the model cannot " \
           "change within a run" in line, line


def test_dit_sample_samples_a_flow_export_as_it_was_trained(cli_in_process, straight, tmp_path):
    """No flag says flow: the export does. The CLI's picture is ditcore.sampling.sample's with the recorded shift,
    for Euler, Heun and UniPC, and UniPC is refused for an EDM network."""
    exported = load_export(straight / "export")
    assert exported.sampling() == {"objective": "flow", "prediction": "x", "vp": None, "shift": TimeShift(shift=2.0)}
    states = exported_states(exported, ["a red butterfly"])
    for solver in ("euler", "heun", "unipc"):
        out = tmp_path / f"{solver}.png"
        proc = cli_in_process("sample", "generate", "--checkpoint", straight, "--prompt", "a red butterfly",
                              "--steps", 3, "--height", 32, "--width", 32, "--solver", solver, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        direct = sample(exported.model, exported.codec, exported.stats, text_states=states, height=32, width=32,
                        steps=3, guidance=exported.guidance, solver=solver, **exported.sampling())
        assert torch.equal(torch.from_numpy(iio.imread(out)), direct.pixels[0, 0]), solver


def exported_states(exported, prompts):
    from ditcore.codecs.text import load_text_encoder

    return load_text_encoder(exported.info.text_encoder["name"]).encode(prompts)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["edm.prediction=x"], "edm.prediction='x' is invalid: expected unset with objective=flow"),
        (["edm.precond=vp"], "edm.precond='vp' is invalid: expected unset with objective=flow"),
        (["objective=flowz"], "objective='flowz' is invalid: expected one of"),
        (["flow.shift=0"], "flow.shift=0.0 is invalid: expected a number > 0"),
        (["flow.t_dist=beta"], "flow.t_dist='beta' is invalid: expected one of"),
        (["flow.base_seq_len=5000"], "flow.base_seq_len=5000 is invalid: expected less than flow.max_seq_len=4096"),
    ],
)
def test_bad_flow_settings_give_one_clear_line(cli_in_process, args, message):
    proc = cli_in_process("train", "--config", "demo-flow", *args, "--print-config")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


def test_unipc_validation_of_an_edm_run_is_refused_before_training(dataset, tmp_path):
    proc = dit_train("--config", "demo", *TINY, f"data.path={dataset}", f"train.run_dir={tmp_path / 'run'}",
                     "train.steps=2", "validation.solver=unipc")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "validation.solver='unipc' is invalid: expected heun or euler under objective=edm" in proc.stderr


def test_the_flow_training_loss_falls(dataset, tmp_path):
    run = tmp_path / "run"
    # velocity prediction: x-prediction's velocity loss weighs x̂₀'s error by 1/t², too noisy a curve for 30 steps
    proc = dit_train(*run_args(dataset, run, 30, "checkpoint.every=30", "validation.every=0",
                               "flow.prediction=velocity"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(r["loss"]) for r in csv.DictReader(next((run / "csv").glob("*/metrics.csv")).open())
              if r.get("loss")]
    assert sum(losses[-8:]) / 8 < 0.9 * sum(losses[:8]) / 8, losses
