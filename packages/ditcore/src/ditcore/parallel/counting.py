"""Communication of a training step, per process group: what a rank sends, in which collective, how often.

The types here are shared by the counter (below: what a step really issues, on any backend) and the model
(ditcore.traffic: what a layout will issue, before any process starts); the step-time model (ditcore.speed) turns
them into seconds.

Bytes are what one rank sends over its links, by the ring algorithms NCCL uses for large messages, for a collective
over n ranks whose full buffer is S bytes: all-gather and reduce-scatter (n-1)/n·S, all-reduce 2(n-1)/n·S,
all-to-all the part of its input that goes to other ranks, send the tensor sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Group = Literal["tp", "cp", "pp", "fsdp", "replicate", "dp"]
Op = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "broadcast"]
When = Literal["micro_batch", "step"]


@dataclass(frozen=True)
class Collective:
    """All collectives of one kind, in one group, issued at one frequency by one rank."""

    group: Group  # tp; cp; pp (stage to stage); fsdp (the shard group); replicate (HSDP's replicas); dp (DDP, dp x cp)
    op: Op
    when: When  # every micro-batch, or once per optimizer step
    count: int  # collectives issued
    bytes: int  # bytes this rank sends in them, in all


@dataclass(frozen=True)
class Traffic:
    collectives: tuple[Collective, ...]

    def bytes(self, group: Group | None = None, when: When | None = None) -> int:
        return sum(c.bytes for c in self.collectives
                   if (group is None or c.group == group) and (when is None or c.when == when))
