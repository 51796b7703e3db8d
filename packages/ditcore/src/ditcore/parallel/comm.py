"""Sequence-dimension collectives with the backward each use needs (plain torch.distributed, CPU and GPU)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, grad: str) -> torch.Tensor:
        ctx.group, ctx.grad = group, grad
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if ctx.grad == "split":
            return grad_out.chunk(world)[rank].contiguous(), None, None
        out = grad_out.new_empty((grad_out.shape[0] // world, *grad_out.shape[1:]))
        dist.reduce_scatter_tensor(out, grad_out.contiguous(), group=ctx.group)
        return out, None, None


def gather_seq(x: torch.Tensor, group, grad: Literal["split", "reduce_scatter"]) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (the sequence), in rank order.

    grad="split": what follows runs identically on every rank, so each rank keeps its own slice of the
    gradient. grad="reduce_scatter": what follows differs per rank (each rank's queries attend to all keys),
    so the slices' gradients are summed over ranks.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _GatherSeq.apply(x, group, grad)
