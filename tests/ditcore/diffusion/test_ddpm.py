"""DiT's objective (ditcore.diffusion.ddpm) against independent computations: the backbone's ε directly, diffusers'
DDPMScheduler (learned-range variance, posterior mean), torch.distributions' Normal KL and CDF."""

import math

import pytest
import torch
from diffusers import DDPMScheduler
from torch.distributions import Normal, kl_divergence

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.diffusion.ddpm import DDPMLoss, discretized_gaussian_log_likelihood, normal_kl
from ditcore.diffusion.vp import DiscreteVP
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import DiT, preset

VP = DiscreteVP()  # DiT's: 1000 linear β from 1e-4 to 0.02
STEPS = [1, 2, 10, 500, 999]  # t = 0 is the decoder's NLL, tested on its own


def random_dit(learn_sigma: bool, seed: int = 0) -> DiT:
    """A tiny class-conditional DiT with every weight random (adaLN-Zero's zero init would make ε̂ ≡ 0)."""
    model = DiT(preset("DiT-Tiny", in_channels=4, num_classes=3, pos_embed="sincos_2d", max_grid=(1, 4, 4),
                       qk_norm=False, learn_sigma=learn_sigma))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[1] ** -0.5 if p.ndim == 2 else 0.3))
    return model.eval()


def case(t: list[int], seed: int = 1):
    """x₀ tokens (B, 16, 16), noise, σ_t and the conditioning of one sample per row at timesteps t."""
    g = torch.Generator().manual_seed(seed)
    B = len(t)
    x0, noise = torch.randn(B, 16, 16, generator=g) * 0.5, torch.randn(B, 16, 16, generator=g)
    sigma = VP.sigmas()[torch.tensor(t)].float()[:, None]  # (B, 1)
    inputs = Inputs(grid_positions((1, 4, 4)), class_labels=torch.tensor(t)[:, None] % 4)
    return x0, noise, sigma, inputs


def test_eps_mse_is_dit_s_and_the_edm_loss_weighted_by_one_over_sigma_squared():
    model = random_dit(learn_sigma=False)
    den = EDMPrecond(model, vp=VP)
    x0, noise, sigma, inputs = case(STEPS)
    with torch.no_grad():
        ours = DDPMLoss(VP, learn_sigma=False)(den, x0, inputs, sigma=sigma, noise=noise)
        # DiT's: ‖ε − ε̂(x_t, t)‖² with x_t = √ᾱ x₀ + √(1 − ᾱ) ε fed to the backbone as it is
        a = VP.alphas_cumprod()[torch.tensor(STEPS)].float().view(-1, 1, 1)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
        eps = model(x_t, torch.tensor(STEPS, dtype=torch.float32)[:, None], inputs)
        dit = ((noise - eps) ** 2).mean()
        # EDM's loss, λ(σ) = 1/σ² in place of EDM's weight, at the same σ and noise
        D = den(x0 + sigma[..., None] * noise, sigma, inputs)
        edm = ((D - x0) ** 2 / sigma[..., None] ** 2).mean()
    # x_t = x/√(σ² + 1) against √ᾱ x₀ + √(1 − ᾱ) ε: a few float32 roundings of unit values, through the network
    # (ε̂ ~ 1); D − x₀ = σ(ε − ε̂) carries the rounding of x₀ + σ ε (|x₀| ~ 1), divided by σ_1 = 0.016: 4e-6
    assert ours.item() == pytest.approx(dit.item(), rel=1e-5)
    assert ours.item() == pytest.approx(edm.item(), rel=1e-6)
    assert 0.5 < ours.item() < 5  # ε̂ of random weights: a loss of order 1, not 0


def test_learned_range_variance_and_posterior_mean_are_diffusers_ddpm_scheduler_s():
    scheduler = DDPMScheduler(variance_type="learned_range", clip_sample=False)  # DiT's schedule
    loss = DDPMLoss(VP, learn_sigma=True)
    g = torch.Generator().manual_seed(2)
    for t in STEPS:
        x_t, eps, v = (torch.randn(1, 4, 4, 4, generator=g) for _ in range(3))
        v = v.clamp(-1, 1)
        tt = torch.full((1, 4, 4, 4), t)
        theirs_log_var = scheduler._get_variance(t, predicted_variance=v)
        ours_log_var = loss.model_log_variance(v, tt)
        # diffusers' tables are float32 products (1 − ᾱ_{t−1} loses digits at small t: 6e-8/1e-4), ours float64
        torch.testing.assert_close(ours_log_var, theirs_log_var, rtol=0, atol=1e-3)  # measured: 2.5e-4 at t = 10
        # the posterior mean at x̂₀ from ε̂: step() adds exp(log Σ / 2) z, with z drawn from the generator given
        out = scheduler.step(torch.cat([eps, v], 1), t, x_t, generator=torch.Generator().manual_seed(t)).prev_sample
        z = torch.randn(eps.shape, generator=torch.Generator().manual_seed(t))
        theirs_mean = out - (0.5 * theirs_log_var).exp() * z
        a = scheduler.alphas_cumprod[t]
        x0_pred = (x_t - (1 - a).sqrt() * eps) / a.sqrt()
        ours_mean, _ = loss.posterior(x0_pred, x_t, tt)
        torch.testing.assert_close(ours_mean, theirs_mean, rtol=0, atol=1e-4 * (1 + x0_pred.abs().max().item()))


