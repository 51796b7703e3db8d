"""dit-train fine-tunes the field's DDPM-trained DiTs (dit_train.recipe): model.init_from of an original DiT checkpoint
(its state-dict layout, built here as DiT's models.py names it; no hub) gives the run its architecture, VP
preconditioning on its schedule, DiT's objective and its latent scale; what disagrees is one line."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dit_train.config import load_config
from dit_train.recipe import resolve
from dit_train.resume_config import compare
from ditcore.data.schema import DatasetInfo
from ditcore.diffusion import EDMLoss
from ditcore.diffusion.ddpm import DDPMLoss
from ditcore.diffusion.vp import DiscreteVP
from ditcore.errors import ConfigError
from ditcore.init_from import read_source
from ditcore.interop import read
from ditcore.layout import SIGMA_DATA

from ..ditcore.test_interop import HUB_SCHEDULER, as_original_dit, diffusers_dit_model, hub_folder, original_state_dict

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def dit_file(tmp_path_factory) -> Path:
    """DiT-S/2's width (the paper gives its 6 heads), 2 blocks, learned Σ, 10 classes, 8x8 latents of 4 channels."""
    theirs = as_original_dit(diffusers_dit_model(num_attention_heads=6, attention_head_dim=64, seed=7))
    path = tmp_path_factory.mktemp("dit") / "DiT-S-2-tiny.pt"
    torch.save(original_state_dict(theirs), path)
    return path


def info(channels: int = 4, classes: int = 0, text_dim: int = 0) -> DatasetInfo:
    return DatasetInfo(codec={"kind": "none"}, latent_stats={"mean": [0.2] * channels, "std": [3.0] * channels},
                       text_encoder={"name": "null", "dim": text_dim}, latent_channels=channels, spatial_factor=8,
                       temporal_factor=1, num_classes=classes)


def recipe(*overrides: str, data: DatasetInfo | None = None):
    return resolve(load_config(None, list(overrides)), data or info())


def test_a_foreign_dit_makes_the_run_vp_ddpm_in_its_architecture_and_units(dit_file):
    r = recipe(f"model.init_from={dit_file}")
    theirs = read(dit_file).cfg
    assert (r.cfg.edm.precond, r.cfg.edm.loss, r.vp) == ("vp", "ddpm", DiscreteVP())
    # saved resolved with every checkpoint: the schedule trained on (DDIM's step settings travel in the export: vp)
    assert r.cfg.edm.vp.schedule() == DiscreteVP()
    assert r.model_cfg == theirs and r.model_cfg.learn_sigma and r.model_cfg.hidden_size == 384
    loss = r.loss()
    assert isinstance(loss, DDPMLoss) and loss.learn_sigma and r.denoiser(torch.nn.Identity()).vp == DiscreteVP()
    assert r.latent_stats.std.tolist() == [pytest.approx(SIGMA_DATA / 0.18215)] * 4 and r.own_units
    # the batch map: dataset (mean 0.2, std 3) → DiT's 0.18215 z
    x = torch.randn(2, 16, 16)
    mapped = r.latent_map("cpu")(x, torch.ones(2, 16, dtype=torch.bool))
    z = x / SIGMA_DATA * 3.0 + 0.2
    torch.testing.assert_close(mapped, 0.18215 * z, rtol=0, atol=1e-6)
    assert r.recorded() == {"precond": "vp", "vp": DiscreteVP().to_dict(), "latent_stats": r.latent_stats.to_dict()}
    # EDM's objective by choice, through the same preconditioning: σ on the network's levels
    edm = recipe(f"model.init_from={dit_file}", "edm.loss=edm")
    assert isinstance(edm.loss(), EDMLoss) and edm.loss().vp == DiscreteVP() and edm.cfg.edm.precond == "vp"


def test_a_pipelines_ddim_settings_travel_to_the_export_and_its_schedule_to_training(tmp_path):
    """A pipeline whose scheduler samples DDIM otherwise than DiT (spacing, final ᾱ, clipping): the run trains on its
    schedule (edm.vp, which a resume compares, holds that alone, and may be given as the same) and records all of
    it, so that the export samples as the pipeline's scheduler did."""
    import json

    root = hub_folder(tmp_path / "pipe", diffusers_dit_model(), "safetensors")
    ddim = dict(timestep_spacing="trailing", set_alpha_to_one=False, clip_sample=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(HUB_SCHEDULER | ddim))
    r = recipe(f"model.init_from={root}")
    assert r.vp == DiscreteVP(**ddim) and r.cfg.edm.vp.schedule() == DiscreteVP()
    assert r.recorded()["vp"] == DiscreteVP(**ddim).to_dict()
    assert recipe(f"model.init_from={root}", "edm.vp.timesteps=1000").vp == r.vp  # the same schedule: agrees


