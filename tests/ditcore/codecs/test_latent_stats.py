import json

import pytest
import torch

from ditcore.codecs import LatentStats
from ditcore.layout import SIGMA_DATA
from ditcore.testing import assert_close_fp32, fp32_tolerance

MEANS, STDS = torch.tensor([3.0, -1.0, 0.0, 10.0]), torch.tensor([0.1, 2.0, 1.0, 5.0])


def latents(batch=8, seed=0):
    """(batch, 4, 2, 6, 6) with channel c ~ N(MEANS[c], STDS[c]²)."""
    z = torch.randn(batch, 4, 2, 6, 6, generator=torch.Generator().manual_seed(seed))
    return z * STDS.view(1, 4, 1, 1, 1) + MEANS.view(1, 4, 1, 1, 1)


def test_normalised_latents_have_mean_zero_and_std_sigma_data():
    batches = [latents(seed=i) for i in range(3)]
    stats = LatentStats.measure(batches)
    # Sampling error, not rounding: each channel's mean over n = 3·8·2·6·6 = 1728 draws has standard error
    # STDS/√n ≤ 0.12, so 0.25 is 2.1 of the widest channel's (the seeded draws are within 1.4 of each channel's).
    torch.testing.assert_close(stats.mean, MEANS, atol=0.05 * STDS.max().item(), rtol=0)
    z = torch.cat(batches)
    normalised = stats.normalize(z)
    per_channel = normalised.transpose(0, 1).reshape(4, -1).double()
    # What is left is float32 rounding: of the stored mean and std, then subtract, divide, scale (work 4), relative
    # to the raw latents, which normalising magnifies by σ_data/std.
    atol = fp32_tolerance(4, scale=(z.abs().amax((0, 2, 3, 4)) / stats.std).max().item() * SIGMA_DATA)
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(4, dtype=torch.float64), atol=atol, rtol=0)
    torch.testing.assert_close(per_channel.std(1, correction=0), torch.full((4,), SIGMA_DATA, dtype=torch.float64),
                               atol=atol, rtol=0)


def test_batches_and_single_samples_measure_the_same():
    z = latents()
    whole = LatentStats.measure([z])
    samples = LatentStats.measure(list(z))  # (C, T, H, W) each: channel axis 0
    # float64 sums in another order, each rounded once to float32 (their float64 errors are far below that)
    assert_close_fp32(samples.mean, whole.mean, work=1)
    assert_close_fp32(samples.std, whole.std, work=1)
    # and agree with torch's own statistics of the whole tensor: in float32, a mean and a sum of squared
    # deviations over each channel's n values, relative to that channel's std
    n = z.numel() // 4
    torch.testing.assert_close(whole.std, z.transpose(0, 1).reshape(4, -1).std(1, correction=0),
                               rtol=fp32_tolerance(2 * n, scale=1.0), atol=0)


def test_denormalize_inverts_normalize_for_batches_and_samples():
    z = latents()
    stats = LatentStats.measure([z])
    # six roundings (− mean, / std, · σ_data and back), each of a value no larger than |z| + |mean| ≤ 2·max|z|: 6u·2
    assert_close_fp32(stats.denormalize(stats.normalize(z)), z, work=6)
    assert_close_fp32(stats.denormalize(stats.normalize(z[0])), z[0], work=6)
    assert torch.equal(stats.normalize(z)[3], stats.normalize(z[3]))  # the same elementwise operations
    assert stats.normalize(z.bfloat16()).dtype == torch.bfloat16


def test_dict_round_trip_is_exact_and_json():
    stats = LatentStats.measure([latents()])
    again = LatentStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert torch.equal(again.mean, stats.mean) and torch.equal(again.std, stats.std)


def test_constant_channel_stays_finite():
    z = latents()
    z[:, 2] = 1.5
    stats = LatentStats.measure([z])
    assert torch.isfinite(stats.normalize(z)).all() and stats.normalize(z)[:, 2].abs().max() == 0


def test_errors_name_the_shape():
    stats = LatentStats.measure([latents()])
    with pytest.raises(ValueError, match=r"\(2, 3, 2, 6, 6\) have 3 channels on axis 1: these statistics are for 4"):
        stats.normalize(torch.zeros(2, 3, 2, 6, 6))
    with pytest.raises(ValueError, match=r"latents of shape \(4, 6\): expected a batch"):
        stats.normalize(torch.zeros(4, 6))
    with pytest.raises(ValueError, match="with 3 channels after ones with 4: mixed codecs"):
        LatentStats.measure([latents(), torch.zeros(1, 3, 1, 2, 2)])
    with pytest.raises(ValueError, match="got no latents"):
        LatentStats.measure([])
    with pytest.raises(ValueError, match="std must be > 0"):
        LatentStats.from_dict({"mean": [0.0], "std": [0.0]})


def test_pooled_stats_keep_the_channels_relative_scales():
    """One std for all channels: the root mean square of theirs, so the whole latent still has std σ_data."""
    stats = LatentStats(MEANS.clone(), STDS.clone())
    pooled = stats.pooled()
    rms = STDS.pow(2).mean().sqrt()
    torch.testing.assert_close(pooled.mean, MEANS, rtol=0, atol=0)
    torch.testing.assert_close(pooled.std, rms.expand(4), rtol=1e-6, atol=0)
    z = latents(batch=64)
    centred = pooled.normalize(z) - pooled.normalize(MEANS.view(1, 4, 1, 1, 1).expand_as(z))
    # each channel is scaled by the same factor σ_data / rms: their ratios are the raw ones
    ratio = centred.transpose(0, 1).reshape(4, -1).std(1) / (z.transpose(0, 1).reshape(4, -1).std(1))
    torch.testing.assert_close(ratio, torch.full((4,), SIGMA_DATA / rms.item()), rtol=1e-5, atol=0)
    assert pooled.std.dtype == torch.float32 and stats.std.equal(STDS)  # the original is untouched