def test_kl_is_torch_distributions_normal_kl():
    g = torch.Generator().manual_seed(3)
    m1, m2, lv1, lv2 = (torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(4))
    expected = kl_divergence(Normal(m1, (0.5 * lv1).exp()), Normal(m2, (0.5 * lv2).exp()))
    torch.testing.assert_close(normal_kl(m1, lv1, m2, lv2), expected, rtol=1e-12, atol=1e-12)


def test_discretized_gaussian_likelihood_is_a_distribution_over_the_256_levels():
    levels = torch.linspace(-1, 1, 256, dtype=torch.float64)  # x ∈ [−1, 1] quantised as DiT's images are
    for mean, log_scale in [(0.0, math.log(0.05)), (0.3, math.log(0.01)), (-0.95, math.log(0.2))]:
        log_p = discretized_gaussian_log_likelihood(levels, torch.tensor(mean, dtype=torch.float64),
                                                    torch.tensor(log_scale, dtype=torch.float64))
        # the bins telescope: [−∞, x₀ + 1/255], …, [x₂₅₅ − 1/255, ∞]
        assert log_p.exp().sum().item() == pytest.approx(1.0, abs=1e-9)
        # each inner bin's mass is the Gaussian's within the tanh approximation of Φ (|error| < 2e-4)
        exact = Normal(mean, math.exp(log_scale))
        inner = exact.cdf(levels[1:-1] + 1 / 255) - exact.cdf(levels[1:-1] - 1 / 255)
        assert (log_p[1:-1].exp() - inner).abs().max().item() < 4e-4
    # a sharp Gaussian on a level puts (almost) all its mass there: −log p ≈ 0
    sharp = discretized_gaussian_log_likelihood(levels[100:101], levels[100:101], torch.tensor([-10.0]).double())
    assert -sharp.item() < 1e-9


def independent_vb(model: DiT, x0, noise, t: list[int], inputs: Inputs) -> torch.Tensor:
    """DiT's L_vb per sample (bits/dim, mean over its features) from diffusers' DDPMScheduler and torch's KL: the
    true posterior is step()'s mean at ε itself (x̂₀ = x₀), the model's at ε̂ with its learned-range variance.
    step() splits [ε̂; v] on dim 1: the tokens are given to it as (1, F, N), features where it expects channels."""
    scheduler = DDPMScheduler(variance_type="learned_range", clip_sample=False)
    out = []
    for i, step in enumerate(t):
        a = scheduler.alphas_cumprod[step]
        x_t = a.sqrt() * x0[i:i + 1] + (1 - a).sqrt() * noise[i:i + 1]  # (1, N, F)
        c = inputs.replace(class_labels=inputs.class_labels[i:i + 1])
        eps_hat, v = model(x_t, torch.tensor([[float(step)]]), c).transpose(1, 2).chunk(2, 1)  # (1, F, N) each

        def mean(eps, v=v, step=step, x_t=x_t):  # eps (1, F, N)
            z = torch.randn(eps.shape, generator=torch.Generator().manual_seed(0))
            prev = scheduler.step(torch.cat([eps, v], 1), step, x_t.transpose(1, 2),
                                  generator=torch.Generator().manual_seed(0))
            return prev.prev_sample - (0.5 * scheduler._get_variance(step, predicted_variance=v)).exp() * z

        true_log_var = scheduler._get_variance(step, predicted_variance=-torch.ones_like(v))  # frac 0: log β̃_t
        model_log_var = scheduler._get_variance(step, predicted_variance=v)
        kl = kl_divergence(Normal(mean(noise[i:i + 1].transpose(1, 2)), (0.5 * true_log_var).exp()),
                           Normal(mean(eps_hat), (0.5 * model_log_var).exp()))
        out.append(kl.mean() / math.log(2))
    return torch.stack(out)


def test_the_learned_sigma_loss_is_eps_mse_plus_dit_s_variational_bound():
    model = random_dit(learn_sigma=True, seed=4)
    den = EDMPrecond(model, vp=VP)
    x0, noise, sigma, inputs = case(STEPS, seed=5)
    with torch.no_grad():
        full = DDPMLoss(VP, learn_sigma=True)(den, x0, inputs, sigma=sigma, noise=noise)
        mse = DDPMLoss(VP, learn_sigma=False)(den, x0, inputs, sigma=sigma, noise=noise)
        vb = independent_vb(model, x0, noise, STEPS, inputs)
    assert vb.min() > 0  # a KL of random predictions: positive, not a vanishing term
    assert full.item() == pytest.approx(mse.item() + vb.mean().item(), rel=2e-4)


