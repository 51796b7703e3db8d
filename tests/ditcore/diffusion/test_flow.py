"""Flow matching (ditcore.diffusion.flow) against independent computations: diffusers' FlowMatch and UniPC schedulers
(their timesteps, shifts and loops), a Gaussian data distribution whose velocity and ODE solution are known in closed
form, and the identities of the straight path."""

import copy
import itertools
import json
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler, UniPCMultistepScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from ditcore.codecs import LatentStats
from ditcore.codecs.pixel import PixelCodec
from ditcore.diffusion import (
    FlowLoss,
    FlowPrecond,
    TimeShift,
    flow_sampler,
    flow_timesteps,
    guided,
    scheduler_sampler,
    unipc_scheduler,
)
from ditcore.diffusion.flow import token_counts
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, patchify, unpatchify
from ditcore.models import DiT, preset
from ditcore.sampling import _inputs, sample
from ditcore.testing import EPS32, EPS64, assert_close_fp32

SHIFTS = (1.0, 3.0, 5.0, 3.17, 0.7)  # none, SD3's and Wan's, Wan 720p's, one whose float32 rounding shows, < 1
LENGTHS = (64, 256, 1000, 4096, 9000)  # below, at, between and beyond Flux's two points


# --------------------------------------------------------------------------------------------------
# The path, the loss and the preconditioning


def test_the_straight_path_and_its_velocity():
    """x_t = (1 − t)x₀ + tε (SD3 Eq. 13): x₀ at t = 0 and ε at t = 1 exactly; x_t − t·v = x₀ and x_t + (1 − t)·v = ε
    with v = ε − x₀, the target; each token at its own sample's t."""
    g = torch.Generator().manual_seed(0)
    x, noise = torch.randn(2, 7, 5, generator=g), torch.randn(2, 7, 5, generator=g)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, -1]])
    t = torch.tensor([[0.0, 1.0], [0.3, 0.0]])
    x_t = FlowLoss.noisy(x, t, noise, seg)
    assert torch.equal(x_t[0, :3], x[0, :3]) and torch.equal(x_t[0, 3:], noise[0, 3:])  # 0·ε + 1·x, 1·ε + 0·x
    v = FlowLoss.target(x, noise)
    assert torch.equal(v, noise - x)
    t_tok = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], [0.3] * 7])[..., None]  # padding: sample 0's t
    # each side a handful of float32 roundings (t·ε, 1 − t, (1 − t)·x, +; ε − x, t·v, −) of values up to |x| + |ε|
    scale = (x.abs() + noise.abs()).max().item()
    torch.testing.assert_close(x_t - t_tok * v, x, rtol=0, atol=8 * EPS32 * scale)
    torch.testing.assert_close(x_t + (1 - t_tok) * v, noise, rtol=0, atol=8 * EPS32 * scale)


class Constant(nn.Module):
    """Backbone F that records its inputs and returns a fixed value (as wide as `width` times x)."""

    def __init__(self, value: float, width: int = 1):
        super().__init__()
        self.value, self.width = value, width

    def forward(self, x, c_noise, inputs=None):
        self.seen = (x.clone(), c_noise.clone(), inputs)
        return torch.full((*x.shape[:-1], x.shape[-1] * self.width), self.value)


def test_precond_gives_the_network_x_t_and_1000_t_and_returns_its_velocity():
    x = torch.randn(2, 3, 4)
    t = torch.tensor([0.25, 0.875])
    F = Constant(0.7, width=2)  # a learned-Σ-shaped output: the velocity is its first half
    inputs = Inputs(torch.zeros(3, 3, dtype=torch.long))
    precond = FlowPrecond(F)
    v, rest = precond.forward_all(x, t, inputs)
    assert torch.equal(v, torch.full_like(x, 0.7)) and rest.shape == x.shape
    assert torch.equal(F.seen[0], x) and F.seen[2] is inputs
    assert torch.equal(F.seen[1], torch.tensor([[250.0], [875.0]]))  # the timestep diffusers' schedulers give
    assert precond.prediction == "velocity" and precond.vp is None
    assert torch.equal(precond.model_inputs(x, t)[1], F.seen[1])


