"""dit-sample with the field's DiT checkpoints (no hub here: tiny random ones built in the test, in the layouts the
original DiT and diffusers save) and dit-sample export to diffusers, checked against diffusers' own code."""

import json
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dit_sample.cli import app
from ditcore import interop
from ditcore.codecs import DiffusersVAECodec, LatentStats
from ditcore.data.schema import DatasetInfo
from ditcore.diffusion import EDMPrecond
from ditcore.diffusion.vp import DiscreteVP
from ditcore.export import export_model
from ditcore.inputs import Inputs
from ditcore.layout import SIGMA_DATA, grid_positions, patchify, unpatchify
from ditcore.media import read_video
from ditcore.models import DiT
from ditcore.models.dit import DiTConfig
from ditcore.models.layers import sincos_2d
from ditcore.sampling import sample
from ditcore.testing import assert_close_fp32, dit_forward_work, dit_pipeline_loop

diffusers = pytest.importorskip("diffusers")

# DiT's architecture at a size a CPU samples in milliseconds: 8x8 latents of a 2x VAE (16x16 pixels), patch 2
SMALL = dict(hidden_size=64, depth=2, num_heads=4, patch_size=2, in_channels=4, num_classes=10,
             pos_embed="sincos_2d", max_grid=(1, 4, 4), qk_norm=False)
SD_SCALING = 0.18215  # AutoencoderKL's default scaling_factor, SD's: what DiT multiplies its latents by


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def random_dit(cfg: DiTConfig, seed: int) -> DiT:
    """Every weight random: the zero-initialised adaLN outputs of a fresh DiT would hide a wrong layout."""
    torch.manual_seed(seed)
    model = DiT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[1] ** -0.5 if p.ndim == 2 else 0.3)
    return model.eval()


def original_state_dict(model: DiT) -> dict[str, torch.Tensor]:
    """The network as facebookresearch/DiT's models.py names and lays it out: Conv2d patch embedder, qkv rows
    (3, heads, hd), final rows (p, p, C_out), timm MLP names, adaLN_modulation, and its fixed pos_embed buffer."""
    cfg, p, out = model.cfg, model.cfg.patch_size, {}
    renames = [(r"^x_embedder\.", "x_embedder.proj."), (r"^y_embedder\.", "y_embedder.embedding_table."),
               (r"^blocks\.(\d+)\.adaLN\.1\.", r"blocks.\1.adaLN_modulation.1."),
               (r"^blocks\.(\d+)\.mlp\.0\.", r"blocks.\1.mlp.fc1."),
               (r"^blocks\.(\d+)\.mlp\.2\.", r"blocks.\1.mlp.fc2."),
               (r"^final\.adaLN\.1\.", "final_layer.adaLN_modulation.1."),
               (r"^final\.linear\.", "final_layer.linear.")]
    for name, t in model.state_dict().items():
        if name == "x_embedder.weight":
            t = t.reshape(cfg.hidden_size, cfg.in_channels, p, p)
        elif re.fullmatch(r"blocks\.\d+\.attn\.qkv\.(weight|bias)", name):  # (heads, 3, hd) → (3, heads, hd)
            t = t.reshape(cfg.num_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        elif name.startswith("final.linear."):  # (C_out, p, p) → (p, p, C_out)
            t = t.reshape(-1, p, p, *t.shape[1:]).movedim(0, 2).reshape(t.shape)
        for pattern, repl in renames:
            name = re.sub(pattern, repl, name)
        out[name] = t.clone()
    g = cfg.max_grid[1]
    out["pos_embed"] = sincos_2d(grid_positions((1, g, g)), cfg.hidden_size)[None].float()  # (1, N, D)
    return out


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    """A tiny AutoencoderKL (2x, 4 latent channels, SD's scaling factor) written by save_pretrained."""
    folder = tmp_path_factory.mktemp("vae") / "vae"
    torch.manual_seed(0)
    diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                            norm_num_groups=8).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """(a DiT, the file its original-layout state dict is saved to as DiT saves it): width 64, which no paper size
    has, so its heads are given with --num-heads; learned Σ, 10 classes and the null class."""
    model = random_dit(DiTConfig(**SMALL, learn_sigma=True), seed=1)
    path = tmp_path_factory.mktemp("dit") / "DiT-tiny-16x16.pt"
    torch.save(original_state_dict(model), path)
    return model, path


