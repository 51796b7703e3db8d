"""Sequence-dimension collectives with the backward each use needs, as functional collectives
(torch.distributed._functional_collectives): torch.compile records them in a block's graph instead of breaking it
there, and they run on gloo (CPU) and NCCL alike."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class _GatherSumBack(torch.autograd.Function):
    """All-gather along dim 0; backward sums every rank's gradient of this rank's slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.reduce_scatter_single(grad.contiguous(), "sum", 0, ctx.group)), None


class _GatherSplitBack(torch.autograd.Function):
    """All-gather along dim 0; backward keeps this rank's slice of the gradient (what follows ran alike on every
    rank, so each rank's gradient of the whole is already the whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size)[ctx.rank].contiguous(), None, None, None


def gather_seq(x: torch.Tensor, group, grad: Literal["split", "reduce_scatter"], rank: int | None = None,
               size: int | None = None) -> torch.Tensor:
    """Concatenate every rank's x along dim 0 (the sequence), in rank order.

    grad="split": what follows runs identically on every rank, so each rank keeps its own slice of the
    gradient. grad="reduce_scatter": what follows differs per rank (each rank's queries attend to all keys),
    so the slices' gradients are summed over ranks.

    rank, size: this rank's place in `group` and the group's size; pass them (known when the model is parallelized)
    so that a compiled forward asks nothing of torch.distributed.
    """
    size = dist.get_world_size(group) if size is None else size
    if size == 1:
        return x
    if grad == "reduce_scatter":  # (funcol's own autograd variants keep tensors alive longer: written out here)
        return _GatherSumBack.apply(x, group)
    rank = dist.get_rank(group) if rank is None else rank
    return _GatherSplitBack.apply(x, group, rank, size)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), recv, send, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = funcol.all_to_all_single(grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return funcol.wait_tensor(grad), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Send x's first `send[r]` rows (dim 0) to rank r, the next ones onward; receive `recv[r]` rows from rank r, in
    rank order. Its backward sends the gradients back the same way."""
    return _AllToAll.apply(x, send, recv, group)
