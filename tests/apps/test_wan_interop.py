"""Wan 2.1 from diffusers in ditcore and back (issue 45): a WanPipeline folder (tiny, random: bench/tiny_wan.py writes
it as diffusers saves Wan-AI/Wan2.1-T2V-1.3B-Diffusers) imports with its VAE's latent units, its UMT5 text encoder and
its scheduler's shift and loop; `dit-sample generate` samples it to diffusers' own WanPipeline's frames, with the
UniPC scheduler Wan ships and with FlowMatchEulerDiscreteScheduler; `dit-sample export` hands it back as a
WanTransformer3DModel folder that diffusers loads and that computes ditcore's velocity."""

import importlib.util
import inspect
import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from ditcore import interop
from ditcore.codecs import DiffusersVAECodec, LatentStats
from ditcore.codecs.text import load_text_encoder
from ditcore.diffusion.flow import FlowPrecond, TimeShift
from ditcore.inputs import Inputs
from ditcore.interop import ConversionError, diffusers_wan
from ditcore.layout import SIGMA_DATA, grid_positions, patchify, unpatchify
from ditcore.models import Wan, preset
from ditcore.sampling import sample
from ditcore.testing import assert_close_fp32, dit_forward_work

diffusers = pytest.importorskip("diffusers")

_spec = importlib.util.spec_from_file_location("tiny_wan", Path(__file__).parents[2] / "bench" / "tiny_wan.py")
tiny_wan = importlib.util.module_from_spec(_spec)  # bench/ is not a package
_spec.loader.exec_module(tiny_wan)

PROMPT, SEED, STEPS = "a red butterfly flying over grass", 0, 6
SIZE = dict(frames=5, height=32, width=48)  # 1 + 4 frames: 2 latent frames of 4 x 6, 2 x 2 x 3 = 12 tokens
SHIFTS = {"unipc": 3.0, "euler": 2.5}  # each scheduler's own, so that reading it shows


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """The same tiny random Wan saved twice as a WanPipeline: with Wan 2.1's UniPC scheduler, and with
    FlowMatchEulerDiscreteScheduler."""
    root = tmp_path_factory.mktemp("wan")
    return {name: tiny_wan.write(root / name, name, shift=shift) for name, shift in SHIFTS.items()}


