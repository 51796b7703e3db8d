"""The field's DiT checkpoints in ditcore, and ditcore's DiTs handed back to diffusers.

`read(path)` reads, without running any code:
- an original DiT checkpoint file (facebookresearch/DiT's state-dict naming: its published DiT-XL-2-256x256.pt, or
  a safetensors file of the same names; a training checkpoint of its train.py gives its EMA weights);
- a diffusers `DiTTransformer2DModel` folder (config.json + weights; a `Transformer2DModel` config of a DiT too, as
  diffusers remaps it), or a whole diffusers DiT pipeline folder (its transformer/, and its scheduler/ and vae/ when
  present: `schedule_from_diffusers` says which scheduler settings are honoured);
- a diffusers `WanTransformer3DModel` folder (Wan 2.1 text-to-video), or a whole `WanPipeline` folder, as
  Wan-AI/Wan2.1-T2V-1.3B-Diffusers is laid out: transformer/, vae/ (AutoencoderKLWan), text_encoder/ and tokenizer/
  (UMT5), scheduler/ (diffusers_wan.sampling_from_scheduler says which are followed);
and returns the ditcore config inferred from the weights, the weights in ditcore's names and layouts, and how the
network was trained. DiT's networks are DDPM ε-predictors, sampled and fine-tuned under VP preconditioning
(ditcore.diffusion.vp) on the discrete-time schedule they were trained with (DiT's, unless the pipeline's scheduler
says otherwise). Wan's are flow-matching velocity networks (ditcore.diffusion.flow) with the time shift of their
scheduler, working in the per-channel latent units of their VAE, their text read by UMT5.

`export_diffusers` writes a DiTTransformer2DModel or WanTransformer3DModel folder that diffusers loads with
`from_pretrained`, and beside it ditcore.json: how the network is preconditioned or what it was trained with, and the
latent units it works in, which `read` reads back.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import disk, durable, tensorfile
from ditcore.choices import OBJECTIVES
from ditcore.codecs import LatentStats
from ditcore.diffusion.flow import TimeShift
from ditcore.diffusion.vp import BETA_SCHEDULES, DiscreteVP
from ditcore.interop import diffusers_dit, diffusers_wan, original
from ditcore.interop.original import ConversionError
from ditcore.models.dit import DiTConfig
from ditcore.models.wan import WanConfig

SCHEDULER_CONFIG = "scheduler_config.json"
PIPELINE_INDEX = "model_index.json"
SIDECAR = "ditcore.json"  # what an export adds beside diffusers' files: how the network is preconditioned
KINDS = ("an original DiT checkpoint file (its state-dict names, .pt/.pth/.safetensors), a diffusers "
         "DiTTransformer2DModel or WanTransformer3DModel folder (config.json + diffusion_pytorch_model.safetensors) or "
         "a diffusers DiT or WanPipeline folder (model_index.json, transformer/)")


@dataclass(frozen=True)
class Imported:
    """A foreign DiT (or Wan) in ditcore's terms."""

    path: Path  # what was read
    kind: str  # "DiT checkpoint" | "diffusers DiTTransformer2DModel" | "diffusers WanTransformer3DModel"
    cfg: DiTConfig  # inferred from the weights (and diffusers' config.json): a WanConfig for Wan
    tensors: dict[str, torch.Tensor]  # ditcore's one-device names and layouts
    vp: DiscreteVP | None  # the DDPM schedule it was trained with; None: an EDM-preconditioned export, or flow
    vae: Path | None = None  # a diffusers pipeline's vae/ folder, if it has one
    latent_stats: LatentStats | None = None  # the latent units it works in, where known: a Wan pipeline's VAE's, or
    #                                          what a ditcore export recorded
    objective: str = "edm"  # what it was trained with: flow for Wan (ditcore.choices.OBJECTIVES)
    shift: TimeShift | None = None  # a flow network's timestep shift, None under EDM
    solver: str | None = None  # the sampler its pipeline's scheduler runs (ditcore.choices.SAMPLE_SOLVERS), if known
    text_encoder: str | None = None  # the text encoder of its pipeline, by ditcore's name (umt5:<pipeline folder>)
    negative_prompt: str | None = None  # the caption its pipeline encodes as the unconditional text when no negative
    #                                     prompt is given (WanPipeline: ""); None: no text at all

    def summary(self) -> str:
        c = self.cfg
        if isinstance(c, WanConfig):
            what = (f"{self.kind} {self.path}: width {c.hidden_size}, depth {c.depth}, {c.num_heads} heads, patch "
                    f"{c.patch_size_t}x{c.patch_size}x{c.patch_size}, {c.in_channels} channels, FFN {c.ffn}, text "
                    f"{c.text_dim} wide (padded to {c.text_len} tokens)")
        else:
            what = (f"{self.kind} {self.path}: width {c.hidden_size}, depth {c.depth}, {c.num_heads} heads, patch "
                    f"{c.patch_size}, {c.in_channels} channels, {c.num_classes} classes, grid {c.max_grid[1]}x"
                    f"{c.max_grid[2]}" + (", learned Σ" if c.learn_sigma else "") +
                    (", each block's own embedders" if c.block_embedders else ""))
        if self.objective == "flow":
            shift = "by token count" if self.shift.dynamic else f"{self.shift.shift:g}"
            solver = f", {self.solver} solver" if self.solver else ""
            return what + f", flow matching (timestep shift {shift}{solver})"
        if self.vp is None:
            return what + ", EDM preconditioning"
        return what + f", DDPM ({self.vp.timesteps} {self.vp.beta_schedule} timesteps, VP preconditioning)"


