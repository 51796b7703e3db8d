"""A Lightning Fabric strategy for Megatron-Core layouts.

Fabric's stock "ddp" strategy is silently wrong once TP > 1: DDP broadcasts rank 0's parameters over the
whole world (overwriting the other TP ranks' shards), averages gradients across TP ranks, and
`fabric.save` writes from global rank 0 only. This strategy keeps Fabric's launching and device handling
and changes exactly those three things:
- the Megatron-Core groups are created right after torch.distributed is initialised;
- DDP runs over the data-parallel group with context parallelism (DP×CP), never across TP ranks;
- a checkpoint is a directory with one file per model-parallel shard, written by DP×CP rank 0 of each
  TP group and read back by every rank of that shard.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from ditcore.parallel.dims import ParallelDims, ParallelGroups, default_backend


class MegatronStrategy(DDPStrategy):
    def __init__(self, dims: ParallelDims, shard_file: Callable[[int], str], **kwargs: Any):
        """shard_file: tensor-parallel rank → the name of its file in a checkpoint folder (ditcore.runs.shard_file)."""
        kwargs.setdefault("process_group_backend", default_backend())
        super().__init__(**kwargs)
        self.dims, self.shard_file = dims, shard_file
        self.groups: ParallelGroups | None = None

    def setup_environment(self) -> None:
        super().setup_environment()  # initialises torch.distributed (torchrun or Fabric's launcher)
        self.groups = self.dims.initialize()

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(
            module, process_group=self.groups.dp_cp_group, device_ids=self._determine_ddp_device_ids())

    def shard_path(self, path: str | Path) -> Path:
        return Path(path) / self.shard_file(self.groups.tp_rank)

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        state = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if self.groups.is_model_parallel_writer:
            self.checkpoint_io.save_checkpoint(checkpoint=state, path=self.shard_path(path),
                                               storage_options=storage_options)
        self.barrier("save_checkpoint")  # the directory is complete only when every shard is written

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict[str, Any]:
        shard = self.shard_path(path)
        if not shard.is_file():
            raise FileNotFoundError(
                f"checkpoint {path} has no shard {shard.name} for tensor-parallel rank {self.groups.tp_rank}: "
                f"was it written with tp={self.dims.tp}? Load a consolidated export to change the layout.")
        return super().load_checkpoint(shard, state=state, strict=strict, weights_only=weights_only)
