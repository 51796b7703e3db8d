"""EDM preconditioning and training loss (Karras et al., "Elucidating the Design Space of
Diffusion-Based Generative Models", NeurIPS 2022). Equation numbers refer to that paper's Table 1.

Besides EDM's own parametrisation (prediction "edm": D = c_skip x + c_out F) the network can predict the clean
data directly (prediction "x": D = σ_d F, as in Li & He, "Back to Basics: Let Denoising Generative Models
Denoise", 2025). Where the data fill only a small part of a token's dimensions (pixels, or a PCA code whose
later channels are small), EDM's F must cancel the noise that c_skip passes through in every other direction,
which a small network learns slowly: its samples keep a grain of noise in every token. Predicting x, it only has
to output the picture. The loss weight λ(σ) is the same; it is capped at `max_weight`, as at low noise x-prediction
would otherwise weigh the network's own error by 1/σ².

Both work on token rows that may hold several packed samples (see ditcore.layout): noise levels are
per sample, shaped (B, S), and `seg` (B, N) maps each token to its sample. With seg=None, S = 1.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ditcore.choices import PREDICTIONS
from ditcore.diffusion.vp import DiscreteVP, vp_coefficients
from ditcore.inputs import Inputs
from ditcore.layout import SIGMA_DATA, per_token

# c_noise = ln(σ)/4 lies in about [-2, 1.2]; the network is given 1000 c_noise, spread over its sinusoid's periods as
# DiT's timesteps t ∈ [0, 1000) are (a DDPM network under VP preconditioning is given t itself)
C_NOISE_SCALE = 1000.0


def edm_coefficients(sigma: torch.Tensor, sigma_data: float = SIGMA_DATA, prediction: str = "edm"):
    """c_skip, c_out, c_in, c_noise of Table 1 ("Preconditioning"); with prediction "x", c_skip = 0, c_out = σ_d."""
    s2, d2 = sigma**2, sigma_data**2
    if prediction == "x":
        c_skip, c_out = torch.zeros_like(sigma), torch.full_like(sigma, sigma_data)
    else:
        c_skip = d2 / (s2 + d2)
        c_out = sigma * sigma_data / (s2 + d2).sqrt()
    c_in = 1 / (s2 + d2).sqrt()
    c_noise = sigma.log() / 4
    return c_skip, c_out, c_in, c_noise


def edm_weight(sigma: torch.Tensor, sigma_data: float = SIGMA_DATA) -> torch.Tensor:
    """Loss weight λ(σ) = 1 / c_out(σ)² = (σ² + σ_d²) / (σ σ_d)², which makes the effective target unit-variance."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


class EDMPrecond(nn.Module):
    """D(x; σ) = c_skip(σ) x + c_out(σ) F(c_in(σ) x; c_noise(σ)) around any backbone F(x, c_noise, inputs).

    x: (B, N, F) tokens; sigma: (B, S) per sample (or (B,) when the rows are one sample each); inputs: the rest of
    what F reads (ditcore.inputs.Inputs), whose seg (B, N) or None says each token's sample.
    With `vp` (a DDPM network's schedule, ditcore.diffusion.vp) the coefficients are VP's: F is its ε-prediction.
    A backbone whose output is wider than x (learned Σ: its variance values follow the prediction) gives D from the
    first x.shape[-1] features; `forward_all` returns the rest as well.
    """

    def __init__(self, model: nn.Module, sigma_data: float = SIGMA_DATA, prediction: str = "edm",
                 vp: DiscreteVP | None = None):
        super().__init__()
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction={prediction!r} is unknown: expected one of {', '.join(PREDICTIONS)}")
        if vp is not None and prediction != "edm":
            raise ValueError(f"prediction={prediction!r} cannot be combined with VP preconditioning: a DDPM network "
                             "predicts the noise (leave prediction at edm)")
        self.model, self.sigma_data, self.prediction, self.vp = model, sigma_data, prediction, vp

    def coefficients(self, sigma: torch.Tensor):
        """c_skip, c_out, c_in and the c_noise the network is given (its own units), each like sigma."""
        if self.vp is not None:
            return vp_coefficients(sigma, self.vp)
        c_skip, c_out, c_in, c_noise = edm_coefficients(sigma, self.sigma_data, self.prediction)
        return c_skip, c_out, c_in, c_noise * C_NOISE_SCALE

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, inputs: Inputs | None = None, **model_kw):
        return self.forward_all(x, sigma, inputs, **model_kw)[0]

    def forward_all(self, x: torch.Tensor, sigma: torch.Tensor, inputs: Inputs | None = None, **model_kw):
        """(D(x; σ), the backbone's features after the prediction: learned Σ's variance values, else empty).
        model_kw: passed on to the backbone (a pipeline stage's `hidden`)."""
        seg = None if inputs is None else inputs.seg
        sigma = sigma.to(torch.float32).reshape(x.shape[0], -1)  # (B, S)
        c_skip, c_out, _, _ = self.coefficients(sigma)
        tok = lambda c: per_token(c, seg)[..., None]  # (B, N or 1, 1): each token uses its sample's σ
        out = self.model(*self.model_inputs(x, sigma, seg), inputs, **model_kw)
        F_x, rest = out[..., :x.shape[-1]], out[..., x.shape[-1]:]
        return (tok(c_skip) * x + tok(c_out) * F_x.to(torch.float32)).to(x.dtype), rest

    def model_inputs(self, x: torch.Tensor, sigma: torch.Tensor, seg: torch.Tensor | None = None):
        """What the backbone F is given: (c_in(σ) x, c_noise(σ)) — alone, for a pipeline stage that ends before F's
        output (ditcore.training.stage_forward)."""
        sigma = sigma.to(torch.float32).reshape(x.shape[0], -1)
        _, _, c_in, c_noise = self.coefficients(sigma)
        return (per_token(c_in, seg)[..., None] * x).to(x.dtype), c_noise

    def round_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        """The noise level the network evaluates for σ: its own nearest one under VP, σ itself under EDM."""
        return sigma if self.vp is None else self.vp.round_sigma(sigma)

    def sigma_range(self, sigma_min: float, sigma_max: float) -> tuple[float, float]:
        """A sampler's (σ_min, σ_max) within the levels the network knows (VP: its σ_0 … σ_{T−1}), as EDM samples
        DDPM networks."""
        if self.vp is None:
            return sigma_min, sigma_max
        return max(sigma_min, self.vp.sigma_min), min(sigma_max, self.vp.sigma_max)

    def prior_std(self, sigma: float) -> float:
        """The std the sampler's start x is drawn with at σ_max: σ (EDM: the data's own spread is negligible there);
        √(σ² + 1) under VP, its x_T ~ N(0, I) divided by √ᾱ_T."""
        return sigma if self.vp is None else math.sqrt(sigma**2 + 1)


