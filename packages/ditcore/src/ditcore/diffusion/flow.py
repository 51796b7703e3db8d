"""Flow matching: rectified flow with a velocity-predicting network, as SD3, Flux and Wan train and sample it (Esser
et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", ICML 2024; equation numbers refer
to that paper).

The forward process is a straight line from the data x₀ (t = 0) to the noise ε ~ N(0, I) (t = 1), Eq. 13:

    x_t = (1 − t)·x₀ + t·ε,   so   dx_t/dt = ε − x₀ =: v,

and the network predicts the velocity v from (x_t, t): the loss is the conditional flow matching loss ‖v̂ − (ε − x₀)‖²
(Eq. 8) with uniform weight, as Wan and SD3 train (SD3's reweighting of t comes from how t is drawn, Eq. 18: here
logit-normal, Eq. 19, or uniform). Sampling integrates dx/dt = v̂(x, t) from t = 1 (x = ε) down to 0.

The time shift t' = s·t / (1 + (s − 1)·t) (Eq. 23, SD3's and Wan's `shift`) moves t towards the noise. In log-SNR
λ = 2 log((1 − t)/t) it is a constant offset, λ' = λ − 2 log s (Eq. 24): logit(t') = logit(t) + log s. Flux's
sequence-length-dependent shift (diffusers' `use_dynamic_shifting`, its "exponential" time_shift) is the same map with
log s = mu, mu linear in the sample's token count: t' = e^mu / (e^mu + (1/t − 1)). `TimeShift` holds either.

The network is given the timestep 1000·t, as diffusers' flow schedulers give theirs (`timesteps = sigmas * 1000`), so a
backbone's sinusoidal timestep embedding sees the range DiT's and Wan's do.

Like EDM's pieces (ditcore.diffusion.edm) these work on token rows that may pack several samples: t is per sample,
shaped (B, S), and `seg` (B, N) maps each token to its sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from ditcore.choices import FLOW_PREDICTIONS, FLOW_SOLVERS, T_DISTRIBUTIONS
from ditcore.diffusion.edm import masked_mean, step_draws
from ditcore.inputs import Inputs
from ditcore.layout import per_token

TRAIN_TIMESTEPS = 1000  # the network's timestep is 1000·t (diffusers' num_train_timesteps)
T_MIN = 0.05  # an x-predicting flow network's velocity divides by t no smaller than this (Li & He's clip)
STEPPERS = tuple(s for s in FLOW_SOLVERS if s != "unipc")  # flow_sampler's; unipc runs in diffusers' scheduler

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TimeShift:
    """t → t' = s·t / (1 + (s − 1)·t) with a constant s (`shift`, Eq. 23), or, with `dynamic`, with s = e^mu where
    mu = base_shift + (max_shift − base_shift)·(seq_len − base_seq_len)/(max_seq_len − base_seq_len) grows linearly
    with the sample's token count (Flux; diffusers' calculate_shift and use_dynamic_shifting; mu is extrapolated
    beyond the two points as diffusers does). shift = 1 and not dynamic: no shift."""

    shift: float = 1.0
    dynamic: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        if not (isinstance(self.shift, (int, float)) and math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"time shift={self.shift!r} is invalid: expected a number > 0 (1: no shift; SD3 at "
                             "1024² and Wan at 480p use 3, Wan at 720p 5)")
        if self.dynamic and self.shift != 1.0:
            raise ValueError(f"time shift={self.shift} with dynamic=True: the dynamic shift replaces the constant one "
                             "(diffusers' use_dynamic_shifting ignores `shift`): leave shift at 1.0, or dynamic off")
        for name in ("base_shift", "max_shift"):
            if not (isinstance(getattr(self, name), (int, float)) and math.isfinite(getattr(self, name))):
                raise ValueError(f"time shift {name}={getattr(self, name)!r} is invalid: expected a finite number "
                                 "(Flux: base_shift 0.5, max_shift 1.15)")
        if not (isinstance(self.base_seq_len, int) and isinstance(self.max_seq_len, int)
                and 0 < self.base_seq_len < self.max_seq_len):
            raise ValueError(f"time shift base_seq_len={self.base_seq_len!r}, max_seq_len={self.max_seq_len!r}: "
                             "expected integers with 0 < base_seq_len < max_seq_len (Flux: 256 and 4096)")

    def mu(self, seq_len):
        """log s of the dynamic shift at `seq_len` tokens (an int, or a tensor of them), by diffusers' calculate_shift
        with the same operations in the same order (an int gives its float exactly)."""
        m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len)
        b = self.base_shift - m * self.base_seq_len
        return seq_len * m + b

    def __call__(self, t: torch.Tensor, seq_len=None) -> torch.Tensor:
        """t shifted, in t's dtype; seq_len (an int, or a tensor like t) is each sample's token count, which a dynamic
        shift needs. Computed as diffusers writes it, so that float64 levels match its schedulers' to the last bit."""
        if not self.dynamic:
            return self.shift * t / (1 + (self.shift - 1) * t)
        if seq_len is None:
            raise ValueError("a dynamic time shift needs the sample's token count (seq_len): it grows with it")
        mu = self.mu(seq_len)
        e_mu = mu.exp() if isinstance(mu, torch.Tensor) else math.exp(mu)
        return e_mu / (e_mu + (1 / t - 1))

    def log_shift(self, seq_len: int | None = None) -> float:
        """log s: the shift's offset in logit(t) (logit t' = logit t + log s), at seq_len tokens when dynamic (a
        constant shift ignores seq_len)."""
        if not self.dynamic:
            return math.log(self.shift)
        if seq_len is None:
            raise ValueError("a dynamic time shift needs the sample's token count (seq_len): it grows with it")
        return float(self.mu(seq_len))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TimeShift:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"time shift keys {sorted(unknown)} are unknown: expected some of "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**d)


