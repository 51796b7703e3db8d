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

`DiscreteVP` is the schedule a checkpoint was trained with: its T and β's, as diffusers' schedulers name them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch

BetaSchedule = Literal["linear", "scaled_linear", "squaredcos_cap_v2"]
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


@dataclass(frozen=True)
class DiscreteVP:
    """A DDPM schedule (DiT's defaults: 1000 linear β from 1e-4 to 0.02), computed in float64 as DiT's own code does."""

    timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    beta_schedule: BetaSchedule = "linear"

    def __post_init__(self) -> None:
        if not isinstance(self.timesteps, int) or self.timesteps < 2:
            raise ValueError(f"vp timesteps={self.timesteps!r} is invalid: expected an integer >= 2 (DiT: 1000)")
        if self.beta_schedule not in BETA_SCHEDULES:
            raise ValueError(f"vp beta_schedule={self.beta_schedule!r} is unknown: expected one of "
                             f"{', '.join(BETA_SCHEDULES)}")
        if self.beta_schedule != "squaredcos_cap_v2" and not 0 < self.beta_start < self.beta_end < 1:
            raise ValueError(f"vp beta_start={self.beta_start}, beta_end={self.beta_end}: expected "
                             "0 < beta_start < beta_end < 1 (DiT: 1e-4 and 0.02)")

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

    def ddim_sigmas(self, steps: int, offset: int = 0) -> torch.Tensor:
        """σ of DDIM's timesteps (diffusers' `leading` spacing: t = k·⌊T/steps⌋ + offset, highest first), then 0."""
        if not 1 <= steps <= self.timesteps:
            raise ValueError(f"steps={steps} is invalid for a {self.timesteps}-timestep network: expected 1.."
                             f"{self.timesteps}")
        t = torch.arange(steps - 1, -1, -1) * (self.timesteps // steps) + offset
        return torch.cat([self.sigmas()[t], torch.zeros(1, dtype=torch.float64)])

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache  # DiscreteVP is frozen, a torch.device hashable
def _levels(vp: DiscreteVP, device: torch.device) -> torch.Tensor:
    return vp.sigmas().to(device)


def vp_coefficients(sigma: torch.Tensor, vp: DiscreteVP):
    """c_skip, c_out, c_in, c_noise of VP preconditioning (see the module docstring); c_noise is the timestep, in
    σ's dtype."""
    return torch.ones_like(sigma), -sigma, 1 / (sigma**2 + 1).sqrt(), vp.timestep(sigma).to(sigma.dtype)
