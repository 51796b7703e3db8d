"""Parallel topology: one validated value (`ParallelDims`) and the process groups it creates.

Ranks are laid out as Megatron-Core lays them (order tp-cp-dp-pp: tensor-parallel peers are adjacent).
Data parallelism runs over the DP×CP group: context-parallel ranks hold the same weights and each sees a
slice of the same rows, so their gradients are combined with the data-parallel ones.

Expert parallelism (ep) splits a mixture of experts' experts over `ep` consecutive ranks of the DP×CP group (ranks that
hold the same TP shard and see different tokens): the EP group. The dp·cp/ep ranks at the same place in the EP groups
hold the same experts: their expert-data-parallel group, over which the experts' gradients are averaged
(ditcore.parallel.expert_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ditcore.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1  # tensor parallel: heads and MLP columns split over ranks
    cp: int = 1  # context parallel: each rank holds a contiguous slice of every row
    pp: int = 1  # pipeline parallel: the transformer blocks split into pp consecutive stages
    dp: int | None = None  # data parallel; None: whatever the world size leaves
    sequence_parallel: bool = False  # with tp > 1: split tokens over TP ranks outside attention
    ep: int = 1  # expert parallel: a mixture of experts' experts split over ep consecutive DP×CP ranks

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError("dp", self.dp, "an integer >= 1, or unset to fill the world size")

    def resolve(self, world_size: int) -> ParallelDims:
        """These dims with dp filled in; raises if the layout does not fit world_size processes."""
        model_parallel = self.tp * self.cp * self.pp
        if world_size % model_parallel:
            raise ConfigError(
                "model_parallel", f"tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model_parallel}",
                f"a divisor of the world size {world_size} (number of processes)")
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                "dp", self.dp,
                f"{dp}: tp*cp*pp*dp must equal the world size {world_size}, and tp*cp*pp = {model_parallel}")
        if (dp * self.cp) % self.ep:
            raise ConfigError("ep", self.ep, f"a divisor of dp x cp = {dp} x {self.cp}: the experts are split over "
                                             "ranks that see different tokens")
        return ParallelDims(self.tp, self.cp, self.pp, dp, self.sequence_parallel, self.ep)

    def check_fsdp_shard(self, shard: int | None) -> None:
        """The one home of HSDP's rule (dit-train, the memory planner and `apply_fsdp` ask it, on resolved dims):
        each parameter is sharded over `shard` consecutive DP×CP ranks, and the dp·cp/shard groups of them replicate
        each other, so `shard` divides dp·cp. None: sharded over all of them."""
        if shard is None:
            return
        size = self.dp * self.cp
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or size % shard:
            divisors = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)
            raise ConfigError("fsdp_shard", shard, f"a divisor of dp x cp = {self.dp} x {self.cp}: one of "
                                                   f"{divisors}, or null to shard over all {size}")

    def check_model(self, num_heads: int, seq_len: int | None = None, depth: int | None = None,
                    num_kv_heads: int | None = None, moe=None) -> None:
        """Errors for a model/sequence that this layout cannot split. Call on every rank before any collective.
        moe: the model's mixture-of-experts config (DiTConfig.moe), None for a dense model."""
        if self.ep > 1 and moe is None:
            raise ConfigError("ep", self.ep, "1 for a model without model.moe: there are no experts to split")
        if self.ep > 1 and moe.experts % self.ep:
            raise ConfigError("ep", self.ep, f"a divisor of model.moe.experts={moe.experts}: each rank holds "
                                             "experts/ep whole experts")
        if depth is not None and depth < self.pp:
            raise ConfigError("pp", self.pp, f"at most the model's depth={depth}: every pipeline stage holds at least "
                                              "one block")
        if num_heads % self.tp:
            raise ConfigError("tp", self.tp, f"a divisor of the model's num_heads={num_heads}")
        if num_kv_heads and num_kv_heads % self.tp:
            raise ConfigError("tp", self.tp, f"a divisor of the model's num_kv_heads={num_kv_heads} (grouped-"
                                              "query attention: each rank holds whole groups)")
        parts = self.cp * (self.tp if self.sequence_parallel else 1)
        if seq_len is not None and seq_len % parts:
            what = "cp*tp (sequence parallel)" if self.sequence_parallel and self.tp > 1 else "cp"
            raise ConfigError("seq_length", seq_len, f"a multiple of {what} = {parts}")

    def initialize(self, timeout: timedelta | None = None) -> ParallelGroups:
        """Create the Megatron-Core process groups (torch.distributed must be initialised) and return them. timeout:
        their collectives' (as the default group's: ditcore.parallel.watchdog); None: Megatron's default, 30 min."""
        from megatron.core import parallel_state as ps

        from ditcore.parallel.cpu import apply_cpu_shims, seed_model_parallel_rng

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: launch with torchrun or Fabric first")
        dims = self.resolve(dist.get_world_size())
        apply_cpu_shims()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            context_parallel_size=dims.cp,
            # int minutes by its signature; it only builds timedelta(minutes=...) of it, which takes a fraction
            **({"distributed_timeout_minutes": timeout.total_seconds() / 60} if timeout is not None else {}),
        )
        groups = ParallelGroups(
            dims=dims,
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            dp_group=ps.get_data_parallel_group(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            pp_group=ps.get_pipeline_model_parallel_group(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
            timeout=timeout,
            **_expert_groups(dims, timeout),
        )
        seed_model_parallel_rng(0, groups.tp_rank)
        return groups


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of an initialised layout. Model, loss and data loader receive this explicitly."""

    dims: ParallelDims
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # data parallel without CP: the data loader's peers
    dp_cp_group: dist.ProcessGroup  # gradient averaging
    tp_rank: int
    cp_rank: int
    dp_rank: int
    dp_cp_rank: int
    pp_group: dist.ProcessGroup | None = None  # the pipeline: one rank of every stage, with the same tp/cp/dp ranks
    pp_rank: int = 0  # this rank's stage
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of the stages, first to last
    ep_group: dist.ProcessGroup | None = None  # ep > 1: the ranks this rank's tokens are dispatched over
    ep_rank: int = 0  # this rank's place in it: it holds experts ep_rank·E/ep to (ep_rank + 1)·E/ep − 1
    edp_group: dist.ProcessGroup | None = None  # ep > 1: the ranks holding the same experts (their gradients' peers)
    timeout: timedelta | None = None  # the collective timeout of these groups, for those made later (None: torch's)

    @property
    def is_model_parallel_writer(self) -> bool:
        """One rank per model-parallel shard writes checkpoints: DP×CP rank 0 of each TP group (of each stage)."""
        return self.dp_cp_rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1


def _expert_groups(dims: ParallelDims, timeout: timedelta | None = None) -> dict:
    """The EP and expert-data-parallel groups of this rank (none when ep = 1). Every DP×CP group of the world (one per
    TP rank and pipeline stage), its ranks in Megatron's order (rank = tp_rank + tp·dp_cp_rank + tp·dp_cp·pp_rank), is
    cut into rows of ep consecutive ranks: the rows are EP groups, the columns expert-data-parallel ones. new_group is
    collective over the world: every rank creates every group, in the same order (as fsdp._hsdp_groups)."""
    if dims.ep == 1:
        return {}
    world, me = dist.get_world_size(), dist.get_rank()
    everyone = torch.arange(world).reshape(dims.pp, world // (dims.tp * dims.pp), dims.tp).permute(0, 2, 1)
    mine = {}
    for dp_cp in everyone.reshape(dims.tp * dims.pp, -1):
        grid = dp_cp.reshape(-1, dims.ep)
        for role, lines in (("ep_group", grid), ("edp_group", grid.T)):
            for line in lines.tolist():
                group = dist.new_group(line, timeout=timeout)
                if me in line:
                    mine[role] = group
                    if role == "ep_group":
                        mine["ep_rank"] = line.index(me)
    return mine


def destroy() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"
