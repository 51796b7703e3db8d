"""Held-out loss at fixed noise levels: per level it is EDM's loss at that σ, and its (sum, count) pairs reduce over
any split of the held-out set to the loss of the whole."""

from __future__ import annotations

import pytest
import torch

from ditcore.data.packing import TokenSample
from ditcore.diffusion import EDMLoss, EDMPrecond, FlowLoss, FlowPrecond, TimeShift
from ditcore.eval.heldout import (
    bucket_weights,
    heldout_batches,
    heldout_losses,
    heldout_noise,
    heldout_totals,
    sigma_buckets,
    split_noise,
    t_bucket_weights,
    t_buckets,
)
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import DiT, preset
from ditcore.testing import assert_close_fp32, dit_forward_work


def test_buckets_are_log_spaced_and_weighted_by_the_training_distribution():
    b = sigma_buckets(8)
    assert abs(b[0].item() - 0.002) < 1e-15 and abs(b[-1].item() - 80.0) < 1e-12
    ratios = b[1:] / b[:-1]
    assert torch.allclose(ratios, ratios[0].expand_as(ratios), rtol=1e-12, atol=0)
    w = bucket_weights(b)
    assert abs(w.sum().item() - 1) < 1e-12
    # Monte Carlo: the share of EDM's training draws nearest each level (in ln σ)
    draws = EDMLoss().sample_sigma((400_000,), generator=torch.Generator().manual_seed(0)).double()
    nearest = (draws.log()[:, None] - b.log()).abs().argmin(1)
    share = torch.bincount(nearest, minlength=8).double() / len(draws)
    assert (share - w).abs().max() < 4 * (0.25 / len(draws)) ** 0.5  # 4 standard errors of a share


def test_each_level_is_edms_loss_at_that_sigma_and_splits_reduce_to_the_whole():
    cfg = preset("DiT-Tiny", num_classes=3, in_channels=4, max_grid=(1, 4, 4))
    model = DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    g = torch.Generator().manual_seed(2)
    B, N = 6, 16
    x, noise = torch.randn(B, N, cfg.patch_dim, generator=g) * 0.5, torch.randn(B, N, cfg.patch_dim, generator=g)
    inputs = Inputs(grid_positions((1, 4, 4)), class_labels=torch.randint(0, 3, (B, 1), generator=g))
    den, loss, buckets = EDMPrecond(model), EDMLoss(), sigma_buckets(4)
    sums, counts = heldout_losses(den, x, noise, buckets, loss=loss, inputs=inputs)
    work = dit_forward_work(cfg, N)
    with torch.no_grad():
        for k, s in enumerate(buckets.tolist()):
            expected = loss(den, x, inputs, sigma=torch.full((B, 1), s), noise=noise)
            assert_close_fp32((sums[k] / counts[k]).float(), expected, work=work)
    # two "ranks" holding halves of the held-out set: their summed pairs give the whole set's mean
    halves = [heldout_losses(den, x[i:i + 3], noise[i:i + 3], buckets, loss=loss,
                             inputs=inputs.replace(class_labels=inputs.class_labels[i:i + 3])) for i in (0, 3)]
    split = (halves[0][0] + halves[1][0]) / (halves[0][1] + halves[1][1])
    assert_close_fp32(split.float(), (sums / counts).float(), work=work)


FLOW_LOSSES = {  # SD3's logit-normal t, shifted as Wan (3) shifts it; uniform t; a dynamic shift at 1024 tokens
    "logit_normal, shift 3": (FlowLoss(t_mean=0.2, t_std=0.9, shift=TimeShift(3.0)), None),
    "uniform": (FlowLoss(t_dist="uniform"), None),
    "uniform, shift 0.5": (FlowLoss(t_dist="uniform", shift=TimeShift(0.5)), None),
    "logit_normal, dynamic": (FlowLoss(shift=TimeShift(dynamic=True)), 1024),
}


@pytest.mark.parametrize("name", FLOW_LOSSES)
def test_t_buckets_are_evenly_spaced_and_weighted_by_the_shifted_training_distribution(name):
    loss, seq_len = FLOW_LOSSES[name]
    b = t_buckets(8)
    assert b[0].item() == 0.05 and b[-1].item() == 0.95
    torch.testing.assert_close(b[1:] - b[:-1], torch.full((7,), 0.9 / 7, dtype=torch.float64), rtol=0, atol=1e-15)
    w = t_bucket_weights(b, loss, seq_len)
    assert abs(w.sum().item() - 1) < 1e-12 and (w > 0).all()
    # Monte Carlo: the share of the loss's own training draws (shifted) nearest each level (in t)
    n = 400_000
    lengths = None if seq_len is None else torch.full((n,), float(seq_len))
    draws = loss.sample_sigma((n,), generator=torch.Generator().manual_seed(0), lengths=lengths).double()
    share = torch.bincount((draws[:, None] - b).abs().argmin(1), minlength=8).double() / n
    assert (share - w).abs().max() < 4 * (0.25 / n) ** 0.5  # 4 standard errors of a share


