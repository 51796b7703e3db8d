"""A Lightning Fabric strategy for Megatron-Core layouts.

Fabric's stock "ddp" strategy is silently wrong once TP > 1: DDP broadcasts rank 0's parameters over the
whole world (overwriting the other TP ranks' shards) and averages gradients across TP ranks. This strategy
keeps Fabric's launching, device handling and precision and changes exactly that:
- the Megatron-Core groups are created right after torch.distributed is initialised;
- DDP runs over the data-parallel group with context parallelism (DP×CP), never across TP ranks;
- with `fsdp=True` the module comes already sharded over DP×CP (ditcore.parallel.fsdp) and is not wrapped:
  FSDP2 reduce-scatters the gradients itself. `fabric.no_backward_sync` (around a micro-batch's forward *and*
  backward: FSDP2 reads it in backward) keeps them unsharded until the step's last micro-batch only for a model
  sharded with sync="step" (`fsdp.accumulating`: the unsharded parameters and gradients stay, which the memory plan
  counts); with sync="micro_batch" they are reduce-scattered after every micro-batch;
- with pipeline stages (pp > 1) the module is not wrapped either: ditcore.parallel.pipeline reduces the gradients;
- `timeout` bounds every collective of the default group and of Megatron's (ditcore.parallel.watchdog).

Checkpoints do not go through Fabric: ditcore.runs writes them in a layout-free form (ditcore.parallel.dist_checkpoint's
views of the live tensors).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.strategies import DDPStrategy
from lightning_fabric.strategies.strategy import _BackwardSyncControl
from torch.nn.parallel import DistributedDataParallel

from ditcore.parallel import fsdp as sharded
from ditcore.parallel.dims import ParallelDims, ParallelGroups, default_backend


class MegatronStrategy(DDPStrategy):
    def __init__(self, dims: ParallelDims, fsdp: bool = False, timeout: timedelta | None = None, **kwargs: Any):
        kwargs.setdefault("process_group_backend", default_backend())
        if timeout is not None:  # init_process_group's; Fabric's default is torch's, 30 min
            kwargs["timeout"] = timeout
        super().__init__(**kwargs)
        self.dims, self.fsdp = dims, fsdp
        self.groups: ParallelGroups | None = None
        if fsdp or dims.pp > 1:
            self._backward_sync_control = _UnwrappedBackwardSyncControl()  # with pp, FSDP is refused

    def setup_environment(self) -> None:
        super().setup_environment()  # initialises torch.distributed (torchrun or Fabric's launcher)
        self.groups = self.dims.initialize(self._timeout)  # Megatron's groups bounded as the default one

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.fsdp:
            return module  # sharded by apply_fsdp before its optimizer was made
        if self.dims.pp > 1:  # 1F1B runs several forwards before their backwards, which DDP's hooks cannot follow:
            return module  # ditcore.parallel.pipeline.reduce_grads averages the gradients after the schedule
        # gradient_as_bucket_view: the gradients are views into DDP's buckets, not a second copy of them
        return DistributedDataParallel(module, process_group=self.groups.dp_cp_group,
                                       device_ids=self._determine_ddp_device_ids(), gradient_as_bucket_view=True)


class _UnwrappedBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        # FSDP: as apply_fsdp's sync says (fsdp.accumulating); PP: the gradients are reduced after the step's schedule
        return sharded.accumulating(module, enabled) if sharded.is_fsdp(module) else nullcontext()
