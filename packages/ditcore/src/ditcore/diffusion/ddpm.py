"""DiT's own training objective, for fine-tuning the field's DDPM-trained DiTs under VP preconditioning
(ditcore.diffusion.vp): facebookresearch/DiT's `gaussian_diffusion.training_losses` with its MSE loss and learned-range
variance (Ho et al. 2020, "Denoising Diffusion Probabilistic Models"; Nichol & Dhariwal 2021, "Improved DDPM", §3.1).

Per sample, a timestep t uniform over 0 … T−1 and the noisy x_t = √ᾱ_t x₀ + √(1 − ᾱ_t) ε, which EDM writes
x = x₀ + σ_t ε with x_t = x/√(σ_t² + 1). The loss is

    ‖ε − ε̂‖²  (= ‖D − x₀‖²/σ_t² under VP preconditioning, D = x − σ ε̂)

plus, for a learned-Σ network (its variance values v ∈ [−1, 1] after the prediction), the variational bound term L_vb
that trains Σ alone: the model's log variance is log β̃_t + (v + 1)/2 · (log β_t − log β̃_t) (β̃_t the posterior's),
its mean the posterior mean at the predicted x̂₀ = D, detached, and L_vb = KL(q(x_{t−1}|x_t, x₀) ‖ p(x_{t−1}|x_t))
in bits per dimension, at t = 0 the discretized Gaussian decoder's NLL instead (Ho et al. §3.3). All of it is computed
in DDPM's units (x_t, x₀), as DiT does; the schedule's tables in float64, then rounded to float32, as DiT's are.

Like EDMLoss it works on token rows that may hold several packed samples, each with its own σ_t (B, S): the mean runs
over the features of real tokens only.
"""

from __future__ import annotations

import math

import torch

from ditcore.diffusion.edm import EDMLoss, masked_mean, step_draws
from ditcore.diffusion.vp import DiscreteVP
from ditcore.inputs import Inputs
from ditcore.layout import per_token


