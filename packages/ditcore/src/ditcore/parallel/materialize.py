"""`materialize(model, seed, device, groups)`: initial weights for a model built on the meta device, shard by shard.

    with torch.device("meta"):
        model = DiT(cfg)            # shapes only: no storage
    parallelize(model, groups)      # still meta: this rank's shard shapes
    materialize(model, seed, device, groups)

Each parameter's full one-device value comes from the model's own rule (`DiT.initial_value`, seeded by seed and
the parameter's name): it is computed on `device` one parameter at a time, this rank keeps its tensor-parallel shard
and the rest is freed; a model sharded by FSDP2 (`apply_fsdp`, between parallelize and materialize) keeps only its
DP×CP piece of that shard. No rank ever holds the whole model, on the host or on the device, and every layout
starts from the weights `DiT(cfg).init_weights(seed)` gives one device of the same type.
"""

from __future__ import annotations

import torch
from torch import nn

from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.fsdp import is_fsdp, local, local_piece, restore_tags
from ditcore.parallel.tensor_parallel import full_shape, shard


def materialize(model: nn.Module, seed: int, device: torch.device | str,
                groups: ParallelGroups | None = None) -> nn.Module:
    """Allocate every parameter and buffer of `model` on `device` and fill it with its shard of its initial value."""
    rule = getattr(model, "initial_value", None)
    if rule is None:
        raise TypeError(f"{type(model).__name__} has no initial_value(name, shape, seed, device) method: "
                        "materialize needs the model's per-parameter initialisation rule")
    tp, rank = (groups.dims.tp, groups.tp_rank) if groups is not None else (1, 0)
    device = torch.device(device)
    if is_fsdp(model):
        return _materialize_sharded(model, rule, seed, device, tp, rank)
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (meta, real): a shared tensor stays shared
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for key, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if id(t) not in done:
                    name = f"{prefix}.{key}" if prefix else key
                    full = rule(name, full_shape(t, tp), seed, device)  # the whole one-device value, on device
                    local = torch.empty_like(t, device=device).copy_(shard(full, t, rank, tp))
                    del full
                    if isinstance(t, nn.Parameter):
                        local = nn.Parameter(local, requires_grad=t.requires_grad)
                        local.__dict__.update(t.__dict__)  # Megatron's TP tags and ours: grads.py, consolidate.py
                    done[id(t)] = (t, local)
                setattr(module, key, done[id(t)][1])  # a buffer stays a buffer, persistent or not
    return model


def _materialize_sharded(model: nn.Module, rule, seed: int, device: torch.device, tp: int, rank: int) -> nn.Module:
    """The same for a model sharded by FSDP2 (ditcore.parallel.fsdp): allocate this rank's pieces, fill them in."""
    model.to_empty(device=device)  # FSDP2 allocates its local shard of each parameter; buffers are whole
    restore_tags(model)  # to_empty swapped the parameters, attributes included
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            full = rule(name, full_shape(t, tp), seed, device)
            local(t).copy_(local_piece(shard(full, t, rank, tp), t))
            del full
    return model
