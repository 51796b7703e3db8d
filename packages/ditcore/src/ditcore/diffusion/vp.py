"""Networks trained as discrete-time VP (DDPM) ε-predictors — DiT, and every diffusers DiT — under ditcore's EDM
samplers, guidance and loss.

A DDPM noises x₀ as x_t = √ᾱ_t x₀ + √(1 − ᾱ_t) ε at timesteps t = 0 … T−1. Divided by √ᾱ_t this is EDM's
x = x₀ + σ_t ε with σ_t = √((1 − ᾱ_t)/ᾱ_t), so the ε-network ε̂(x_t, t) is the denoiser (Karras et al. 2022, Table 1,
"VP" and "iDDPM" preconditioning)

    D(x; σ) = x − σ ε̂(x / √(σ² + 1), t(σ)):   c_skip = 1, c_out = −σ, c_in = 1/√(σ² + 1), c_noise = t(σ),

where t(σ) is the timestep whose σ_t is nearest (the network knows only its T noise levels; EDM's iDDPM
preconditioning rounds the same way, and so do the samplers, `round_sigma`, so that every evaluation lands on one).
Euler steps of this D on DDIM's timesteps are DDIM (η = 0) exactly: x' = D + σ'·(x − D)/σ is DDIM's update written
in x/√ᾱ.

`DiscreteVP` is the schedule a checkpoint was trained with: its T and β's, as diffusers' schedulers name them; and
how DDIM steps through it, as a diffusers DDIMScheduler config says (`ddim_steps`: which timesteps, where each step
lands, the final ᾱ, clipping of x̂₀): ditcore.diffusion.sampler.ddim_sampler is that scheduler's loop.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch

from ditcore.choices import BETA_SCHEDULES

BetaSchedule = Literal[BETA_SCHEDULES]
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")


@dataclass(frozen=True)
class DiscreteVP:
    """A DDPM schedule (DiT's defaults: 1000 linear β from 1e-4 to 0.02), computed in float64 as DiT's own code does."""

    timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    beta_schedule: BetaSchedule = "linear"
    # DDIM's steps through it, named and defaulted as diffusers' DDIMScheduler has them, except clip_sample (DiT
    # samples without clipping; a scheduler config read by ditcore.interop gives its own)
    timestep_spacing: Literal["leading", "trailing", "linspace"] = "leading"
    steps_offset: int = 0  # added to leading spacing's timesteps (diffusers: leading only)
    set_alpha_to_one: bool = True  # the last step lands on ᾱ = 1 (σ = 0); False: on ᾱ_0, σ_0
    clip_sample: bool = False  # clamp DDIM's x̂₀ to ±clip_sample_range
    clip_sample_range: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.timesteps, int) or self.timesteps < 2:
            raise ValueError(f"vp timesteps={self.timesteps!r} is invalid: expected an integer >= 2 (DiT: 1000)")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(f"vp beta_schedule={self.beta_schedule!r} is unknown: expected one of "
                             f"{', '.join(BETA_SCHEDULES)}")
        if self.beta_schedule != "squaredcos_cap_v2" and not 0 < self.beta_start < self.beta_end < 1:
            raise ValueError(f"vp beta_start={self.beta_start}, beta_end={self.beta_end}: expected "
                             "0 < beta_start < beta_end < 1 (DiT: 1e-4 and 0.02)")
        if self.timestep_spacing not in TIMESTEP_SPACINGS:
            raise ValueError(f"vp timestep_spacing={self.timestep_spacing!r} is unknown: expected one of "
                             f"{', '.join(TIMESTEP_SPACINGS)}")
        if not isinstance(self.steps_offset, int) or not 0 <= self.steps_offset < self.timesteps:
            raise ValueError(f"vp steps_offset={self.steps_offset!r} is invalid: expected an integer in "
                             f"0..{self.timesteps - 1}")
        if not self.clip_sample_range > 0:
            raise ValueError(f"vp clip_sample_range={self.clip_sample_range!r} is invalid: expected a number > 0")

    def trained(self) -> DiscreteVP:
        """The schedule alone (T and β's), DDIM's step settings at their defaults: what training reads."""
        return DiscreteVP(self.timesteps, self.beta_start, self.beta_end, self.beta_schedule)

    def betas(self) -> torch.Tensor:
        T = self.timesteps
        if self.beta_schedule == "linear":
            return torch.linspace(self.beta_start, self.beta_end, T, dtype=torch.float64)
        if self.beta_schedule == "scaled_linear":  # latent diffusion's
            return torch.linspace(self.beta_start**0.5, self.beta_end**0.5, T, dtype=torch.float64) ** 2
        # improved DDPM's cosine ᾱ, each β capped at 0.999
        alpha_bar = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        return torch.tensor([min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), 0.999) for i in range(T)],
                            dtype=torch.float64)

    def alphas_cumprod(self) -> torch.Tensor:
        """ᾱ_t, t = 0 … T−1 (float64)."""
        return torch.cumprod(1 - self.betas(), dim=0)

    def sigmas(self) -> torch.Tensor:
        """σ_t = √((1 − ᾱ_t)/ᾱ_t), increasing with t (float64)."""
        a = self.alphas_cumprod()
        return ((1 - a) / a).sqrt()

    @property
    def sigma_min(self) -> float:
        return float(self.sigmas()[0])

    @property
    def sigma_max(self) -> float:
        return float(self.sigmas()[-1])

    def levels(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """`sigmas()` on `device`, copied there once per schedule and device: a copy from the host at every step
        would make the host wait for the device."""
        return _levels(self, torch.device(device))

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep t(σ) (long) whose σ_t is nearest to each σ (EDM's iDDPM c_noise), on σ's device."""
        return (sigma.double()[..., None] - self.levels(sigma.device)).abs().argmin(-1)

    def round_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        """σ_{t(σ)}: the network's own noise level nearest to σ (0 stays 0: the sampler's end)."""
        rounded = self.levels(sigma.device)[self.timestep(sigma)].to(sigma.dtype)
        return torch.where(sigma == 0, sigma, rounded)

    def ddim_timesteps(self, steps: int) -> tuple[list[int], list[int]]:
        """(the timesteps DDIM evaluates the network at, highest first; the timestep each step lands on, −1 for the
        final ᾱ), by diffusers' DDIMScheduler rules: `set_timesteps` spaces them (leading: k·⌊T/steps⌋ + offset;
        trailing: round(T − k·T/steps) − 1; linspace: round of steps points over 0..T−1) and `step` lands t on
        t − ⌊T/steps⌋, which is the next timestep for leading spacing, and for the others only when steps divides
        T (else the next step reads that x_t as the next timestep's, as diffusers does)."""
        T = self.timesteps
        if not 1 <= steps <= T:
            raise ValueError(f"steps={steps} is invalid for a {T}-timestep network: expected 1..{T}")
        if self.timestep_spacing == "leading":
            t = (np.arange(0, steps) * (T // steps)).round()[::-1].astype(np.int64) + self.steps_offset
        elif self.timestep_spacing == "trailing":  # numpy's float arange and rounding, as diffusers computes it
            t = np.round(np.arange(T, 0, -T / steps)).astype(np.int64) - 1
        else:
            t = np.linspace(0, T - 1, steps).round()[::-1].astype(np.int64)
        if t.min() < 0 or t.max() >= T:
            raise ValueError(f"{steps} DDIM steps with timestep_spacing={self.timestep_spacing} and steps_offset="
                             f"{self.steps_offset} reach timestep {int(t.max() if t.max() >= T else t.min())}, "
                             f"outside the network's 0..{T - 1}: choose another number of steps")
        lands = t - T // steps
        return t.tolist(), np.where(lands >= 0, lands, -1).tolist()

    def ddim_steps(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(σ of the timesteps DDIM evaluates the network at; σ each step lands on, the last one the final ᾱ's: 0,
        or σ_0 without set_alpha_to_one), float64: `ddim_timesteps` as noise levels."""
        t, lands = self.ddim_timesteps(steps)
        sigmas = self.sigmas()
        final = torch.zeros((), dtype=torch.float64) if self.set_alpha_to_one else sigmas[0]
        return sigmas[t], torch.stack([sigmas[p] if p >= 0 else final for p in lands])

    def ddim_refusal(self, steps: int, solver: str) -> str | None:
        """Why `solver` cannot step through these DDIM steps as the scheduler does, or None. Euler is DDIM itself
        (ditcore.diffusion.sampler.ddim_sampler); another solver through `ddim_sigmas` steps between the same
        levels only when the steps need nothing of DDIM's own: no clipping, a final ᾱ of 1, each step landing on
        the next timestep."""
        levels, lands = self.ddim_steps(steps)
        if solver == "euler":
            return None
        why = (f"clip_sample (x̂₀ clamped to ±{self.clip_sample_range})" if self.clip_sample else
               "set_alpha_to_one=False (the last step lands on ᾱ_0, not 1)" if not self.set_alpha_to_one else
               f"timestep_spacing={self.timestep_spacing} at {steps} steps (a step lands ⌊T/steps⌋ below its "
               "timestep, not on the next one)" if not torch.equal(lands[:-1], levels[1:]) else None)
        return why and (f"schedule ddim with solver {solver}: this schedule's {why} is a DDIM step, which only "
                        "solver euler (DDIM itself) takes: use solver euler, or schedule karras")

    def ddim_sigmas(self, steps: int) -> torch.Tensor:
        """σ of DDIM's timesteps (`ddim_timesteps`), then 0: the levels another solver steps through (only DDIM's own
        loop, ditcore.diffusion.sampler.ddim_sampler, lands, clips and ends as the scheduler does)."""
        return torch.cat([self.ddim_steps(steps)[0], torch.zeros(1, dtype=torch.float64)])

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache  # DiscreteVP is frozen, a torch.device hashable
def _levels(vp: DiscreteVP, device: torch.device) -> torch.Tensor:
    return vp.sigmas().to(device)


def vp_coefficients(sigma: torch.Tensor, vp: DiscreteVP):
    """c_skip, c_out, c_in, c_noise of VP preconditioning (see the module docstring); c_noise is the timestep, in
    σ's dtype."""
    return torch.ones_like(sigma), -sigma, 1 / (sigma**2 + 1).sqrt(), vp.timestep(sigma).to(sigma.dtype)