def as_dit_does(model: DiT, vae_folder, **request) -> np.ndarray:
    """What a sampler that decodes as DiT's sample.py does, vae.decode(x / 0.18215), gives for ditcore's VP sample
    of `model`: pixels (B, H, W, 3) uint8. Its latents come from ditcore.sampling.sample itself."""
    any_stats = LatentStats(torch.zeros(4), torch.ones(4))  # only the latents are used, in the network's units
    latents = sample(model, DiffusersVAECodec(vae_folder), any_stats, vp=DiscreteVP(), **request).latents
    return decoded_as_dit(latents, vae_folder)


def decoded_as_dit(latents: torch.Tensor, vae_folder) -> np.ndarray:
    """Latents (B, C, 1, H, W) in the network's units decoded as DiT's sample.py does: pixels (B, H, W, 3) uint8."""
    vae = diffusers.AutoencoderKL.from_pretrained(vae_folder).eval()
    with torch.no_grad():
        images = vae.decode(latents[:, :, 0] / SD_SCALING).sample.clamp(-1, 1)  # (B, 3, H, W)
    return ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize(("schedule", "solver"), [("ddim", "euler"), ("karras", "heun")])
def test_generate_samples_an_original_dit_checkpoint_with_a_vae(original, vae_folder, tmp_path, schedule, solver):
    """The file converts (--num-heads: a width no paper size has), samples under VP preconditioning with DiT's
    guidance 4.0, and decodes as DiT decodes: the png equals vae.decode(x / 0.18215) of ditcore's sample of the
    network it was made from (to one level: ÷0.18215 and ×(0.5/0.18215)/0.5 round differently)."""
    model, path = original
    out = tmp_path / "dit.png"
    result = invoke("generate", "--checkpoint", path, "--vae", vae_folder, "--num-heads", 4, "--class", 3,
                    "--class", 7, "--steps", 4, "--schedule", schedule, "--solver", solver, "--seed", 5,
                    "--out", out)
    assert result.exit_code == 0, result.output
    assert "DiT checkpoint" in result.stdout and "VP preconditioning" in result.stdout
    assert "2 sample(s) of 1x16x16" in result.stdout and "(2x batch for guidance)" in result.stdout
    expected = as_dit_does(model, vae_folder, class_labels=[3, 7], height=16, width=16, steps=4, guidance=4.0,
                           solver=solver, schedule=schedule, seed=5)
    for i in range(2):
        got = read_video(tmp_path / f"dit-{i}.png")[0]
        assert got.shape == (16, 16, 3)
        assert np.abs(got.astype(int) - expected[i]).max() <= 1


def test_a_vp_sample_through_the_sampler_is_ditcore_sampling_bitwise(original, vae_folder):
    """No drift between dit-sample's path and the library's: the same latents, bit for bit."""
    from dit_sample.generate import Sampler

    model, path = original
    sampler = Sampler.load(path, vae=str(vae_folder), num_heads=4)
    assert sampler.exported.vp == DiscreteVP() and sampler.exported.guidance == 4.0
    assert sampler.default_size() == (16, 16) and sampler.example_classes() == []
    request = dict(class_labels=[0, 9], steps=3, guidance=2.5, seed=1, height=16, width=16, solver="euler")
    got, _ = sampler.run(**request, schedule="ddim")
    stats = LatentStats(torch.zeros(4), torch.full((4,), SIGMA_DATA / SD_SCALING))
    expected = sample(model, DiffusersVAECodec(vae_folder), stats, vp=DiscreteVP(), schedule="ddim", **request)
    assert torch.equal(got.latents, expected.latents) and torch.equal(got.pixels, expected.pixels)


def random_diffusers_dit(seed: int):
    """A tiny DiTTransformer2DModel of diffusers (each block its own embedders), every weight moved off its zero
    initialisation (its output layers start at zero: a test of them would see nothing)."""
    torch.manual_seed(seed)
    theirs = diffusers.DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                             out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                             num_embeds_ada_norm=10).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, p.shape[1] ** -0.5 if p.ndim == 2 else 0.3)
    return theirs


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, vae_folder):
    """A diffusers DiT pipeline folder as DiTPipeline.save_pretrained writes it: transformer/ (diffusers' own
    DiTTransformer2DModel, random, with the one embedder its conversion copies into every block), scheduler/ (a
    schedule other than DiT's, so that using it shows), vae/ and model_index.json."""
    import shutil

    root = tmp_path_factory.mktemp("pipe") / "DiT-tiny"
    theirs = random_diffusers_dit(seed=2)
    with torch.no_grad():
        for block in theirs.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(theirs.transformer_blocks[0].norm1.emb.state_dict())
    theirs.save_pretrained(root / "transformer")
    diffusers.DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).save_pretrained(
        root / "scheduler")
    shutil.copytree(vae_folder, root / "vae")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    return root