@pytest.mark.parametrize(("classes", "expected"), [(0, 10), (10, 10), (5, 5)])
def test_classes_come_from_the_checkpoint_unless_the_dataset_has_others(dit_file, classes, expected):
    """None (every sample the null class: DiT's unconditional model is fine-tuned) or the same: the checkpoint's class
    embedding; another number: the dataset's, its embedding fresh (init_from's line names it)."""
    assert recipe(f"model.init_from={dit_file}", data=info(classes=classes)).model_cfg.num_classes == expected


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.preset=DiT-Demo"], "model.preset='DiT-Demo' is invalid: expected the checkpoint's hidden_size 384 (the "
                                "preset's 192), depth 2 (the preset's 6)"),
    (["model.depth=3", "model.patch_size=4"], "model.patch_size=4 is invalid: expected the checkpoint's 2; also "
                                              "model.depth=3 (the checkpoint's: 2): model.init_from="),
    (["model.qk_norm=true"], "leave model.qk_norm unset, or start from fresh weights"),
    (["model.learn_sigma=false"], "model.learn_sigma=False is invalid: expected the checkpoint's True"),
    (["edm.prediction=x"], "edm.prediction='x' is invalid: expected edm with edm.precond=vp"),
    (["edm.precond=edm"], "edm.precond='edm' is invalid: expected vp or auto for DiT checkpoint"),
    (["edm.vp.timesteps=500"], "expected the schedule DiT checkpoint"),
])
def test_what_disagrees_with_the_checkpoint_is_one_line_naming_it(dit_file, overrides, message):
    with pytest.raises(ConfigError) as e:
        recipe(f"model.init_from={dit_file}", *overrides)
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)


def test_what_agrees_with_the_checkpoint_may_be_given(dit_file):
    r = recipe(f"model.init_from={dit_file}", "model.preset=DiT-S/2", "model.depth=2", "model.qk_norm=false",
               "model.pos_embed=sincos_2d", "model.max_grid=[1,8,8]", "edm.precond=vp", "edm.loss=ddpm")
    assert r.model_cfg == read(dit_file).cfg.replace(max_grid=(1, 8, 8))  # a larger grid: DiT's table is computed


def test_a_dataset_of_other_latents_is_refused_naming_the_checkpoint_s_channels(dit_file):
    with pytest.raises(ConfigError) as e:
        recipe(f"model.init_from={dit_file}", data=info(channels=16))
    assert str(e.value).startswith("data.path='data/butterflies' is invalid: expected latents of 4 channels, as DiT "
                                   f"checkpoint {dit_file} was trained on (this dataset's have 16) — prepare the data "
                                   "with the checkpoint's VAE"), str(e.value)


def test_without_a_foreign_source_the_run_is_edm_unless_told_and_a_resume_cannot_switch(dit_file, tmp_path):
    r = recipe()
    assert (r.cfg.edm.precond, r.cfg.edm.loss, r.vp, r.own_units) == ("edm", "edm", None, False)
    assert r.latent_map("cpu") is None and r.recorded() == {}
    vp = recipe("edm.precond=vp", "edm.vp.beta_schedule=scaled_linear", "edm.vp.beta_start=0.00085",
                "edm.vp.beta_end=0.012")
    assert vp.cfg.edm.loss == "ddpm" and vp.vp == DiscreteVP(beta_schedule="scaled_linear", beta_start=0.00085,
                                                              beta_end=0.012)
    with pytest.raises(ConfigError, match=r"edm\.loss='ddpm' is invalid: expected auto or edm with edm\.precond=edm"):
        recipe("edm.precond=edm", "edm.loss=ddpm")
    # a run saved resolved (vp), resumed with init_from dropped (auto would resolve to edm): refused
    saved = recipe(f"model.init_from={dit_file}").cfg.to_dict()
    refusal = compare(saved, r.cfg, tmp_path / "step-0000003").refusal()
    assert refusal and "edm.precond=vp" in refusal and "edm.precond=edm" in refusal


# --------------------------------------------------------------------------------------------------
# dit-train as a user runs it


