"""The shipped config dit-xl-diffusers (issue 47): what it trains, `dit-sample export --format diffusers` writes with
no flag and no override, and diffusers' DiTTransformer2DModel computes the same function to float32 accuracy; and
--approximate, refused for a network it would change beyond float error (EDM's), with that change measured here.

The tiny flavour overrides the model's size (model.preset=DiT-Tiny) and the run's length and batch only, never a key
the export needs (the config marks those [diffusers])."""

import ast
import copy
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dit_train.config import load_config, shipped_configs
from dit_train.recipe import resolve
from ditcore.data.schema import DatasetInfo
from ditcore.diffusion import EDMPrecond
from ditcore.export import export_model, load_network
from ditcore.inputs import Inputs
from ditcore.interop import diffusers_dit
from ditcore.layout import grid_positions, unpatchify
from ditcore.models import DiT
from ditcore.testing import assert_close_fp32, dit_forward_work, dit_pipeline_loop

diffusers = pytest.importorskip("diffusers")

# test_train.py's dit-train in a subprocess (tests are no package: pytest imports them by path)
_spec = importlib.util.spec_from_file_location("train_helpers", Path(__file__).with_name("test_train.py"))
train_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_helpers)

CONFIG = shipped_configs()["dit-xl-diffusers"]
TINY = ["model.preset=DiT-Tiny"]  # the size; everything else is the shipped config's
CLASSES, CHANNELS = 3, 3  # the dataset's: three colour classes, pixel latents (3 channels, a 32x32 image's 32x32)


def info(root=None) -> DatasetInfo:
    """A class-labelled dataset of 32x32x3 pixel latents, without text, as dit-prepare writes one."""
    data = DatasetInfo(codec={"kind": "pixel", "factor": 1}, latent_stats={"mean": [0.5] * 3, "std": [0.25] * 3},
                       text_encoder={"name": "null", "dim": 0}, latent_channels=CHANNELS, spatial_factor=1,
                       temporal_factor=1, num_classes=CLASSES)
    if root is not None:
        root.mkdir(parents=True)
        data.write(root)
    return data


