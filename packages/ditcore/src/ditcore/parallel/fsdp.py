"""Sharded data parallelism (FSDP2 `fully_shard`) over the DP×CP ranks, on top of Megatron-Core TP/SP/CP; or HSDP:
sharded within groups of consecutive DP×CP ranks and replicated across the groups.

    with torch.device("meta"):
        model = DiT(cfg)
    parallelize(model, groups)                  # TP shards (meta)
    apply_fsdp(model, groups, ...)              # each TP shard split again over DP×CP (meta DTensors)
    materialize(model, seed, device, groups)    # only this rank's pieces are ever allocated

Each transformer block is one FSDP unit (its parameters are all-gathered just before it runs and freed after),
the root holds the embedders and the final layer. Parameters, gradients, AdamW state and the EMA copy are all
DTensors sharded along dim 0 over DP×CP: a rank holds 1/(dp·cp) of its TP shard. Gradients are reduce-scattered
(averaged over DP×CP, as DDP would), so `finalize_grads` and `clip_grad_norm_` work on the local pieces.

HSDP (`shard=k`): the DTensors live on a 2-D (replicate, shard) mesh of the DP×CP ranks, (Replicate(), Shard(0)):
a rank holds 1/k of its TP shard, the same piece as the ranks at its place in the other groups. Gathers and
reduce-scatters stay within the group of k ranks; gradients are then all-reduced across the dp·cp/k groups. The
groups are k consecutive DP×CP ranks: with Megatron's rank order (tp-cp-dp-pp) tp·k consecutive global ranks,
one node when tp·k divides the GPUs per node.

What stays gathered (torchtitan's choices): the root and the last block are not resharded after forward (backward
needs them at once: resharding them only to gather them again is waste). With sync="step" no block is, and
`accumulating` keeps parameters gathered and gradients unsharded over a step's micro-batches: one all-gather and
one reduce-scatter per block and step instead of three collectives per block and micro-batch.

The TP tags that Megatron and ditcore put on parameters (`tensor_model_parallel`, `partition_dim`,
`tp_partial_grad`) are carried over to the sharded parameters, which FSDP2 creates anew. `Module.to_empty` and
`Module.to` swap DTensor parameters' contents *and* attributes (torch.utils.swap_tensors), which would drop them:
`apply_fsdp` keeps them by name on the model, and `restore_tags` puts them back after such a move.

Expert parallelism (ditcore.parallel.expert_parallel): a MoE block's experts (this EP rank's E/ep of them) are an FSDP
unit of their own, sharded along dim 0 over the expert-data-parallel ranks (those holding the same experts, dp·cp/ep
of them; one rank when ep = dp·cp) and made before their block's, which then leaves them out (torchtitan's
composition). They are gathered and resharded with their block; their gradients are reduce-scattered within the
expert-data-parallel group, averaged over it, and `reduce_expert_grads` turns that average into the sum over all
DP×CP ranks / (dp·cp) that the other parameters get. Under HSDP the experts are sharded over the same group (plain
FSDP: no replicas of them).
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ditcore.choices import FSDP_SYNCS
from ditcore.errors import ConfigError
from ditcore.models.dit import symbolic_block_inputs
from ditcore.models.moe import GroupedExperts
from ditcore.models.techniques import held_blocks
from ditcore.parallel.dims import ParallelGroups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TAGS = "_ditcore_tp_tags"  # {parameter name: its tags}, kept on the sharded model


_SYNC = "_ditcore_fsdp_sync"  # "micro_batch" or "step", kept on the sharded model for `accumulating`


def dp_cp_mesh(groups: ParallelGroups, device_type: str):
    """A one-dimensional DeviceMesh over the DP×CP group (the ranks that hold the same TP shard)."""
    return _mesh(groups.dp_cp_group, device_type)


def expert_mesh(groups: ParallelGroups, device_type: str):
    """A one-dimensional DeviceMesh over the expert-data-parallel group (the ranks that hold the same experts)."""
    return _mesh(groups.edp_group, device_type, "edp")


def fsdp_mesh(groups: ParallelGroups, device_type: str, shard: int | None = None):
    """The mesh FSDP2 shards over: the DP×CP group, or for HSDP (`shard` < dp·cp) a 2-D (replicate, shard) mesh of it
    whose shard groups are `shard` consecutive DP×CP ranks. Collective the first time (new groups): call on every
    rank."""
    groups.dims.check_fsdp_shard(shard)
    if shard is None or shard == groups.dims.dp * groups.dims.cp:
        return dp_cp_mesh(groups, device_type)
    return _hsdp_mesh(groups, device_type, shard)


@functools.cache
def _mesh(group: dist.ProcessGroup, device_type: str, name: str = "dp_cp"):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group(group, device_type, mesh=torch.tensor(ranks), mesh_dim_names=(name,))


def _hsdp_mesh(groups: ParallelGroups, device_type: str, shard: int):
    world, tp, pp = dist.get_world_size(), groups.dims.tp, groups.dims.pp
    mesh = _hsdp_groups(world, tp, pp, shard, device_type, groups.timeout)
    if mesh.mesh.reshape(-1).tolist() != dist.get_process_group_ranks(groups.dp_cp_group):
        raise RuntimeError(f"rank {dist.get_rank()}: HSDP's mesh {mesh.mesh.tolist()} is not Megatron's DP×CP group "
                           f"{dist.get_process_group_ranks(groups.dp_cp_group)}")
    return mesh


@functools.cache
def _hsdp_groups(world: int, tp: int, pp: int, shard: int, device_type: str, timeout: timedelta | None = None):
    """Created once per layout of the world (new communicators; Megatron's groups may be created again meanwhile)."""
    from torch.distributed.device_mesh import DeviceMesh

    # Every DP×CP group of the world (one per TP rank and pipeline stage), its ranks in Megatron's order
    # (rank = tp_rank + tp·dp_cp_rank + tp·dp_cp·pp_rank), cut into rows of `shard`: the rows shard, the columns
    # replicate. new_group is collective over the world: every rank creates every group, in the same order.
    everyone = torch.arange(world).reshape(pp, world // (tp * pp), tp).permute(0, 2, 1).reshape(tp * pp, -1)
    me = dist.get_rank()
    for dp_cp in everyone:
        grid = dp_cp.reshape(-1, shard)
        shard_groups = {tuple(row.tolist()): dist.new_group(row.tolist(), timeout=timeout) for row in grid}
        replicate_groups = {tuple(col.tolist()): dist.new_group(col.tolist(), timeout=timeout) for col in grid.T}
        if me in dp_cp.tolist():
            mine = grid
            shard_group = next(g for ranks, g in shard_groups.items() if me in ranks)
            replicate_group = next(g for ranks, g in replicate_groups.items() if me in ranks)
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=mine,
                                 mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, groups: ParallelGroups, device_type: str, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32, shard: int | None = None,
               sync: str = "micro_batch") -> nn.Module:
    """Shard `model` (parallelized, real or meta) over DP×CP in place: each block, then the rest.

    param_dtype: the dtype parameters are gathered and computed in (bf16 halves the traffic; the fp32 master
    weights stay sharded); None keeps the parameters' own dtype. reduce_dtype: the dtype gradients are
    reduce-scattered and kept in (and, with sync="step", accumulated in: FSDP2 casts the first micro-batch's
    unsharded gradient to it and adds the others'). shard: HSDP, the ranks each parameter is sharded over (a divisor
    of dp·cp; None: all). sync: "micro_batch" (gather and reduce every micro-batch) or "step" (`accumulating`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if sync not in FSDP_SYNCS:
        raise ConfigError("fsdp_sync", sync, "one of " + ", ".join(map(repr, FSDP_SYNCS)))
    tags = {name: dict(vars(p)) for name, p in model.named_parameters()}
    mesh = fsdp_mesh(groups, device_type, shard)
    # Inputs are left in their dtype (cast_forward_inputs=False): autocast decides the compute dtype per op, as
    # without FSDP; casting the root's inputs to bf16 would round the noise level before its sinusoidal embedding.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    blocks = held_blocks(model)
    for i, block in enumerate(blocks):
        # the last block's backward runs right after the final layer: not resharded after forward
        keep = sync == "step" or i == len(blocks) - 1
        if groups.dims.ep > 1:  # first: a unit that holds them already leaves them out of the block's
            for experts in (m for m in block.modules() if isinstance(m, GroupedExperts)):
                fully_shard(experts, mesh=expert_mesh(groups, device_type), mp_policy=policy,
                            reshard_after_forward=not keep)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep)
        # FSDP2's own pre-forward hook (prepended) hands the block unmarked aliases of its inputs: this one, after it,
        # marks them again, so that a compiled block keeps one graph for all text lengths and samples per row
        block.register_forward_pre_hook(symbolic_block_inputs)
    # the root (embedders, final layer): the final layer's backward comes first; its gradients are reduced with the
    # last block's
    model.__dict__["architecture_class"] = type(model)  # fully_shard swaps its class: the registry's plan_for reads it
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    model.register_forward_hook(_reshard_without_backward)
    model.__dict__[_TAGS], model.__dict__[_SYNC] = tags, sync
    return restore_tags(model)


def _reshard_without_backward(model: nn.Module, args, output) -> None:
    """What a forward without backward (validation, a probe) left gathered is resharded: no backward would, and the
    next forward would otherwise run on these copies after the optimizer changed the shards."""
    from torch.distributed.fsdp import FSDPModule

    if not torch.is_grad_enabled():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def accumulating(model: nn.Module, enabled: bool = True):
    """Around the forward and backward of a step's micro-batches before its last (enabled) on a model sharded with
    sync="step": FSDP2 neither reduces their gradients (it keeps them unsharded, summed in the reduce dtype) nor
    reshards the parameters after backward, so that the last micro-batch's backward reduce-scatters the step's sum
    and the parameters are gathered once. Otherwise nothing changes: every micro-batch's gradients are
    reduce-scattered into the sharded ones, which accumulate there."""
    if not enabled or model.__dict__.get(_SYNC) != "step":
        yield
        return
    model.set_requires_gradient_sync(False)  # for HSDP the all-reduce across the groups too
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def shard_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The ranks a sharded model's parameters are split over (DP×CP, or HSDP's shard group); None if not sharded."""
    p = next((p for p in model.parameters() if isinstance(p, DTensor) and not getattr(p, "expert_parallel", False)),
             None)
    if p is None:
        return None
    mesh = p.device_mesh
    return mesh.get_group("shard") if mesh.ndim == 2 else mesh.get_group()


def restore_tags(model: nn.Module) -> nn.Module:
    """Put the TP tags back on a sharded model's parameters (after `to_empty` or `to`, which drop them)."""
    tags = model.__dict__.get(_TAGS, {})
    for name, p in model.named_parameters():
        p.__dict__.update(tags.get(name, {}))
    return model


def is_fsdp(model: nn.Module) -> bool:
    """Is `model` sharded by `apply_fsdp`? Asked of its modules, not its parameters: while FSDP2 holds a unit
    gathered (between a forward and its backward, as in the pipeline's schedule) the unit's parameters are the plain
    unsharded tensors."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_piece(value: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """The part of `value` (shaped like the DTensor `sharded`'s global shape) that this rank holds."""
    if not isinstance(sharded, DTensor):
        return value
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(sharded.shape, sharded.device_mesh, sharded.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return value[index] if value.ndim else value