def test_the_variational_bound_trains_the_variance_only():
    """DiT detaches the mean in L_vb: the ε features get the ε-MSE's gradient alone, the variance values L_vb's."""
    out = torch.nn.Parameter(torch.randn(2, 5, 8))
    backbone = lambda x, c_noise, inputs: out  # (B, N, 2F): ε̂, then the variance values
    den = EDMPrecond(backbone, vp=VP)
    x0, noise = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    sigma = VP.sigmas()[torch.tensor([[3], [700]])].float()
    grads = []
    for learn_sigma in (False, True):
        out.grad = None
        DDPMLoss(VP, learn_sigma)(den, x0, sigma=sigma, noise=noise).backward()
        grads.append(out.grad.clone())
    torch.testing.assert_close(grads[1][..., :4], grads[0][..., :4], rtol=0, atol=0)
    assert (grads[0][..., 4:] == 0).all() and (grads[1][..., 4:] != 0).all()


def test_timesteps_are_drawn_uniformly_and_reproducibly_and_at_t0_the_decoder_nll_counts():
    loss = DDPMLoss(VP, learn_sigma=True)
    sigma = loss.sample_sigma((20_000,), generator=torch.Generator().manual_seed(0))
    t = loss.timestep(sigma)
    assert torch.equal(loss.sample_sigma((20_000,), generator=torch.Generator().manual_seed(0)), sigma)
    assert torch.equal(VP.sigmas()[t].float(), sigma)  # every σ is one of the network's levels, its t found back
    counts = torch.bincount(t // 100, minlength=10)
    # 2000 in each tenth of the timesteps on average; 5 standard deviations (√(2000 · 0.9) = 42) either side
    assert counts.min() > 2000 - 5 * 42 and counts.max() < 2000 + 5 * 42 and t.min() == 0 and t.max() == 999
    x0, x_t, x0_pred, v = (torch.rand(1, 3, 4) * 2 - 1 for _ in range(4))
    t0, t1 = torch.zeros(1, 3, 1, dtype=torch.long), torch.ones(1, 3, 1, dtype=torch.long)
    model_mean, _ = loss.posterior(x0_pred, x_t, t0)
    nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * loss.model_log_variance(v, t0)) / math.log(2)
    torch.testing.assert_close(loss.vb_terms(x0, x_t, x0_pred, v, t0), nll, rtol=0, atol=0)
    assert not torch.equal(loss.vb_terms(x0, x_t, x0_pred, v, t1), nll)


def test_the_loss_is_the_same_packed_and_unpacked():
    """Two samples of one row at their own timesteps, then padding, against each alone."""
    torch.manual_seed(6)
    out_layer = torch.nn.Linear(4, 8)
    backbone = lambda x, c_noise, inputs: out_layer(x)  # token by token: packing cannot change it
    den, loss = EDMPrecond(backbone, vp=VP), DDPMLoss(VP, learn_sigma=True)
    x, n = torch.randn(1, 7, 4), torch.randn(1, 7, 4)
    seg = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    sigma = VP.sigmas()[torch.tensor([[0, 400]])].float()  # t = 0 (decoder NLL) and t = 400 (KL)
    with torch.no_grad():
        packed = loss(den, x, Inputs(None, seg=seg), mask=seg >= 0, sigma=sigma, noise=n)
        a = loss(den, x[:, :3], sigma=sigma[:, :1], noise=n[:, :3])
        b = loss(den, x[:, 3:5], sigma=sigma[:, 1:], noise=n[:, 3:5])
        x2 = x.clone()
        x2[:, 5:] = 1e6  # padding content must not matter
        padded = loss(den, x2, Inputs(None, seg=seg), mask=seg >= 0, sigma=sigma, noise=n)
    # the same per-element terms (≥ 0), summed 14 at a time against 6 and 4, + the weighted mean's 3 roundings
    assert packed.item() == pytest.approx(((3 * a + 2 * b) / 5).item(), rel=20 * 1.2e-7)
    assert torch.equal(padded, packed)


def test_the_edm_loss_under_vp_trains_on_the_network_s_levels():
    loss = EDMLoss(vp=VP)
    sigma = loss.sample_sigma((10_000,), generator=torch.Generator().manual_seed(0))
    levels = VP.sigmas().float()
    assert torch.isin(sigma, levels).all()
    free = EDMLoss().sample_sigma((10_000,), generator=torch.Generator().manual_seed(0))
    # the same log-normal draws, each moved to its nearest level
    nearest = (levels[None] - free[:, None]).abs().min(1).values
    assert torch.equal((sigma - free).abs(), nearest)


def test_vp_preconditioning_s_coefficients_are_vp_s():
    """EDMPrecond finds the timestep among levels it keeps on the device; the coefficients are vp_coefficients'."""
    from ditcore.diffusion.vp import vp_coefficients

    sigma = torch.cat([VP.sigmas()[[0, 1, 500, 999]].float(), torch.tensor([0.003, 0.3, 3.0, 300.0])])
    for ours, theirs in zip(EDMPrecond(torch.nn.Identity(), vp=VP).coefficients(sigma), vp_coefficients(sigma, VP),
                            strict=True):
        assert torch.equal(ours, theirs)