def token_counts(seg: torch.Tensor, num_samples: int) -> torch.Tensor:
    """(B, S) float32: how many tokens of rows whose seg (B, N) says each token's sample (−1: padding) belong to each
    sample, summed on seg's device (a scatter-add of ones, exact in float32 below 2²⁴ tokens): the host never waits."""
    real = (seg >= 0).to(torch.float32)
    counts = torch.zeros(seg.shape[0], num_samples, device=seg.device)
    return counts.scatter_add_(1, seg.clamp(min=0), real)


class FlowLoss:
    """E_t,ε ‖v̂(x_t, t) − (ε − x₀)‖² (Eq. 8 with Eq. 13's path), t drawn per sample and then shifted.

    t_dist: "logit_normal", t = sigmoid(u) with u ~ N(t_mean, t_std²) (Eq. 19; SD3's choice, t_mean 0, t_std 1), or
    "uniform" on (0, 1). The weight is 1 at every t: Wan and SD3 train on the plain velocity MSE, their weighting
    being the distribution of t (Eq. 18). The mean runs over the features of real tokens only (mask (B, N)), as
    EDMLoss's does. With a dynamic shift each sample's t is shifted by its own token count (`sample_sigma`'s lengths).

    It has EDMLoss's interface, noise levels named sigma there (ditcore.training.draw and stage_forward, the held-out
    loss), its t in the place of σ.
    """

    vp = None  # no discrete-time network's levels to round t to

    def __init__(self, t_dist: str = "logit_normal", t_mean: float = 0.0, t_std: float = 1.0,
                 shift: TimeShift = TimeShift()):
        if t_dist not in T_DISTRIBUTIONS:
            raise ValueError(f"t_dist={t_dist!r} is unknown: expected one of {', '.join(T_DISTRIBUTIONS)}")
        if not (math.isfinite(t_mean) and math.isfinite(t_std) and t_std > 0):
            raise ValueError(f"t_mean={t_mean}, t_std={t_std}: expected finite numbers with t_std > 0 (SD3: 0 and 1)")
        self.t_dist, self.t_mean, self.t_std, self.shift = t_dist, t_mean, t_std, shift

    @property
    def needs_lengths(self) -> bool:
        """Does sample_sigma need each sample's token count (a dynamic shift)?"""
        return self.shift.dynamic

    def sample_sigma(self, shape, device=None, generator: torch.Generator | None = None,
                     lengths: torch.Tensor | None = None) -> torch.Tensor:
        """t (shape, float32) drawn and shifted; lengths (shape): each sample's token count, for a dynamic shift (a
        packed row's samples each keep their own)."""
        if self.shift.dynamic and lengths is None:
            raise ValueError("FlowLoss with a dynamic time shift draws t by each sample's token count: pass lengths")
        if self.t_dist == "logit_normal":
            t = torch.sigmoid(torch.randn(shape, device=device, generator=generator) * self.t_std + self.t_mean)
        else:
            t = torch.rand(shape, device=device, generator=generator)
        return self.shift(t, lengths)

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        """1 at every t (see the class docstring)."""
        return torch.ones_like(t)

    @staticmethod
    def noisy(x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, seg: torch.Tensor | None = None):
        """x_t = (1 − t)·x + t·ε (Eq. 13), each token with its sample's t, written as diffusers' scale_noise does."""
        t_tok = per_token(t.reshape(x.shape[0], -1), seg)[..., None]  # (B, N or 1, 1)
        return t_tok * noise + (1 - t_tok) * x

    @staticmethod
    def target(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """What the network is trained to output: the velocity ε − x₀."""
        return noise - x

    def __call__(self, denoiser, x, inputs: Inputs | None = None, *, mask=None, sigma=None, noise=None,
                 generator=None, **model_kw):
        """The loss of `denoiser` (a FlowPrecond: its output is v̂) on clean tokens x (B, N, F) with `inputs`; sigma:
        t (B, S), drawn when not given (then, for a dynamic shift, by each sample's real tokens: seg and mask);
        noise drawn when not given; mask (B, N) the real tokens. model_kw: passed on to the backbone."""
        B = x.shape[0]
        if sigma is None and self.shift.dynamic:
            seg = None if inputs is None else inputs.seg
            rows = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device) if seg is None else seg
            rows = rows if mask is None else torch.where(mask, rows, -1)
            S = 1 if seg is None else int(seg.max()) + 1
            sigma = self.sample_sigma((B, S), x.device, generator, lengths=token_counts(rows, S))
        seg, t, noise = step_draws(self, x, inputs, sigma, noise, generator)
        t_tok = per_token(t.reshape(B, -1), seg)[..., None]  # (B, N or 1, 1)
        v = denoiser(self.noisy(x, t, noise, seg), t, inputs, **model_kw)
        per_elem = self.weight(t_tok) * (v.float() - self.target(x, noise).float()) ** 2  # (B, N, F)
        return masked_mean(per_elem, mask)