class DDPMLoss:
    """E_t,ε [ ‖ε − ε̂(x_t, t)‖² + L_vb ] with t ~ U{0 … T−1} per sample (L_vb for learned-Σ networks only)."""

    def __init__(self, vp: DiscreteVP, learn_sigma: bool):
        self.vp, self.learn_sigma = vp, learn_sigma
        self.table = schedule_tables(vp)  # float64 on the host; each device's float copy is made once (`_on`)
        self._device_tables: dict[torch.device, dict[str, torch.Tensor]] = {}

    def sample_sigma(self, shape, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
        """σ_t of timesteps drawn uniformly per sample (float32; ditcore.training.draw calls it as EDMLoss's)."""
        t = torch.randint(0, self.vp.timesteps, shape, device=device, generator=generator)
        return self._on(t.device)["sigma"][t]

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep (long) whose σ_t is nearest to each σ: exactly the t that `sample_sigma` drew."""
        return self.vp.timestep(sigma)

    def __call__(self, denoiser, x, inputs: Inputs | None = None, *, mask=None, sigma=None, noise=None,
                 generator=None, **model_kw):
        """As EDMLoss's: clean tokens x with `inputs`, sigma and noise drawn when not given, mask the real tokens."""
        seg, sigma, noise = step_draws(self, x, inputs, sigma, noise, generator)
        sigma = sigma.reshape(x.shape[0], -1)
        x_noisy = EDMLoss.noisy(x, sigma, noise, seg)
        D, var_values = denoiser.forward_all(x_noisy, sigma, inputs, **model_kw)
        sigma_tok = per_token(sigma.float(), seg)[..., None]  # (B, N or 1, 1)
        per_elem = ((D.float() - x.float()) / sigma_tok) ** 2  # ‖ε − ε̂‖²: D − x₀ = σ (ε − ε̂)
        if self.learn_sigma:
            if var_values.shape != x.shape:
                raise ValueError(f"the DDPM loss with learned Σ needs the network's variance values after its "
                                 f"prediction ({tuple(x.shape)}), got {tuple(var_values.shape)}: build the model with "
                                 "learn_sigma")
            t_tok = per_token(self.timestep(sigma), seg)[..., None]  # (B, N or 1, 1)
            per_elem = per_elem + self.vb_terms(x.float(), x_noisy.float() / (sigma_tok**2 + 1).sqrt(),
                                                D.detach().float(), var_values.float(), t_tok)
        return masked_mean(per_elem, mask)

    def vb_terms(self, x0: torch.Tensor, x_t: torch.Tensor, x0_pred: torch.Tensor, var_values: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
        """L_vb per element, in bits: KL(q(x_{t−1}|x_t, x₀) ‖ p(x_{t−1}|x_t)), at t = 0 the decoder's −log p(x₀|x₁)
        (DiT's `_vb_terms_bpd`, before its mean). x_t in DDPM's units; x0_pred the network's x̂₀ (detached)."""
        true_mean, true_log_var = self.posterior(x0, x_t, t)
        model_mean, _ = self.posterior(x0_pred, x_t, t)
        model_log_var = self.model_log_variance(var_values, t)
        kl = normal_kl(true_mean, true_log_var, model_mean, model_log_var) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    def posterior(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and clipped log variance of q(x_{t−1} | x_t, x₀) (Ho et al. eq. 6–7; log β̃_0 := log β̃_1, DiT's)."""
        tab = self._on(x0.device)
        mean = tab["posterior_mean_coef1"][t] * x0 + tab["posterior_mean_coef2"][t] * x_t
        return mean, tab["posterior_log_variance_clipped"][t]

    def model_log_variance(self, var_values: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Learned range (Improved DDPM eq. 15): log β̃_t + (v + 1)/2 · (log β_t − log β̃_t)."""
        tab = self._on(var_values.device)
        min_log, max_log = tab["posterior_log_variance_clipped"][t], tab["log_betas"][t]
        frac = (var_values + 1) / 2
        return frac * max_log + (1 - frac) * min_log

    def _on(self, device) -> dict[str, torch.Tensor]:
        """The tables on `device` in float32, copied there once: a copy per step would make the host wait for the
        device."""
        device = torch.device(device or "cpu")
        if device not in self._device_tables:
            self._device_tables[device] = {k: v.float().to(device) for k, v in self.table.items()}
        return self._device_tables[device]


def schedule_tables(vp: DiscreteVP) -> dict[str, torch.Tensor]:
    """DiT's GaussianDiffusion tables of a schedule (float64, indexed by t)."""
    betas = vp.betas()
    alphas_cumprod = vp.alphas_cumprod()
    prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])  # ᾱ_{t−1}, ᾱ_{−1} = 1
    posterior_variance = betas * (1 - prev) / (1 - alphas_cumprod)  # β̃_t; 0 at t = 0, hence the clipped log
    return {
        "sigma": vp.sigmas(),
        "log_betas": betas.log(),
        "posterior_log_variance_clipped": torch.cat([posterior_variance[1:2], posterior_variance[1:]]).log(),
        "posterior_mean_coef1": betas * prev.sqrt() / (1 - alphas_cumprod),
        "posterior_mean_coef2": (1 - prev) * (1 - betas).sqrt() / (1 - alphas_cumprod),
    }


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) ‖ N(mean2, e^logvar2)) per element, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + (logvar1 - logvar2).exp() + (mean1 - mean2) ** 2 * (-logvar2).exp())


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Φ(x) by the tanh approximation DiT (after Improved DDPM) uses."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """log P(x) of data in [−1, 1] quantised to 256 levels (bins 2/255 wide, the outer two open-ended) under
    N(means, e^(2 log_scales)) (Ho et al. §3.3), per element in nats. DiT applies it to its latents as they are."""
    centered = x - means
    inv_std = (-log_scales).exp()
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = cdf_plus.clamp(min=1e-12).log()
    log_one_minus_cdf_min = (1.0 - cdf_min).clamp(min=1e-12).log()
    log_cdf_delta = (cdf_plus - cdf_min).clamp(min=1e-12).log()
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))
