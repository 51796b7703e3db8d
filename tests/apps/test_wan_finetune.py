"""dit-train fine-tunes a Wan 2.1 pipeline (issue 45): model.init_from=<a WanPipeline folder> gives the run Wan's
architecture, objective flow with its scheduler's shift and its VAE's latent units (dit_train.recipe); the shipped
wan-1.3b-finetune config, shrunk to a tiny random pipeline (bench/tiny_wan.py), trains on a Wan-ready dataset
(dit-prepare with the pipeline's VAE and UMT5), and its export samples through dit-sample and goes back to diffusers
as a WanTransformer3DModel that computes what the run's network computes."""

import importlib.util
import json
from pathlib import Path
from unittest import mock

import imageio.v3 as iio
import pytest
import torch

from dit_train.config import load_config
from dit_train.recipe import resolve
from ditcore import interop
from ditcore.codecs.text import load_text_encoder
from ditcore.data.schema import DatasetInfo
from ditcore.diffusion.flow import FlowPrecond, TimeShift
from ditcore.errors import ConfigError
from ditcore.export import load_export
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, patchify, unpatchify
from ditcore.models import arch_of
from ditcore.sampling import sample
from ditcore.testing import assert_close_fp32, dit_forward_work

diffusers = pytest.importorskip("diffusers")

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("tiny_wan", ROOT / "bench" / "tiny_wan.py")
tiny_wan = importlib.util.module_from_spec(_spec)  # bench/ is not a package
_spec.loader.exec_module(tiny_wan)
_spec = importlib.util.spec_from_file_location("train_helpers", Path(__file__).with_name("test_train.py"))
train_helpers = importlib.util.module_from_spec(_spec)  # test_train.py's dit_train: tests are no package
_spec.loader.exec_module(train_helpers)

# the shipped config at the tiny pipeline's size on 2 CPU cores: no compile, recomputation or FSDP; rows of 16 tokens
TINY = ["model.preset=Wan-Tiny", "model.compile=false", "model.activation_checkpointing=none", "parallel.fsdp=false",
        "data.seq_length=16", "data.num_workers=0", "train.global_batch=2", "train.micro_batch=2",
        "optim.warmup_steps=0", "validation.size=32", "validation.clip_frames=5", "validation.steps=2",
        "validation.prompts=[a red butterfly]", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    return tiny_wan.write(tmp_path_factory.mktemp("wan") / "pipe")


def info(channels: int = tiny_wan.LATENT_CHANNELS, text_dim: int = tiny_wan.TEXT_DIM) -> DatasetInfo:
    return DatasetInfo(codec={"kind": "none"}, latent_stats={"mean": [0.2] * channels, "std": [3.0] * channels},
                       text_encoder={"name": "umt5:x", "dim": text_dim}, latent_channels=channels, spatial_factor=8,
                       temporal_factor=4)


def recipe(*overrides: str, data: DatasetInfo | None = None):
    return resolve(load_config(None, list(overrides)), data or info())


# ---------------------------------------------------------------- the recipe


def test_a_wan_pipeline_makes_the_run_flow_in_its_architecture_shift_and_units(pipeline):
    r = recipe(f"model.init_from={pipeline}")
    theirs = interop.read(pipeline)
    assert arch_of(r.model_cfg) == "wan" and r.model_cfg == theirs.cfg
    assert r.cfg.objective == "flow" and r.cfg.flow.time_shift() == TimeShift(3.0)  # the scheduler's flow_shift
    assert r.latent_stats.to_dict() == theirs.latent_stats.to_dict() and r.own_units
    assert r.recorded() == {"objective": "flow", "shift": TimeShift(3.0).to_dict(),
                            "latent_stats": theirs.latent_stats.to_dict()}
    assert "model.init_from: diffusers WanTransformer3DModel" in r.foreign_line()
    assert "objective=flow (timestep shift 3)" in r.foreign_line()
    # a shift the config sets is the run's; the preset of Wan's size may be named
    assert recipe(f"model.init_from={pipeline}", "flow.shift=5").cfg.flow.time_shift() == TimeShift(5.0)
    assert recipe(f"model.init_from={pipeline}", "model.preset=Wan-Tiny").model_cfg == theirs.cfg
    # a dataset of another text encoder's width: the cross-attention's text embedder starts fresh
    assert recipe(f"model.init_from={pipeline}", data=info(text_dim=384)).model_cfg.text_dim == 384


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.preset=DiT-Demo"], "model.preset='DiT-Demo' is invalid: expected the checkpoint's hidden_size 64"),
    (["model.preset=DiT-Demo"], "also model.arch=dit (the checkpoint's: wan)"),
    (["model.arch=wan", "model.preset=Wan-1.3B"], "model.preset='Wan-1.3B' is invalid: expected the checkpoint's "
                                                  "hidden_size 64 (the preset's 1536)"),
])
def test_what_disagrees_with_the_wan_is_one_line_naming_it(pipeline, overrides, message):
    with pytest.raises(ConfigError) as info_:
        recipe(f"model.init_from={pipeline}", *overrides)
    assert message in str(info_.value) and "\n" not in str(info_.value)