class FlowPrecond(nn.Module):
    """v̂(x_t, t) = F(x_t, 1000·t) around any backbone F(x, c_noise, inputs), EDMPrecond's interface: x_t (B, N, F)
    tokens, t (B, S) per sample (or (B,)), inputs the rest of what F reads (ditcore.inputs.Inputs). The network is
    given x_t as it is (for data of std σ_d ≤ 1 its variance (1 − t)²σ_d² + t² stays within [σ_d²/(1 + σ_d²), 1]:
    no input scaling) and the timestep 1000·t, as diffusers' Wan, SD3 and Flux pipelines give theirs. A backbone
    whose output is wider than x gives v̂ from the first x.shape[-1] features; `forward_all` returns the rest too.

    prediction "x": the network outputs the clean data x̂₀ and the velocity is v̂ = (x_t − x̂₀)/max(t, t_min), as Li & He
    ("Back to Basics: Let Denoising Generative Models Denoise", 2025) train flow matching: where the data fill only a
    small part of a token's dimensions (pixels, a PCA code whose later channels are small), a velocity network must
    output the noise ε in every other direction, and its error there stays in the samples as grain; an x-network only
    has to output the picture. The loss stays the velocity's (FlowLoss): on x̂₀ it weighs ‖x̂₀ − x₀‖² by 1/t², and
    t_min (their 0.05) caps that weight at low noise, where the Euler step to t = 0 then leaves a t/t_min share of the
    last level's residual noise (t ≤ 0.001 at the end of flow_timesteps)."""

    vp = None

    def __init__(self, model: nn.Module, prediction: str = "velocity", t_min: float = T_MIN):
        super().__init__()
        if prediction not in FLOW_PREDICTIONS:
            raise ValueError(f"prediction={prediction!r} is unknown for a flow network: expected one of "
                             f"{', '.join(FLOW_PREDICTIONS)}")
        self.model, self.prediction, self.t_min = model, prediction, t_min

    def forward(self, x: torch.Tensor, t: torch.Tensor, inputs: Inputs | None = None, **model_kw):
        return self.forward_all(x, t, inputs, **model_kw)[0]

    def forward_all(self, x: torch.Tensor, t: torch.Tensor, inputs: Inputs | None = None, **model_kw):
        """(v̂, the backbone's features after the velocity: empty unless it outputs more). model_kw: passed on to the
        backbone (a pipeline stage's `hidden`)."""
        seg = None if inputs is None else inputs.seg
        out = self.model(*self.model_inputs(x, t, seg), inputs, **model_kw)
        F_x, rest = out[..., :x.shape[-1]], out[..., x.shape[-1]:]
        if self.prediction == "velocity":
            return F_x.to(x.dtype), rest
        t_tok = per_token(t.to(torch.float32).reshape(x.shape[0], -1), seg)[..., None].clamp(min=self.t_min)
        return ((x.float() - F_x.float()) / t_tok).to(x.dtype), rest

    def model_inputs(self, x: torch.Tensor, t: torch.Tensor, seg: torch.Tensor | None = None):
        """What the backbone F is given: (x_t, 1000·t (B, S) float32) — alone, for a pipeline stage that ends before
        F's output (ditcore.training.stage_forward). seg is unused (EDMPrecond's signature)."""
        return x, t.to(torch.float32).reshape(x.shape[0], -1) * TRAIN_TIMESTEPS

    def round_sigma(self, t: torch.Tensor) -> torch.Tensor:
        """t itself: the network knows every t."""
        return t