def test_an_x_predicting_network_gives_the_velocity_its_x_implies_each_sample_with_its_own_t():
    """prediction x (Li & He): v̂ = (x_t − x̂₀)/max(t, 0.05), per packed sample. With the exact x₀ as its output the
    velocity is ε − x₀ wherever t ≥ 0.05 (within a few roundings), and at t below it the clipped one."""
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(1, 5, 4, generator=g), torch.randn(1, 5, 4, generator=g)
    seg = torch.tensor([[0, 0, 0, 1, 1]])
    t = torch.tensor([[0.6, 0.01]])
    x_t = FlowLoss.noisy(x0, t, eps, seg)

    class Exact(torch.nn.Module):
        def forward(self, x, c_noise, inputs):
            return x0

    v = FlowPrecond(Exact(), prediction="x")(x_t, t, Inputs(None, seg=seg))
    exact = eps - x0
    assert torch.allclose(v[:, :3], exact[:, :3], rtol=0, atol=16 * EPS32 * (1 + exact.abs().max().item()))
    clipped = (x_t[:, 3:] - x0[:, 3:]) / 0.05  # t = 0.01 < 0.05: the clip's velocity, 1/5 of the exact one
    assert torch.allclose(v[:, 3:], clipped, rtol=8 * EPS32, atol=8 * EPS32) and torch.allclose(
        v[:, 3:], exact[:, 3:] * 0.2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prediction='eps' is unknown for a flow network: expected one of velocity, x"):
        FlowPrecond(Exact(), prediction="eps")


def test_loss_equals_hand_computed_value():
    # one token, one feature: x = 1, ε = 0.5, t = 0.25, F ≡ 0.2: v = ε − x = −0.5, loss = (0.2 + 0.5)² = 0.49
    loss = FlowLoss()(FlowPrecond(Constant(0.2)), torch.ones(1, 1, 1), sigma=torch.full((1, 1), 0.25),
                      noise=torch.full((1, 1, 1), 0.5))
    assert loss.item() == pytest.approx(0.49, rel=8 * EPS32)  # ε − x, − , square, mean: exact or one rounding each


def test_loss_on_packed_row_uses_each_samples_t_and_ignores_padding():
    loss_fn = FlowLoss()
    den = FlowPrecond(Constant(0.3))
    g = torch.Generator().manual_seed(1)
    y, n = torch.randn(1, 7, 2, generator=g), torch.randn(1, 7, 2, generator=g)
    seg = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    t = torch.tensor([[0.2, 0.9]])
    mask = seg >= 0
    packed = loss_fn(den, y, Inputs(None, seg=seg), mask=mask, sigma=t, noise=n)
    a = loss_fn(den, y[:, :3], sigma=t[:, :1], noise=n[:, :3])
    b = loss_fn(den, y[:, 3:5], sigma=t[:, 1:], noise=n[:, 3:5])
    # the same per-element terms (all ≥ 0), summed 14 at a time then divided, against 6 and 4 at a time, + 3
    assert_close_fp32(packed, (3 * a + 2 * b) / 5, work=14 + 1 + 3)
    y2 = y.clone()
    y2[:, 5:] = 1e6  # padding content must not matter
    assert torch.equal(loss_fn(den, y2, Inputs(None, seg=seg), mask=mask, sigma=t, noise=n), packed)


class Oracle(nn.Module):
    """The exact velocity of each token, read from x_t and the clean x₀ it knows: (x_t − x₀)/t = ε − x₀."""

    def __init__(self, x0: torch.Tensor, seg: torch.Tensor):
        super().__init__()
        self.x0, self.seg = x0, seg

    def forward(self, x_t, c_noise, inputs=None):
        t = torch.gather(c_noise / 1000, 1, self.seg.clamp(min=0))[..., None]
        return (x_t - self.x0) / t


def test_the_exact_velocity_has_zero_loss():
    g = torch.Generator().manual_seed(2)
    x, noise = torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g)
    seg = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, -1]])
    t = torch.tensor([[0.1, 0.6], [0.95, 0.3]])
    loss = FlowLoss()(FlowPrecond(Oracle(x, seg)), x, Inputs(None, seg=seg), mask=seg >= 0, sigma=t, noise=noise)
    # x_t carries ~4 roundings of values up to |x| + |ε|, 1000·t/1000 and x_t − x₀ two more, and dividing by t ≥ 0.1
    # amplifies them ×10: each squared term is below (6ε·max(|x| + |ε|)/0.1)²
    bound = (6 * EPS32 * (x.abs() + noise.abs()).max().item() / 0.1) ** 2
    assert 0 <= loss.item() <= bound, (loss.item(), bound)
    wrong = FlowLoss()(FlowPrecond(Oracle(-x, seg)), x, Inputs(None, seg=seg), mask=seg >= 0, sigma=t, noise=noise)
    assert wrong.item() > 1  # the oracle of other data is far off: the bound is not met by accident


