"""ditcore.training: a step's random draws are reproducible, and CFG dropout drops what it should."""

import pytest
import torch

from ditcore.data.packing import PackedRow, TokenSample, collate
from ditcore.diffusion import EDMLoss, FlowLoss, TimeShift
from ditcore.layout import grid_positions
from ditcore.models import preset
from ditcore.testing import EPS32, HostReads
from ditcore.training import WithLoss, aux_loss, draw, drop_conditions, step_generator

CFG = preset("DiT-Tiny", num_classes=9)  # null class 9


def drawn(d, name: str) -> torch.Tensor:
    return getattr(d.inputs, name) if name in ("text_seg", "class_labels") else getattr(d, name)


def batch():
    def smp(n_text, label):
        grid = (1, 2, 2)
        meta = {"fps": 8.0} | ({"label": label} if label >= 0 else {})  # unlabelled: no label in its metadata
        return TokenSample("k", torch.randn(4, 6), grid_positions(grid), grid, torch.randn(n_text, 8), meta, "")

    return collate([PackedRow([smp(3, 1), smp(2, -1)]), PackedRow([smp(0, 2)])], seq_length=8)


def test_same_seed_step_micro_and_rank_draw_the_same_values():
    b, loss = batch(), EDMLoss()
    a1, a2 = (draw(b, step_generator(0, 5, 1, 0), loss, 0.5, CFG) for _ in range(2))
    other = draw(b, step_generator(0, 5, 1, 1), loss, 0.5, CFG)  # another data-parallel rank
    for f in ("text_seg", "class_labels", "sigma", "noise"):
        assert torch.equal(drawn(a1, f), drawn(a2, f)), f
    assert not torch.equal(a1.noise, other.noise)
    assert a1.sigma.shape == (2, 2) and a1.noise.shape == b.x.shape


def test_dropout_empties_text_and_nulls_labels_per_sample():
    b = batch()
    keep = drop_conditions(b, 0.0, CFG, g=torch.Generator().manual_seed(0))
    assert torch.equal(keep.text_seg, b.text_seg)
    assert keep.class_labels.tolist() == [[1, 9], [2, 9]]  # unlabelled samples and unused slots get the null class
    assert torch.equal(keep.fps, b.conditions["fps"])  # a condition without a null value is never dropped
    dropped = drop_conditions(b, 1.0, CFG, g=torch.Generator().manual_seed(0))
    assert (dropped.text_seg == -1).all() and (dropped.class_labels == 9).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_draws_are_made_on_the_batch_s_device_and_repeat(device):
    b, loss = batch().to(device), EDMLoss()
    a1, a2 = (draw(b, step_generator(0, 5, 1, 0, device), loss, 0.5, CFG) for _ in range(2))
    for f in ("text_seg", "class_labels", "sigma", "noise"):
        assert drawn(a1, f).device.type == device and torch.equal(drawn(a1, f), drawn(a2, f)), f


def test_a_dynamic_shift_gives_each_packed_sample_the_shift_of_its_own_length():
    """draw() hands FlowLoss each sample's token count, counted on the device without a host read: two samples packed
    in one row (4 and 8 tokens) are shifted by their own mu, logit t' = logit t + mu(length)."""
    def smp(grid):
        n = grid[0] * grid[1] * grid[2]
        return TokenSample("k", torch.randn(n, 6), grid_positions(grid), grid, torch.zeros(0, 8), {"fps": 8.0}, "")

    b = collate([PackedRow([smp((1, 2, 2)), smp((1, 2, 4))]), PackedRow([smp((1, 4, 4))])], seq_length=16)
    shift = TimeShift(dynamic=True, base_seq_len=4, max_seq_len=16, base_shift=0.0, max_shift=3.0)  # mu = (n − 4)/4
    with HostReads("cpu"):
        d = draw(b, step_generator(0, 5, 1, 0), FlowLoss(shift=shift), 0.5, CFG)
    g = step_generator(0, 5, 1, 0)  # replayed: CFG dropout's draw, then t's logit-normal one
    torch.rand((2, 2), generator=g)
    raw = torch.sigmoid(torch.randn((2, 2), generator=g))
    logit = lambda t: (t.double() / (1 - t.double())).log()
    mu = torch.tensor([[0.0, 1.0], [3.0, -1.0]], dtype=torch.float64)  # 4 and 8 tokens; 16; the empty slot: 0
    # float32 t and t' (sigmoid; exp and three roundings) read through a logit, which turns a rounding of t into
    # Δt/(t(1 − t)): a few ε over the smallest t(1 − t) of either
    bound = 8 * EPS32 / min((raw * (1 - raw)).min().item(), (d.sigma * (1 - d.sigma)).min().item())
    torch.testing.assert_close(logit(d.sigma) - logit(raw), mu, rtol=0, atol=bound)
    plain = draw(b, step_generator(0, 5, 1, 0), FlowLoss(), 0.5, CFG)  # no shift: the same draw unshifted
    assert torch.equal(plain.sigma, raw) and torch.equal(plain.noise, d.noise)