def test_a_bare_wan_transformer_folder_is_refused_for_its_unknown_units(pipeline):
    with pytest.raises(ConfigError, match="a bare diffusers WanTransformer3DModel folder does not say them — give "
                                          "its WanPipeline folder"):
        recipe(f"model.init_from={pipeline / 'transformer'}")


def test_a_dataset_of_other_latents_is_refused(pipeline):
    with pytest.raises(ConfigError, match=r"latents of 4 channels, as diffusers WanTransformer3DModel .* was trained"):
        recipe(f"model.init_from={pipeline}", data=info(channels=16))


# ---------------------------------------------------------------- the chain


def test_the_shipped_wan_config_fine_tunes_a_pipeline_that_samples_and_goes_back_to_diffusers(
        pipeline, cli_in_process, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    proc = cli_in_process("prepare", "synthetic", "--out", data, "--num", 8, "--size", 32, "--frames", 5,
                          "--fit-samples", 8, "--codec", "vae", "--vae", pipeline / "vae", "--vae-class",
                          "AutoencoderKLWan", "--text-encoder", f"umt5:{pipeline}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = train_helpers.dit_train("--config", "wan-1.3b-finetune", f"model.init_from={pipeline}", *TINY,
                                   f"data.path={data}", f"train.run_dir={run}", "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "objective=flow (timestep shift 3)" in proc.stdout + proc.stderr
    assert f"init_from {pipeline}: 57 of 57 tensors" in proc.stdout + proc.stderr  # every weight, the text's too

    exported = load_export(run / "export")
    source = interop.read(pipeline)
    assert exported.sampling()["shift"] == TimeShift(3.0) and exported.objective == "flow"
    assert exported.stats.to_dict() == source.latent_stats.to_dict() and exported.solver == "unipc"
    # dit-sample samples the export as it was trained, with no flag: UniPC, shift 3, the Wan VAE and UMT5
    out = tmp_path / "finetuned.png"
    proc = cli_in_process("sample", "generate", "--checkpoint", run, "--prompt", "a red butterfly", "--steps", 3,
                          "--height", 32, "--width", 32, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = load_text_encoder(exported.info.text_encoder["name"]).encode(["a red butterfly"])
    direct = sample(exported.model, exported.codec, exported.stats, text_states=states, height=32, width=32,
                    steps=3, guidance=5.0, solver="unipc", objective="flow", shift=TimeShift(3.0))
    assert torch.equal(torch.from_numpy(iio.imread(out)), direct.pixels[0, 0])

    # back to diffusers: the run's network, its objective, shift and units recorded
    folder = tmp_path / "wan-diffusers"
    proc = cli_in_process("sample", "export", "--checkpoint", run, "--format", "diffusers", folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sidecar = json.loads((folder / interop.SIDECAR).read_text())
    assert sidecar["objective"] == "flow" and TimeShift.from_dict(sidecar["shift"]) == TimeShift(3.0)
    assert sidecar["latent_stats"] == source.latent_stats.to_dict()
    back = interop.read(folder)
    state = exported.model.state_dict()
    assert back.tensors.keys() == state.keys() and all(torch.equal(back.tensors[k], v) for k, v in state.items())
    with mock.patch.object(diffusers.WanTransformer3DModel, "_keep_in_fp32_modules", None):  # needs accelerate else
        theirs = diffusers.WanTransformer3DModel.from_pretrained(folder).eval()
    cfg, g = exported.model.cfg, torch.Generator().manual_seed(2)
    x, t = torch.randn(1, cfg.in_channels, 2, 4, 4, generator=g), torch.tensor([0.6])
    text = torch.randn(1, 5, cfg.text_dim, generator=g)
    with torch.no_grad():
        tokens = FlowPrecond(exported.model)(patchify(x, 2, 1), t, Inputs(grid_positions((2, 2, 2)), text=text))
        padded = torch.cat([text, torch.zeros(1, cfg.text_len - 5, cfg.text_dim)], dim=1)
        expected = theirs(x, timestep=1000 * t, encoder_hidden_states=padded).sample
    D = cfg.hidden_size  # the float32 work of a Wan output value, as tests/ditcore/models/test_wan.py counts it
    work = dit_forward_work(cfg, 8, cfg.text_len) + D + 2 * cfg.depth * (D - cfg.head_dim)
    assert_close_fp32(unpatchify(tokens, (2, 2, 2), 2, 1), expected, work=work)
