"""The layout of a training job: one validated value (`Layout`) of everything besides the architecture that decides
a rank's memory (ditcore.memory), communication (ditcore.traffic) and speed (ditcore.speed).

Its errors name its fields (ConfigError("tp", ...)): an app says them in its own words (dit-train: the one table
dit_train.config.LAYOUT_KEYS, which also builds a Layout from its config and writes one back as overrides).
A new parallel dimension goes in ParallelDims (ditcore.parallel.dims: its degree, checks and process groups), then
here as a field that `dims` passes on (a field's choices, when not numbers, in ditcore.choices.LAYOUT_CHOICES, which
__post_init__ checks and dit-train's config offers), and in dit-train's LAYOUT_KEYS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ditcore.choices import LAYOUT_CHOICES
from ditcore.errors import ConfigError
from ditcore.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    """Everything besides the architecture that decides a rank's memory: parallel layout, batch shape, techniques."""

    world_size: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages: the blocks split into pp consecutive runs, one per rank
    sequence_parallel: bool = False
    ep: int = 1  # expert parallel: a mixture of experts' experts split over ep consecutive dp x cp ranks
    fsdp: bool = False
    reduce_dtype: Literal[LAYOUT_CHOICES["reduce_dtype"]] = "fp32"  # with fsdp: gradients are reduce-scattered in
    fsdp_shard: int | None = None  # with fsdp: ranks each parameter is sharded over (HSDP); None: all dp x cp ranks
    fsdp_sync: Literal[LAYOUT_CHOICES["fsdp_sync"]] = "micro_batch"  # with fsdp: gather/reduce per micro-batch or step
    micro_batch: int = 1  # packed rows per forward on one rank
    micro_batches: int = 1  # per optimizer step on one rank (gradient accumulation): global_batch / (micro_batch*dp)
    seq_length: int = 256  # tokens per row
    text_len: int = 0  # text tokens per row, padding included (ignored by a model without text)
    samples_per_row: int = 1  # per-sample conditioning is (B, S, ...): small, but counted
    packed: bool = True  # rows pack several samples: per-token modulation, masked attention
    precision: Literal[LAYOUT_CHOICES["precision"]] = "bf16"  # bf16: autocast, fp32 master weights (dit-train on a GPU)
    activation_checkpointing: Literal[LAYOUT_CHOICES["activation_checkpointing"]] = "none"
    device: Literal[LAYOUT_CHOICES["device"]] = "cuda"  # CUDA fuses RMSNorm; the CPU decomposes it, in fp32
    attention: Literal[LAYOUT_CHOICES["attention"]] = "flex"  # dit-train's `auto` trains with flex on a GPU
    compile: bool = False  # compiled blocks: selective checkpointing then sees (and keeps) flex's output too

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "an integer >= 1 (processes, one per GPU)")
        dims = self.dims  # ParallelDims' rules: the degrees, that they fit world_size, HSDP's shard
        if self.fsdp:
            dims.check_fsdp_shard(self.fsdp_shard)
        for field in ("micro_batch", "seq_length", "samples_per_row", "micro_batches"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(field, value, "an integer >= 1")
        if not isinstance(self.text_len, int) or self.text_len < 0:
            raise ConfigError("text_len", self.text_len, "an integer >= 0 (text tokens per row)")
        for field, allowed in LAYOUT_CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(field, getattr(self, field), "one of " + ", ".join(map(repr, allowed)))
        if self.device == "cpu" and self.attention == "flex":
            raise ConfigError("attention", "flex", "sdpa on a CPU: FlexAttention has no CPU backward")

    @property
    def dims(self) -> ParallelDims:
        """The parallel dimensions, resolved over world_size (dp filled in)."""
        return ParallelDims(self.tp, self.cp, self.pp, sequence_parallel=self.sequence_parallel, ep=self.ep).resolve(
            self.world_size)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def shards(self) -> int:
        """Ranks that FSDP2 shards each parameter over: data parallel x context parallel, or HSDP's fsdp_shard of them
        (1 without fsdp)."""
        return (self.fsdp_shard or self.dp * self.cp) if self.fsdp else 1

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations pipeline stage `stage` keeps at once at its peak (1F1B; 1 without pp)."""
        return min(self.pp - stage, self.micro_batches)

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        sp = " + sequence parallel" if self.sequence_parallel and self.tp > 1 else ""
        if self.fsdp:
            replicas = self.dp * self.cp // self.shards
            wrap = (f"HSDP: FSDP2 over {self.shards} ranks, replicated x {replicas}" if replicas > 1 else
                    f"FSDP2 over dp x cp = {self.shards}")
            wrap += f", reduce in {self.reduce_dtype}, " + ("gathered and reduced once per step"
                                                           if self.fsdp_sync == "step" else "every micro-batch")
        elif self.pp > 1:
            n = self.micro_batches
            wrap = f"1F1B pipeline, {n} micro-batch{'es' if n > 1 else ''} a step; no DDP, no FSDP"
        else:
            wrap = "DDP, no FSDP"
        ep = f"; experts over ep {self.ep} of dp x cp" if self.ep > 1 else ""
        return f"world {self.world_size} = tp {self.tp}{sp} x cp {self.cp} x pp {self.pp} x dp {self.dp}; {wrap}{ep}"