def test_a_batch_mapped_to_the_model_s_latent_stats_is_the_scaled_raw_latents():
    """A dataset stores (z − mean)/std · σ_d with its measured per-channel stats; a network trained on DiT's 0.18215 z
    (stats mean 0, std σ_d/0.18215) is fed exactly that, token by token, padding left at zero."""
    from ditcore.codecs import LatentStats
    from ditcore.layout import SIGMA_DATA, patchify
    from ditcore.training import LatentMap

    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 1, 8, 8, generator=g) * torch.tensor([3.0, 5.0, 0.5, 8.0]).view(1, 4, 1, 1, 1) \
        + torch.tensor([1.0, -2.0, 0.3, 4.0]).view(1, 4, 1, 1, 1)  # (B, C, T, H, W): channels of their own scale
    data = LatentStats.measure([z])
    model = LatentStats(torch.zeros(4), torch.full((4,), SIGMA_DATA / 0.18215))
    tokens = patchify(data.normalize(z), 2)  # (B, 16, 16): what the loader gives, channel-major features
    mask = torch.ones(tokens.shape[:2], dtype=torch.bool)
    mask[2, 10:] = False  # a padded row
    tokens[2, 10:] = 0
    mapped = LatentMap.between(data, model, values_per_channel=4)(tokens, mask)
    expected = patchify(0.18215 * z, 2)
    expected[2, 10:] = 0
    # z normalised and back: a few float32 roundings of values up to |0.18215 z| ~ 4
    torch.testing.assert_close(mapped, expected, rtol=0, atol=8 * 1.2e-7 * expected.abs().max().item())


def test_a_stages_own_loss_rides_on_the_backward_of_what_it_hands_on():
    """ditcore.training.WithLoss: the hidden states pass unchanged, and their backward also backpropagates the
    stage's loss (a pipeline stage's MoE aux loss) with the given scale, as if it had been added to the objective."""
    w = torch.tensor([1.5, -2.0], requires_grad=True)
    h = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    out = h * w  # what a stage sends on
    aux = (w**2).sum()  # its own loss term
    grad = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))  # what the next stage sends back
    sent = WithLoss.apply(out, aux, 0.25)
    assert torch.equal(sent, out)
    torch.autograd.backward(sent, grad)
    expected = (h * grad).sum(0) + 0.25 * 2 * w.detach()
    assert torch.allclose(w.grad, expected, rtol=1e-6, atol=0)


def test_under_sequence_parallelism_each_tp_rank_trains_on_its_share_of_the_routing_loss():
    """finalize_grads sums the router's gradients over TP under SP, where the ranks split a row's tokens: each counts
    1/tp of its own routing losses, so that the layout trains on their mean, as DP and CP (which average) do."""
    from ditcore.models.moe import MoEConfig, Routing
    from ditcore.parallel.dims import ParallelDims

    routing = Routing(torch.tensor([[1.2, 3.0, 0.5, 0.5, 0.0]]), MoEConfig(experts=2, balance_loss=0.01, z_loss=0.001))
    assert aux_loss(routing, ParallelDims()) == pytest.approx(0.01 * 1.2 + 0.001 * 3.0)
    sp = ParallelDims(tp=2, sequence_parallel=True)
    for dims, share in ((ParallelDims(tp=2), 1), (ParallelDims(cp=2), 1), (sp, 2)):
        assert aux_loss(routing, dims) == pytest.approx(routing.aux_loss / share)
