"""Gradients of a parallelized model: completed after backward, then measured and clipped without host syncs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.expert_parallel import is_expert_sharded, reduce_expert_grads
from ditcore.parallel.fsdp import is_fsdp, local, shard_group
from ditcore.parallel.pipeline import is_shared
from ditcore.parallel.tensor_parallel import is_tp_sharded


def finalize_grads(model: nn.Module, groups: ParallelGroups | None) -> None:
    """Complete the gradients after backward (and after DDP's averaging over DP×CP), before clipping/stepping.

    1. Sum partial gradients of replicated parameters over TP (tagged by `parallelize` from the plan).
    2. Expert parallel: the experts' gradients, which DDP skipped, averaged over their own ranks
       (ditcore.parallel.expert_parallel.reduce_expert_grads).
    3. Context parallel: every CP rank computed the full loss but only its slice of the tokens, so its
       gradients are partial sums; DDP averaged them over DP×CP, which divides by cp once too often.

    Under FSDP each rank does the same to its DP×CP piece of every gradient (TP peers hold the same pieces); FSDP2
    averaged them over all DP×CP ranks, HSDP's replicas included (reduce-scattered within a group, then all-reduced
    across the groups).
    """
    if groups is None:
        return
    if groups.dims.tp > 1 and not any(is_tp_sharded(p) for p in model.parameters()):
        raise RuntimeError("tp > 1 but no parameter carries Megatron's tensor-parallel tags: a move of a sharded "
                           "model (Module.to / to_empty) dropped them — call ditcore.parallel.fsdp.restore_tags "
                           "after it")
    partial = [local(p.grad) for p in model.parameters()
               if p.grad is not None and getattr(p, "tp_partial_grad", False)]
    if partial and groups.dims.tp > 1:
        flat = torch.cat([g.reshape(-1) for g in partial])
        dist.all_reduce(flat, group=groups.tp_group)  # one collective for all of them
        torch._foreach_copy_(partial, [s.view_as(g) for g, s in zip(partial, flat.split([g.numel() for g in partial]),
                                                                         strict=True)])
    if groups.dims.ep > 1:
        reduce_expert_grads(model, groups)
    if groups.dims.cp > 1:
        torch._foreach_mul_(_grads(model), float(groups.dims.cp))


def grad_norm(model: nn.Module, groups: ParallelGroups | None) -> torch.Tensor:
    """Global L2 norm of the gradients, a float64 tensor on their device: TP shards' squares are summed over TP,
    experts' over EP, replicated parameters counted once; under FSDP every rank's pieces are summed over DP×CP
    (HSDP: over its shard group only, whose pieces make a whole parameter; the other groups hold the same ones), the
    experts' over their own shard group, the expert-data-parallel one. One fused (foreach) reduction per kind, one
    collective per kind of split, no host sync. Pipeline stages add up their own.

    torch._foreach_norm gives every gradient's norm (one kernel launch for many tensors; accumulated in float64
    on a CPU, in float32 on a GPU) as float64, and their squares are summed in float64.
    """
    params = [p for n, p in model.named_parameters() if p.grad is not None and _counted_here(model, n, groups)]
    device = local(next(model.parameters())).device
    sharded_sq, replicated_sq, experts_sq = _squares_by_split(params, device)
    if groups is not None and groups.dims.tp > 1:
        dist.all_reduce(sharded_sq, group=groups.tp_group)
    total = sharded_sq + replicated_sq
    if groups is not None and is_fsdp(model):  # every parameter is split over the shard group: add up the pieces
        dist.all_reduce(total, group=shard_group(model))
    if groups is not None and groups.dims.ep > 1:
        _sum_over_expert_ranks(experts_sq, [p for p in params if is_expert_sharded(p)], groups)
    total = total + experts_sq
    if groups is not None and groups.dims.pp > 1:  # each stage its own blocks; the shared embedders once
        dist.all_reduce(total, group=groups.pp_group)
    return total.sqrt()


def _squares_by_split(params: list[nn.Parameter], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The local gradients' sums of squares: of the TP shards, of the replicated parameters, of EP's experts."""
    sharded = [local(p.grad) for p in params if is_tp_sharded(p)]
    replicated = [local(p.grad) for p in params if not is_tp_sharded(p) and not is_expert_sharded(p)]
    experts = [local(p.grad) for p in params if is_expert_sharded(p)]
    return tuple(_sum_of_squares(g, device) for g in (sharded, replicated, experts))


def _sum_over_expert_ranks(experts_sq: torch.Tensor, experts: list[torch.Tensor], groups: ParallelGroups) -> None:
    """The experts' squares: each EP rank holds its own experts, and under FSDP each of the ranks holding the same
    ones its piece of them."""
    dist.all_reduce(experts_sq, group=groups.ep_group)
    if groups.dims.dp * groups.dims.cp > groups.dims.ep and any(isinstance(p.grad, DTensor) for p in experts):
        dist.all_reduce(experts_sq, group=groups.edp_group)


def _counted_here(model: nn.Module, name: str, groups: ParallelGroups | None) -> bool:
    """Pipeline stages hold the conditioning embedders alike (ditcore.parallel.pipeline): the first one counts them."""
    return groups is None or groups.dims.pp == 1 or groups.first_stage or not is_shared(model, name)


def clip_grad_norm_(model: nn.Module, max_norm: float, groups: ParallelGroups | None) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most max_norm (inf: measure only); returns the norm.

    A non-finite norm leaves the gradients as they are (scaling by max_norm/inf = 0 would turn inf into NaN);
    the caller sees the norm and stops.
    """
    norm = grad_norm(model, groups)
    if max_norm != float("inf"):
        scale = torch.where(norm.isfinite(), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
        torch._foreach_mul_(_grads(model), scale.float())
    return norm


def _grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradient tensors (local pieces under FSDP), to scale in place."""
    return [local(p.grad) for p in model.parameters() if p.grad is not None]


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()
