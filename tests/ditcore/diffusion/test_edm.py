import math

import pytest
import torch

from ditcore.diffusion import EDMLoss, EDMPrecond, edm_coefficients, edm_weight
from ditcore.diffusion.edm import C_NOISE_SCALE
from ditcore.inputs import Inputs
from ditcore.layout import SIGMA_DATA, grid_positions
from ditcore.models import DiT, preset
from ditcore.testing import EPS32, EPS64, assert_close_fp32

SIGMAS = torch.tensor([0.002, 0.05, 0.5, 1.0, 7.0, 80.0], dtype=torch.float64)


def test_coefficient_golden_values_at_sigma_equal_sigma_data():
    c_skip, c_out, c_in, c_noise = edm_coefficients(torch.tensor(0.5, dtype=torch.float64))
    assert c_skip.item() == pytest.approx(0.5)
    assert c_out.item() == pytest.approx(0.25 / math.sqrt(0.5))
    assert c_in.item() == pytest.approx(1 / math.sqrt(0.5))
    assert c_noise.item() == pytest.approx(math.log(0.5) / 4)


def test_coefficient_identities():
    c_skip, c_out, c_in, _ = edm_coefficients(SIGMAS)
    d2, s2 = SIGMA_DATA**2, SIGMAS**2
    # float64, relative to 1: each side's roundings (no cancellation that matters: where 1 − c_skip loses
    # digits, its term is < 1e-4 of the sum) — about 8, 16 and 10 of them
    # network input x = y + n has unit variance after c_in
    torch.testing.assert_close(c_in**2 * (d2 + s2), torch.ones_like(SIGMAS), rtol=0, atol=8 * EPS64)
    # the effective training target (y − c_skip (y + n)) / c_out has unit variance
    target_var = ((1 - c_skip) ** 2 * d2 + c_skip**2 * s2) / c_out**2
    torch.testing.assert_close(target_var, torch.ones_like(SIGMAS), rtol=0, atol=16 * EPS64)
    # λ(σ) c_out(σ)² = 1: the weighted loss equals the unweighted loss on F
    torch.testing.assert_close(edm_weight(SIGMAS) * c_out**2, torch.ones_like(SIGMAS), rtol=0, atol=10 * EPS64)
    # limits: σ → 0 passes x through, σ → ∞ predicts from the network alone
    assert c_skip[0] > 0.9999 and c_out[0] < 0.0021 and c_skip[-1] < 4e-5


