"""What one training step draws at random, reproducibly: its generator, CFG dropout, noise levels and noise; and
the latents' units the network is given (`LatentMap`).

Everything depends only on (seed, step, micro-batch, data-parallel rank), so tensor- and context-parallel
peers draw the same values, and a resumed run draws exactly what the uninterrupted one would have. The draws
are made on the batch's device (a CUDA generator on a GPU: nothing is drawn on the host and copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ditcore.codecs import LatentStats
from ditcore.data.packing import PackedBatch
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.diffusion.ddpm import DDPMLoss
from ditcore.layout import SIGMA_DATA

Loss = EDMLoss | DDPMLoss


def step_generator(seed: int, step: int, micro: int, dp_rank: int, device="cpu") -> torch.Generator:
    """The generator of one micro-batch on `device` (int tuples hash the same in every process and Python run)."""
    return torch.Generator(device=device).manual_seed(hash((seed, step, micro, dp_rank)) % 2**62)


def drop_conditions(batch: PackedBatch, p: float, null_class: int, g: torch.Generator):
    """CFG dropout per sample: its text becomes empty (all text tokens masked) and its class the null class.

    Returns (text_seg, class_labels) to use in place of the batch's; unlabelled samples get the null class too.
    """
    B, S = batch.class_labels.shape
    drop = torch.rand(B, S, generator=g, device=g.device) < p
    text_seg = batch.text_seg
    if text_seg.numel():
        dropped = drop.gather(1, text_seg.clamp(min=0)) & (text_seg >= 0)
        text_seg = torch.where(dropped, -1, text_seg)
    labels = torch.where(drop | (batch.class_labels < 0), null_class, batch.class_labels)
    return text_seg, labels


@dataclass
class StepDraw:
    text_seg: torch.Tensor  # (B, L) after CFG dropout
    class_labels: torch.Tensor  # (B, S) after CFG dropout, null class for unlabelled samples
    sigma: torch.Tensor  # (B, S) noise level of each sample
    noise: torch.Tensor  # like batch.x


def draw(batch: PackedBatch, g: torch.Generator, loss: Loss, cfg_dropout: float, null_class: int) -> StepDraw:
    """One micro-batch's random choices, in a fixed order from one generator on the batch's device."""
    text_seg, labels = drop_conditions(batch, cfg_dropout, null_class, g)
    sigma = loss.sample_sigma(tuple(batch.class_labels.shape), device=g.device, generator=g)
    noise = torch.randn(batch.x.shape, generator=g, device=g.device)
    return StepDraw(text_seg, labels, sigma, noise)


def stage_forward(loss: Loss, denoiser: EDMPrecond, x: torch.Tensor, *, last: bool, hidden: torch.Tensor | None,
                  sigma: torch.Tensor, noise: torch.Tensor, seg=None, mask=None, **cond) -> torch.Tensor:
    """One pipeline stage's part of the EDM loss (ditcore.parallel.pipeline): the last stage computes the loss from
    the hidden states it is given; the others run the backbone on the same noisy, preconditioned inputs and return
    their hidden states. With one stage (last, hidden None) it is the loss itself."""
    if last:
        return loss(denoiser, x, seg=seg, mask=mask, sigma=sigma, noise=noise, hidden=hidden, **cond)
    inputs = denoiser.model_inputs(loss.noisy(x, sigma, noise, seg), sigma, seg)
    return denoiser.model(*inputs, seg=seg, hidden=hidden, **cond)


@dataclass(frozen=True)
class LatentMap:
    """Token features normalised by one set of latent statistics → by another, x' = scale x + shift per feature.

    A dataset stores (z − mean)/std · σ_d with its own measured stats; a network imported from the field was trained
    on other units (DiT: 0.18215 z, i.e. mean 0, std σ_d/0.18215) and must be fed those. Per channel,
    x' = (z − mean')/std' · σ_d = x · std/std' + (mean − mean')/std' · σ_d; a token's features are its channels'
    pt·p·p values in turn (ditcore.layout.patchify), so each channel's pair repeats that often.
    """

    scale: torch.Tensor  # (patch_dim,) float32
    shift: torch.Tensor

    @classmethod
    def between(cls, data: LatentStats, model: LatentStats, values_per_channel: int, device=None) -> LatentMap:
        if len(data.mean) != len(model.mean):
            raise ValueError(f"the dataset's latents have {len(data.mean)} channels, the model's {len(model.mean)}")
        scale = data.std.double() / model.std.double()
        shift = (data.mean.double() - model.mean.double()) / model.std.double() * SIGMA_DATA
        spread = lambda v: v.repeat_interleave(values_per_channel).float().to(device)
        return cls(spread(scale), spread(shift))

    def __call__(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, N, patch_dim) in the model's units, padding (mask False) left at zero; on x's device, no sync."""
        mapped = x.float() * self.scale + self.shift
        return torch.where(mask[..., None], mapped, torch.zeros_like(mapped)).to(x.dtype)
