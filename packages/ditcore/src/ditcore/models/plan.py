"""Tensor-parallel plans: how every parameter of an architecture is laid out over the TP ranks.

A plan maps module paths (fnmatch patterns over `model.named_modules()` names, where `*` also spans dots, so
`t_embedder.*` covers every layer inside it) to a style. Each architecture defines its plan beside its model and
registers the two together (ditcore.models.registry); `plan_for(model)` finds it. The plan is the only place
outside the model file that names a model's layers: sharding, gradient finalisation and offline consolidation
(ditcore.parallel) all read it, and tests/ditcore/models/test_plan.py fails if a parameter of any registered
architecture is covered by no entry or by two. It is a description only: nothing here touches process groups.

It also says how the model splits into pipeline stages (`PipelineSplit`).

Styles, as Megatron-Core lays them out:
- `ColumnParallel`: output features split (weight rows and bias); heads and MLP columns are divided. With
  `gather_output` the ranks' output features are all-gathered after the matmul (adaLN's per-sample modulations).
- `RowParallel`: input features split (weight columns); the bias is replicated and added after the reduction.
- `NormOverHeads`: an RMS norm over the features of every head together (Wan's QK norm): its scale, shaped (heads,
  head_dim), split by heads as the column-parallel projection before it is, each rank normalising its heads by the
  mean square of all of them, whose sums ditcore.parallel adds up over the ranks.
- `Replicated`: every TP rank holds the whole parameter. Its gradient on one rank may be only a part of the
  whole, and must then be summed over TP: `partial_grad="tp"` when it is computed from this rank's heads only
  (shared QK-norm weights), `"sp"` when it sees this rank's share of the tokens only, i.e. under sequence
  parallelism (the patch embedder, norms, the final layer), `"never"` when it sees everything on every rank.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Literal

from torch import nn


@dataclass(frozen=True)
class ColumnParallel:
    sequence_parallel: bool = True  # False: the input is never sequence-split (e.g. it reads text tokens)
    gather_output: bool = False  # True: the ranks' output features are all-gathered (small per-sample outputs)


@dataclass(frozen=True)
class RowParallel:
    pass


@dataclass(frozen=True)
class NormOverHeads:
    pass


@dataclass(frozen=True)
class Replicated:
    partial_grad: Literal["never", "sp", "tp"] = "sp"


Style = ColumnParallel | RowParallel | NormOverHeads | Replicated


@dataclass(frozen=True)
class PipelineSplit:
    """How the model splits into pipeline stages: a ModuleList of layers cut into consecutive runs, modules that only
    the first or the last stage holds; every other module is on every stage (ditcore.parallel.pipeline)."""

    layers: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    modules: dict[str, Style]  # module path pattern → style of its parameters (and its children's)
    heads: tuple[str, ...] = field(default=())  # attention modules whose `num_heads` is divided over TP
    pipeline: PipelineSplit | None = None

    def matches(self, module: str) -> list[str]:
        """Patterns that cover a module (its own entry, or an ancestor's ending in `.*`)."""
        return [pattern for pattern in self.modules if fnmatch.fnmatchcase(module, pattern)]

    def module_style(self, module: str) -> Style | None:
        """The style of a module's own parameters; None if no entry covers it; an error if several do."""
        found = self.matches(module)
        if len(found) > 1:
            raise KeyError(f"the tensor-parallel plan has {len(found)} entries ({', '.join(found)}) for {module}: "
                           "keep exactly one in the architecture's plan (beside its model)")
        return self.modules[found[0]] if found else None

    def style(self, param: str) -> Style:
        """The style of a parameter, by its full name (e.g. `blocks.3.attn.qkv.weight`)."""
        style = self.module_style(param.rpartition(".")[0])
        if style is None:
            raise KeyError(f"the tensor-parallel plan has no entry for parameter {param}: add exactly one to "
                           "the architecture's plan (beside its model)")
        return style

    def partition_dim(self, param: str) -> int | None:
        """Dimension along which a parameter is split over TP ranks; None if every rank holds all of it."""
        style = self.style(param)
        if isinstance(style, ColumnParallel | NormOverHeads):
            return 0
        if isinstance(style, RowParallel) and param.endswith("weight"):
            return 1
        return None

    def partial_over_tp(self, param: str, sequence_parallel: bool) -> bool:
        """Is this rank's gradient of a replicated parameter only a part, to be summed over TP?"""
        style = self.style(param)
        if self.partition_dim(param) is not None:
            return False  # sharded: each rank's gradient is whole for its shard
        partial = style.partial_grad if isinstance(style, Replicated) else "sp"  # a row-parallel bias
        return partial == "tp" or (partial == "sp" and sequence_parallel)

    def check(self, model: nn.Module) -> None:
        """Every parameter covered exactly once, and every entry names modules that exist (give a model with
        every optional layer: text, classes, fps)."""
        for name, _ in model.named_parameters():
            self.style(name)
        for pattern in self.modules:
            if not any(fnmatch.fnmatchcase(m, pattern) for m, _ in model.named_modules()):
                raise KeyError(f"the tensor-parallel plan names {pattern}, which matches no module of "
                               f"{type(model).__name__}: remove or rename the entry")