def _scheduler_range(shift: TimeShift) -> tuple[float, float]:
    """FlowMatchEulerDiscreteScheduler's sigma_max and sigma_min: the largest and smallest of its 1000 training
    sigmas k/1000, shifted by a constant shift (not by a dynamic one, which it applies only in set_timesteps), in
    float32 as it computes them."""
    ends = torch.tensor([TRAIN_TIMESTEPS, 1], dtype=torch.float32) / TRAIN_TIMESTEPS
    if not shift.dynamic:
        ends = shift(ends)
    return ends[0].item(), ends[1].item()


def flow_timesteps(steps: int, shift: TimeShift = TimeShift(), seq_len: int | None = None) -> torch.Tensor:
    """t_0 > … > t_{N−1}, then 0 (float64): FlowMatchEulerDiscreteScheduler(shift=s).set_timesteps(N), or with
    use_dynamic_shifting and mu = shift.mu(seq_len), step by step. N points evenly spaced from its sigma_max to its
    sigma_min (`_scheduler_range`: with a constant shift these are already shifted once, so its schedule shifts its
    smallest level twice), then shifted; in float64, which the scheduler rounds to float32 (equal to the last bit)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} is invalid: expected an integer >= 1")
    if shift.dynamic and seq_len is None:
        raise ValueError("a dynamic time shift needs the sample's token count (seq_len): it grows with it")
    sigma_max, sigma_min = _scheduler_range(shift)
    levels = np.linspace(sigma_max * TRAIN_TIMESTEPS, sigma_min * TRAIN_TIMESTEPS, steps) / TRAIN_TIMESTEPS
    t = shift(torch.from_numpy(levels), seq_len)  # float64, as the scheduler's numpy
    return torch.cat([t, t.new_zeros(1)])


def _check_levels(ts: torch.Tensor) -> torch.Tensor:
    ts = ts.to(torch.float64)
    if ts.ndim != 1 or len(ts) < 2 or ts[-1] != 0 or ts[0] > 1 or not bool((ts[:-1] > ts[1:]).all()):
        raise ValueError(f"ts must fall strictly from at most 1 and end at 0, got {ts.tolist()[:4]}... "
                         f"({len(ts)} levels)")
    return ts


@torch.no_grad()
def flow_sampler(velocity: Velocity, noise: torch.Tensor, *, steps: int, shift: TimeShift = TimeShift(),
                 solver: str = "euler", seq_len: int | None = None, ts: torch.Tensor | None = None,
                 callback: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """x₀ from x = noise at t_0 (≈ 1) by the flow ODE dx/dt = v̂(x, t) over `flow_timesteps` (or ts: t_0 > … > 0).

    euler: x ← x + (t_{i+1} − t_i)·v̂(x, t_i), FlowMatchEulerDiscreteScheduler's step; N evaluations.
    heun: the trapezoidal correction x ← x + (t_{i+1} − t_i)·(v̂(x, t_i) + v̂(x_E, t_{i+1}))/2 at the Euler step's
    x_E, the last step (to t = 0, where v̂ is not evaluated) Euler alone: FlowMatchHeunDiscreteScheduler's steps (it
    writes the slope as (x − (x − σ v̂))/σ, which is v̂), 2N − 1 evaluations.
    The state is float64; `velocity(x, t)` is called with x in the noise's dtype and a 0-dim t in it (the network's
    timestep 1000·t is then the float32 product diffusers gives it). callback(i, steps) after each step."""
    if solver not in STEPPERS:
        raise ValueError(f"solver={solver!r} is invalid for flow_sampler: expected one of {', '.join(STEPPERS)} "
                         "(unipc: scheduler_sampler)")
    t = flow_timesteps(steps, shift, seq_len) if ts is None else _check_levels(ts)
    t = t.to(noise.device)
    steps = len(t) - 1
    V = lambda x, s: velocity(x.to(noise.dtype), s.to(noise.dtype)).to(torch.float64)
    x = noise.to(torch.float64)
    for i in range(steps):
        v = V(x, t[i])
        x_next = x + (t[i + 1] - t[i]) * v  # Euler step
        if solver == "heun" and i < steps - 1:
            x_next = x + (t[i + 1] - t[i]) * (0.5 * v + 0.5 * V(x_next, t[i + 1]))
        x = x_next
        if callback is not None:
            callback(i, steps)
    return x.to(noise.dtype)


def unipc_scheduler(shift: TimeShift = TimeShift()):
    """diffusers' UniPCMultistepScheduler as Wan samples with it: prediction_type flow_prediction, flow sigmas with
    flow_shift = the shift (or, dynamic, use_dynamic_shifting: scheduler_sampler then needs mu), its other settings
    at their defaults (solver order 2, bh2, the last steps at lower order, a final σ of 0), which are Wan's."""
    from diffusers import UniPCMultistepScheduler  # deferred: importing diffusers takes seconds

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   flow_shift=1.0 if shift.dynamic else shift.shift,
                                   use_dynamic_shifting=shift.dynamic)


