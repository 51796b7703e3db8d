"""The architectures ditcore knows: each registers itself, once, at the bottom of its model file.

A registration is everything outside the model file that needs to know an architecture: its name (dit-train's
`model.arch`, an export's `arch`), its config and model classes, its size presets (one of them the tiny preset that
the tests build) and its tensor-parallel plan. dit-train's choices, the plan of a model (`plan_for`), the presets
and the tests' lists of architectures are all read from here, so a new architecture is its model file plus one
`register(Architecture(...))`. Its inputs (ditcore.inputs) are its model class's `inputs_class`: a new conditioning
input is a field of its own Inputs subclass in its model file (`inputs_of` gives the loader and the probes that type).

An architecture that regroups tokens between blocks (ST-DiT) needs no stand-in of its own: it moves them with its
rows' `permutation` (ditcore.models.attention.RowSplit), which ditcore.parallel's row splits and their one-process
stand-in implement for every architecture, and registers here what that stand-in cannot show, the tokens each
regrouping sends between context-parallel ranks (`token_moves`), so no other module imports its model file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ditcore.errors import ConfigError
from ditcore.models.plan import Plan

if TYPE_CHECKING:
    from torch import nn

    from ditcore.inputs import Inputs
    from ditcore.models.dit import DiT, DiTConfig


@dataclass(frozen=True)
class Architecture:
    name: str  # model.arch; the "arch" an export's model.json records
    config: type[DiTConfig]  # its configs are exactly of this type (not a subclass): that is how a config names it
    model: type[DiT]
    presets: Mapping[str, DiTConfig]  # size name → config; names are unique across architectures
    tiny: str  # the preset that tests build for every architecture
    plan: Plan  # how ditcore.parallel lays its parameters out over tensor-parallel ranks
    summary: str  # one line for people, e.g. in dit-train's error for an unknown model.arch
    # (model, grids, N, parts) → [(block index, counts)]: every regrouping of tokens around the model's blocks, with
    # counts[r][q] the tokens of rows of N tokens laid out as `grids` (ditcore.layout) that it takes from slice r of
    # `parts` to slice q, for ditcore.traffic's all-to-alls; None: the architecture regroups no tokens
    token_moves: Callable[[nn.Module, list, int, int], list[tuple[int, list[list[int]]]]] | None = None


ARCHS: dict[str, Architecture] = {}  # name → architecture, in the order they registered


def register(arch: Architecture) -> Architecture:
    """Add an architecture; its name, config class and preset names must be new."""
    taken = [name for name in arch.presets if name in PRESETS]
    if arch.name in ARCHS or any(a.config is arch.config for a in ARCHS.values()) or taken:
        raise ValueError(f"architecture {arch.name!r} ({arch.config.__name__}, presets {', '.join(arch.presets)}) "
                         "repeats a registered name, config class or preset: give it its own")
    wrong = [name for name, cfg in arch.presets.items() if type(cfg) is not arch.config]
    if arch.tiny not in arch.presets or wrong:
        raise ValueError(f"architecture {arch.name!r}: its tiny preset {arch.tiny!r} must be one of its presets, "
                         f"and every preset a {arch.config.__name__} (not: {', '.join(wrong) or '-'})")
    ARCHS[arch.name] = arch
    return arch


class Presets(Mapping[str, "DiTConfig"]):
    """Every registered architecture's presets as one read-only mapping, in registration order."""

    def __getitem__(self, name: str) -> DiTConfig:
        for arch in ARCHS.values():
            if name in arch.presets:
                return arch.presets[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for arch in ARCHS.values() for name in arch.presets)

    def __len__(self) -> int:
        return sum(len(arch.presets) for arch in ARCHS.values())


PRESETS = Presets()


def arch_of(cfg: DiTConfig) -> str:
    """The architecture name of a config ("dit", "stdit", "moviegen", ...)."""
    for arch in ARCHS.values():
        if type(cfg) is arch.config:
            return arch.name
    raise TypeError(f"{type(cfg).__name__} is the config of no registered architecture: register it "
                    "(ditcore.models.registry.register)")


def preset(name: str, **changes) -> DiTConfig:
    """A preset's config with data-dependent fields filled in, e.g. preset("DiT-XL/2", num_classes=1000)."""
    if name not in PRESETS:
        raise ConfigError("model.preset", name, "one of " + ", ".join(PRESETS))
    return PRESETS[name].replace(**changes)


def build(cfg: DiTConfig, attention: str = "auto") -> DiT:
    """The model of a config, of its architecture."""
    return ARCHS[arch_of(cfg)].model(cfg, attention=attention)


def inputs_of(cfg: DiTConfig) -> type[Inputs]:
    """The inputs type (ditcore.inputs) the model of a config takes: its model class's `inputs_class`, which is
    what its loader's batches, the planner's probes and the samplers build."""
    return ARCHS[arch_of(cfg)].model.inputs_class


def plan_for(model: nn.Module) -> Plan:
    """The tensor-parallel plan of a model, by its exact type (a subclass is another architecture). A model sharded by
    FSDP2 is of a class `fully_shard` made for it: ditcore.parallel.fsdp keeps its own as `architecture_class`."""
    cls = model.__dict__.get("architecture_class", type(model))
    for arch in ARCHS.values():
        if cls is arch.model:
            return arch.plan
    raise TypeError(f"no tensor-parallel plan for {type(model).__name__}: register its architecture with its plan "
                    "(ditcore.models.registry.register)")