def dit_train(*args):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(BIN / "dit-train"), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> Path:
    """16 images of 4-channel 8x8 latents (the SD VAE's shape, 64 px), unlabelled, no text."""
    out = tmp_path_factory.mktemp("finetune") / "data"
    shapes = ["--latent-shape", "4,1,8,8", "--video-latent-shape", "4,2,8,8", "--video-ratio", "0"]
    proc = subprocess.run([str(BIN / "dit-prepare"), "mock", "--out", str(out), "--num", "16", *shapes, "--text-dim",
                           "0"], capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow  # 61 s on 2 cores: make test-slow, which CI runs
def test_dit_train_fine_tunes_an_original_dit_checkpoint_and_exports_it_for_vp_sampling(dit_file, latents, tmp_path):
    run = tmp_path / "run"
    common = [f"model.init_from={dit_file}", f"data.path={latents}", "data.seq_length=32", "data.num_workers=0",
              "train.micro_batch=2", "train.global_batch=2", "logging.every=1", "logging.tensorboard=false"]
    proc = dit_train(*common, f"train.run_dir={run}", "train.steps=3", "checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert f"model.init_from: DiT checkpoint {dit_file} — its architecture (width 384, depth 2, 6 heads, patch 2, " \
           "learned Σ), edm.precond=vp (1000 linear timesteps), edm.loss=ddpm" in said, said[-3000:]
    assert f"init_from {dit_file}: 31 of 31 tensors" in said, said[-3000:]
    losses = [float(r["loss"]) for r in csv.DictReader(next((run / "csv").glob("*/metrics.csv")).open())
              if r.get("loss")]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), losses
    exported = json.loads((run / "export" / "model.json").read_text())
    assert exported["precond"] == "vp" and exported["vp"] == DiscreteVP().to_dict()
    assert exported["model"]["learn_sigma"] and exported["model"]["hidden_size"] == 384
    stats = json.loads((run / "export" / "ditcore.json").read_text())["latent_stats"]
    assert stats["mean"] == [0.0] * 4 and stats["std"] == [pytest.approx(SIGMA_DATA / 0.18215)] * 4
    again = read_source(run)  # a run started from this one continues the same way
    assert again.vp == DiscreteVP() and again.latent_stats.std.tolist() == stats["std"]
    # a key that disagrees with the checkpoint: one line, before any step
    bad = dit_train(*common, f"train.run_dir={tmp_path / 'bad'}", "train.steps=1", "model.depth=3")
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr[-3000:]
    assert lines[0].startswith("error: model.depth=3 is invalid: expected the checkpoint's 2: model.init_from="), lines


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda case runs it for real "
                                                 "here (ditcore's CPU shims apply only where CUDA is absent)")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_vp_ddpm_training_step_never_waits_for_the_device(dit_file, latents, tmp_path, monkeypatch, restored_process,
                                                            device):
    """As test_train's test of the EDM step, for what a fine-tune adds: the batch mapped to the network's units, the
    timesteps drawn and found, VP's coefficients and DiT's learned-range bound — all queued, nothing read back."""
    from dit_train import train
    from dit_train.metrics import Metrics
    from ditcore.models import dit
    from ditcore.testing import HostReads

    from .test_train import watched

    cfg = load_config(None, [f"model.init_from={dit_file}", f"data.path={latents}", "data.seq_length=32",
                             "data.num_workers=0", "train.micro_batch=2", "train.global_batch=2",
                             "logging.tensorboard=false", f"train.run_dir={tmp_path / 'run'}",
                             f"parallel.accelerator={'gpu' if device == 'cuda' else 'cpu'}"])
    run = train.setup(cfg)
    trainee = train.build(run)
    train.start_from(run, trainee)
    assert isinstance(trainee.loss_fn, DDPMLoss) and trainee.latent_map is not None
    it = iter(trainee.loader)
    for step in range(3):  # warm-up: allocations, the tables' first copies to the device
        train.train_step(run, trainee, it, step, Metrics())
    steps = [s["step"] for g in trainee.optimizer.param_groups if not (g["fused"] or g["capturable"])
             for s in map(trainee.optimizer.state.get, g["params"])]
    watch = HostReads(device, host=steps)
    monkeypatch.setattr(train.MicroBatches, "_next_on_host", watch.unwatched(train.MicroBatches._next_on_host))
    monkeypatch.setattr(dit, "check_positions", watch.unwatched(dit.check_positions))
    metrics = Metrics()
    with watched(watch, device):
        train.train_step(run, trainee, it, 3, metrics)
    assert math.isfinite(metrics.recorded["loss"].item())


def test_model_moe_keys_make_the_models_moe_config_and_errors_name_them():
    from ditcore.models import MoEConfig

    cfg = recipe("model.moe.experts=4", "model.moe.top_k=1", "model.moe.every=2").model_cfg
    assert cfg.moe == MoEConfig(experts=4, top_k=1, every=2)  # the keys left unset: MoEConfig's defaults
    assert recipe().model_cfg.moe is None
    with pytest.raises(ConfigError, match=r"^model\.moe\.top_k=5 is invalid: expected an integer from 1 to experts=4"):
        recipe("model.moe.experts=4", "model.moe.top_k=5")
    with pytest.raises(ConfigError, match=r"^model\.moe\.every=4 is invalid: expected a divisor of depth=6"):
        recipe("model.moe.every=4")