def random_weights(model: DiT, seed: int) -> DiT:
    """Every weight random: the zero-initialised adaLN outputs of a fresh DiT would hide a wrong layout."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[1] ** -0.5 if p.ndim == 2 else 0.3)
    return model.eval()


def assert_diffusers_computes_it(theirs, model: DiT, steps=(0, 1, 250, 999)) -> None:
    """diffusers' network output (ε and the learned-Σ values) equals ditcore's on the same latents, timesteps and
    classes (the last: the null class) within float32 error of one forward over the 16x16 grid."""
    cfg, g = model.cfg, model.cfg.max_grid[1]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(steps), cfg.in_channels, g * cfg.patch_size, g * cfg.patch_size, generator=gen)
    t = torch.tensor(steps, dtype=torch.float32)
    y = torch.arange(len(steps)) % (cfg.num_classes + 1)
    with torch.no_grad():
        ours = model.forward_latents(x[:, :, None], t, class_labels=y)[:, :, 0]
        got = theirs(x, timestep=t, class_labels=y).sample
    assert got.shape == ours.shape == (len(steps), 2 * cfg.in_channels, *x.shape[2:])
    assert_close_fp32(got, ours, work=dit_forward_work(cfg, g * g))


def test_the_config_trains_the_layout_and_objective_diffusers_holds():
    """What the config resolves to: DiT's image layout with diffusers' sinusoid, a learned-Σ DDPM ε-network on DiT's
    schedule, 256 px (16x16 tokens) — and nothing for the export to refuse, with or without --approximate."""
    run = resolve(load_config(CONFIG, TINY), info())
    m = run.model_cfg
    assert (m.pos_embed, m.max_grid, m.qk_norm, m.freq_shift, m.mlp_norm_eps, m.learn_sigma, m.text_dim,
            m.num_classes, m.block_embedders) == ("sincos_2d", (1, 16, 16), False, 1, 1e-5, True, 0, CLASSES, False)
    assert (run.cfg.edm.precond, run.cfg.edm.loss, run.cfg.edm.prediction, run.cfg.validation.clip_frames) == \
        ("vp", "ddpm", "edm", 0)
    assert run.vp.timesteps == 1000 and run.vp.beta_schedule == "linear"
    assert diffusers_dit.refusal(m) is None and diffusers_dit.refusal(m, approximate=True, ddpm=True) is None
    full = resolve(load_config(CONFIG), info()).model_cfg  # the shipped size: DiT-XL/2
    assert (full.hidden_size, full.depth, full.num_heads, full.patch_size) == (1152, 28, 16, 2)
    assert diffusers_dit.refusal(full) is None


def test_its_network_converts_to_a_diffusers_model_of_the_same_function():
    """The config's network (random weights) converted in memory and built by diffusers' own constructor from the
    config.json the export writes: the same outputs, every tensor placed (strict load)."""
    model = random_weights(DiT(resolve(load_config(CONFIG, TINY), info()).model_cfg), seed=1)
    config, weights = diffusers_dit.to_diffusers(model.cfg, model.state_dict())
    theirs = diffusers.DiTTransformer2DModel.from_config(config).eval()
    theirs.load_state_dict(weights, strict=True)
    assert config["sample_size"] == 32 and config["out_channels"] == 2 * CHANNELS
    assert_diffusers_computes_it(theirs, model)


def edm_export(root, freq_shift: int):
    """An EDM-preconditioned DiT of the config's layout but DiT's own sinusoid (freq_shift=0), exported."""
    cfg = resolve(load_config(CONFIG, TINY), info()).model_cfg.replace(freq_shift=freq_shift)
    model = random_weights(DiT(cfg), seed=2)
    info(root / "data")
    export_model(root / "run" / "export", model.state_dict(), cfg, root / "data", extra={"step": 1})
    return model, root / "run"


def test_approximate_is_refused_for_an_edm_network_whose_denoiser_it_would_change(cli_in_process, tmp_path):
    """On random weights, diffusers' sinusoid in place of DiT's moves EDM's D(x; σ) over σ in [0.002, 80] by a fifth
    of its range or more: millions of times the float32 bound. So --approximate refuses it, in one line naming the
    way to an exact export, and writes nothing."""
    model, run = edm_export(tmp_path, freq_shift=0)
    other = DiT(model.cfg.replace(freq_shift=1)).eval()
    other.load_state_dict(model.state_dict())
    g = grid_positions((1, 16, 16))
    x = torch.randn(6, 256, model.cfg.patch_dim, generator=torch.Generator().manual_seed(3))
    sigma = torch.logspace(np.log10(0.002), np.log10(80.0), 6)
    inputs = Inputs(g, class_labels=torch.arange(6)[:, None] % (CLASSES + 1), grids=[[(1, 16, 16)]] * 6)
    noisy = x * (sigma[:, None, None] ** 2 + 0.25).sqrt()  # x + σ·n at each σ
    with torch.no_grad():
        d_ours, d_approx = EDMPrecond(model)(noisy, sigma, inputs), EDMPrecond(other)(noisy, sigma, inputs)
    change, scale = (d_approx - d_ours).abs().max().item(), d_ours.abs().max().item()
    print(f"--approximate on an EDM network, random weights: max |ΔD| = {change:.3f} on max |D| = {scale:.3f}")
    assert change > 0.2 * scale

    out = tmp_path / "out"
    refused = cli_in_process("sample", "export", "--checkpoint", run, "--format", "diffusers", out, "--approximate")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("error: cannot export to diffusers: --approximate is for DDPM-trained DiTs")
    assert "model.freq_shift=1" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert not out.exists()
    plain = cli_in_process("sample", "export", "--checkpoint", run, "--format", "diffusers", out)
    assert plain.returncode == 2 and "freq_shift=0" in plain.stderr and not out.exists()


def colour_images(root, per_class: int = 6):
    """per_class 32x32 images of a coloured square on grey in each of three class folders (dit-prepare's
    --labels subfolders)."""
    rng = np.random.default_rng(0)
    for name, rgb in [("blue", (30, 30, 220)), ("green", (30, 200, 30)), ("red", (220, 30, 30))]:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((32, 32, 3), 200, np.uint8)
            x, y = rng.integers(2, 20, 2)
            pixels[y:y + 10, x:x + 10] = rgb
            Image.fromarray(pixels).save(root / name / f"{i}.png")


@pytest.mark.slow  # dit-train in a subprocess: 20 s on 2 idle cores, 50 s on busy ones
def test_the_tiny_flavour_trains_and_exports_to_diffusers_without_overrides(cli_in_process, tmp_path):
    """dit-train --config dit-xl-diffusers (the size and the run's length overridden, nothing else the export reads),
    then dit-sample export with no flag: diffusers loads the folder, its config what the run trained, its outputs
    the trained network's to float32 accuracy; --approximate changes nothing (there is nothing to approximate)."""
    colour_images(tmp_path / "images")
    data = tmp_path / "data"
    prepared = cli_in_process("prepare", "folder", tmp_path / "images", "--out", data, "--labels", "subfolders",
                              "--size", 32, "--codec", "pixel", "--pixel-factor", 1, "--text-encoder", "null")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    run = tmp_path / "run"
    trained = train_helpers.dit_train("--config", "dit-xl-diffusers", *TINY, "model.compile=false", f"data.path={data}",
                        "data.num_workers=0", f"train.run_dir={run}", "train.steps=3", "train.micro_batch=2",
                        "train.global_batch=2", "validation.size=32", "validation.steps=2",
                        "logging.tensorboard=false")
    assert trained.returncode == 0, trained.stderr[-3000:]

    out = tmp_path / "diffusers"
    done = cli_in_process("sample", "export", "--checkpoint", run, "--format", "diffusers", out)
    assert done.returncode == 0, done.stderr
    assert "DDPM ε-prediction network" in done.stdout and "clip_sample=False" in done.stdout
    assert "approximate:" not in done.stdout
    assert "null class, this network's is 3" in done.stdout  # DiTPipeline's guidance assumes ImageNet's 1000
    assert "decode z = latents·std/σ_data + mean yourself" in done.stdout  # the dataset's per-channel units
    sidecar = json.loads((out / "ditcore.json").read_text())
    assert sidecar["precond"] == "vp" and sidecar["prediction_type"] == "epsilon"

    cfg, state, meta = load_network(run / "export")
    assert meta["step"] == 3 and meta["precond"] == "vp"
    model = DiT(cfg).eval()
    model.load_state_dict(state)
    theirs = diffusers.DiTTransformer2DModel.from_pretrained(out, low_cpu_mem_usage=False).eval()
    assert (theirs.config.sample_size, theirs.config.num_embeds_ada_norm, theirs.config.in_channels,
            theirs.config.out_channels) == (32, CLASSES, CHANNELS, 2 * CHANNELS)
    assert_diffusers_computes_it(theirs, model)
    assert_the_printed_ddim_is_ditcores(theirs, done.stdout, run)

    again = cli_in_process("sample", "export", "--checkpoint", run, "--format", "diffusers", tmp_path / "approx",
                           "--approximate")
    assert again.returncode == 0, again.stderr
    assert "approximate:" not in again.stdout
    assert (tmp_path / "approx" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (out / "diffusion_pytorch_model.safetensors").read_bytes()


def assert_the_printed_ddim_is_ditcores(theirs, printed: str, run) -> None:
    """diffusers' own DDIM loop (DiTPipeline's steps: guidance 4 over the conditional and null-class rows, the
    learned-Σ half dropped) on the exported transformer, with the DDIMScheduler(...) the export printed, gives the
    latents of ditcore's DDIM sampling of the run (dit-sample generate's Sampler) from the same x_T: within twice the
    float32 error of diffusers' loop, measured against its float64 twin."""
    from dit_sample.generate import Sampler

    call = re.search(r"DDIMScheduler\(([^)]*)\)", printed).group(1)  # name=value, ... as Python writes them

    def scheduler():
        return diffusers.DDIMScheduler(**{k: ast.literal_eval(v) for k, v in re.findall(r"(\w+)=([^,]+)", call)})

    labels, steps, seed, g, p = [0, 2], 4, 5, 16, 2
    sampler = Sampler.load(run / "export")
    ours = sampler.run(class_labels=labels, steps=steps, guidance=4.0, seed=seed, height=32, width=32,
                       solver="euler", schedule="ddim")[0].latents[:, :, 0]
    noise = torch.randn(2, g * g, CHANNELS * p * p, generator=torch.Generator().manual_seed(seed))
    x_T = unpatchify(noise, (1, g, g), p)[:, :, 0]  # ditcore's x_T in the image's layout
    theirs32 = dit_pipeline_loop(theirs, scheduler(), x_T, labels, CLASSES, 4.0, steps)
    theirs64 = dit_pipeline_loop(copy.deepcopy(theirs).double(), scheduler(), x_T.double(), labels, CLASSES, 4.0,
                                 steps, sampler.exported.vp.alphas_cumprod())
    fp32_error = (theirs32.double() - theirs64).abs().max().item()
    assert 0 < fp32_error < 1e-5 * theirs64.abs().max().item()
    assert (ours.double() - theirs64).abs().max().item() <= 2 * fp32_error
