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


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad = grad_out.new_empty((sum(ctx.send), *grad_out.shape[1:]))
        dist.all_to_all_single(grad, grad_out.contiguous(), output_split_sizes=ctx.send,
                               input_split_sizes=ctx.recv, group=ctx.group)
        return grad, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Send x's first `send[r]` rows (dim 0) to rank r, the next ones onward; receive `recv[r]` rows from rank r, in
    rank order. Its backward sends the gradients back the same way."""
    return _AllToAll.apply(x, send, recv, group)
