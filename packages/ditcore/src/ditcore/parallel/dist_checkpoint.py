"""Training state of any layout as layout-free views, for ditcore.runs to write and read with
torch.distributed.checkpoint (DCP).

Every tensor of the state (model and EMA weights, AdamW moments) is given to DCP as a DTensor of its one-device
shape over a (tp, dp_cp) mesh of all ranks — of its pipeline stage's ranks under PP, each stage holding its own
blocks: `Shard(partition_dim)` or `Replicate()` over TP (as the plan splits it), `Shard(0)` (FSDP) or `Replicate()`
over DP×CP; HSDP's over a (tp, replicate, shard) mesh of the same ranks, `Replicate()` and `Shard(0)` over its two
data-parallel dimensions. The DTensors are views of the live tensors, so nothing is copied. Each rank writes only the
pieces it holds (a replicated piece once, by one rank) and reads exactly the pieces its own layout needs: a checkpoint
written with one layout resumes with any other (TP=2 → FSDP over DP=2, FSDP over 2 → one process, TP=2 → two
pipeline stages). The keys, the files and reading them back on one device are ditcore.runs.tensors'.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ditcore.parallel.consolidate import without_extra_state
from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.expert_parallel import is_expert_sharded
from ditcore.parallel.fsdp import local
from ditcore.parallel.tensor_parallel import full_shape, is_tp_sharded


def state_tensors(model: nn.Module, ema: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                  groups: ParallelGroups, device_type: str) -> tuple[dict, dict, dict]:
    """The model's, EMA's and optimizer's tensors as layout-free views (collective: creates a mesh once):
    ({parameter or buffer: view}, the same for the EMA ({} without one), {"<parameter>.<state>": view})."""
    mesh = _mesh(groups, device_type)
    params = dict(model.named_parameters())
    weights = _module_tensors(model, params, groups, mesh)
    ema_weights = _module_tensors(ema, params, groups, mesh) if ema is not None else {}  # the model's layout
    optim = {}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        for name, p in params.items():
            for key, value in optimizer.state[p].items():
                if torch.is_tensor(value):  # AdamW: step (0-d, the same on every rank), exp_avg, exp_avg_sq
                    optim[f"{name}.{key}"] = _global(value, p, groups, mesh) if value.ndim else value
    return weights, ema_weights, optim


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state for parameters that have none yet (zeros: what its first step would create), so that a
    checkpoint can be loaded into it before any step."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"checkpoints hold Adam/AdamW state; got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        on_device = group["fused"] or group["capturable"]
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            state = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def _module_tensors(module: nn.Module, params: dict, groups: ParallelGroups, mesh) -> dict:
    out = {}
    for name, value in without_extra_state(module.state_dict()).items():
        like = params.get(name, value)  # a parameter carries its TP tags; a buffer is whole on every rank
        out[name] = _global(value, like, groups, mesh)
    return out


def _global(value: torch.Tensor, like: torch.Tensor, groups: ParallelGroups, mesh) -> DTensor:
    """`value` (this rank's piece, or a DTensor over DP×CP) as a DTensor of its one-device shape over all ranks."""
    piece = local(value).detach()
    tp = Shard(like.partition_dim) if is_tp_sharded(like) else Replicate()
    dp = [Shard(0) if isinstance(value, DTensor) else Replicate()]
    if isinstance(value, DTensor) and value.device_mesh.ndim == 2:  # HSDP: a piece of its group's, replicated
        mesh, dp = _hsdp_mesh(groups, value.device_mesh), [Replicate(), Shard(0)]
    if is_expert_sharded(like) and isinstance(value, DTensor):  # FSDP's: its rows of them, EP's rows split over edp
        mesh, dp = _ep_mesh(groups, mesh.device_type, fsdp=True), [Shard(0), Shard(0)]
    elif is_expert_sharded(like):  # this rank's experts: replicated over the expert-data-parallel ranks
        mesh, dp = _ep_mesh(groups, mesh.device_type), [Replicate(), Shard(0)]
    shape = full_shape(like, groups.dims.tp)
    return DTensor.from_local(piece, mesh, [tp, *dp], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


@functools.cache
def _mesh(groups: ParallelGroups, device_type: str):
    """This pipeline stage's ranks (all ranks without PP) as a (tp, dp_cp) mesh over Megatron's own TP and DP×CP
    groups (no new communicators). Megatron puts TP peers next to each other and stages outermost:
    rank = tp_rank + tp·dp_cp_rank + tp·dp_cp·pp_rank. A tensor that every stage holds (the conditioning
    embedders) is then one replicated piece per stage, and DCP writes it once."""
    from torch.distributed.device_mesh import DeviceMesh

    world, tp, pp = dist.get_world_size(), groups.dims.tp, groups.dims.pp
    ranks = torch.arange(world).reshape(pp, world // (tp * pp), tp)[groups.pp_rank].T
    mesh = DeviceMesh.from_group([groups.tp_group, groups.dp_cp_group], device_type, mesh=ranks,
                                 mesh_dim_names=("tp", "dp_cp"))
    if tuple(mesh.get_coordinate()) != (groups.tp_rank, groups.dp_cp_rank):
        raise RuntimeError(f"rank {dist.get_rank()}: the checkpoint mesh puts it at {mesh.get_coordinate()}, "
                           f"Megatron at tp {groups.tp_rank}, dp×cp {groups.dp_cp_rank}")
    return mesh


@functools.cache
def _ep_mesh(groups: ParallelGroups, device_type: str, fsdp: bool = False):
    """The (tp, dp_cp) mesh with dp_cp split into (expert data parallel, ep) over the same groups (ep consecutive
    DP×CP ranks, ditcore.parallel.dims): rank = tp_rank + tp·(ep_rank + ep·edp_rank) + tp·dp_cp·pp_rank. fsdp: its
    dims ordered (tp, ep, edp) instead, for experts that FSDP shards over edp: DTensor splits a dim sharded twice
    along the mesh's dims in their order, EP's blocks of experts first, then each block over edp."""
    from torch.distributed.device_mesh import DeviceMesh

    world, tp, pp, ep = dist.get_world_size(), groups.dims.tp, groups.dims.pp, groups.dims.ep
    ranks = torch.arange(world).reshape(pp, world // (tp * pp * ep), ep, tp)[groups.pp_rank].permute(2, 0, 1)
    dims = [("tp", groups.tp_group), ("edp", groups.edp_group), ("ep", groups.ep_group)]
    if fsdp:
        ranks, dims = ranks.permute(0, 2, 1), [dims[0], dims[2], dims[1]]
    mesh = DeviceMesh.from_group([g for _, g in dims], device_type, mesh=ranks,
                                 mesh_dim_names=tuple(name for name, _ in dims))
    if (mesh.get_coordinate()[0], mesh.get_local_rank("ep")) != (groups.tp_rank, groups.ep_rank):
        raise RuntimeError(f"rank {dist.get_rank()}: the checkpoint mesh puts it at {mesh.get_coordinate()}, "
                           f"Megatron at tp {groups.tp_rank}, ep {groups.ep_rank}")
    return mesh


@functools.cache
def _hsdp_mesh(groups: ParallelGroups, fsdp_mesh):
    """The (tp, dp_cp) mesh with dp_cp split as HSDP's (replicate, shard) mesh `fsdp_mesh` splits it, over the same
    groups: rank = tp_rank + tp·(shard_rank + shard·replicate_rank) + tp·dp_cp·pp_rank."""
    from torch.distributed.device_mesh import DeviceMesh

    world, tp, pp = dist.get_world_size(), groups.dims.tp, groups.dims.pp
    replicas, shard = fsdp_mesh.shape
    ranks = torch.arange(world).reshape(pp, replicas, shard, tp)[groups.pp_rank].permute(2, 0, 1)
    mesh = DeviceMesh.from_group([groups.tp_group, fsdp_mesh.get_group("replicate"), fsdp_mesh.get_group("shard")],
                                 fsdp_mesh.device_type, mesh=ranks, mesh_dim_names=("tp", "replicate", "shard"))
    if tuple(mesh.get_coordinate()) != (groups.tp_rank, *fsdp_mesh.get_coordinate()):
        raise RuntimeError(f"rank {dist.get_rank()}: the checkpoint mesh puts it at {mesh.get_coordinate()}, "
                           f"HSDP at tp {groups.tp_rank}, (replicate, shard) {fsdp_mesh.get_coordinate()}")
    return mesh