def test_t_bucket_refusals_and_a_single_level():
    assert t_buckets(1).tolist() == [0.5] and t_bucket_weights(t_buckets(1), FlowLoss()).tolist() == [1.0]
    with pytest.raises(ValueError, match="0 < t_min < t_max < 1"):
        t_buckets(4, 0.0, 0.9)


def test_each_level_is_the_flow_loss_at_that_t():
    """heldout_losses is generic over the loss: with FlowLoss each level is ‖v̂(x_t; t_k) − (n − x)‖², FlowLoss's own
    value at that t and noise."""
    cfg = preset("DiT-Tiny", num_classes=3, in_channels=4, max_grid=(1, 4, 4))
    model = DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    g = torch.Generator().manual_seed(3)
    B, N = 4, 16
    x, noise = torch.randn(B, N, cfg.patch_dim, generator=g) * 0.5, torch.randn(B, N, cfg.patch_dim, generator=g)
    inputs = Inputs(grid_positions((1, 4, 4)), class_labels=torch.randint(0, 3, (B, 1), generator=g))
    den, loss, buckets = FlowPrecond(model), FlowLoss(shift=TimeShift(3.0)), t_buckets(4)
    sums, counts = heldout_losses(den, x, noise, buckets, loss=loss, inputs=inputs)
    assert counts.tolist() == [B * N * cfg.patch_dim] * 4
    work = dit_forward_work(cfg, N)
    with torch.no_grad():
        for k, t in enumerate(buckets.tolist()):
            expected = loss(den, x, inputs, sigma=torch.full((B, 1), t), noise=noise)
            assert_close_fp32((sums[k] / counts[k]).float(), expected, work=work)
            # and written out: the velocity's squared error, no weight
            v = den(FlowLoss.noisy(x, torch.full((B, 1), t), noise), torch.full((B, 1), t), inputs)
            assert_close_fp32((sums[k] / counts[k]).float(), ((v - (noise - x)) ** 2).mean(), work=work)


def _heldout_set(n: int, patch_dim: int) -> list[TokenSample]:
    g = torch.Generator().manual_seed(5)
    grids = [(1, 4, 4), (1, 2, 4), (1, 2, 2), (1, 3, 3), (1, 4, 2), (1, 1, 4), (1, 4, 4)]
    return [TokenSample(key=f"{i:08d}", tokens=torch.randn(t * h * w, patch_dim, generator=g), pos=grid_positions(
                        (t, h, w)), grid=(t, h, w), text=torch.zeros(0, 0), meta={}, caption="")
            for i, (t, h, w) in enumerate(grids[:n])]


def _noise_by_key(batches) -> dict[str, torch.Tensor]:
    found = {}
    for batch in batches:
        _, noise = split_noise(batch)
        for b, keys in enumerate(batch.keys):
            for s, key in enumerate(keys):
                found[key] = noise[b][batch.seg[b] == s]
    return found


def test_each_samples_noise_and_tokens_do_not_depend_on_the_split_or_the_batching():
    """A sample keeps its noise, drawn from (seed, its index), whichever rank, row or batch holds it."""
    samples = _heldout_set(7, 12)
    whole = _noise_by_key(heldout_batches(samples, list(range(7)), seed=3, seq_length=32, rows=4))
    for dp in (2, 3):
        for rank in range(dp):
            mine = list(range(7))[rank::dp]
            batches = heldout_batches([samples[i] for i in mine], mine, seed=3, seq_length=16, rows=1)
            for key, noise in _noise_by_key(batches).items():
                assert torch.equal(noise, whole[key]), (dp, rank, key)
                assert torch.equal(noise, heldout_noise(3, int(key), noise.shape))
            x, _ = split_noise(batches[0])
            assert torch.equal(x[0][batches[0].seg[0] == 0], samples[int(batches[0].keys[0][0])].tokens)
    assert not torch.equal(whole["00000000"], heldout_noise(4, 0, whole["00000000"].shape))  # the seed matters


class PerToken(torch.nn.Module):
    """A denoiser whose output at each token depends on that token and its noise level alone: its held-out loss is
    the same however the samples are packed, so a split must reproduce the whole set's up to float64 rounding."""

    def forward(self, x, sigma, inputs=None):
        return torch.tanh(x) * 0.7


def test_the_pairs_of_any_split_of_the_set_add_up_to_the_whole_sets_loss():
    samples, buckets, loss = _heldout_set(7, 12), sigma_buckets(5), EDMLoss()
    pairs = lambda mine, rows: heldout_totals(PerToken(), heldout_batches(
        [samples[i] for i in mine], mine, seed=1, seq_length=32, rows=rows), buckets, loss, device="cpu",
        cfg=preset("DiT-Tiny"))
    sums, counts = pairs(list(range(7)), 3)
    assert counts.tolist() == [sum(len(s.tokens) for s in samples) * 12] * 5
    for dp in (2, 3, 7):
        parts = [pairs(list(range(7))[r::dp], 1) for r in range(dp)]
        split_sums, split_counts = sum(p[0] for p in parts), sum(p[1] for p in parts)
        assert torch.equal(split_counts, counts)
        assert torch.allclose(split_sums / split_counts, sums / counts, rtol=1e-13, atol=0), dp