def test_logit_normal_t_has_the_stated_logit_mean_and_std_and_a_shift_moves_it_by_log_s():
    n = 200_000
    for shift in (1.0, 3.0):
        t = FlowLoss(t_mean=0.3, t_std=0.8, shift=TimeShift(shift)).sample_sigma(
            (n,), generator=torch.Generator().manual_seed(0)).double()
        logit = (t / (1 - t)).log()
        # sampling error, not rounding: the mean and std of n draws have standard errors 0.8/√n = 0.0018 and
        # 0.8/√(2n) = 0.0013, so 0.01 is 5.6 and 7.9 of them (float32 t near 1 adds < 1e-5 to a logit)
        assert logit.mean().item() == pytest.approx(0.3 + math.log(shift), abs=0.01)
        assert logit.std().item() == pytest.approx(0.8, abs=0.01)
    # uniform t shifted by s: P(t' ≤ ½) = P(t ≤ 1/(1 + s)) = 1/(1 + s); a share's standard error is ≤ 0.5/√n = 0.0011
    t = FlowLoss(t_dist="uniform", shift=TimeShift(3.0)).sample_sigma((n,), generator=torch.Generator().manual_seed(1))
    assert (t <= 0.5).double().mean().item() == pytest.approx(0.25, abs=0.005)


