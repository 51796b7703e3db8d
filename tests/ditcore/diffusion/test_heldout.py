"""Held-out loss at fixed noise levels: per level it is EDM's loss at that σ, and its (sum, count) pairs reduce over
any split of the held-out set to the loss of the whole."""

from __future__ import annotations

import torch

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.diffusion.heldout import bucket_weights, heldout_losses, sigma_buckets
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
    cond = dict(pos=grid_positions((1, 4, 4)), class_labels=torch.randint(0, 3, (B, 1), generator=g))
    den, loss, buckets = EDMPrecond(model), EDMLoss(), sigma_buckets(4)
    sums, counts = heldout_losses(den, x, noise, buckets, loss=loss, **cond)
    work = dit_forward_work(cfg, N)
    with torch.no_grad():
        for k, s in enumerate(buckets.tolist()):
            expected = loss(den, x, sigma=torch.full((B, 1), s), noise=noise, **cond)
            assert_close_fp32((sums[k] / counts[k]).float(), expected, work=work)
    # two "ranks" holding halves of the held-out set: their summed pairs give the whole set's mean
    halves = [heldout_losses(den, x[i:i + 3], noise[i:i + 3], buckets, loss=loss, pos=cond["pos"],
                             class_labels=cond["class_labels"][i:i + 3]) for i in (0, 3)]
    split = (halves[0][0] + halves[1][0]) / (halves[0][1] + halves[1][1])
    assert_close_fp32(split.float(), (sums / counts).float(), work=work)