def step_draws(loss, x: torch.Tensor, inputs: Inputs | None, sigma, noise, generator):
    """The segments of `inputs` (None: one sample a row), and the σ (B, S) and noise of a loss's step on clean tokens
    x: drawn with the loss's `sample_sigma` and `generator` where not given (EDMLoss, ddpm.DDPMLoss)."""
    seg = None if inputs is None else inputs.seg
    if sigma is None:
        num_samples = 1 if seg is None else int(seg.max()) + 1
        sigma = loss.sample_sigma((x.shape[0], num_samples), x.device, generator)  # (B, S)
    if noise is None:
        noise = torch.randn(x.shape, device=x.device, generator=generator, dtype=x.dtype)
    return seg, sigma, noise


def masked_mean(per_elem: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of a loss's per_elem (B, N, F) over the real tokens, mask (B, N) (None: all of them)."""
    if mask is None:
        return per_elem.mean()
    mask = mask[..., None].to(per_elem.dtype)
    return (per_elem * mask).sum() / (mask.sum() * per_elem.shape[-1])


class EDMLoss:
    """E_σ,n [ λ(σ) ‖D(x + n; σ) − x‖² ] with ln σ ~ N(P_mean, P_std²) drawn per sample (Table 1, "Training").

    The mean runs over the features of real tokens only (mask (B, N), False on padding), so packing and
    padding never change what a sample contributes per token.

    With `vp` (a DDPM network under VP preconditioning) each σ drawn is rounded to the network's nearest level σ_t:
    it knows only its T noise levels, and is evaluated at its c_noise = t(σ) anyway (EDM's iDDPM rounding).
    """

    def __init__(self, P_mean: float = -1.2, P_std: float = 1.2, sigma_data: float = SIGMA_DATA,
                 max_weight: float | None = None, vp: DiscreteVP | None = None):
        self.P_mean, self.P_std, self.sigma_data, self.max_weight = P_mean, P_std, sigma_data, max_weight
        self.vp = vp

    def sample_sigma(self, shape, device=None, generator: torch.Generator | None = None) -> torch.Tensor:
        rnd = torch.randn(shape, device=device, generator=generator)
        sigma = (rnd * self.P_std + self.P_mean).exp()
        if self.vp is None:
            return sigma
        return self.vp.round_sigma(sigma)

    def weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """λ(σ) = (σ² + σ_d²)/(σ σ_d)², capped at max_weight where one is set."""
        weight = edm_weight(sigma, self.sigma_data)
        return weight if self.max_weight is None else weight.clamp(max=self.max_weight)

    @staticmethod
    def noisy(x: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor, seg: torch.Tensor | None = None):
        """x + σ n, each token with its sample's σ."""
        return x + noise * per_token(sigma.reshape(x.shape[0], -1), seg)[..., None]

    @staticmethod
    def target(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """What the denoiser is trained to output: the clean x (flow.FlowLoss's is the velocity; held-out code reads
        either through this)."""
        return x

    def __call__(self, denoiser, x, inputs: Inputs | None = None, *, mask=None, sigma=None, noise=None,
                 generator=None, **model_kw):
        """The loss of denoiser on clean tokens x (B, N, F) with `inputs` (their seg says each token's sample); sigma
        (B, S) and noise drawn when not given; mask (B, N) the real tokens. model_kw: passed on to the backbone."""
        B = x.shape[0]
        seg, sigma, noise = step_draws(self, x, inputs, sigma, noise, generator)
        sigma_tok = per_token(sigma.reshape(B, -1), seg)[..., None]  # (B, N or 1, 1)
        D = denoiser(self.noisy(x, sigma, noise, seg), sigma, inputs, **model_kw)
        weight = self.weight(sigma_tok)
        per_elem = weight * (D.float() - x.float()) ** 2  # (B, N, F)
        return masked_mean(per_elem, mask)