def is_foreign(path: str | Path) -> bool:
    """Whether `path` looks like one of the formats `read` takes (by its files' names, nothing is loaded)."""
    path = Path(path)
    if path.is_file():
        return path.suffix in (".pt", ".pth", ".bin", ".safetensors")
    return (path / diffusers_dit.CONFIG_FILE).is_file() or (path / PIPELINE_INDEX).is_file()


def read(path: str | Path, num_heads: int | None = None) -> Imported:
    """A foreign DiT or Wan (see the module docstring); ConversionError in one line when `path` is none of them."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"'{path}' does not exist: expected {KINDS}")
    if path.is_file():
        state = _load_file(path)
        if not original.is_original(state):
            raise ConversionError(f"'{path}' holds no DiT weights (no {original.SIGNATURE}): expected {KINDS}")
        cfg, tensors = original.to_ditcore(state, num_heads)
        return Imported(path, "DiT checkpoint", cfg, _finite(path, tensors), DiscreteVP())
    pipeline = (path / PIPELINE_INDEX).is_file()
    folder = path / "transformer" if pipeline else path  # a pipeline: its transformer, scheduler and VAE
    config = _json(folder / diffusers_dit.CONFIG_FILE)
    if config.get("_class_name") == diffusers_wan.CLASS_NAME:
        return _read_wan(path, folder, config, pipeline)
    vae, vp = None, DiscreteVP()
    if pipeline:
        vae = path / "vae" if (path / "vae" / diffusers_dit.CONFIG_FILE).is_file() else None
        if (path / "scheduler" / SCHEDULER_CONFIG).is_file():
            vp = schedule_from_diffusers(_json(path / "scheduler" / SCHEDULER_CONFIG))
    diffusers_dit.check_class(config, str(folder / diffusers_dit.CONFIG_FILE))
    trained = _sidecar(folder) or {"vp": vp}  # exported by ditcore: its preconditioning and units travel with it
    trained.pop("text_len", None)  # a DiT's text is no padded length
    cfg, tensors = diffusers_dit.to_ditcore(config, _load_weights(folder))
    return Imported(path, f"diffusers {diffusers_dit.CLASS_NAME}", cfg, _finite(path, tensors), vae=vae, **trained)


def _read_wan(path: Path, folder: Path, config: dict, pipeline: bool) -> Imported:
    """A WanTransformer3DModel folder, or a WanPipeline's (`path`) around its transformer/ (`folder`): the network, and
    where the pipeline says them, its VAE and latent units, its text encoder and its scheduler's shift and solver.
    Without a scheduler: Wan's own defaults (diffusers_wan.DEFAULT_SHIFT, DEFAULT_SOLVER)."""
    where = str(folder / diffusers_dit.CONFIG_FILE)
    try:
        cfg = diffusers_wan.wan_config_from_diffusers(config)
    except ConversionError as e:
        raise ConversionError(f"'{where}': {e}") from None
    parts = {"shift": TimeShift(diffusers_wan.DEFAULT_SHIFT), "solver": diffusers_wan.DEFAULT_SOLVER}
    if pipeline:
        parts |= _wan_pipeline(path, cfg)
    trained = _sidecar(folder) or {}  # a ditcore export: what it was trained with and in, and its text length
    cfg = cfg.replace(text_len=trained.pop("text_len", cfg.text_len))
    tensors = diffusers_wan.state_from_diffusers(_load_weights(folder), cfg)
    parts = parts | {"vp": None, "objective": "flow", "negative_prompt": ""} | trained  # WanPipeline's default: ""
    if parts["objective"] != "flow":  # a ditcore Wan trained under EDM: no flow scheduler's loop samples it
        parts["solver"] = None
    return Imported(path, f"diffusers {diffusers_wan.CLASS_NAME}", cfg, _finite(path, tensors), **parts)