def test_generate_samples_a_diffusers_pipeline_with_its_own_vae_and_schedule(pipeline, tmp_path):
    """No --vae: the pipeline's vae/ decodes (offline, DiT's default VAE from the hub could not load), and its
    scheduler's schedule preconditions the network: the png is ditcore.sampling.sample of the converted network
    under that schedule, decoded by that VAE."""
    from ditcore import interop

    out = tmp_path / "pipe.png"
    result = invoke("generate", "--checkpoint", pipeline, "--class", 4, "--steps", 3, "--schedule", "ddim",
                    "--solver", "euler", "--out", out)
    assert result.exit_code == 0, result.output
    assert "diffusers DiTTransformer2DModel" in result.stdout and "scaled_linear" in result.stdout
    imported = interop.read(pipeline)
    model = DiT(imported.cfg).eval()
    model.load_state_dict(imported.tensors)
    stats = LatentStats(torch.zeros(4), torch.full((4,), SIGMA_DATA / SD_SCALING))
    # its scheduler's: DDIMScheduler's defaults (x̂₀ clipped at ±1) on the schedule it was given
    vp = DiscreteVP(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=True)
    assert imported.vp == vp
    expected = sample(model, DiffusersVAECodec(pipeline / "vae"), stats, vp=vp, schedule="ddim", class_labels=[4],
                      steps=3, guidance=4.0, solver="euler", height=16, width=16)
    assert np.array_equal(read_video(out)[0], expected.pixels[0, 0].numpy())


def test_the_app_opens_a_pipeline_with_class_labels_only(pipeline):
    """The Gradio app loads it through the same Sampler: one checkpoint, no prompt examples or class examples,
    one frame (an image model), the import named on the page."""
    from dit_sample.app import build_app

    demo = build_app(pipeline)
    components = demo.config["components"]
    assert not [c for c in components if c["type"] == "dataset"]  # gr.Examples: none offered
    props = {c["props"].get("elem_id"): c["props"] for c in components if c["props"].get("elem_id")}
    assert props["class"]["visible"] and not props["prompt"]["visible"] and not props["checkpoint"]["visible"]
    assert props["frames"]["value"] == 1 and (props["height"]["value"], props["width"]["value"]) == (16, 16)
    assert any("diffusers DiTTransformer2DModel" in str(c["props"].get("value")) for c in components)


def test_generate_samples_a_diffusers_made_dit_with_its_own_block_embedders_as_diffusers_ddim(vae_folder, tmp_path):
    """A DiT as diffusers makes it (each block its own timestep/class embedders), every weight moved off its zero
    initialisation, saved by DiTPipeline.save_pretrained with a scheduler of DDIM settings other than DiT's: dit-sample
    generate samples it to the latents of diffusers' own DDIM loop (guidance 4, the pipeline's steps) from the same
    x_T, within float32 error, and its png is their decoding to one level."""
    from dit_sample.generate import Sampler

    theirs = random_diffusers_dit(seed=3)
    # trailing at 3 steps lands each step off the next timestep, the last one on ᾱ_0 (clip_sample, whose clamped
    # outputs hide the float32 error this test measures, is checked against diffusers in tests/ditcore/test_interop.py)
    scheduler = diffusers.DDIMScheduler(timestep_spacing="trailing", set_alpha_to_one=False, clip_sample=False)
    root = tmp_path / "DiT-own"
    diffusers.DiTPipeline(transformer=theirs, vae=diffusers.AutoencoderKL.from_pretrained(vae_folder),
                          scheduler=scheduler).save_pretrained(root)
    labels, steps, seed = [3, 7], 3, 5
    out = tmp_path / "own.png"
    result = invoke("generate", "--checkpoint", root, "--class", 3, "--class", 7, "--steps", steps, "--schedule",
                    "ddim", "--solver", "euler", "--seed", seed, "--out", out)
    assert result.exit_code == 0, result.output
    request = dict(class_labels=labels, steps=steps, guidance=4.0, seed=seed, height=16, width=16, solver="euler",
                   schedule="ddim")
    sampler = Sampler.load(root)
    assert sampler.exported.model.cfg.block_embedders
    ours = sampler.run(**request)[0].latents[:, :, 0]  # what generate sampled: the same Sampler, the same request
    # ditcore's x_T: randn of the seed over (B, tokens, patch features), in the image's layout
    noise = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(seed))
    x_T = unpatchify(noise, (1, 4, 4), 2)[:, :, 0]
    loaded = diffusers.DiTTransformer2DModel.from_pretrained(root / "transformer", low_cpu_mem_usage=False).eval()
    theirs32 = dit_pipeline_loop(loaded, diffusers.DDIMScheduler.from_pretrained(root / "scheduler"), x_T, labels,
                                 10, 4.0, steps)
    theirs64 = dit_pipeline_loop(loaded.double(), diffusers.DDIMScheduler.from_pretrained(root / "scheduler"),
                                 x_T.double(), labels, 10, 4.0, steps, sampler.exported.vp.alphas_cumprod())
    fp32_error = (theirs32.double() - theirs64).abs().max().item()
    assert 0 < fp32_error < 1e-5 * theirs64.abs().max().item()
    assert (ours.double() - theirs64).abs().max().item() <= 2 * fp32_error
    expected = decoded_as_dit(theirs32[:, :, None], vae_folder)
    for i in range(2):
        assert np.abs(read_video(tmp_path / f"own-{i}.png")[0].astype(int) - expected[i]).max() <= 1


