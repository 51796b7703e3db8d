"""Sharded data parallelism (FSDP2 `fully_shard`) over the DP×CP ranks, on top of Megatron-Core TP/SP/CP.

    with torch.device("meta"):
        model = DiT(cfg)
    parallelize(model, groups)                  # TP shards (meta)
    apply_fsdp(model, groups, ...)              # each TP shard split again over DP×CP (meta DTensors)
    materialize(model, seed, device, groups)    # only this rank's pieces are ever allocated

Each transformer block is one FSDP unit (its parameters are all-gathered just before it runs and freed after),
the root holds the embedders and the final layer. Parameters, gradients, AdamW state and the EMA copy are all
DTensors sharded along dim 0 over DP×CP: a rank holds 1/(dp·cp) of its TP shard. Gradients are reduce-scattered
(averaged over DP×CP, as DDP would), so `finalize_grads` and `clip_grad_norm_` work on the local pieces.

The TP tags that Megatron and ditcore put on parameters (`tensor_model_parallel`, `partition_dim`,
`tp_partial_grad`) are carried over to the sharded parameters, which FSDP2 creates anew. `Module.to_empty` and
`Module.to` swap DTensor parameters' contents *and* attributes (torch.utils.swap_tensors), which would drop them:
`apply_fsdp` keeps them by name on the model, and `restore_tags` puts them back after such a move.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ditcore.models.techniques import held_blocks
from ditcore.parallel.dims import ParallelGroups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TAGS = "_ditcore_tp_tags"  # {parameter name: its tags}, kept on the sharded model


def dp_cp_mesh(groups: ParallelGroups, device_type: str):
    """A one-dimensional DeviceMesh over the DP×CP group (the ranks that hold the same TP shard)."""
    return _mesh(groups.dp_cp_group, device_type)


@functools.cache
def _mesh(group: dist.ProcessGroup, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group(group, device_type, mesh=torch.tensor(ranks), mesh_dim_names=("dp_cp",))


def apply_fsdp(model: nn.Module, groups: ParallelGroups, device_type: str, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (parallelized, real or meta) over DP×CP in place: each block, then the rest.

    param_dtype: the dtype parameters are gathered and computed in (bf16 halves the traffic; the fp32 master
    weights stay sharded); None keeps the parameters' own dtype. reduce_dtype: the dtype gradients are
    reduce-scattered and kept in.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    groups.dims.check_fsdp(True)
    tags = {name: dict(vars(p)) for name, p in model.named_parameters()}
    mesh = dp_cp_mesh(groups, device_type)
    # Inputs are left in their dtype (cast_forward_inputs=False): autocast decides the compute dtype per op, as
    # without FSDP; casting the root's inputs to bf16 would round the noise level before its sinusoidal embedding.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in held_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # the root: after backward its gradients (embedders, final layer) are reduced with the last block's
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    model.__dict__[_TAGS] = tags
    return restore_tags(model)


def restore_tags(model: nn.Module) -> nn.Module:
    """Put the TP tags back on a sharded model's parameters (after `to_empty` or `to`, which drop them)."""
    tags = model.__dict__.get(_TAGS, {})
    for name, p in model.named_parameters():
        p.__dict__.update(tags.get(name, {}))
    return model


def is_fsdp(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


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
