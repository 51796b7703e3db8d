import itertools
import math

import pytest
import torch

from ditcore.diffusion import edm_sampler, guided, karras_sigmas
from ditcore.testing import EPS32, assert_close_fp32

S_DATA, SIGMA_MAX = 0.5, 80.0


def gaussian_denoiser(s):
    """Exact D(x; σ) for data ~ N(0, s²): E[y | y + σn = x] = x s² / (s² + σ²)."""
    return lambda x, sigma: x * s**2 / (s**2 + sigma**2)


def sampler_error(steps, solver):
    noise = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    # probability-flow ODE dx/dσ = σ x / (s² + σ²) has x(σ) ∝ √(s² + σ²), so x(0) = x(σ_max) s / √(s² + σ_max²)
    exact = noise * SIGMA_MAX * S_DATA / math.sqrt(S_DATA**2 + SIGMA_MAX**2)
    out = edm_sampler(gaussian_denoiser(S_DATA), noise, steps=steps, solver=solver, sigma_max=SIGMA_MAX)
    return (out - exact).abs().max().item()


def test_heun_is_second_order():
    errors = [sampler_error(n, "heun") for n in (16, 32, 64, 128)]
    ratios = [a / b for a, b in itertools.pairwise(errors)]
    assert all(3.5 < r < 5.0 for r in ratios), (errors, ratios)  # doubling the steps cuts the error ~4×
    assert errors[-1] < 2e-3


def test_euler_is_first_order():
    errors = [sampler_error(n, "euler") for n in (16, 32, 64, 128)]
    ratios = [a / b for a, b in itertools.pairwise(errors)]
    assert all(1.8 < r < 2.2 for r in ratios), (errors, ratios)
    assert sampler_error(32, "heun") < 0.25 * sampler_error(32, "euler")


@pytest.mark.parametrize(("solver", "steps", "nfe"), [("heun", 18, 35), ("heun", 1, 1), ("euler", 18, 18)])
def test_number_of_denoiser_evaluations(solver, steps, nfe):
    seen = []

    def denoise(x, sigma):
        seen.append(float(sigma))
        return gaussian_denoiser(S_DATA)(x, sigma)

    edm_sampler(denoise, torch.randn(3), steps=steps, solver=solver)
    assert len(seen) == nfe
    if solver == "heun" and steps > 1:
        sig = karras_sigmas(steps)
        # the correction of step i evaluates D at σ_{i+1}, not again at σ_i
        # the float32 denoiser sees each float64 σ rounded once: within u = ε/2
        assert seen[:4] == pytest.approx([sig[0].item(), sig[1].item(), sig[1].item(), sig[2].item()], rel=EPS32)


def test_karras_schedule_endpoints_and_monotone():
    s = karras_sigmas(18)
    assert s[0].item() == pytest.approx(80.0) and s[-2].item() == pytest.approx(0.002) and s[-1].item() == 0
    assert torch.all(s[1:] < s[:-1])


def test_churn_is_seeded_and_changes_the_path():
    noise = torch.randn(256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    D = gaussian_denoiser(S_DATA)
    run = lambda seed, churn: edm_sampler(D, noise, steps=16, churn=churn, churn_tmin=0.05, churn_tmax=50,
                                          generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run(0, 40.0), run(0, 40.0))
    assert not torch.allclose(run(0, 40.0), run(1, 40.0))
    assert torch.equal(run(0, 0.0), edm_sampler(D, noise, steps=16))
    # stochastic sampling still targets N(0, s²): the std's bias shrinks as the steps grow
    many = torch.randn(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bias = {n: abs(edm_sampler(D, many, steps=n, churn=40.0 * n / 32, churn_tmin=0.05, churn_tmax=50,
                               generator=torch.Generator().manual_seed(3)).std().item() - S_DATA)
            for n in (32, 128)}
    assert bias[128] < 0.01 and bias[128] < 0.5 * bias[32], bias


def test_classifier_free_guidance_is_one_batched_call():
    calls = []

    def both(x2, sigma):  # conditional half → 2x, unconditional half → x
        calls.append(x2.shape[0])
        c, u = x2.chunk(2)
        return torch.cat([2 * c, u])

    x = torch.randn(3, 5)
    for w in (0.0, 1.0, 4.5):
        assert_close_fp32(guided(both, w)(x, torch.tensor(1.0)), x + w * (2 * x - x), work=3)  # −, ·w, +
    assert calls == [6, 6, 6]


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="solver='rk4' is invalid"):
        edm_sampler(gaussian_denoiser(1), torch.randn(2), solver="rk4")
    with pytest.raises(ValueError, match="steps=0 is invalid"):
        edm_sampler(gaussian_denoiser(1), torch.randn(2), steps=0)