class Constant(torch.nn.Module):
    """Backbone F that records its inputs and returns a fixed value."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, x, c_noise, inputs=None):
        self.seen = (x.clone(), c_noise.clone(), inputs)
        return torch.full_like(x, self.value)


def test_precond_applies_the_formula():
    x = torch.randn(2, 3, 4)
    sigma = torch.tensor([0.3, 5.0])
    F = Constant(0.7)
    inputs = Inputs(torch.zeros(3, 3, dtype=torch.long), class_labels=torch.tensor([[1], [2]]))
    D = EDMPrecond(F)(x, sigma, inputs)
    c_skip, c_out, c_in, c_noise = (c.view(2, 1, 1) for c in edm_coefficients(sigma))
    assert_close_fp32(D, c_skip * x + c_out * 0.7, work=3)  # two products and a sum
    assert_close_fp32(F.seen[0], c_in * x, work=1)
    # the network is given 1000·ln(σ)/4, its sinusoid's range as DiT's timesteps
    assert_close_fp32(F.seen[1], C_NOISE_SCALE * c_noise.view(2, 1), work=2)
    assert F.seen[2] is inputs  # handed on as it is


def test_x_prediction_outputs_sigma_data_times_the_network():
    """prediction x: D = σ_d F, nothing of the noisy input passes through; F sees the same c_in x and c_noise."""
    x = torch.randn(2, 3, 4)
    sigma = torch.tensor([0.3, 5.0])
    F = Constant(0.7)
    D = EDMPrecond(F, prediction="x")(x, sigma)
    assert torch.equal(D, torch.full_like(x, SIGMA_DATA * 0.7))
    _, _, c_in, c_noise = (c.view(2, 1, 1) for c in edm_coefficients(sigma))
    assert_close_fp32(F.seen[0], c_in * x, work=1)
    assert_close_fp32(F.seen[1], C_NOISE_SCALE * c_noise.view(2, 1), work=2)
    with pytest.raises(ValueError, match="prediction='v' is unknown"):
        EDMPrecond(F, prediction="v")


def test_max_weight_caps_the_loss_weight():
    # one token, one feature, F ≡ 0 under x-prediction: D = 0, so the loss is λ(σ)·1 — or the cap where it is lower
    y, n = torch.ones(1, 1, 1), torch.zeros(1, 1, 1)
    for sigma, weight in ((0.05, edm_weight(torch.tensor(0.05)).item()), (2.0, edm_weight(torch.tensor(2.0)).item())):
        capped = EDMLoss(max_weight=30.0)(EDMPrecond(Constant(0.0), prediction="x"), y, sigma=torch.full((1, 1), sigma),
                                          noise=n)
        assert capped.item() == pytest.approx(min(weight, 30.0), rel=8 * EPS32)
    assert edm_weight(torch.tensor(0.05)).item() > 30 > edm_weight(torch.tensor(2.0)).item()  # one of each


def test_loss_equals_hand_computed_value():
    # one token, one feature: y = 1, n = 0.5, σ = 1, F ≡ 0 → c_skip = 0.25/1.25 = 0.2,
    # D = 0.2·(1 + 0.5) = 0.3, λ = 1.25/0.25 = 5, loss = 5·(0.3 − 1)² = 2.45
    loss = EDMLoss()(EDMPrecond(Constant(0.0)), torch.ones(1, 1, 1),
                     sigma=torch.ones(1, 1), noise=torch.full((1, 1, 1), 0.5))
    # float32: D − y carries ~5 roundings, which squaring doubles; λ, the product and the mean add 4
    assert loss.item() == pytest.approx(2.45, rel=(2 * 5 + 4) * EPS32)


def test_loss_on_packed_row_uses_each_samples_sigma_and_ignores_padding():
    loss_fn = EDMLoss()
    den = EDMPrecond(Constant(0.3))
    y, n = torch.randn(1, 7, 2), torch.randn(1, 7, 2)
    seg = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    sigma = torch.tensor([[0.2, 3.0]])
    mask = seg >= 0
    packed = loss_fn(den, y, Inputs(None, seg=seg), mask=mask, sigma=sigma, noise=n)
    a = loss_fn(den, y[:, :3], sigma=sigma[:, :1], noise=n[:, :3])
    b = loss_fn(den, y[:, 3:5], sigma=sigma[:, 1:], noise=n[:, 3:5])
    # the same per-element terms (all ≥ 0), summed 14 at a time then divided, against 6 and 4 at a time, + 3
    assert_close_fp32(packed, (3 * a + 2 * b) / 5, work=14 + 1 + 3)
    y2 = y.clone()
    y2[:, 5:] = 1e6  # padding content must not matter
    repacked = loss_fn(den, y2, Inputs(None, seg=seg), mask=mask, sigma=sigma, noise=n)
    assert torch.equal(repacked, packed)  # multiplied by exact 0


def test_sigma_is_log_normal_per_sample():
    sigma = EDMLoss(P_mean=-1.2, P_std=1.2).sample_sigma((200_000,), generator=torch.Generator().manual_seed(0))
    # sampling error, not rounding: the mean and std of n = 200 000 draws have standard errors 1.2/√n = 0.0027 and
    # 1.2/√(2n) = 0.0019, so 0.01 is 3.7 and 5 of them
    assert sigma.log().mean().item() == pytest.approx(-1.2, abs=0.01)
    assert sigma.log().std().item() == pytest.approx(1.2, abs=0.01)


def test_loss_trains_a_tiny_dit():
    """The loss is differentiable end to end through the DiT and falls on a fixed batch."""
    cfg = preset("DiT-Tiny", num_classes=4)
    model = DiT(cfg)
    den = EDMPrecond(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(8, 16, cfg.patch_dim, generator=g) * 0.5
    labels = torch.randint(0, 4, (8, 1), generator=g)
    pos = grid_positions((1, 4, 4))
    sigma, noise = EDMLoss().sample_sigma((8, 1), generator=g), torch.randn(y.shape, generator=g)
    losses = []
    for _ in range(30):
        loss = EDMLoss()(den, y, Inputs(pos, class_labels=labels), sigma=sigma, noise=noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
