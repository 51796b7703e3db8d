"""VP (DDPM) preconditioning: the discrete schedule against diffusers' schedulers, the denoiser identity, the sampler's
rounding to the network's own noise levels and its start."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from ditcore.diffusion import EDMPrecond, edm_sampler
from ditcore.diffusion.vp import DiscreteVP
from ditcore.testing import EPS32, EPS64, assert_close_fp32

SCHEDULES = [dict(), dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
             dict(beta_schedule="squaredcos_cap_v2")]


@pytest.mark.parametrize("fields", SCHEDULES, ids=["linear", "scaled_linear", "cosine"])
def test_the_schedule_is_diffusers_schedule(fields):
    """ᾱ_t of every β schedule equal diffusers' (its float32 cumulative product against our float64: ≤ T ε32)."""
    ours = DiscreteVP(**fields).alphas_cumprod()
    theirs = DDPMScheduler(**fields).alphas_cumprod.double()
    assert ((ours - theirs).abs() / ours).max() < 1000 * EPS32


def test_timesteps_and_rounding_find_the_networks_own_levels():
    vp = DiscreteVP()
    sigmas = vp.sigmas()
    assert sigmas[0] == pytest.approx(0.01, rel=1e-3) and 150 < sigmas[-1] < 160  # DiT's: σ from 0.01 to ~157
    assert bool((sigmas[1:] > sigmas[:-1]).all())
    t = torch.tensor([0, 1, 500, 998, 999])
    assert torch.equal(vp.timestep(sigmas[t]), t.double())  # each level is its own timestep
    between = (sigmas[500] * sigmas[501]).sqrt()  # nearer one of the two in value
    assert vp.timestep(between.reshape(1)).item() in (500, 501)
    assert vp.timestep(torch.tensor([1e-4, 1e4])).tolist() == [0, 999]  # outside: the ends
    assert torch.equal(vp.round_sigma(torch.tensor([0.0, float(sigmas[7])], dtype=torch.float64)),
                       torch.tensor([0.0, float(sigmas[7])], dtype=torch.float64))  # 0 (the end) stays 0


def test_ddim_sigmas_are_diffusers_ddim_timesteps():
    vp, scheduler = DiscreteVP(), DDIMScheduler()
    for steps in (1, 10, 50, 999):
        scheduler.set_timesteps(steps)
        expected = vp.sigmas()[scheduler.timesteps]
        assert torch.equal(vp.ddim_sigmas(steps), torch.cat([expected, torch.zeros(1, dtype=torch.float64)]))
    with pytest.raises(ValueError, match="steps=0 is invalid for a 1000-timestep network"):
        vp.ddim_sigmas(0)


class Eps(torch.nn.Module):
    """An ε-network that returns a fixed ε and records what it was given."""

    def __init__(self, eps: torch.Tensor):
        super().__init__()
        self.eps = eps

    def forward(self, x, c_noise, inputs=None):
        self.seen = (x.clone(), c_noise.clone())
        return self.eps


def test_vp_precond_turns_an_eps_network_into_a_denoiser():
    """D(x; σ) = x − σ ε̂(x/√(σ² + 1), t(σ)); a learned-Σ network's extra features are passed on, not mixed in."""
    vp, g = DiscreteVP(), torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    sigma = vp.sigmas()[torch.tensor([10, 700])].float()
    x = x0 + sigma[:, None, None] * eps
    net = Eps(torch.cat([eps, torch.full_like(eps, 9.0)], dim=-1))  # [ε; variance values]
    D, rest = EDMPrecond(net, vp=vp).forward_all(x, sigma)
    assert_close_fp32(D, x0, work=4)  # x − σ ε, with x = x0 + σ ε: exact but for rounding
    assert torch.equal(rest, torch.full_like(eps, 9.0))
    assert torch.equal(net.seen[1], torch.tensor([[10.0], [700.0]]))  # the timesteps themselves
    assert_close_fp32(net.seen[0], x / (sigma[:, None, None] ** 2 + 1).sqrt(), work=3)  # = √ᾱ_t x_VE: DDPM's x_t
    with pytest.raises(ValueError, match="prediction='x' cannot be combined with VP preconditioning"):
        EDMPrecond(net, prediction="x", vp=vp)


def test_sampler_evaluates_only_the_networks_levels_and_starts_from_its_prior():
    """Under VP, Karras levels are clamped to the network's range and rounded to its levels (EDM's iDDPM sampling);
    the start x is x_T·√(σ_0² + 1), DDPM's x_T ~ N(0, I) divided by √ᾱ."""
    vp, seen = DiscreteVP(), []
    precond = EDMPrecond(torch.nn.Identity(), vp=vp)

    def denoise(x, sigma):
        seen.append((x.clone(), float(sigma)))
        return torch.zeros_like(x)

    noise = torch.ones(3, dtype=torch.float64)
    lo, hi = precond.sigma_range(0.002, 80.0)
    assert lo == vp.sigma_min and hi == 80.0
    edm_sampler(denoise, noise, steps=6, sigma_min=lo, sigma_max=hi, solver="heun", round_sigma=precond.round_sigma,
                prior_std=precond.prior_std)
    levels = {float(s) for s in vp.sigmas()}
    assert all(s in levels for _, s in seen)
    first = seen[0][1]
    assert torch.allclose(seen[0][0], noise * (first**2 + 1) ** 0.5, rtol=4 * EPS64, atol=0)


def test_explicit_sigmas_must_fall_to_zero():
    D = lambda x, s: x
    with pytest.raises(ValueError, match="sigmas must fall strictly and end at 0"):
        edm_sampler(D, torch.ones(2), sigmas=torch.tensor([1.0, 2.0, 0.0]))
    with pytest.raises(ValueError, match="sigmas must fall strictly and end at 0"):
        edm_sampler(D, torch.ones(2), sigmas=torch.tensor([2.0, 1.0]))
    steps = []
    edm_sampler(D, torch.ones(2), sigmas=torch.tensor([2.0, 1.0, 0.0]), callback=lambda i, n: steps.append(n))
    assert steps == [2, 2]


@pytest.mark.parametrize(("fields", "match"), [
    (dict(timesteps=1), "timesteps=1 is invalid"), (dict(beta_schedule="sigmoid"), "beta_schedule='sigmoid'"),
    (dict(beta_start=0.02, beta_end=0.01), "beta_start=0.02, beta_end=0.01"),
])
def test_bad_schedules_are_one_line_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        DiscreteVP(**fields)