def wan_pipeline(folder: Path, dtype=torch.float32):
    """diffusers' WanPipeline as from_pretrained loads it. diffusers 0.42 loads a WanTransformer3DModel only with
    accelerate installed, for the modules it keeps in float32 (_keep_in_fp32_modules), which matter in half precision
    alone: here every module is float32 (or float64), so they are loaded as the rest."""
    with mock.patch.object(diffusers.WanTransformer3DModel, "_keep_in_fp32_modules", None):
        pipe = diffusers.WanPipeline.from_pretrained(folder).to(dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def their_sample(folder: Path, dtype, negative_prompt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """WanPipeline's final latents (B, C, T', H', W') and frames (F, H, W, 3) in [0, 1] (output_type np), float64."""
    got = {}

    def keep(pipe, i, t, tensors):
        got["latents"] = tensors["latents"]  # after step i: the last one's are what it decodes
        return {}

    out = wan_pipeline(folder, dtype)(PROMPT, negative_prompt=negative_prompt, num_frames=SIZE["frames"],
                                      height=SIZE["height"], width=SIZE["width"], num_inference_steps=STEPS,
                                      guidance_scale=5.0, generator=torch.Generator().manual_seed(SEED),
                                      output_type="np", callback_on_step_end=keep,
                                      callback_on_step_end_tensor_inputs=["latents"])
    return got["latents"].double(), torch.from_numpy(np.asarray(out.frames[0])).double()


def imported_model(got: interop.Imported) -> Wan:
    model = Wan(got.cfg).eval()
    model.load_state_dict(got.tensors)  # strict: every tensor has its place
    return model


def wan_work(cfg, seq_len: int, text_len: int) -> int:
    """Float32 work of a Wan output value, as tests/ditcore/models/test_wan.py counts it: a DiT forward's, the time
    projection (D), and QK norms over all heads' D features in both attentions of every block."""
    D = cfg.hidden_size
    return dit_forward_work(cfg, seq_len, text_len) + D + 2 * cfg.depth * (D - cfg.head_dim)


# ---------------------------------------------------------------- import


def test_a_wan_pipeline_imports_with_its_units_text_encoder_and_scheduler(pipelines):
    for solver, folder in pipelines.items():
        assert interop.is_foreign(folder) and interop.is_foreign(folder / "transformer")
        got = interop.read(folder)
        assert got.kind == "diffusers WanTransformer3DModel" and got.objective == "flow" and got.vp is None
        # Wan-Tiny's sizes, text as wide as the UMT5, padded to WanPipeline's 512 tokens; RoPE tables of 256
        assert got.cfg == preset("Wan-Tiny", text_dim=tiny_wan.TEXT_DIM, text_len=512, max_grid=(256, 256, 256))
        assert (got.shift, got.solver) == (TimeShift(SHIFTS[solver]), solver)
        assert got.vae == folder / "vae" and got.text_encoder == f"umt5:{folder.resolve()}"
        assert got.negative_prompt == ""  # WanPipeline encodes "" when no negative prompt is given
        vae = json.loads((folder / "vae" / "config.json").read_text())
        # WanPipeline's (z − latents_mean)/latents_std is ditcore's (z − mean)/std·σ_d for std = latents_std·σ_d
        assert got.latent_stats.to_dict() == LatentStats(torch.tensor(vae["latents_mean"]),
                                                         torch.tensor(vae["latents_std"]) * SIGMA_DATA).to_dict()
        assert f"flow matching (timestep shift {SHIFTS[solver]:g}, {solver} solver)" in got.summary()
    bare = interop.read(pipelines["unipc"] / "transformer")  # no scheduler: Wan 2.1's own defaults, shift 5 and UniPC
    assert (bare.shift, bare.solver, bare.vae, bare.latent_stats, bare.text_encoder) == (TimeShift(5.0), "unipc",
                                                                                          None, None, None)
    full = interop.read(pipelines["unipc"])
    assert all(torch.equal(bare.tensors[k], v) for k, v in full.tensors.items()) and bare.cfg == full.cfg


def test_the_pipelines_guidance_default_is_dit_samples():
    signature = inspect.signature(diffusers.WanPipeline.__call__)
    assert signature.parameters["guidance_scale"].default == diffusers_wan.GUIDANCE


def _edit(folder: Path, part: str, **changes) -> None:
    path = folder / part
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize(("part", "changes", "message"), [
    ("model_index.json", {"_class_name": "WanImageToVideoPipeline"}, "the pipeline is a 'WanImageToVideoPipeline'"),
    ("model_index.json", {"boundary_ratio": 0.875}, "Wan 2.2's two experts"),
    ("scheduler/scheduler_config.json", {"_class_name": "DPMSolverMultistepScheduler"},
     "the scheduler is a 'DPMSolverMultistepScheduler'"),
    ("scheduler/scheduler_config.json", {"prediction_type": "epsilon"},
     "the scheduler says prediction_type='epsilon': ditcore samples Wan with UniPCMultistepScheduler's loop at "
     "prediction_type='flow_prediction'"),
    ("scheduler/scheduler_config.json", {"solver_order": 3}, "the scheduler says solver_order=3"),
    ("scheduler/scheduler_config.json", {"use_dynamic_shifting": True}, "WanPipeline passes it no mu"),
    ("vae/config.json", {"latents_std": [1.0, 2.0]}, "the VAE config's latents_std is [1.0, 2.0]: expected 4 finite"),
    ("text_encoder/config.json", {"model_type": "t5"}, "its text encoder is a 't5' model"),
    ("transformer/config.json", {"image_dim": 1280}, "image_dim=1280 has no ditcore counterpart"),
])
def test_what_ditcore_does_not_follow_is_refused_in_one_line(pipelines, tmp_path, part, changes, message):
    folder = shutil.copytree(pipelines["unipc"], tmp_path / "pipe")
    _edit(folder, part, **changes)
    with pytest.raises(ConversionError, match=r"^'") as info:  # it names the folder or file first
        interop.read(folder)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_euler_scheduler_setting_that_changes_its_steps_is_refused(pipelines, tmp_path):
    folder = shutil.copytree(pipelines["euler"], tmp_path / "pipe")
    _edit(folder, "scheduler/scheduler_config.json", stochastic_sampling=True)
    with pytest.raises(ConversionError, match="the scheduler says stochastic_sampling=True"):
        interop.read(folder)
    # a dynamic shift is Flux's, by token count, from the config's own line (its constant shift then unread)
    _edit(folder, "scheduler/scheduler_config.json", stochastic_sampling=False, use_dynamic_shifting=True,
          base_image_seq_len=16, max_image_seq_len=64)
    assert interop.read(folder).shift == TimeShift(dynamic=True, base_seq_len=16, max_seq_len=64)


# ---------------------------------------------------------------- dit-sample generate = WanPipeline


@pytest.mark.parametrize(("solver", "negative"), [("unipc", None), ("euler", "blurry")])
def test_dit_sample_generate_is_wan_pipelines_video(pipelines, cli_in_process, monkeypatch, tmp_path, solver,
                                                    negative):
    """The same prompt, negative prompt (none: WanPipeline's "", encoded), seed, steps, guidance (5, both defaults)
    and size through diffusers' WanPipeline and through `dit-sample generate --checkpoint PIPELINE` with no other
    flag (its scheduler gives the solver and shift, its VAE the units, its UMT5 the text).

    Latents: ditcore.sampling.sample on the import is as close to WanPipeline run in float64 as WanPipeline's own
    float32 run is (within twice its error: the DiT tests' bound). Frames: the uint8 frames generate writes are that
    sample's, bit for bit; their float pixels are within 3x WanPipeline's own float32 error of its float32 frames
    (each side within 2x resp. 1x of float64's), so the frames, rounded to 8 bits, differ by at most
    ⌊255·3·error⌋ + 1 levels (two roundings of values that close), and only where a value lies that close to a
    rounding boundary."""
    folder = pipelines[solver]
    l32, f32 = their_sample(folder, torch.float32, negative)
    l64, f64 = their_sample(folder, torch.float64, negative)

    got = interop.read(folder)
    codec = DiffusersVAECodec(got.vae, diffusers_wan.VAE_CLASS)
    encoder = load_text_encoder(got.text_encoder)
    ours = sample(imported_model(got), codec, got.latent_stats, text_states=encoder.encode([PROMPT]),
                  negative_states=encoder.encode([negative or ""]), steps=STEPS, guidance=5.0, solver=solver,
                  seed=SEED, objective="flow", shift=got.shift, **SIZE)
    fp32_latents = (l32 - l64).abs().max().item()
    assert 0 < fp32_latents < 1e-5 * l64.abs().max().item() * STEPS
    print(f"{solver}: latents |ours − float64| {(ours.latents.double() - l64).abs().max().item():.2e}, "
          f"WanPipeline float32's {fp32_latents:.2e}")
    assert (ours.latents.double() - l64).abs().max().item() <= 2 * fp32_latents

    written = []
    real_write = __import__("ditcore.media", fromlist=["write_sample"]).write_sample
    monkeypatch.setattr("ditcore.media.write_sample",
                        lambda pixels, path, fps: written.append(pixels.copy()) or real_write(pixels, path, fps))
    args = ["--negative-prompt", negative] if negative else []
    proc = cli_in_process("sample", "generate", "--checkpoint", folder, "--prompt", PROMPT, *args, "--steps", STEPS,
                          "--seed", SEED, "--frames", SIZE["frames"], "--height", SIZE["height"], "--width",
                          SIZE["width"], "--out", tmp_path / "wan.mp4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"flow matching (timestep shift {SHIFTS[solver]:g}, {solver} solver)" in proc.stdout
    assert "1 sample(s) of 5x32x48" in proc.stdout and (tmp_path / "wan.mp4").stat().st_size > 0
    (frames,) = written  # (F, H, W, 3) uint8, before the mp4's lossy coding
    assert np.array_equal(frames, ours.pixels[0].numpy())  # dit-sample's path is the library's

    pixels = (codec.decode(got.latent_stats.denormalize(ours.latents.float())) + 1) / 2  # what ours rounds, [0, 1]
    pixels = pixels[0].permute(1, 2, 3, 0).double()
    fp32_pixels = (f32 - f64).abs().max().item()
    apart = (pixels - f32).abs().max().item()
    assert apart <= 3 * fp32_pixels
    theirs = (f32.numpy() * 255).round().astype(int)  # WanPipeline's np frames as 8-bit values
    levels = np.abs(frames.astype(int) - theirs)
    allowed = int(255 * 3 * fp32_pixels) + 1
    print(f"{solver}: frames differ by at most {levels.max()} levels in {np.count_nonzero(levels)} of {levels.size} "
          f"values (allowed {allowed}: float pixels {apart:.2e} apart, WanPipeline's float32 error {fp32_pixels:.2e})")
    assert levels.max() <= allowed == 1


def test_a_bare_transformer_folder_needs_a_vae_and_a_text_encoder(pipelines, cli_in_process, tmp_path):
    """Without its pipeline a WanTransformer3DModel folder names neither: each is asked for in one line. Given both
    it samples with Wan's default shift (5) and UniPC, its units the given VAE's."""
    from dit_sample.generate import Sampler

    folder = pipelines["euler"]
    request = ["--prompt", PROMPT, "--steps", 2, "--frames", 1, "--height", 32, "--width", 32]
    proc = cli_in_process("sample", "generate", "--checkpoint", folder / "transformer", *request, "--out",
                          tmp_path / "x.png")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "names no text encoder: pass --text-encoder umt5:<its WanPipeline folder" in proc.stderr
    proc = cli_in_process("sample", "generate", "--checkpoint", folder / "transformer", "--text-encoder",
                          f"umt5:{folder}", *request, "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and "holds no VAE: pass --vae" in proc.stderr
    sampler = Sampler.load(folder / "transformer", vae=str(folder / "vae"), text_encoder=f"umt5:{folder}")
    assert sampler.exported.shift == TimeShift(5.0) and sampler.exported.solver == "unipc"
    full = Sampler.load(folder)  # the same network and VAE: the same units, read from the VAE's config either way
    assert sampler.exported.stats.to_dict() == full.exported.stats.to_dict()


def test_the_app_opens_a_wan_pipeline_with_its_defaults(pipelines):
    """dit-sample serve loads it through the same Sampler: text prompts, guidance 5, its scheduler's solver, and a
    clip of 1 + 2·4 frames that Wan's VAE decodes."""
    from dit_sample.app import build_app

    demo = build_app(pipelines["unipc"])
    props = {c["props"].get("elem_id"): c["props"] for c in demo.config["components"] if c["props"].get("elem_id")}
    assert props["prompt"]["visible"] and not props["class"]["visible"]
    assert (props["guidance"]["value"], props["solver"]["value"], props["frames"]["value"]) == (5.0, "unipc", 9)


# ---------------------------------------------------------------- dit-sample export --format diffusers


def test_export_hands_a_wan_back_to_diffusers_and_it_imports_back_bitwise(pipelines, cli_in_process, tmp_path):
    """The folder diffusers' WanTransformer3DModel.from_pretrained loads computes ditcore's velocity v̂(x_t, t) =
    F(x_t, 1000·t) on the same input (text zero-padded to 512 tokens, as WanPipeline pads it) within float32 error;
    its ditcore.json records objective flow, the shift and the latent units; read back it gives every tensor back."""
    folder, out = pipelines["unipc"], tmp_path / "wan-diffusers"
    proc = cli_in_process("sample", "export", "--checkpoint", folder, "--format", "diffusers", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"WanTransformer3DModel.from_pretrained({str(out)!r})" in proc.stdout
    assert "flow_shift=3" in proc.stdout and "max_sequence_length=512" in proc.stdout
    got, back = interop.read(folder), interop.read(out)
    sidecar = json.loads((out / interop.SIDECAR).read_text())
    assert sidecar["objective"] == "flow" and TimeShift.from_dict(sidecar["shift"]) == TimeShift(3.0)
    assert sidecar["latent_stats"] == got.latent_stats.to_dict() and sidecar["max_sequence_length"] == 512
    assert back.cfg == got.cfg and back.tensors.keys() == got.tensors.keys()
    assert all(torch.equal(back.tensors[k], v) for k, v in got.tensors.items())
    assert (back.shift, back.latent_stats.to_dict(), back.objective) == (got.shift, sidecar["latent_stats"], "flow")

    with mock.patch.object(diffusers.WanTransformer3DModel, "_keep_in_fp32_modules", None):  # see wan_pipeline
        theirs = diffusers.WanTransformer3DModel.from_pretrained(out).eval()
    model, cfg = imported_model(back), back.cfg
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, cfg.in_channels, 2, 4, 6, generator=g)  # 2 x 2 x 3 tokens
    t = torch.tensor([0.9, 0.3])
    text = torch.randn(2, 7, cfg.text_dim, generator=g)
    grid = (2, 2, 3)
    with torch.no_grad():
        tokens = FlowPrecond(model)(patchify(x, 2, 1), t, Inputs(grid_positions(grid), text=text))
        ours = unpatchify(tokens, grid, 2, 1)
        padded = torch.cat([text, torch.zeros(2, cfg.text_len - 7, cfg.text_dim)], dim=1)
        expected = theirs(x, timestep=1000 * t, encoder_hidden_states=padded).sample
    assert_close_fp32(ours, expected, work=wan_work(cfg, 12, cfg.text_len))
    assert (expected[0] - expected[1]).abs().max() > 0.1 * expected.abs().max()  # not vacuous
