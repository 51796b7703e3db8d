"""`dit-sample export`: a trained or imported DiT handed to diffusers as a `DiTTransformer2DModel` folder, a Wan
(model.arch=wan) as a `WanTransformer3DModel` folder.

The conversion and its refusals are ditcore.interop's; here: which weights (an export, a run, or one of the field's
checkpoints), what may be overwritten, and what a user must know to load and sample the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import interop, runs
from ditcore.codecs import LatentStats
from ditcore.data.schema import INFO_FILE, parse_info
from ditcore.diffusion.flow import TimeShift
from ditcore.diffusion.vp import DiscreteVP
from ditcore.export import CONFIG, exported_config, load_network, shift_of, vp_of
from ditcore.interop import diffusers_dit, diffusers_wan
from ditcore.layout import SIGMA_DATA
from ditcore.models.dit import DiTConfig
from ditcore.models.wan import WanConfig


class ExportError(ValueError):
    """An export that cannot be written, with what to do."""


def out_problem(out: Path, checkpoint: Path, force: bool) -> str | None:
    """Why OUT cannot be written (checked before anything loads), or None."""
    if out.exists() and not out.is_dir():
        return f"OUT '{out}' is a file: give a folder to write the diffusers model to"
    if not out.parent.is_dir():
        return f"OUT '{out}': the folder '{out.parent}' does not exist — create it first or choose another path"
    if out.exists() and not force:
        return f"OUT '{out}' exists: pass --force to replace it, or give a new folder"
    if checkpoint.exists() and checkpoint.resolve().is_relative_to(out.resolve()):
        return f"OUT '{out}' is (or holds) the checkpoint being exported: give another folder"
    return None


@dataclass(frozen=True)
class Network:
    """What is exported: the architecture, the one-device weights, and what the network was trained with and in."""

    cfg: DiTConfig
    tensors: dict[str, torch.Tensor]
    vp: DiscreteVP | None  # a DDPM schedule (VP preconditioning), or None
    latent_stats: LatentStats | None  # None: not recorded
    objective: str = "edm"
    shift: TimeShift | None = None  # a flow network's


def refusal(cfg: DiTConfig, approximate: bool, ddpm: bool) -> str | None:
    """Why the diffusers class of cfg's architecture cannot hold it, or None (ddpm: a DDPM-trained network, the only
    kind --approximate takes)."""
    if isinstance(cfg, WanConfig):
        return diffusers_wan.refusal(cfg)
    return diffusers_dit.refusal(cfg, approximate, ddpm)


def network(checkpoint: Path, num_heads: int | None, approximate: bool) -> Network:
    """What `checkpoint` names; a model that diffusers cannot hold is refused from its config alone, before its
    weights load."""
    if interop.is_foreign(checkpoint):
        got = interop.read(checkpoint, num_heads)
        return Network(got.cfg, got.tensors, got.vp, got.latent_stats, got.objective, got.shift)
    if num_heads is not None:
        raise ExportError(f"--num-heads is for the field's DiT checkpoints ({interop.KINDS}); '{checkpoint}' is a "
                          "ditcore export or run, which records its heads — leave it out")
    path = runs.find_export(checkpoint)
    cfg = exported_config(path)  # which also checks that its CONFIG file reads
    why = refusal(cfg, approximate, ddpm=vp_of(json.loads((path / CONFIG).read_text())) is not None)
    if why:
        raise ExportError(why)
    cfg, state, meta = load_network(path)
    prediction, objective = meta.get("prediction", "edm"), meta.get("objective", "edm")
    # what a diffusers folder's reader follows: EDM's c_skip/c_out (its ditcore.json), or a flow network's velocity
    # (WanPipeline's schedulers); a network that outputs the clean latents would be read as either
    if prediction not in (("edm", "velocity") if objective == "flow" else ("edm",)):
        raise ExportError(f"cannot export to diffusers: prediction={prediction} (the network predicts the clean "
                          "latents): the folder records EDM's preconditioning (c_skip, c_out) or a flow network's "
                          "velocity only")
    info = parse_info(path / INFO_FILE, "export", "export the run again (dit-train writes RUN_DIR/export/)")
    return Network(cfg, state, vp_of(meta), LatentStats.from_dict(info.latent_stats), meta.get("objective", "edm"),
                   shift_of(meta))


def to_diffusers(checkpoint: str | Path, out: str | Path, *, approximate: bool = False, num_heads: int | None = None,
                 force: bool = False) -> list[str]:
    """Write `out` (complete or not at all: interop.export_diffusers); the lines that tell a user how to use it."""
    checkpoint, out = Path(checkpoint), Path(out)
    problem = out_problem(out, checkpoint, force)
    if problem:
        raise ExportError(problem)
    net = network(checkpoint, num_heads, approximate)
    interop.export_diffusers(out, net.cfg, net.tensors, net.vp, approximate, latent_stats=net.latent_stats,
                             objective=net.objective, shift=net.shift)
    c, wan = net.cfg, isinstance(net.cfg, WanConfig)
    name = diffusers_wan.CLASS_NAME if wan else diffusers_dit.CLASS_NAME
    if wan:
        what = (f"width {c.hidden_size}, depth {c.depth}, {c.num_heads} heads, patch {c.patch_size_t}x{c.patch_size}x"
                f"{c.patch_size}, {c.in_channels} channels, text {c.text_dim} wide")
    else:
        what = (f"width {c.hidden_size}, depth {c.depth}, {c.num_heads} heads, patch {c.patch_size}, {c.in_channels} "
                f"channels, {c.num_classes} classes, sample_size {c.max_grid[1] * c.patch_size}")
    lines = [f"wrote {out}: a diffusers {name} ({what}); it holds the network only, no VAE or scheduler "
             f"({interop.SIDECAR} records its preconditioning or objective and, when known, the latent units it was "
             "trained in)",
             f"load it with: from diffusers import {name}; {name}.from_pretrained({str(out)!r})"
             + (" (diffusers needs accelerate installed to load it)" if wan else "")]
    return lines + _how_to_sample(net, out, wan) + (
        ["approximate: diffusers computes the timestep sinusoid with frequencies 10000^(-k/(half-1)), the network "
         "was trained with 10000^(-k/half): close to its function, not equal"]
        if approximate and c.freq_shift == 0 else [])


def _how_to_sample(net: Network, out: Path, wan: bool) -> list[str]:
    """What a user must know to sample the folder in diffusers: its objective and preconditioning."""
    if net.objective == "flow":
        s = net.shift
        shift = (f"use_dynamic_shifting=True, base_shift={s.base_shift:g}, max_shift={s.max_shift:g}" if s.dynamic
                 else f"shift={s.shift:g}")
        line = (f"it is a flow-matching velocity network (timestep 1000·t, output ε − x₀; {out / interop.SIDECAR} "
                f"records its time shift): sample it with FlowMatchEulerDiscreteScheduler({shift})")
        if not s.dynamic:
            line += (f" or UniPCMultistepScheduler(prediction_type='flow_prediction', use_flow_sigmas=True, "
                     f"flow_shift={s.shift:g})")
        if wan:
            line += (f", as the transformer of a WanPipeline with the Wan VAE and UMT5 encoder it was trained with "
                     f"(max_sequence_length={net.cfg.text_len})")
        return [line]
    vp = net.vp
    if vp is not None:
        return _dit_pipeline(net, out)
    return [f"it is EDM-preconditioned, not a DDPM network ({out / interop.SIDECAR} says so): give it "
            "c_in·x with timestep = 1000·ln(σ)/4 and take D(x; σ) = c_skip·x + c_out·output, where "
            f"σ_data = {SIGMA_DATA}, c_in = 1/√(σ²+σ_data²), c_skip = σ_data²/(σ²+σ_data²), c_out = "
            "σ·σ_data/√(σ²+σ_data²) — diffusers' DDPM schedulers cannot sample it as it is"]


# DDIMScheduler's defaults for the DDIM settings a DiscreteVP records (diffusers' DDIMScheduler.__init__)
_DDIM_DEFAULTS = {"timestep_spacing": "leading", "steps_offset": 0, "set_alpha_to_one": True, "clip_sample": True,
                  "clip_sample_range": 1.0}


def _dit_pipeline(net: Network, out: Path) -> list[str]:
    """How DiTPipeline samples a DDPM network as ditcore does: its schedule and DDIM settings as DDIMScheduler's
    arguments (those that differ from its defaults), the latent units its VAE must decode, and its null class."""
    vp, stats, classes = net.vp, net.latent_stats, net.cfg.num_classes
    ddim = {k: v for k, v in vp.to_dict().items() if k in _DDIM_DEFAULTS and v != _DDIM_DEFAULTS[k]}
    args = ", ".join([f"num_train_timesteps={vp.timesteps}", f"beta_schedule={vp.beta_schedule!r}",
                      f"beta_start={vp.beta_start:g}", f"beta_end={vp.beta_end:g}",
                      *(f"{k}={v!r}" for k, v in ddim.items())])
    lines = [f"it is a DDPM ε-prediction network, as DiT ({vp.timesteps} {vp.beta_schedule} timesteps, β "
             f"{vp.beta_start:g}..{vp.beta_end:g}; {out / interop.SIDECAR} records them): sample it as DiT, e.g. "
             f"DiTPipeline with DDIMScheduler({args})"]
    # ditcore's latents are (z − mean)/std·σ_data of the VAE's z; DiTPipeline decodes latents / scaling_factor
    if stats is not None and not (stats.mean == 0).all():
        lines.append(f"its latents are the VAE's z per channel as (z − mean)/std·{SIGMA_DATA} ({interop.SIDECAR}'s "
                     "latent_stats): decode z = latents·std/σ_data + mean yourself, as dit-sample generate does "
                     "(DiTPipeline's vae.decode(latents / scaling_factor) has no mean to add)")
    elif stats is not None and len(set(stats.std.tolist())) == 1:
        lines.append(f"its latents are the VAE's z·{SIGMA_DATA / stats.std[0].item():.6g}: give DiTPipeline a VAE "
                     f"with scaling_factor={SIGMA_DATA / stats.std[0].item():.6g}")
    elif stats is not None:
        lines.append(f"its latents are the VAE's z per channel as z/std·{SIGMA_DATA} ({interop.SIDECAR}'s "
                     "latent_stats): decode z = latents·std/σ_data yourself, as dit-sample generate does "
                     "(DiTPipeline divides all channels by one scaling_factor)")
    if classes != 1000:  # DiTPipeline.__call__: class_null = 1000, ImageNet's
        lines.append(f"DiTPipeline's guidance takes class 1000 as the null class, this network's is {classes} "
                     f"(classes 0..{classes - 1}): call it with guidance_scale=1, or guide with class {classes} "
                     "as the unconditional")
    return lines