def test_a_dynamic_shift_draws_each_packed_sample_at_its_own_length():
    """FlowLoss's own draw with a dynamic shift: the t the network sees is the logit-normal draw shifted by each
    sample's count of real tokens."""
    shift = TimeShift(dynamic=True, base_seq_len=2, max_seq_len=6, base_shift=0.0, max_shift=2.0)
    seg = torch.tensor([[0, 0, 1, 1, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(3))
    F = Constant(0.0)
    FlowLoss(shift=shift)(FlowPrecond(F), x, Inputs(None, seg=seg), mask=seg >= 0,
                          generator=torch.Generator().manual_seed(4))
    raw = torch.sigmoid(torch.randn((2, 2), generator=torch.Generator().manual_seed(4)))
    lengths = torch.tensor([[2.0, 4.0], [8.0, 0.0]])  # row 1 holds one sample; its second slot is unused
    assert torch.equal(token_counts(seg, 2), lengths)
    assert_close_fp32(F.seen[1] / 1000, shift(raw, lengths), work=8)  # exp, a few products, ×1000 and back
    mu = shift.mu(lengths)
    assert torch.equal(mu[0], torch.tensor([0.0, 1.0]))  # 2 tokens: base_shift 0; 4: halfway to max_shift
    with pytest.raises(ValueError, match="pass lengths"):
        FlowLoss(shift=shift).sample_sigma((2, 2))


# --------------------------------------------------------------------------------------------------
# The time shift against diffusers


def test_constant_shift_is_the_schedulers():
    """TimeShift(s) on the scheduler's 1000 training sigmas k/1000 (float32) gives its shifted ones, bit for bit."""
    for s in SHIFTS:
        plain = FlowMatchEulerDiscreteScheduler().sigmas  # shift 1: the unshifted k/1000, as it computes them
        assert torch.equal(TimeShift(s)(plain), FlowMatchEulerDiscreteScheduler(shift=s).sigmas), s
        assert torch.equal(TimeShift(s)(plain), FlowMatchHeunDiscreteScheduler(shift=s).sigmas), s


def test_dynamic_shift_is_flux_s_mu_and_the_schedulers_exponential_time_shift():
    t = torch.linspace(0.001, 1, 37, dtype=torch.float64)
    euler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    unipc = UniPCMultistepScheduler(use_flow_sigmas=True, use_dynamic_shifting=True)
    for base, top, lo, hi in ((0.5, 1.15, 256, 4096), (0.2, 3.0, 100, 50_000)):
        shift = TimeShift(dynamic=True, base_shift=base, max_shift=top, base_seq_len=lo, max_seq_len=hi)
        for L in LENGTHS:
            mu = shift.mu(L)
            assert mu == calculate_shift(L, lo, hi, base, top)  # the same float operations: equal
            assert torch.equal(shift(t, L), euler.time_shift(mu, 1.0, t))
            assert torch.equal(shift(t, L), unipc.time_shift(mu, 1.0, t))
            # per-sample lengths as a tensor (training): torch's exp against math.exp, a few float64 roundings
            torch.testing.assert_close(shift(t, torch.full_like(t, L)), shift(t, L), rtol=8 * EPS64, atol=0)
    # a constant shift s is the exponential one with e^mu = s: logit(t') = logit(t) + log s (SD3 Eq. 24)
    for s in SHIFTS:
        torch.testing.assert_close(TimeShift(s)(t), euler.time_shift(math.log(s), 1.0, t), rtol=8 * EPS64, atol=0)


def test_time_shift_settings_round_trip_and_are_checked():
    shift = TimeShift(dynamic=True, base_shift=0.3, max_shift=1.5, base_seq_len=128, max_seq_len=8192)
    assert TimeShift.from_dict(json.loads(json.dumps(shift.to_dict()))) == shift
    for kwargs, message in (({"shift": 0.0}, "time shift=0.0 is invalid"),
                            ({"shift": 3.0, "dynamic": True}, "the dynamic shift replaces the constant one"),
                            ({"base_seq_len": 4096, "max_seq_len": 256}, "0 < base_seq_len < max_seq_len"),
                            ({"max_shift": float("nan")}, "max_shift=nan is invalid")):
        with pytest.raises(ValueError, match=message):
            TimeShift(**kwargs)
    with pytest.raises(ValueError, match="keys \\['shfit'\\] are unknown"):
        TimeShift.from_dict({"shfit": 3.0})
    with pytest.raises(ValueError, match="needs the sample's token count"):
        TimeShift(dynamic=True)(torch.tensor(0.5))
    with pytest.raises(ValueError, match="t_dist='beta' is unknown"):
        FlowLoss(t_dist="beta")


@pytest.mark.parametrize("steps", [1, 2, 7, 28, 50])
def test_flow_timesteps_are_the_euler_schedulers_sigmas(steps):
    """Float64 levels that round to FlowMatchEulerDiscreteScheduler's float32 sigmas exactly: N points evenly spaced
    between its (shifted) training sigmas' largest and smallest, shifted once more, then 0."""
    for s in SHIFTS:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=s)
        scheduler.set_timesteps(steps)
        ours = flow_timesteps(steps, TimeShift(s))
        assert ours.dtype == torch.float64 and torch.equal(ours.float(), scheduler.sigmas), s
    for L in LENGTHS:
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        scheduler.set_timesteps(steps, mu=TimeShift(dynamic=True).mu(L))
        assert torch.equal(flow_timesteps(steps, TimeShift(dynamic=True), seq_len=L).float(), scheduler.sigmas), L


# --------------------------------------------------------------------------------------------------
# The samplers against diffusers' loops


class TinyVelocity(nn.Module):
    """A backbone F(x, timestep) nonlinear in both (a per-token MLP), so that solvers of different order differ;
    it records the timesteps it is given (diffusers' units, 0..1000)."""

    def __init__(self, dim: int = 6, hidden: int = 32, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(dim, hidden, generator=g) / dim**0.5)
        self.wt = nn.Parameter(torch.randn(hidden, generator=g) * 2)
        self.b = nn.Parameter(torch.randn(hidden, generator=g) * 0.3)
        self.w2 = nn.Parameter(torch.randn(hidden, dim, generator=g) / hidden**0.5)
        self.seen = []

    def forward(self, x, timestep, inputs=None):
        self.seen.append(timestep.reshape(-1)[0].item())
        t = timestep.to(x.dtype).reshape(-1, 1, 1).expand(x.shape[0], 1, 1) / 1000
        return torch.tanh(x @ self.w1 + t * self.wt + self.b) @ self.w2 + (1 - 2 * t) * x


def diffusers_loop(scheduler, model, x, steps: int, **kw):
    """A diffusers pipeline's denoising loop: set_timesteps, then the model at each timestep and the scheduler's
    step (WanPipeline's, without guidance)."""
    scheduler.set_timesteps(steps, **kw)
    for tau in scheduler.timesteps:
        x = scheduler.step(model(x, tau.expand(x.shape[0])), tau, x).prev_sample
    return x


def exact_loop(model64, noise, t: torch.Tensor, solver: str) -> torch.Tensor:
    """The same steps in float64 throughout, written out: Euler, or Heun's average of the slopes at both ends (the
    last step Euler)."""
    x = noise.double()
    for i in range(len(t) - 1):
        v = model64(x, t[i] * 1000)
        x_next = x + (t[i + 1] - t[i]) * v
        if solver == "heun" and i < len(t) - 2:
            x_next = x + (t[i + 1] - t[i]) * (v + model64(x_next, t[i + 1] * 1000)) / 2
        x = x_next
    return x


def assert_within_fp32_error(ours, theirs32, exact64):
    """diffusers' float32 loop's distance from the float64 computation is this computation's float32 error (the
    network's roundings, measured rather than worked out, as tests/ditcore/test_interop.py bounds DDIM): ditcore's,
    float32 network and float64 state, is as close to the float64 result, within 2x."""
    fp32_error = (theirs32.double() - exact64).abs().max().item()
    assert 0 < fp32_error < 1e-5 * exact64.abs().max().item()
    assert (ours.double() - exact64).abs().max().item() <= 2 * fp32_error


@pytest.mark.parametrize(("solver", "shift", "steps"), [("euler", 1.0, 4), ("euler", 3.0, 20), ("heun", 1.0, 4),
                                                         ("heun", 3.0, 20)])
def test_flow_sampler_is_the_flowmatch_schedulers_loop(solver, shift, steps):
    """Euler is FlowMatchEulerDiscreteScheduler's loop and Heun FlowMatchHeunDiscreteScheduler's (2N − 1 network
    calls at the timesteps t_0, t_1, t_1, t_2, …), the network given the same timesteps bit for bit."""
    net = TinyVelocity().eval()
    noise = torch.randn(3, 10, 6, generator=torch.Generator().manual_seed(1))
    kind = FlowMatchEulerDiscreteScheduler if solver == "euler" else FlowMatchHeunDiscreteScheduler
    with torch.no_grad():
        theirs32 = diffusers_loop(kind(shift=shift), net, noise, steps)
        theirs_seen, net.seen = net.seen, []
        precond = FlowPrecond(net)
        ours = flow_sampler(lambda x, t: precond(x, t.expand(x.shape[0], 1)), noise, steps=steps,
                            shift=TimeShift(shift), solver=solver)
        exact = exact_loop(copy.deepcopy(net).double(), noise, flow_timesteps(steps, TimeShift(shift)), solver)
    assert net.seen == theirs_seen and len(net.seen) == (steps if solver == "euler" else 2 * steps - 1)
    assert ours.dtype == noise.dtype
    assert_within_fp32_error(ours, theirs32, exact)


@pytest.mark.parametrize(("shift", "steps"), [(1.0, 4), (3.0, 20), (5.0, 9)])
def test_unipc_through_the_scheduler_object_is_wan_s_loop(shift, steps):
    """scheduler_sampler with Wan's UniPC (flow_prediction, flow sigmas, flow_shift) against the loop written with the
    scheduler directly: the network sees UniPC's integer timesteps (to one float32 rounding: τ/1000·1000)."""
    net = TinyVelocity(seed=2).eval()
    noise = torch.randn(2, 12, 6, generator=torch.Generator().manual_seed(3))
    wan = lambda: UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
    settings = lambda scheduler: {k: v for k, v in scheduler.config.items() if not k.startswith("_")}
    assert settings(unipc_scheduler(TimeShift(shift))) == settings(wan())
    with torch.no_grad():
        theirs32 = diffusers_loop(wan(), net, noise, steps)
        theirs_seen, net.seen = net.seen, []
        theirs64 = diffusers_loop(wan(), copy.deepcopy(net).double(), noise.double(), steps)
        precond = FlowPrecond(net)
        ours = scheduler_sampler(lambda x, t: precond(x, t.expand(x.shape[0], 1)), noise,
                                 unipc_scheduler(TimeShift(shift)), steps)
    assert len(net.seen) == steps and all(float(tau).is_integer() for tau in theirs_seen)
    for a, tau in zip(net.seen, theirs_seen, strict=True):
        assert abs(a - tau) <= EPS32 * tau  # one rounding
    # UniPC keeps the state in the sample's dtype: its float64 run is the float64 computation of the same steps
    assert_within_fp32_error(ours, theirs32, theirs64)


# --------------------------------------------------------------------------------------------------
# Gaussian data: the exact velocity and ODE solution

S_DATA = 0.5


def gaussian_rate(t):
    """For x₀ ~ N(0, s²) and x_t = (1 − t)x₀ + tε, Var x_t = σ(t)² = (1 − t)²s² + t², Cov(ε − x₀, x_t) = t − (1 − t)s²:
    the exact velocity E[ε − x₀ | x_t = x] = a(t)·x with a(t) = (t − (1 − t)s²)/σ(t)² = σ'(t)/σ(t)."""
    return (t - (1 - t) * S_DATA**2) / ((1 - t) ** 2 * S_DATA**2 + t**2)


def gaussian_velocity(x, t):
    return x * gaussian_rate(t)


def gaussian_case():
    """Noise at t_0 = 1 and the exact x(0): the ODE dx/dt = a(t)x moves x ∝ σ(t), so x(0) = x(1)·s/σ(1) = s·x(1)."""
    noise = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return noise, noise * S_DATA


def rate_bounds():
    """L = max|a|, max|a'| and max|a' + a²| on [0, 1] (x'' = (a' + a²)x), from a fine grid."""
    t = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    a = gaussian_rate(t)
    da = torch.gradient(a, spacing=(t,))[0]
    return a.abs().max().item(), da.abs().max().item(), (da + a**2).abs().max().item()


def uniform_error(steps, solver):
    noise, exact = gaussian_case()
    out = flow_sampler(gaussian_velocity, noise, steps=steps, solver=solver,
                       ts=torch.linspace(1, 0, steps + 1, dtype=torch.float64))
    return (out - exact).abs().max().item()


def test_heun_is_second_order_and_euler_first_on_the_flow_ode():
    euler = [uniform_error(n, "euler") for n in (16, 32, 64, 128)]
    heun = [uniform_error(n, "heun") for n in (16, 32, 64, 128)]
    assert all(1.8 < a / b < 2.2 for a, b in itertools.pairwise(euler)), euler  # doubling the steps halves it
    assert all(3.5 < a / b < 5.0 for a, b in itertools.pairwise(heun)), heun  # ... and quarters Heun's
    assert heun[-1] < 2e-4 and heun[0] < 0.1 * euler[0]


def test_euler_on_the_schedulers_levels_lands_within_its_error_bound():
    """Euler's global error is at most (h_max/2)·max|x''|·(e^L − 1)/L (local errors h²/2·max|x''|, each grown at
    most by e^{L·Δt} after it; L = max|a|), |x''| ≤ max|a' + a²|·max|x(t)| and |x(t)| ≤ |x(1)| (σ(t) ≤ σ(1) = 1)."""
    L, _, curvature = rate_bounds()
    noise, exact = gaussian_case()
    for shift, steps in ((1.0, 200), (3.0, 200), (3.0, 50)):
        t = flow_timesteps(steps, TimeShift(shift))
        h_max = (t[:-1] - t[1:]).max().item()
        bound = h_max / 2 * curvature * noise.abs().max().item() * math.expm1(L) / L
        error = (flow_sampler(gaussian_velocity, noise, steps=steps, shift=TimeShift(shift)) - exact).abs().max()
        assert error.item() < bound, (shift, steps, error.item(), bound)
        heun = flow_sampler(gaussian_velocity, noise, steps=steps, shift=TimeShift(shift), solver="heun")
        assert (heun - exact).abs().max().item() < 0.1 * error.item()


def test_unipc_lands_within_the_offset_of_its_integer_timesteps():
    """UniPC (Wan's sampler) evaluates the velocity at t = ⌊1000 σ⌋/1000, up to 1e-3 before its own σ, and steps with
    σ: it solves the flow ODE with v(x, t − δ), 0 ≤ δ < 1e-3, whose solution is within 1e-3·max|a'|·max|x|·(e^L − 1)/L
    of the exact one (Gronwall); at 200 steps its own second-order error is far below that."""
    L, slope, _ = rate_bounds()
    noise, exact = gaussian_case()
    for shift in (1.0, 3.0):
        scheduler = unipc_scheduler(TimeShift(shift))
        out = scheduler_sampler(gaussian_velocity, noise, scheduler, 200)
        bound = 1e-3 * slope * noise.abs().max().item() * math.expm1(L) / L
        start = float(scheduler.sigmas[0])  # 1 − 1e-6: diffusers moves its first σ off 1; x(0) moves by < 1e-6
        assert (out - exact).abs().max().item() < bound + 1e-6 * noise.abs().max().item(), shift
        assert start == pytest.approx(1 - 1e-6, abs=1e-7)


@pytest.mark.parametrize(("solver", "steps", "nfe"), [("heun", 18, 35), ("heun", 1, 1), ("euler", 18, 18)])
def test_number_of_velocity_evaluations(solver, steps, nfe):
    seen = []

    def velocity(x, t):
        seen.append(float(t))
        return gaussian_velocity(x, t)

    flow_sampler(velocity, torch.randn(3, 4), steps=steps, solver=solver)
    assert len(seen) == nfe


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match=r"solver='unipc' is invalid for flow_sampler.*scheduler_sampler"):
        flow_sampler(gaussian_velocity, torch.randn(2), steps=2, solver="unipc")
    with pytest.raises(ValueError, match="steps=0 is invalid"):
        flow_sampler(gaussian_velocity, torch.randn(2), steps=0)
    with pytest.raises(ValueError, match="needs the sample's token count"):
        flow_sampler(gaussian_velocity, torch.randn(2), steps=2, shift=TimeShift(dynamic=True))
    with pytest.raises(ValueError, match="ts must fall strictly"):
        flow_sampler(gaussian_velocity, torch.randn(2), steps=2, ts=torch.tensor([1.0, 0.5, 0.6, 0.0]))


