"""The field's DiT checkpoints in ditcore, and ditcore's DiTs handed back to diffusers.

`read(path)` reads, without running any code:
- an original DiT checkpoint file (facebookresearch/DiT's state-dict naming: its published DiT-XL-2-256x256.pt, or
  a safetensors file of the same names; a training checkpoint of its train.py gives its EMA weights);
- a diffusers `DiTTransformer2DModel` folder (config.json + weights; a `Transformer2DModel` config of a DiT too, as
  diffusers remaps it), or a whole diffusers DiT pipeline folder (its transformer/, and its scheduler/ and vae/ when
  present: `schedule_from_diffusers` says which scheduler settings are honoured);
and returns the ditcore config inferred from the weights, the weights in ditcore's names and layouts, and the
discrete-time schedule the network was trained with (DiT's, unless the pipeline's scheduler says otherwise): such
networks are DDPM ε-predictors, sampled and fine-tuned under VP preconditioning (ditcore.diffusion.vp).

`export_diffusers` writes a DiTTransformer2DModel folder that diffusers loads with `from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import disk, durable, tensorfile
from ditcore.codecs import LatentStats
from ditcore.diffusion.vp import BETA_SCHEDULES, DiscreteVP
from ditcore.interop import diffusers_dit, original
from ditcore.interop.original import ConversionError
from ditcore.models.dit import DiTConfig

SCHEDULER_CONFIG = "scheduler_config.json"
SIDECAR = "ditcore.json"  # what an export adds beside diffusers' files: how the network is preconditioned
KINDS = ("an original DiT checkpoint file (its state-dict names, .pt/.pth/.safetensors), a diffusers "
         "DiTTransformer2DModel folder (config.json + diffusion_pytorch_model.safetensors) or a diffusers DiT "
         "pipeline folder (model_index.json, transformer/)")


@dataclass(frozen=True)
class Imported:
    """A foreign DiT in ditcore's terms."""

    path: Path  # what was read
    kind: str  # "DiT checkpoint" | "diffusers DiTTransformer2DModel"
    cfg: DiTConfig  # inferred from the weights (and diffusers' config.json)
    tensors: dict[str, torch.Tensor]  # ditcore's one-device names and layouts
    vp: DiscreteVP | None  # the DDPM schedule it was trained with; None: an EDM-preconditioned ditcore export
    vae: Path | None = None  # a diffusers pipeline's vae/ folder, if it has one
    latent_stats: LatentStats | None = None  # the latent units it was trained in, when a ditcore export recorded them
    objective: str = "edm"  # what it was trained with: flow for Wan (ditcore.choices.OBJECTIVES)
    shift: object = None  # a flow network's timestep shift (ditcore.diffusion.flow.TimeShift), None under EDM

    def summary(self) -> str:
        c = self.cfg
        what = (f"{self.kind} {self.path}: width {c.hidden_size}, depth {c.depth}, {c.num_heads} heads, patch "
                f"{c.patch_size}, {c.in_channels} channels, {c.num_classes} classes, grid {c.max_grid[1]}x"
                f"{c.max_grid[2]}" + (", learned Σ" if c.learn_sigma else "") +
                (", each block's own embedders" if c.block_embedders else ""))
        if self.objective == "flow":
            return what + f", flow matching (timestep shift {self.shift.shift:g})"
        if self.vp is None:
            return what + ", EDM preconditioning"
        return what + f", DDPM ({self.vp.timesteps} {self.vp.beta_schedule} timesteps, VP preconditioning)"


def is_foreign(path: str | Path) -> bool:
    """Whether `path` looks like one of the formats `read` takes (by its files' names, nothing is loaded)."""
    path = Path(path)
    if path.is_file():
        return path.suffix in (".pt", ".pth", ".bin", ".safetensors")
    return (path / diffusers_dit.CONFIG_FILE).is_file() or (path / "model_index.json").is_file()


def read(path: str | Path, num_heads: int | None = None) -> Imported:
    """A foreign DiT (see the module docstring); ConversionError in one line when `path` is none of them."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"'{path}' does not exist: expected {KINDS}")
    if path.is_file():
        state = _load_file(path)
        if not original.is_original(state):
            raise ConversionError(f"'{path}' holds no DiT weights (no {original.SIGNATURE}): expected {KINDS}")
        cfg, tensors = original.to_ditcore(state, num_heads)
        return Imported(path, "DiT checkpoint", cfg, _finite(path, tensors), DiscreteVP())
    folder, vae, vp = path, None, DiscreteVP()
    if (path / "model_index.json").is_file():  # a pipeline: its transformer, scheduler and VAE
        folder = path / "transformer"
        vae = path / "vae" if (path / "vae" / diffusers_dit.CONFIG_FILE).is_file() else None
        if (path / "scheduler" / SCHEDULER_CONFIG).is_file():
            vp = schedule_from_diffusers(_json(path / "scheduler" / SCHEDULER_CONFIG))
    config = _json(folder / diffusers_dit.CONFIG_FILE)
    diffusers_dit.check_class(config, str(folder / diffusers_dit.CONFIG_FILE))
    stats = None
    if (folder / SIDECAR).is_file():  # exported by ditcore: its preconditioning and latent units travel with it
        sidecar = _json(folder / SIDECAR)
        try:
            vp = DiscreteVP(**sidecar["vp"]) if sidecar.get("precond") == "vp" else None
            stats = LatentStats.from_dict(sidecar["latent_stats"]) if sidecar.get("latent_stats") else None
        except (TypeError, ValueError, KeyError) as e:
            raise ConversionError(f"'{folder / SIDECAR}' is damaged ({e}): export the model again") from None
    cfg, tensors = diffusers_dit.to_ditcore(config, _load_weights(folder))
    return Imported(path, f"diffusers {diffusers_dit.CLASS_NAME}", cfg, _finite(path, tensors), vp, vae, stats)


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
                     approximate: bool = False, latent_stats: LatentStats | None = None) -> Path:
    """Write a DiTTransformer2DModel folder (config.json, diffusion_pytorch_model.safetensors, and ditcore.json: its
    preconditioning and, given, the latent statistics it was trained in) to `out`, complete or not at all;
    ConversionError naming what diffusers cannot hold."""
    config, weights = diffusers_dit.to_diffusers(cfg, tensors, approximate)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    what = f"could not write the diffusers export {out}"
    disk.check_space(what, out.parent, sum(t.numel() * t.element_size() for t in weights.values()))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensorfile.save(weights, tmp / diffusers_dit.WEIGHTS_FILE)
        durable.write_text(tmp / diffusers_dit.CONFIG_FILE, json.dumps(config, indent=1))
        sidecar = {"precond": "edm", "timestep": "1000 * ln(sigma) / 4", "sigma_data": 0.5} if vp is None else \
            {"precond": "vp", "vp": vp.to_dict(), "prediction_type": "epsilon"}
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
