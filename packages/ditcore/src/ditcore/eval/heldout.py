"""The loss on held-out data at fixed noise levels: a curve that can be compared between windows, runs and resumes.

The training loss mixes σ drawn at random, so two windows of it differ by the draw as much as by the model. Here
every held-out sample is noised with the same noise at each of K fixed levels (EDM: σ log-spaced from σ_min to σ_max,
`sigma_buckets`; flow matching: t evenly spaced inside (0, 1), `t_buckets`, as SD3 reports its validation loss), and
the training loss is kept per level. Each level's result is a (sum, count) pair in float64: summed over data-parallel
ranks and then divided, it is the mean over the whole held-out set whatever the batching or the number of ranks.
The weighted total weighs the levels by how much of the training distribution of the level (EDM's log-normal σ,
`bucket_weights`; flow's shifted t, `t_bucket_weights`) falls nearest each, so it estimates the training objective
without its sampling noise.

Each held-out sample's noise is drawn from its own generator, seeded by (seed, its index in the held-out set), and
packed with it (`heldout_batches`): which rank, row or batch holds a sample never changes its noise, so any split of
the set over data-parallel ranks gives the same pairs to sum (`heldout_totals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist

from ditcore.data.packing import PackedBatch, PackedRow, TokenSample, collate, first_fit_decreasing
from ditcore.diffusion.edm import EDMLoss
from ditcore.diffusion.flow import FlowLoss
from ditcore.inputs import Inputs

Loss = EDMLoss | FlowLoss


def sigma_buckets(n: int = 8, sigma_min: float = 0.002, sigma_max: float = 80.0) -> torch.Tensor:
    """n noise levels, log-spaced from sigma_min to sigma_max (float64)."""
    if n < 1 or not 0 < sigma_min < sigma_max:
        raise ValueError(f"sigma buckets n={n}, sigma_min={sigma_min}, sigma_max={sigma_max}: expected n >= 1 and "
                         "0 < sigma_min < sigma_max")
    if n == 1:
        return torch.tensor([math.sqrt(sigma_min * sigma_max)], dtype=torch.float64)
    return torch.logspace(math.log10(sigma_min), math.log10(sigma_max), n, dtype=torch.float64)


def bucket_weights(buckets: torch.Tensor, P_mean: float = -1.2, P_std: float = 1.2) -> torch.Tensor:
    """The probability that ln σ ~ N(P_mean, P_std²) falls nearest each level (in ln σ); they sum to 1."""
    log = buckets.log()
    edges = torch.cat([log.new_tensor([-math.inf]), (log[1:] + log[:-1]) / 2, log.new_tensor([math.inf])])
    cdf = 0.5 * (1 + torch.erf((edges - P_mean) / (P_std * math.sqrt(2))))
    return cdf[1:] - cdf[:-1]


def t_buckets(n: int = 8, t_min: float = 0.05, t_max: float = 0.95) -> torch.Tensor:
    """n levels of flow matching's t, evenly spaced from t_min to t_max (float64), as SD3 reports its validation loss
    (§5.3.3: levels equidistant in t ∈ (0, 1)). The ends stay away from 0 and 1, where the loss measures the data
    rather than the model: at t → 0 the input is the clean x₀ and the target ε − x₀ keeps all of ε's variance (no
    network can predict the noise), at t → 1 the input is the noise and the target keeps all of x₀'s; and the
    logit-normal training distribution has no mass there (its density vanishes at both ends, SD3 Eq. 19)."""
    if n < 1 or not 0 < t_min < t_max < 1:
        raise ValueError(f"t buckets n={n}, t_min={t_min}, t_max={t_max}: expected n >= 1 and 0 < t_min < t_max < 1")
    if n == 1:
        return torch.tensor([(t_min + t_max) / 2], dtype=torch.float64)
    return torch.linspace(t_min, t_max, n, dtype=torch.float64)


def t_bucket_weights(buckets: torch.Tensor, loss: FlowLoss, seq_len: int | None = None) -> torch.Tensor:
    """The probability that the training t of `loss` (drawn, then shifted) falls nearest each level (in t); they sum
    to 1. The shift adds log s to logit(t) (ditcore.diffusion.flow), so logit(t') is N(t_mean + log s, t_std²) for
    logit-normal t and logistic, shifted by log s, for uniform t. A dynamic shift is taken at seq_len tokens (default
    its base_seq_len, where log s = base_shift): a run's samples of other lengths train at other shifts."""
    log_s = loss.shift.log_shift(loss.shift.base_seq_len if seq_len is None else seq_len)
    mid = (buckets[1:] + buckets[:-1]) / 2
    logit = (mid / (1 - mid)).log() - log_s  # the edges' logit before the shift
    if loss.t_dist == "logit_normal":
        inner = 0.5 * (1 + torch.erf((logit - loss.t_mean) / (loss.t_std * math.sqrt(2))))
    else:
        inner = torch.sigmoid(logit)
    cdf = torch.cat([inner.new_zeros(1), inner, inner.new_ones(1)])
    return cdf[1:] - cdf[:-1]


def heldout_losses(denoiser, x: torch.Tensor, noise: torch.Tensor, buckets: torch.Tensor, *, loss: Loss,
                   inputs: Inputs | None = None, mask: torch.Tensor | None = None, S: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per level k: (Σ w(k)‖out(noisy(x, n, k); k) − target(x, n)‖² over real tokens' features, how many there are),
    float64: the loss's own noising, target and weight (EDM: λ(σ_k)‖D(x + σ_k n; σ_k) − x‖²; flow: ‖v̂(x_t; t_k) −
    (n − x)‖²).

    x, noise: (B, N, F), the noise fixed per held-out sample; inputs/mask as the loss takes them; S: samples per row
    (default: read from seg, which waits for the device). Every sample of the batch is noised to the same level k
    (rounded to a DDPM network's own level under VP, as its training is)."""
    B, seg = x.shape[0], None if inputs is None else inputs.seg
    if S is None:
        S = 1 if seg is None else int(seg.max()) + 1
    sums, counts = [], []
    keep = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
    with torch.no_grad():
        for s in buckets.tolist():
            sigma = torch.full((B, S), s, device=x.device)
            if loss.vp is not None:
                sigma = loss.vp.round_sigma(sigma)
            out = denoiser(loss.noisy(x, sigma, noise, seg), sigma, inputs)
            weight = loss.weight(sigma[:, :1].double())[..., None]  # one level for every sample
            err = ((out.double() - loss.target(x, noise).double()) ** 2).sum(-1)  # (B, N)
            sums.append((weight[..., 0] * err * keep).sum())
            counts.append(keep.sum().double() * x.shape[-1])
    return torch.stack(sums), torch.stack(counts)


def heldout_noise(seed: int, index: int, shape) -> torch.Tensor:
    """The noise of the held-out set's sample `index` (int tuples hash the same in every process and Python run)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(hash((seed, index)) % 2**62))


def heldout_batches(samples: list[TokenSample], indices: list[int], seed: int, seq_length: int, rows: int,
                    text_multiple: int = 1, inputs: type[Inputs] = Inputs) -> list[PackedBatch]:
    """Samples of the held-out set (their `indices` in it) packed into batches of `rows` rows of seq_length tokens,
    each token carrying its sample's noise after its features (`split_noise`); inputs: the model's inputs type."""
    noisy = [dataclasses.replace(s, tokens=torch.cat([s.tokens, heldout_noise(seed, i, s.tokens.shape)], -1))
             for s, i in zip(samples, indices, strict=True)]
    packed = [PackedRow([noisy[i] for i in b]) for b in first_fit_decreasing([len(s.tokens) for s in noisy],
                                                                               seq_length)]
    return [collate(packed[k:k + rows], seq_length, text_multiple, inputs) for k in range(0, len(packed), rows)]


def split_noise(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A heldout_batches batch's (x, noise), each (B, N, F)."""
    return batch.x.chunk(2, dim=-1)


def heldout_totals(denoiser, batches: list[PackedBatch], buckets: torch.Tensor, loss: Loss, *, device, cfg,
                   latent_map=None, group=None, autocast=contextlib.nullcontext
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective over `group` (the data-parallel ranks, each with its own batches): the (sum, count) pairs of every
    level over the whole held-out set, float64 on `device`. latent_map: dataset units → the network's, if they
    differ; autocast: the context the forward runs in (the run's precision)."""
    sums = torch.zeros(len(buckets), dtype=torch.float64, device=device)
    counts = torch.zeros_like(sums)
    for batch in batches:
        batch = batch.to(device)
        x, noise = split_noise(batch)
        if latent_map is not None:
            x = latent_map(x, batch.mask)
        inputs = batch.inputs().dropped(None, cfg)  # unlabelled: the null class
        with autocast():
            s, c = heldout_losses(denoiser, x, noise, buckets, loss=loss, inputs=inputs, mask=batch.mask,
                                  S=batch.per_sample_shape[1])
        sums += s
        counts += c
    if group is not None and dist.get_world_size(group) > 1:
        pairs = torch.stack([sums, counts])
        dist.all_reduce(pairs, group=group)  # in float64, far below the fp32 rounding of what it adds
        sums, counts = pairs
    return sums, counts