# --------------------------------------------------------------------------------------------------
# ditcore.sampling.sample with objective flow


def tiny_flow_dit(seed: int = 0) -> DiT:
    model = DiT(preset("DiT-Tiny", in_channels=3, num_classes=3, max_grid=(1, 4, 4)))  # the pixel codec's 3 channels
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


CODEC, STATS = PixelCodec(1), LatentStats(torch.zeros(3), torch.ones(3))


def test_flow_sampling_starts_from_wan_s_noise_and_guides_the_velocity():
    """sample(objective=flow): an untrained DiT (adaLN-Zero: v̂ ≡ 0) returns its start noise, which is what diffusers'
    randn_tensor draws in the latents' layout for the seed (WanPipeline.prepare_latents); a random one returns
    flow_sampler's result with the guided FlowPrecond, and counts its evaluations."""
    untrained = DiT(preset("DiT-Tiny", in_channels=3, num_classes=3, max_grid=(1, 4, 4))).eval()
    got = sample(untrained, CODEC, STATS, class_labels=[0, 2], height=4, width=8, steps=3, guidance=2.0,
                 objective="flow", solver="euler", seed=11)
    wan = randn_tensor((2, 3, 1, 4, 8), generator=torch.Generator("cpu").manual_seed(11), dtype=torch.float32)
    assert torch.equal(got.latents, wan) and got.nfe == 3

    model, shift = tiny_flow_dit(), TimeShift(3.0)
    p = model.cfg.patch_size
    grid = (1, 4 // p, 8 // p)
    inputs = _inputs(model, 2, grid_positions(grid), grid, True, None, None, {"class_labels": [0, 2], "fps": 8.0})
    precond = FlowPrecond(model)
    velocity = guided(lambda x, t: precond(x, t.expand(x.shape[0], 1), inputs), 2.0)
    noise = patchify(wan, p)
    for solver, nfe in (("euler", 3), ("heun", 5), ("unipc", 3)):
        got = sample(model, CODEC, STATS, class_labels=[0, 2], height=4, width=8, steps=3, guidance=2.0,
                     objective="flow", solver=solver, seed=11, shift=shift)
        with torch.no_grad():
            tokens = (scheduler_sampler(velocity, noise, unipc_scheduler(shift), 3) if solver == "unipc" else
                      flow_sampler(velocity, noise, steps=3, shift=shift, solver=solver))
        assert torch.equal(got.latents, unpatchify(tokens, grid, p)), solver
        assert got.nfe == nfe and not torch.equal(got.latents, wan)


def test_flow_sampling_refuses_edm_s_settings_and_edm_refuses_unipc():
    model = tiny_flow_dit()
    run = lambda **kw: sample(model, CODEC, STATS, class_labels=[0], height=4, width=4, steps=2, **kw)
    for kw, message in (({"objective": "flow", "schedule": "ddim"}, "schedule ddim steps through a DDPM"),
                        ({"objective": "flow", "prediction": "eps"}, "prediction='eps' with objective flow"),
                        ({"objective": "flow", "vp": object()}, "a DDPM schedule \\(vp\\) was given for a flow"),
                        ({"objective": "flow", "solver": "rk4"}, "solver='rk4' is invalid for a flow network"),
                        ({"solver": "unipc"}, "solver='unipc' is invalid for an EDM network"),
                        ({"objective": "rf"}, "objective='rf' is unknown")):
        with pytest.raises(ValueError, match=message):
            run(**kw)