def test_a_scheduler_setting_ditcore_does_not_follow_stops_generate_in_one_line(pipeline, tmp_path):
    import shutil

    root = shutil.copytree(pipeline, tmp_path / "pipe")
    config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(config | {"thresholding": True}))
    result = invoke("generate", "--checkpoint", root, "--class", 1, "--out", tmp_path / "x.png")
    assert result.exit_code == 2 and result.stderr.startswith("error: the scheduler says thresholding=True")
    assert len(result.stderr.splitlines()) == 1
    heun = invoke("generate", "--checkpoint", pipeline, "--class", 1, "--schedule", "ddim", "--solver", "heun",
                  "--out", tmp_path / "y.png")
    assert heun.exit_code == 2 and len(heun.stderr.splitlines()) == 1
    assert heun.stderr.startswith("error: schedule ddim with solver heun: this schedule's clip_sample")


# ---------------------------------------------------------------- dit-sample export --format diffusers


@pytest.fixture(scope="module")
def edm_run(tmp_path_factory):
    """A ditcore export of an EDM-preconditioned class-conditional DiT that diffusers can hold (DiT's 2-D table, no
    QK-norm, diffusers' timestep sinusoid), written by export_model as dit-train writes it."""
    root = tmp_path_factory.mktemp("edm")
    DatasetInfo(codec={"kind": "pixel", "factor": 2}, latent_stats={"mean": [0.0] * 4, "std": [0.5] * 4},
                text_encoder={"name": "null", "dim": 0}, latent_channels=4, spatial_factor=2, temporal_factor=1,
                num_classes=10).write(root)
    cfg = DiTConfig(**SMALL, freq_shift=1, mlp_norm_eps=1e-5)
    model = random_dit(cfg, seed=3)
    export_model(root / "run" / "export", model.state_dict(), cfg, root, extra={"step": 1})
    return model, root / "run"


