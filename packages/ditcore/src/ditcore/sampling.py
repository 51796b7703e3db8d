"""Prompts → latents → pixels: the sampling that training validation and dit-sample share.

Classifier-free guidance runs as one batched forward over [conditional rows; unconditional rows]. The
unconditional text is the negative prompt, or no text at all (the same "null text" the model was trained
with under CFG dropout); for class-conditional models it is the null class. Guidance is linear in the network's
output, so it guides a flow network's velocities as it guides EDM's denoised estimates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ditcore.choices import FLOW_PREDICTIONS, FLOW_SOLVERS, OBJECTIVES, SOLVERS
from ditcore.codecs import Codec, LatentStats
from ditcore.diffusion import EDMPrecond, ddim_sampler, edm_sampler, guided
from ditcore.diffusion.flow import FlowPrecond, TimeShift, flow_sampler, scheduler_sampler, unipc_scheduler
from ditcore.diffusion.vp import DiscreteVP
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, patchify, unpatchify
from ditcore.models.dit import DiT, DiTConfig
from ditcore.models.registry import inputs_of

SCHEDULES = ("karras", "ddim")
SIGMA_MIN, SIGMA_MAX = 0.002, 80.0  # EDM's sampling range; a DDPM network's own range narrows it


@dataclass
class SampleResult:
    pixels: torch.Tensor  # (B, F, H, W, 3) uint8
    latents: torch.Tensor  # (B, C, T', H', W') normalised latents
    nfe: int  # denoiser evaluations (each one batched forward)


def token_grid(model: DiT | DiTConfig, codec: Codec, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The (T, H, W) token grid for pixels of this size (a model or its config: training checks its validation
    sizes before the model exists); a ValueError says what sizes work."""
    cfg = model if isinstance(model, DiTConfig) else model.cfg
    step = codec.spatial_factor * cfg.patch_size
    if height % step or width % step:
        raise ValueError(f"{height}x{width} pixels cannot be sampled: use heights and widths that are multiples "
                         f"of {step} (codec factor {codec.spatial_factor} x patch {cfg.patch_size})")
    T, H, W = codec.latent_size(frames, height, width)
    if T % cfg.patch_size_t:
        raise ValueError(f"{frames} frames give {T} latent frames, which the temporal patch {cfg.patch_size_t} "
                         "does not divide: choose another frame count")
    grid = (T // cfg.patch_size_t, H // cfg.patch_size, W // cfg.patch_size)
    for axis, (n, limit) in enumerate(zip(grid, cfg.max_grid, strict=True)):
        if n > limit:
            what = ("frames", "height", "width")[axis]
            raise ValueError(f"{what} too large: {n} tokens along it, the model supports up to {limit}")
    return grid


@contextlib.contextmanager
def step_bar(total: int, desc: str = "sampling", disable: bool = False,
             leave: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A progress bar over `total` sampler steps, as a callback for sample() (one bar may span several calls).

    On stderr and drawn whether or not it is a terminal, as dit-train's and dit-prepare's bars are; closed however
    the block ends, so an error message starts on its own line."""
    with tqdm(total=total, desc=desc, unit="step", disable=disable, leave=leave, dynamic_ncols=True) as bar:
        yield lambda i, n: bar.update()


def _text_rows(states: list[torch.Tensor], dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpadded per-row text states → (B, L, D) padded and (B, L) text_seg (0 real, −1 padding)."""
    L = max((s.shape[0] for s in states), default=0)
    text = torch.zeros(len(states), L, dim, device=device)
    seg = torch.full((len(states), L), -1, dtype=torch.long, device=device)
    for i, s in enumerate(states):
        text[i, :s.shape[0]] = s
        seg[i, :s.shape[0]] = 0
    return text, seg


def _inputs(model: DiT, B: int, pos: torch.Tensor, grid, use_cfg: bool, text_states, negative_states,
            values: dict) -> Inputs:
    """The inputs of B rows of one sample each, then (with CFG) of B unconditional ones: their text the negative
    prompts' or none, their conditions with a null value (the class) that value (Inputs.for_sampling). The type is
    the config's architecture's (registry.inputs_of): the model may be a wrapper (a pipeline stage, an EMA copy)."""
    cfg, device = model.cfg, pos.device
    text = text_seg = None
    if cfg.text_dim:
        states = [s.to(device) for s in (text_states or [torch.zeros(0, cfg.text_dim)] * B)]
        if use_cfg:
            states += [s.to(device) for s in negative_states] if negative_states else \
                [torch.zeros(0, cfg.text_dim, device=device)] * B
        text, text_seg = _text_rows(states, cfg.text_dim, device)
    return inputs_of(cfg).for_sampling(cfg, B, pos, grid, text, text_seg, values, unconditional=B if use_cfg else 0)


def _check_objective(objective: str, solver: str, schedule: str, vp: DiscreteVP | None, prediction: str) -> None:
    """The combinations a flow network cannot take (EDM's are checked by _check_schedule and the samplers)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is unknown: expected one of {', '.join(OBJECTIVES)}")
    if objective == "edm":
        if solver not in SOLVERS:
            raise ValueError(f"solver={solver!r} is invalid for an EDM network: expected one of {', '.join(SOLVERS)} "
                             "(unipc samples flow networks)")
        return
    if solver not in FLOW_SOLVERS:
        raise ValueError(f"solver={solver!r} is invalid for a flow network: expected one of {', '.join(FLOW_SOLVERS)}")
    if schedule != "karras":
        raise ValueError(f"schedule {schedule} steps through a DDPM network's timesteps: a flow network steps through "
                         "its own levels of t (diffusion.flow.flow_timesteps, set by the shift): leave schedule out")
    if vp is not None:
        raise ValueError("a DDPM schedule (vp) was given for a flow network: flow matching has no DDPM timesteps, and "
                         "its network is not VP-preconditioned — leave vp out")
    if prediction not in ("edm", *FLOW_PREDICTIONS):  # edm: the default, a velocity network
        raise ValueError(f"prediction={prediction!r} with objective flow: a flow network predicts the velocity "
                         f"ε − x₀ or the data x₀ ({', '.join(FLOW_PREDICTIONS)})")


def _flow_tokens(velocity, cfg: DiTConfig, B: int, grid: tuple[int, int, int], *, steps: int, solver: str, seed: int,
                 shift: TimeShift, callback, device) -> torch.Tensor:
    """A flow network's samples (B, N, patch_dim) from noise drawn in the latents' layout (B, C, T, H, W) by a CPU
    generator seeded with `seed`, then cut into tokens: the noise diffusers' WanPipeline draws for that seed, so the
    two sample the same latents. A dynamic shift is taken at the sample's token count N."""
    pt, p = cfg.patch_size_t, cfg.patch_size
    shape = (B, cfg.in_channels, grid[0] * pt, grid[1] * p, grid[2] * p)
    latents = torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(seed))
    noise = patchify(latents, p, pt).to(device)
    N = noise.shape[1]
    if solver == "unipc":
        return scheduler_sampler(velocity, noise, unipc_scheduler(shift), steps, callback=callback,
                                 mu=shift.mu(N) if shift.dynamic else None)
    return flow_sampler(velocity, noise, steps=steps, shift=shift, solver=solver, seq_len=N, callback=callback)


def _check_schedule(schedule: str, vp: DiscreteVP | None, steps: int, solver: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown: expected one of {', '.join(SCHEDULES)}")
    if schedule == "ddim" and vp is None:
        raise ValueError("schedule ddim steps through a DDPM network's timesteps: this model is EDM-preconditioned "
                         "(no timesteps) — use schedule karras")
    if schedule == "ddim" and (why := vp.ddim_refusal(steps, solver)):
        raise ValueError(why)


@torch.no_grad()
def sample(
    model: DiT,
    codec: Codec,
    stats: LatentStats,
    *,
    text_states: list[torch.Tensor] | None = None,
    negative_states: list[torch.Tensor] | None = None,
    class_labels: list[int] | None = None,
    num: int | None = None,
    frames: int = 1,
    height: int = 64,
    width: int = 64,
    steps: int = 18,
    guidance: float = 4.0,
    solver: str = "heun",
    seed: int = 0,
    fps: float = 8.0,
    prediction: str = "edm",
    vp: DiscreteVP | None = None,
    schedule: str = "karras",
    callback: Callable[[int, int], None] | None = None,
    conditions: dict | None = None,
    objective: str = "edm",
    shift: TimeShift | None = None,
) -> SampleResult:
    """Sample B = len(text_states) (or len(class_labels), or num) items with the EDM sampler, or a flow network's.

    prediction: what the network was trained to output (ditcore.diffusion.edm; an export records it).
    vp: a DDPM network's schedule (VP preconditioning, ditcore.diffusion.vp), None for EDM's.
    schedule: karras (EDM's noise levels, Eq. 5) or ddim (a DDPM network's: DDIM's timesteps, as vp says; with solver
    euler DDIM itself, ditcore.diffusion.sampler.ddim_sampler).
    conditions: values of the architecture's other per-sample conditions (ditcore.inputs), by field name: one for
    every sample or a list of one each; one not given has its default.
    objective: edm, or flow (a velocity network, ditcore.diffusion.flow: FlowPrecond), sampled with solver euler or
    heun (flow_sampler on flow_timesteps) or unipc (diffusers' UniPCMultistepScheduler with flow sigmas, Wan's
    sampler); its start noise is drawn in the latents' layout, as WanPipeline draws it (`_flow_tokens`).
    shift: a flow network's time shift (None: no shift); a dynamic one is taken at the sample's token count. schedule,
    vp and prediction are EDM's."""
    cfg = model.cfg
    B = len(text_states) if text_states is not None else len(class_labels) if class_labels is not None else num
    if not B:
        raise ValueError("nothing to sample: pass text_states, class_labels or num")
    device = next(model.parameters()).device
    grid = token_grid(model, codec, frames, height, width)
    pos = grid_positions(grid, device=device)
    use_cfg = guidance != 1.0

    values = {"class_labels": class_labels, "fps": float(fps)} | (conditions or {})
    inputs = _inputs(model, B, pos, grid, use_cfg, text_states, negative_states, values)
    _check_objective(objective, solver, schedule, vp, prediction)
    nfe = 0

    def counted(precond: torch.nn.Module):
        """The network's output as the samplers call it (x, 0-dim σ or t), each call counted."""

        def evaluate(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
            nonlocal nfe
            nfe += 1
            return precond(x, level.expand(x.shape[0], 1), inputs)

        return evaluate

    if objective == "flow":
        velocity = counted(FlowPrecond(model, "velocity" if prediction == "edm" else prediction).eval())
        tokens = _flow_tokens(guided(velocity, guidance) if use_cfg else velocity, cfg, B, grid, steps=steps,
                              solver=solver, seed=seed, shift=shift or TimeShift(), callback=callback, device=device)
        return _decoded(tokens, grid, cfg, codec, stats, nfe)
    _check_schedule(schedule, vp, steps, solver)
    precond = EDMPrecond(model, prediction=prediction, vp=vp).eval()
    sigma_min, sigma_max = precond.sigma_range(SIGMA_MIN, SIGMA_MAX)
    denoise = counted(precond)
    g = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(B, pos.shape[0], cfg.patch_dim, generator=g).to(device)
    D = guided(denoise, guidance) if use_cfg else denoise
    if schedule == "ddim" and solver == "euler":  # DDIM itself, as the network's scheduler steps
        tokens = ddim_sampler(D, noise, vp, steps, callback=callback)
    else:
        tokens = edm_sampler(D, noise, steps=steps, solver=solver, sigma_min=sigma_min, sigma_max=sigma_max,
                             sigmas=vp.ddim_sigmas(steps) if schedule == "ddim" else None,
                             round_sigma=None if vp is None else precond.round_sigma, prior_std=precond.prior_std,
                             callback=callback)
    return _decoded(tokens, grid, cfg, codec, stats, nfe)


def _decoded(tokens: torch.Tensor, grid, cfg: DiTConfig, codec: Codec, stats: LatentStats, nfe: int) -> SampleResult:
    latents = unpatchify(tokens, grid, cfg.patch_size, cfg.patch_size_t)  # (B, C, T', H', W')
    pixels = codec.decode(stats.denormalize(latents.float().cpu()))  # (B, 3, F, H, W) in [-1, 1]
    return SampleResult(pixels=to_uint8(pixels).permute(0, 2, 3, 4, 1), latents=latents, nfe=nfe)


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Decoded pixels in [-1, 1] → uint8, rounded: the samples' values, and a reference's images scored like them."""
    return ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