def _wan_pipeline(path: Path, cfg: WanConfig) -> dict:
    """What a WanPipeline folder says around its transformer: Imported's vae, latent_stats, text_encoder, shift and
    solver (those it has); ConversionError for what ditcore does not sample as WanPipeline does."""
    why = diffusers_wan.pipeline_refusal(_json(path / PIPELINE_INDEX))
    if why:
        raise ConversionError(f"'{path}': {why}")
    parts = {}
    if (path / "vae" / diffusers_dit.CONFIG_FILE).is_file():
        try:
            parts["latent_stats"] = diffusers_wan.latent_units(_json(path / "vae" / diffusers_dit.CONFIG_FILE))
        except ConversionError as e:
            raise ConversionError(f"'{path / 'vae'}': {e}") from None
        if len(parts["latent_stats"].mean) != cfg.in_channels:
            raise ConversionError(f"'{path / 'vae'}' has {len(parts['latent_stats'].mean)} latent channels, its "
                                  f"transformer takes {cfg.in_channels}: the pipeline's parts do not fit together")
        parts["vae"] = path / "vae"
    if (path / "text_encoder" / diffusers_dit.CONFIG_FILE).is_file() and (path / "tokenizer").is_dir():
        why = diffusers_wan.text_encoder_refusal(_json(path / "text_encoder" / diffusers_dit.CONFIG_FILE),
                                                 cfg.text_dim)
        if why:
            raise ConversionError(f"'{path}': {why}")
        parts["text_encoder"] = f"{diffusers_wan.TEXT_ENCODER}:{path.resolve()}"
    if (path / "scheduler" / SCHEDULER_CONFIG).is_file():
        try:
            parts["shift"], parts["solver"] = diffusers_wan.sampling_from_scheduler(
                _json(path / "scheduler" / SCHEDULER_CONFIG))
        except ConversionError as e:
            raise ConversionError(f"'{path / 'scheduler'}': {e}") from None
    return parts


# The scheduler classes whose configs ditcore reads, and how each one's DDIM defaults differ: a DDPMScheduler config is
# sampled as DDIMScheduler.from_config(it) samples (its absent set_alpha_to_one: DDIM's default)
SCHEDULERS = ("DDIMScheduler", "DDPMScheduler")
_REFUSED = {  # fields that change the timesteps or ᾱ in a way ditcore does not follow: (the value it takes, why)
    "thresholding": (False, "dynamic thresholding of x̂₀ (per-sample quantiles) has no ditcore counterpart"),
    "rescale_betas_zero_snr": (False, "zero terminal SNR makes σ_T infinite, which VP preconditioning cannot take"),
    "trained_betas": (None, "an explicit β table: ditcore's schedule is one of "
                            f"{', '.join(BETA_SCHEDULES)} from beta_start to beta_end"),
}


