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
from ditcore.diffusion.flow import FlowLoss, token_counts
from ditcore.inputs import Inputs
from ditcore.layout import SIGMA_DATA
from ditcore.models.moe import Routing

Loss = EDMLoss | DDPMLoss | FlowLoss


def step_generator(seed: int, step: int, micro: int, dp_rank: int, device="cpu") -> torch.Generator:
    """The generator of one micro-batch on `device` (int tuples hash the same in every process and Python run)."""
    return torch.Generator(device=device).manual_seed(hash((seed, step, micro, dp_rank)) % 2**62)


def drop_conditions(batch: PackedBatch, p: float, cfg, g: torch.Generator) -> Inputs:
    """The batch's inputs after CFG dropout per sample (Inputs.dropped): a dropped sample's text becomes empty (all
    its text tokens masked) and each condition with a null value takes it (its class the null class); unlabelled
    samples get the null class too. cfg: the model's config, whose null values they are. p: the dropout rate of
    samples whose dataset sets none (batch.drop_rate: a blend's cfg_drop), with the same one draw either way."""
    u = torch.rand(batch.per_sample_shape, generator=g, device=g.device)
    drop = u < (p if batch.drop_rate is None else torch.where(batch.drop_rate.isnan(), p, batch.drop_rate))
    return batch.inputs().dropped(drop, cfg)


@dataclass
class StepDraw:
    inputs: Inputs  # the batch's, after CFG dropout
    sigma: torch.Tensor  # (B, S) noise level of each sample
    noise: torch.Tensor  # like batch.x


def draw(batch: PackedBatch, g: torch.Generator, loss: Loss, cfg_dropout: float, cfg) -> StepDraw:
    """One micro-batch's random choices, in a fixed order from one generator on the batch's device. cfg: the
    model's config (the null values of CFG dropout). A loss whose noise levels depend on each sample's token count
    (FlowLoss with a dynamic time shift: `needs_lengths`) is given them, counted on the device from seg."""
    inputs = drop_conditions(batch, cfg_dropout, cfg, g)
    shape = batch.per_sample_shape
    lengths = {"lengths": token_counts(batch.seg, shape[1])} if getattr(loss, "needs_lengths", False) else {}
    sigma = loss.sample_sigma(shape, device=g.device, generator=g, **lengths)
    noise = torch.randn(batch.x.shape, generator=g, device=g.device)
    return StepDraw(inputs, sigma, noise)


def stage_forward(loss: Loss, denoiser: EDMPrecond, x: torch.Tensor, inputs: Inputs, *, last: bool,
                  hidden: torch.Tensor | None, sigma: torch.Tensor, noise: torch.Tensor, mask=None) -> torch.Tensor:
    """One pipeline stage's part of the EDM loss (ditcore.parallel.pipeline): the last stage computes the loss from
    the hidden states it is given; the others run the backbone on the same noisy, preconditioned inputs and return
    their hidden states. With one stage (last, hidden None) it is the loss itself."""
    if last:
        return loss(denoiser, x, inputs, mask=mask, sigma=sigma, noise=noise, hidden=hidden)
    model_inputs = denoiser.model_inputs(loss.noisy(x, sigma, noise, inputs.seg), sigma, inputs.seg)
    return denoiser.model(*model_inputs, inputs, hidden=hidden)


class WithLoss(torch.autograd.Function):
    """`out` itself, whose backward also runs the backward of the 0-d `loss`, with gradient `scale`: a pipeline
    stage's own loss terms (its MoE blocks' aux loss) ride on the hidden states it hands on, so that the schedule's one
    backward of them (ditcore.parallel.pipeline.one_f_one_b) trains on both."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def aux_loss(routing: Routing, dims) -> torch.Tensor:
    """The MoE blocks' aux loss a rank trains on, of a layout's ParallelDims `dims`: its own tokens' routing losses
    (Routing.aux_loss), whose gradients data and context parallelism average over the ranks like every other; under
    sequence parallelism the TP ranks split a row's tokens and finalize_grads sums the router's gradients over them,
    so each rank's counts 1/tp. Every layout then trains on the mean of its ranks' own routing losses (as Megatron-Core
    computes them per rank by default), which is one process's where the ranks see the same tokens."""
    return routing.aux_loss / (dims.tp if dims.sequence_parallel and dims.tp > 1 else 1)


def routing_of(model) -> Routing | None:
    """The routing statistics of the backbone's last forward, through a data-parallel wrapper (DDP's .module): its
    mixture-of-experts blocks' losses, which the training objective adds to the diffusion loss (`Routing.aux_loss`),
    and their expert shares; None for a model without MoE blocks."""
    return getattr(getattr(model, "module", model), "routing", None)


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
