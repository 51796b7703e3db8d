"""Consolidated (one-device) weights from a model of any TP layout, and back.

CP and DP ranks hold copies (under FSDP, pieces: gathered over DP×CP first); the TP shards are gathered along
the dimension the architecture's plan splits them (ditcore.models.plan), the experts over EP along dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.expert_parallel import is_expert_sharded
from ditcore.parallel.fsdp import local, local_piece
from ditcore.parallel.pipeline import is_shared
from ditcore.parallel.tensor_parallel import is_tp_sharded, shard


def gather_full(model: nn.Module, tensors: dict[str, torch.Tensor], groups: ParallelGroups | None):
    """Unshard tensors named and shaped like `model`'s parameters/buffers (weights or gradients).

    Collective over TP (and over DP×CP for FSDP's DTensors, and over the pipeline): call on every rank. Rank 0
    gets the one-device tensors on CPU, the others None.
    """
    params = dict(model.named_parameters())
    stage_writer = groups is None or (groups.tp_rank == 0 and groups.dp_cp_rank == 0)  # one per pipeline stage
    keep = groups is None or (stage_writer and (groups.dims.pp == 1 or dist.get_rank() == 0))
    full = {}
    for k, v in tensors.items():
        p = params.get(k)
        v = _unshard(v, p, groups)
        if keep:
            full[k] = v.detach().cpu().clone()
        elif stage_writer:  # sent to rank 0 below, one tensor at a time
            full[k] = v.detach()
    if groups is not None and groups.dims.pp > 1 and stage_writer:  # the stages' writers: global rank 0's pipeline
        _gather_stages(full, groups, keep)
    return full if keep else None


def _unshard(v: torch.Tensor, p: torch.Tensor | None, groups: ParallelGroups | None) -> torch.Tensor:
    """One tensor of this rank: gathered over DP×CP (FSDP's DTensor), over EP (the experts), over TP (its shards)."""
    v = v.full_tensor() if isinstance(v, DTensor) else v
    if groups is not None and p is not None and is_expert_sharded(p):  # this rank's experts: all of them
        parts = [torch.empty_like(v) for _ in range(groups.dims.ep)]
        dist.all_gather(parts, v.detach().contiguous(), group=groups.ep_group)
        v = torch.cat(parts)
    if groups is not None and groups.dims.tp > 1 and p is not None and is_tp_sharded(p):
        parts = [torch.empty_like(v) for _ in range(groups.dims.tp)]
        dist.all_gather(parts, v.detach().contiguous(), group=groups.tp_group)
        v = torch.cat(parts, dim=p.partition_dim)
    return v


def _gather_stages(full: dict[str, torch.Tensor], groups: ParallelGroups, keep: bool) -> None:
    """Every pipeline stage's tensors into rank 0's `full` (called by the stages' writers): their names, shapes and
    dtypes first, then each tensor by itself, so that no device ever holds more than one extra tensor."""
    specs = [None] * groups.dims.pp if keep else None
    mine = {k: (tuple(v.shape), v.dtype) for k, v in full.items()}
    dist.gather_object(mine, specs, dst=groups.pp_ranks[0], group=groups.pp_group)
    for stage in range(1, groups.dims.pp):
        src = groups.pp_ranks[stage]
        names = sorted(specs[stage]) if keep else sorted(mine) if groups.pp_rank == stage else []
        for k in names:
            if keep:
                shape, dtype = specs[stage][k]
                t = torch.empty(shape, dtype=dtype, device=_device(groups))
                dist.recv(t, src=src, group=groups.pp_group)
                full[k] = t.cpu()
            else:
                dist.send(full[k].contiguous(), dst=groups.pp_ranks[0], group=groups.pp_group)


def _device(groups: ParallelGroups) -> torch.device:
    """Where point-to-point tensors go: the current CUDA device under NCCL, else the CPU."""
    backend = dist.get_backend(groups.pp_group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def consolidated_state_dict(model: nn.Module, groups: ParallelGroups | None) -> dict[str, torch.Tensor] | None:
    """The one-device state dict of a model of any layout. Collective; rank 0 gets it, the others None."""
    return gather_full(model, without_extra_state(model.state_dict()), groups)


def load_consolidated(model: nn.Module, state: dict[str, torch.Tensor], groups: ParallelGroups | None) -> None:
    """Load a one-device state dict into a model of any layout: each rank takes its shard."""
    params = dict(model.named_parameters())
    tp, rank = (groups.dims.tp, groups.tp_rank) if groups is not None else (1, 0)
    own = without_extra_state(model.state_dict())
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    if groups is not None and groups.dims.pp > 1:  # a pipeline stage takes its own part: other stages' are expected
        unexpected = {k for k in unexpected if is_shared(model, k)}
    if missing or unexpected:
        raise KeyError(f"state dict does not fit this model: missing {sorted(missing)[:5]}, "
                       f"unexpected {sorted(unexpected)[:5]} — is it a checkpoint of another architecture?")
    with torch.no_grad():
        for k, v in own.items():
            p = params.get(k)
            src = shard(state[k], p, rank, tp) if p is not None else state[k]
            if src.shape != v.shape:
                raise ValueError(f"{k}: checkpoint shape {tuple(state[k].shape)} does not fit this model's "
                                 f"{tuple(v.shape)} (shard of tp={tp}, ep={getattr(p, 'ep_size', 1)})")
            local(v).copy_(local_piece(src, v))  # under FSDP, this rank's piece of its shard


def without_extra_state(state: dict) -> dict:
    """Drop Megatron's `_extra_state` entries (TE bookkeeping): they are not weights and not in a one-device model."""
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}
