"""`parallelize(model, groups)`: shard a one-device model for this rank, from the outside; `build_parallel_model`:
this rank's part of a model built the way dit-train builds it (meta device, sharded, techniques, materialised).

The model file knows nothing of ranks. This applies, in order: the pipeline split (this rank's stage only),
tensor (and sequence) parallelism as the architecture's plan says (ditcore.models.plan), the experts split over the
EP group (ditcore.parallel.expert_parallel), the row split for context/sequence parallelism, and the tags that
gradient finalisation reads (which replicated parameters' gradients are partial over TP).
"""

from __future__ import annotations

import torch
from torch import nn

from ditcore.models import DiTConfig, apply_activation_checkpointing, apply_compile, build, plan_for
from ditcore.parallel.context_parallel import SplitRows
from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.expert_parallel import apply_expert_parallel
from ditcore.parallel.fsdp import apply_fsdp
from ditcore.parallel.materialize import materialize
from ditcore.parallel.pipeline import split_stages
from ditcore.parallel.tensor_parallel import apply_tensor_parallel, is_tp_sharded


def parallelize(model: nn.Module, groups: ParallelGroups) -> nn.Module:
    """Shard `model` (real or meta weights) in place for this rank and return it."""
    dims, plan = groups.dims, plan_for(model)
    dims.check_model(model.cfg.num_heads, depth=model.cfg.depth, num_kv_heads=model.cfg.kv_heads,
                     moe=model.cfg.moe)
    if dims.pp > 1:
        split_stages(model, groups)
    sp = dims.sequence_parallel and dims.tp > 1
    names = [name for name, _ in model.named_parameters()]  # the one-device names, which sharding keeps
    if dims.tp > 1:
        apply_tensor_parallel(model, plan, groups, sp)
    if dims.ep > 1:
        apply_expert_parallel(model, groups)
    if dims.cp > 1 or sp:
        model.rows = SplitRows(groups, sp)  # every architecture's: one that regroups tokens uses its permutation
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        p.tp_partial_grad = dims.tp > 1 and not is_tp_sharded(p) and plan.partial_over_tp(name, sp)
    return model


def build_parallel_model(cfg: DiTConfig, groups: ParallelGroups, device: torch.device | str, *, seed: int,
                         attention: str = "auto", checkpointing: str = "none", fsdp: bool = False,
                         param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                         fsdp_shard: int | None = None, fsdp_sync: str = "micro_batch", compile: bool = False,
                         compile_options: dict | None = None) -> nn.Module:
    """This rank's part of the model of `cfg`, built on the meta device and materialised shard by shard: no rank
    ever holds the whole model, on the host or the device, and every layout starts from the same weights.

    The order matters: activation checkpointing after parallelize (it recomputes the parallel linears and their
    collectives), FSDP after it (each TP shard split again over DP×CP, or HSDP's `fsdp_shard` of them; gathered in
`param_dtype`, every micro-batch or once per step as `fsdp_sync` says), compile last (it
    traces the checkpointed, sharded forward). dit-train builds its models here, and the compile tests too.
    """
    with torch.device("meta"):
        model = build(cfg, attention=attention)
    parallelize(model, groups)
    apply_activation_checkpointing(model, checkpointing)
    if fsdp:
        apply_fsdp(model, groups, torch.device(device).type, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   shard=fsdp_shard, sync=fsdp_sync)
    materialize(model, seed, device, groups)  # each rank computes its pieces of the init
    if compile:
        apply_compile(model, **(compile_options or {}))
    return model