def test_export_to_diffusers_loads_there_and_its_printed_recipe_gives_ditcores_denoiser(edm_run, tmp_path):
    """diffusers loads the folder as its own model, and following what the command prints (timestep 1000·ln(σ)/4 on
    c_in·x, D = c_skip·x + c_out·output) gives ditcore's D(x; σ) to float32 accuracy. An existing OUT is kept
    unless --force."""
    model, run = edm_run
    out = tmp_path / "dit-diffusers"
    result = invoke("export", "--checkpoint", run, "--format", "diffusers", out)
    assert result.exit_code == 0, result.output
    assert f"DiTTransformer2DModel.from_pretrained({str(out)!r})" in result.stdout
    assert "timestep = 1000·ln(σ)/4" in result.stdout
    sidecar = json.loads((out / "ditcore.json").read_text())
    assert sidecar["precond"] == "edm"
    # the latent units it was trained in travel with it (read back as such, not assumed to be SD-VAE's 0.18215 z)
    assert sidecar["latent_stats"] == {"mean": [0.0] * 4, "std": [0.5] * 4}
    assert interop.read(out).latent_stats.to_dict() == sidecar["latent_stats"]

    theirs = diffusers.DiTTransformer2DModel.from_pretrained(out, low_cpu_mem_usage=False).eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.02, 1.0, 40.0])
    y = torch.tensor([0, 7, 10])  # the last: the null class
    s, d = sigma[:, None, None, None], SIGMA_DATA  # EDM's Table 1, as the command prints it
    c_skip, c_out, c_in = d**2 / (s**2 + d**2), s * d / (s**2 + d**2).sqrt(), 1 / (s**2 + d**2).sqrt()
    with torch.no_grad():
        output = theirs(c_in * x, timestep=1000 * sigma.log() / 4, class_labels=y).sample
        recipe = c_skip * x + c_out * output
        inputs = Inputs(grid_positions((1, 4, 4)), class_labels=y[:, None], grids=[[(1, 4, 4)]] * 3)
        tokens = EDMPrecond(model)(patchify(x[:, :, None], 2), sigma, inputs)
        ours = unpatchify(tokens, (1, 4, 4), 2)[:, :, 0]
    assert_close_fp32(recipe, ours, work=dit_forward_work(model.cfg, 16))

    again = invoke("export", "--checkpoint", run, "--format", "diffusers", out)
    assert again.exit_code == 2 and again.stderr == f"error: OUT '{out}' exists: pass --force to replace it, or " \
                                                    "give a new folder\n"
    assert invoke("export", "--checkpoint", run, "--format", "diffusers", out, "--force").exit_code == 0


def test_export_of_an_original_checkpoint_needs_approximate(original, tmp_path):
    """The original DiT's timestep sinusoid is not diffusers': refused by name, exported with --approximate (as
    diffusers' own conversion of DiT-XL/2 is), with its schedule recorded."""
    _, path = original
    refused = invoke("export", "--checkpoint", path, "--num-heads", 4, "--format", "diffusers", tmp_path / "o")
    assert refused.exit_code == 2 and refused.stderr.startswith("error: cannot export to diffusers: freq_shift=0")
    assert not (tmp_path / "o").exists()
    done = invoke("export", "--checkpoint", path, "--num-heads", 4, "--format", "diffusers", tmp_path / "o",
                  "--approximate")
    assert done.exit_code == 0, done.output
    assert "DDPM ε-prediction network" in done.stdout and "approximate:" in done.stdout
    assert json.loads((tmp_path / "o" / "ditcore.json").read_text())["vp"] == DiscreteVP().to_dict()


@pytest.mark.parametrize(("args", "message"), [
    # the demo's tiny run (RoPE, text-conditioned): the first feature diffusers cannot hold
    (["export", "--format", "diffusers", "OUT"], "error: cannot export to diffusers: pos_embed=rope"),
    (["generate", "--prompt", "a grey stone", "--schedule", "ddim"],
     "error: schedule ddim steps through a DDPM network's timesteps, and this model is EDM-preconditioned"),
    (["generate", "--prompt", "a grey stone", "--vae", "stabilityai/sd-vae-ft-ema"],
     "error: --vae, --num-heads and --text-encoder are for the field's checkpoints"),
])
def test_refusals_are_one_line(checkpoint, tmp_path, args, message):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    result = invoke(*args[:1], "--checkpoint", checkpoint, *args[1:], *(["--out", tmp_path / "s.png"]
                                                                        if args[0] == "generate" else []))
    assert result.exit_code == 2 and result.stderr.startswith(message), result.output
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_an_original_checkpoint_of_no_paper_width_asks_for_its_heads(original, vae_folder, tmp_path):
    result = invoke("generate", "--checkpoint", original[1], "--vae", vae_folder, "--class", 1)
    assert result.exit_code == 2 and "none of the paper's sizes" in result.stderr and "--num-heads" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_an_x_prediction_run_is_refused_by_name(edm_run, tmp_path):
    """Its ditcore.json would record EDM's c_skip/c_out, which, followed, give another denoiser than the network's."""
    import shutil

    _, run = edm_run
    export = shutil.copytree(run / "export", tmp_path / "export")
    meta = json.loads((export / "model.json").read_text())
    (export / "model.json").write_text(json.dumps(meta | {"prediction": "x"}))  # what dit-train records
    result = invoke("export", "--checkpoint", export, "--format", "diffusers", tmp_path / "out")
    assert result.exit_code == 2 and result.stderr.startswith("error: cannot export to diffusers: prediction=x")
    assert not (tmp_path / "out").exists()