def schedule_from_diffusers(config: dict) -> DiscreteVP:
    """The DiscreteVP of a diffusers DDIMScheduler or DDPMScheduler config: its schedule, and DDIM's steps through
    it (spacing, offset, final ᾱ, clipping; a field absent takes diffusers' default). ConversionError, naming the
    field, for anything that changes the timesteps or ᾱ in a way ditcore does not follow."""
    name = config.get("_class_name", "DDIMScheduler")
    if name not in SCHEDULERS:
        raise ConversionError(f"the scheduler is a {name!r} (_class_name): ditcore reads {' and '.join(SCHEDULERS)} "
                              "configs, whose DDIM loop it reproduces — save the pipeline with "
                              "DDIMScheduler.from_config(pipe.scheduler.config), or drop its scheduler/ for DiT's")
    if config.get("prediction_type", "epsilon") != "epsilon":
        raise ConversionError(f"the scheduler says prediction_type={config['prediction_type']!r}: ditcore's VP "
                              "preconditioning takes ε-prediction networks")
    for key, (fine, why) in _REFUSED.items():
        if config.get(key, fine) != fine:
            raise ConversionError(f"the scheduler says {key}={config[key]!r}: {why}")
    if config.get("beta_schedule", "linear") not in BETA_SCHEDULES:
        raise ConversionError(f"the scheduler's beta_schedule={config['beta_schedule']!r} is not supported: expected "
                              f"one of {', '.join(BETA_SCHEDULES)}")
    try:
        return DiscreteVP(timesteps=int(config.get("num_train_timesteps", 1000)),
                          beta_start=float(config.get("beta_start", 1e-4)),
                          beta_end=float(config.get("beta_end", 0.02)),
                          beta_schedule=config.get("beta_schedule", "linear"),
                          timestep_spacing=config.get("timestep_spacing", "leading"),
                          steps_offset=config.get("steps_offset", 0),
                          set_alpha_to_one=bool(config.get("set_alpha_to_one", True)),
                          clip_sample=bool(config.get("clip_sample", True)),  # both classes' default
                          clip_sample_range=float(config.get("clip_sample_range", 1.0)))
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the scheduler config does not give a schedule: {e}") from None


def export_diffusers(out: str | Path, cfg: DiTConfig, tensors: dict[str, torch.Tensor], vp: DiscreteVP | None,
                     approximate: bool = False, latent_stats: LatentStats | None = None, objective: str = "edm",
                     shift: TimeShift | None = None) -> Path:
    """Write a diffusers model folder to `out`, complete or not at all: a DiTTransformer2DModel, or for ditcore's Wan
    (model.arch=wan) a WanTransformer3DModel — config.json, diffusion_pytorch_model.safetensors, and ditcore.json: its
    preconditioning (or objective and time shift) and, given, the latent statistics it was trained in; for Wan the
    text length it pads captions to (WanPipeline's max_sequence_length). ConversionError naming what diffusers cannot
    hold."""
    if isinstance(cfg, WanConfig):
        config, weights = diffusers_wan.state_to_diffusers(tensors, cfg)
    else:
        config, weights = diffusers_dit.to_diffusers(cfg, tensors, approximate, ddpm=vp is not None)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    what = f"could not write the diffusers export {out}"
    disk.check_space(what, out.parent, sum(t.numel() * t.element_size() for t in weights.values()))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensorfile.save(weights, tmp / diffusers_dit.WEIGHTS_FILE)
        durable.write_text(tmp / diffusers_dit.CONFIG_FILE, json.dumps(config, indent=1))
        if objective == "flow":  # a velocity network given the timestep 1000·t (ditcore.diffusion.flow)
            sidecar = {"objective": "flow", "shift": shift.to_dict(), "prediction_type": "flow_prediction",
                       "timestep": "1000 * t"}
        elif vp is None:
            sidecar = {"precond": "edm", "timestep": "1000 * ln(sigma) / 4", "sigma_data": 0.5}
        else:
            sidecar = {"precond": "vp", "vp": vp.to_dict(), "prediction_type": "epsilon"}
        if isinstance(cfg, WanConfig):
            sidecar["max_sequence_length"] = cfg.text_len
        if latent_stats is not None:  # ditcore's latents are (z − mean)/std·σ_data of the VAE's z
            sidecar["latent_stats"] = latent_stats.to_dict()
        durable.write_text(tmp / SIDECAR, json.dumps(sidecar, indent=1))
        durable.fsync_file(tmp / diffusers_dit.WEIGHTS_FILE)
        durable.publish_dir(tmp, out)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk.is_disk_full(e):
            raise disk.disk_full(what, tmp) from None
        raise
    return out