@torch.no_grad()
def scheduler_sampler(velocity: Velocity, noise: torch.Tensor, scheduler, steps: int,
                      callback: Callable[[int, int], None] | None = None, mu: float | None = None) -> torch.Tensor:
    """x₀ through a diffusers flow scheduler OBJECT's own loop, as diffusers' pipelines run it: set_timesteps(steps,
    mu=mu), then at each of its timesteps τ, x ← scheduler.step(v̂(x, τ/1000), τ, x). UniPC (`unipc_scheduler`) is
    sampled this way rather than rewritten: its multistep predictor-corrector keeps state (past outputs, orders,
    corrector switches) that only agreeing with its code line by line would reproduce, and Wan samples with it.

    The state stays in the noise's dtype, as the scheduler keeps it (WanPipeline's: float32). `velocity` is called
    with a 0-dim t = τ/1000 in that dtype, so the network's timestep 1000·t is τ to within one rounding (UniPC's τ
    are integers: exactly τ for 991 of the 1000 in float32). mu: a dynamic shift's, for a scheduler that uses one.
    callback(i, steps) after each step."""
    scheduler.set_timesteps(steps, device=noise.device, **({} if mu is None else {"mu": mu}))
    timesteps = scheduler.timesteps
    x = noise
    for i, tau in enumerate(timesteps):
        t = (tau.to(torch.float64) / TRAIN_TIMESTEPS).to(noise.dtype)
        x = scheduler.step(velocity(x, t), tau, x).prev_sample
        if callback is not None:
            callback(i, len(timesteps))
    return x
