"""EDM sampling (Karras et al. 2022, Algorithm 2), DDIM as diffusers' scheduler steps, and classifier-free guidance.

`denoise(x, sigma)` is any callable that returns the denoised estimate D(x; σ) for a 0-dim σ. Heun is the
true second-order method: its correction evaluates D at (x_next, σ_next), so N steps cost 2N − 1 calls
(the last step, to σ = 0, is an Euler step). Churn adds noise before a step (the paper's γ_i).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ditcore.choices import SOLVERS
from ditcore.diffusion.vp import DiscreteVP

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def karras_sigmas(steps: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0,
                  device=None) -> torch.Tensor:
    """σ_0 > … > σ_{N−1} = σ_min (Eq. 5), followed by σ_N = 0; float64."""
    if steps < 1:
        raise ValueError(f"steps={steps} is invalid: expected an integer >= 1")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"sigma_min={sigma_min}, sigma_max={sigma_max}: expected 0 < sigma_min < sigma_max")
    i = torch.arange(steps, dtype=torch.float64, device=device)
    ramp = i / max(steps - 1, 1)
    sigmas = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([sigmas, sigmas.new_zeros(1)])


@torch.no_grad()
def edm_sampler(
    denoise: Denoiser,
    noise: torch.Tensor,
    *,
    steps: int = 18,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    solver: str = "heun",
    churn: float = 0.0,
    churn_tmin: float = 0.0,
    churn_tmax: float = float("inf"),
    churn_noise: float = 1.0,
    sigmas: torch.Tensor | None = None,
    round_sigma: Callable[[torch.Tensor], torch.Tensor] | None = None,
    prior_std: Callable[[float], float] | None = None,
    generator: torch.Generator | None = None,
    callback: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Integrate the probability-flow ODE from σ_max to 0 starting at x = noise · prior_std(σ_max) (default σ_max).

    churn, churn_tmin, churn_tmax, churn_noise are the paper's S_churn, S_tmin, S_tmax, S_noise.
    sigmas: the noise levels to step through (σ_0 > … > σ_{N−1}, then 0) in place of Eq. 5's; steps is then N.
    round_sigma: a discrete-time network's nearest own noise level (ditcore.diffusion.vp), applied to every level the
    denoiser is evaluated at, as EDM's sampler does for such networks.
    callback(i, steps) is called after each step (for progress bars).
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver={solver!r} is invalid: expected one of {', '.join(SOLVERS)}")
    if sigmas is None:
        t = karras_sigmas(steps, sigma_min, sigma_max, rho, device=noise.device)
    else:
        t = sigmas.to(device=noise.device, dtype=torch.float64)
        if t.ndim != 1 or len(t) < 2 or t[-1] != 0 or not bool((t[:-1] > t[1:]).all()):
            raise ValueError(f"sigmas must fall strictly and end at 0, got {t.tolist()[:4]}... ({len(t)} levels)")
        steps = len(t) - 1
    rounded = round_sigma or (lambda s: s)
    t = rounded(t)
    x = noise.to(torch.float64) * (t[0] if prior_std is None else prior_std(float(t[0])))
    gamma_max = min(churn / steps, math.sqrt(2) - 1)
    D = lambda x, s: denoise(x.to(noise.dtype), s.to(noise.dtype)).to(torch.float64)
    for i in range(steps):
        t_cur, t_next = t[i], t[i + 1]
        # Churn: raise the noise level from t_cur to t_hat by adding fresh noise (Algorithm 2, lines 4-6).
        gamma = gamma_max if churn_tmin <= t_cur <= churn_tmax else 0.0
        t_hat = rounded(t_cur + gamma * t_cur)
        if gamma > 0:
            eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            x = x + (t_hat**2 - t_cur**2).sqrt() * churn_noise * eps
        d = (x - D(x, t_hat)) / t_hat  # dx/dσ at (x, t_hat)
        x_next = x + (t_next - t_hat) * d  # Euler step
        if solver == "heun" and i < steps - 1:
            d_next = (x_next - D(x_next, t_next)) / t_next  # slope at the Euler prediction (x_next, t_next)
            x_next = x + (t_next - t_hat) * (0.5 * d + 0.5 * d_next)
        x = x_next
        if callback is not None:
            callback(i, steps)
    return x.to(noise.dtype)


@torch.no_grad()
def ddim_sampler(denoise: Denoiser, noise: torch.Tensor, vp: DiscreteVP, steps: int,
                 callback: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """DDIM (η = 0) as diffusers' DDIMScheduler steps with `vp`'s settings, for a network under VP preconditioning,
    in ditcore's x = x_t/√ᾱ_t (float64 state; the denoiser sees the noise's dtype).

    At each timestep t of `vp.ddim_steps`, x̂₀ = D(x; σ_t) (clamped under clip_sample; ε̂ = (x − D)/σ_t is the
    unclamped one, as the scheduler keeps the network's), and the step lands on x̂₀ + σ_p ε̂ at its landing level σ_p.
    Where that is not the next timestep's level (diffusers' trailing or linspace spacing when steps does not divide
    T) the scheduler reads the landed x_t as the next timestep's: x is rescaled by √ᾱ_p/√ᾱ_next. The result is the
    last landing's x_t, √ᾱ_final·(x̂₀ + σ_final ε̂): x̂₀ when the final ᾱ is 1. x_T = noise·√(σ_T² + 1), DDPM's prior."""
    levels, lands = (s.to(noise.device) for s in vp.ddim_steps(steps))
    after = torch.cat([levels[1:], levels.new_zeros(1)])  # the level each step's result is read at; 0: the output
    x = noise.to(torch.float64) * (levels[0] ** 2 + 1).sqrt()
    for i in range(len(levels)):
        sigma = levels[i]
        x0 = denoise(x.to(noise.dtype), sigma.to(noise.dtype)).to(torch.float64)
        eps = (x - x0) / sigma
        if vp.clip_sample:
            x0 = x0.clamp(-vp.clip_sample_range, vp.clip_sample_range)
        x = (x0 + lands[i] * eps) * ((after[i] ** 2 + 1) / (lands[i] ** 2 + 1)).sqrt()
        if callback is not None:
            callback(i, len(levels))
    return x.to(noise.dtype)


def guided(denoise_batched: Denoiser, guidance: float) -> Denoiser:
    """Classifier-free guidance: D = D_u + w (D_c − D_u) from ONE batched call over [cond, uncond].

    denoise_batched(x2, sigma) receives the batch doubled along dim 0 (conditional half first) and must
    return both halves' estimates; the caller sets up the [cond, uncond] conditioning to match.
    With guidance == 1 the result is D_c.
    """

    def denoise(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        D_c, D_u = denoise_batched(torch.cat([x, x]), sigma).chunk(2)
        return D_u + guidance * (D_c - D_u)

    return denoise