def _sidecar(folder: Path) -> dict | None:
    """What a ditcore export recorded beside diffusers' files (export_diffusers), as Imported's vp, latent_stats,
    objective and shift (and "text_len" where it records one); None for a folder ditcore did not write."""
    if not (folder / SIDECAR).is_file():
        return None
    sidecar = _json(folder / SIDECAR)
    try:
        objective = sidecar.get("objective", "edm")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective {objective!r} is none of {', '.join(OBJECTIVES)}")
        trained = {"vp": DiscreteVP(**sidecar["vp"]) if sidecar.get("precond") == "vp" else None,
                   "latent_stats": LatentStats.from_dict(sidecar["latent_stats"]) if sidecar.get("latent_stats")
                   else None,
                   "objective": objective,
                   "shift": TimeShift.from_dict(sidecar["shift"]) if objective == "flow" else None}
        if "max_sequence_length" in sidecar:
            trained["text_len"] = int(sidecar["max_sequence_length"])
    except (TypeError, ValueError, KeyError) as e:
        raise ConversionError(f"'{folder / SIDECAR}' is damaged ({e}): export the model again") from None
    return trained


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a safetensors file, or a torch file loaded with weights_only (no pickled code runs)."""
    if path.suffix == ".safetensors":
        return tensorfile.load(path, "download or convert the checkpoint again")
    try:  # DiT's train.py keeps its argparse args beside the weights: plain data, allowed like tensors
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an UnpicklingError names the Python object that weights_only refused
        raise ConversionError(f"'{path}' cannot be read as plain tensors ({str(e).splitlines()[0][:200]}): ditcore "
                              "loads no pickled Python objects — save its state dict alone (or as safetensors) on a "
                              "machine you trust, and pass that file") from None
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):  # DiT's train.py: model, ema, opt, args
        state = state["ema"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"'{path}' is not a state dict (name → tensor): expected {KINDS}")
    return state


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A diffusers folder's weights: its safetensors file, the shards its index names (save_pretrained splits a large
    model), or its pickled .bin read as plain tensors (diffusers' first saves, the hub's DiT-XL-2-256 among them)."""
    weights = folder / diffusers_dit.WEIGHTS_FILE
    if weights.is_file():
        return tensorfile.load(weights, "download or save the model again")
    index = folder / (diffusers_dit.WEIGHTS_FILE + ".index.json")
    if index.is_file():
        return _load_shards(folder, index)
    legacy = folder / "diffusion_pytorch_model.bin"
    if legacy.is_file():
        return _load_file(legacy)
    raise ConversionError(f"'{folder}' has a {diffusers_dit.CONFIG_FILE} but no {diffusers_dit.WEIGHTS_FILE}: "
                          "save the model again (save_pretrained) or download its weights")


def _load_shards(folder: Path, index: Path) -> dict[str, torch.Tensor]:
    shards = _json(index).get("weight_map")
    if not isinstance(shards, dict) or not all(isinstance(v, str) for v in shards.values()):
        raise ConversionError(f"'{index}' has no weight_map (tensor name → shard file): download or save the model "
                              "again")
    state = {}
    for name in sorted(set(shards.values())):
        shard = folder / name
        if Path(name).name != name or not shard.is_file():  # a plain file beside the index, never a path elsewhere
            raise ConversionError(f"'{index}' names the shard {name!r}, which is not a file in {folder}: download "
                                  "the model's every shard")
        state |= tensorfile.load(shard, "download or save the model again")
    if missing := shards.keys() - state.keys():
        raise ConversionError(f"'{index}' maps {len(missing)} tensors (e.g. {sorted(missing)[0]}) to shards that do "
                              "not hold them: download or save the model again")
    return state


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"'{path}' cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"'{path}' is not a JSON object")
    return data


def _finite(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bad = tensorfile.non_finite(tensors)
    if bad:
        raise ConversionError(f"'{path}' holds NaN/Inf in {len(bad)} tensors (e.g. {bad[0]}): a diverged or damaged "
                              "checkpoint")
    return tensors


__all__ = ["ConversionError", "Imported", "export_diffusers", "is_foreign", "read", "schedule_from_diffusers"]
