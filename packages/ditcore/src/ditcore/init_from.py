"""A new run's first weights taken from another model (dit-train's `model.init_from`): every tensor whose one-device
name and shape match is copied in, every other one keeps its fresh initial value.

The source is a training checkpoint (its EMA weights, consolidated from the pieces of whatever layout wrote it:
ditcore.runs.load_weights), a run directory (its newest complete checkpoint, else its export/) or an export folder
(ditcore.export: safetensors, read without running any code). Every rank reads the one-device tensors on the host
and copies in the piece it holds — its tensor-parallel shard along the parameter's `partition_dim`, of that its
FSDP piece (Shard(0) over DP×CP), a pipeline stage only its own blocks — exactly as `materialize` fills a fresh
model, so every layout starts from the same weights and no collective is needed.

Which tensors match is decided on the one-device model (built on the meta device), the same on every rank, so the
line that says what was taken describes the whole model whatever the layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ditcore import runs, tensorfile
from ditcore.errors import ConfigError
from ditcore.export import CONFIG, WEIGHTS
from ditcore.models import DiTConfig, build, plan_for
from ditcore.parallel.consolidate import without_extra_state
from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.fsdp import local, local_piece
from ditcore.parallel.tensor_parallel import full_shape, shard

KEY = "model.init_from"
NOT_IN_SOURCE = "not in the source"
KINDS = (f"a training checkpoint (RUN_DIR/{runs.CHECKPOINTS}/step-XXXXXXX with its {runs.MARKER} marker), a run "
         f"directory that has one or an {runs.EXPORT}/, or an export folder ({WEIGHTS} + {CONFIG})")


@dataclass(frozen=True)
class Source:
    """The one-device weights read from `path`: a checkpoint's EMA weights, or an export's."""

    path: Path  # the checkpoint or export folder they come from
    tensors: dict[str, torch.Tensor]


def read_source(path: str | Path) -> Source:
    """The weights `path` holds (a checkpoint, a run directory or an export); ConfigError in one line when it is none
    of these, cannot be read, or holds NaN/Inf."""
    given = Path(path)
    if not given.exists():
        raise ConfigError(KEY, str(given), f"an existing path: {KINDS}")
    if runs.is_complete(given) or (given / WEIGHTS).is_file():
        folder = given
    elif runs.newest(given):
        folder = runs.newest(given)  # the one written last: where the run stands (after a branch, not the top step)
    elif (runs.export_dir(given) / WEIGHTS).is_file():
        folder = runs.export_dir(given)
    else:
        raise ConfigError(KEY, str(given), KINDS)
    try:
        if runs.is_complete(folder):
            tensors = runs.load_weights(folder)  # verified against its manifest, then consolidated
        else:
            tensors = tensorfile.load(folder / WEIGHTS, f"export the source run again, or set {KEY} to one of its "
                                                        "checkpoints")
    except (runs.CheckpointError, tensorfile.DamagedFile) as e:
        raise ConfigError(KEY, str(given), f"weights that load: {e}") from None
    bad = tensorfile.non_finite(tensors)
    if bad:
        raise ConfigError(KEY, str(given), f"finite weights: {folder} holds NaN/Inf in {len(bad)} tensors (e.g. "
                                           f"{bad[0]}), its run had diverged — take an earlier checkpoint of it "
                                           f"({runs.CHECKPOINTS}/step-XXXXXXX)")
    return Source(folder, tensors)


@dataclass(frozen=True)
class Match:
    """Which of a model's one-device tensors a source provides (`taken`), which stay fresh and why, and which of the
    source's tensors the model has no place for."""

    taken: tuple[str, ...]
    fresh: dict[str, str]  # name → why: not in the source, or the source's shape
    unused: tuple[str, ...]
    layers: str = "blocks"  # the model's numbered list of layers (its plan's pipeline split), named as ranges

    def summary(self, source: Path) -> str:
        """One line: 'init_from PATH: 41 of 56 tensors (x_embedder, t_embedder, blocks 0-1 of 3, final); fresh:
        blocks 2 (not in the source)' — whole modules and numbered layers (as ranges) where a whole one was taken or
        stays fresh, single tensors where only part of one did."""
        counts: dict[tuple[str, int | None], list[int]] = {}  # (module, layer) → [taken, fresh]
        for i, names in enumerate((self.taken, self.fresh)):
            for name in names:
                counts.setdefault(_group(name, self.layers), [0, 0])[i] += 1
        layers = {}  # how many layers each numbered list has: 'blocks 0-1 of 3'
        for module, layer in counts:
            layers[module] = layers.get(module, 0) + (layer is not None)
        whole = [g for g, (_, fresh) in counts.items() if not fresh]
        part = [g for g, (taken, fresh) in counts.items() if taken and fresh]
        line = (f"init_from {source}: {len(self.taken)} of {len(self.taken) + len(self.fresh)} tensors "
                f"({_names(whole, layers)}" + (f"; in part: {_names(part, layers)}" if part else "") + ")")
        if self.fresh:
            untouched = {g for g, (taken, _) in counts.items() if not taken}
            missing = [g for g in untouched if all(why == NOT_IN_SOURCE for k, why in self.fresh.items()
                                                   if _group(k, self.layers) == g)]
            singles = [f"{k} ({why})" for k, why in self.fresh.items() if _group(k, self.layers) not in missing]
            parts = ([f"{_names(missing, layers)} ({NOT_IN_SOURCE})"] if missing else []) + singles[:3]
            parts += [f"and {len(singles) - 3} more tensors"] if len(singles) > 3 else []
            line += "; fresh: " + ", ".join(parts)
        if self.unused:
            line += (f"; not used: {len(self.unused)} of the source's tensors "
                     f"({_names(list(dict.fromkeys(_group(k, self.layers) for k in self.unused)), {})})")
        return line


def match(source: dict[str, torch.Tensor], wanted: dict[str, torch.Size], layers: str = "blocks") -> Match:
    """Take every tensor of `wanted` (one-device name → shape) that `source` has with that shape."""
    taken = tuple(k for k, shape in wanted.items() if k in source and source[k].shape == shape)
    fresh = {k: (NOT_IN_SOURCE if k not in source else
                 f"the source's is {list(source[k].shape)}, this model's {list(shape)}")
             for k, shape in wanted.items() if k not in taken}
    unused = tuple(k for k in source if k not in wanted)
    return Match(taken, fresh, unused, layers)


def copy_in(model: nn.Module, tensors: dict[str, torch.Tensor], groups: ParallelGroups | None) -> list[str]:
    """Copy into `model` (this rank's part of any layout) its pieces of the one-device `tensors` it holds; returns
    the names copied. A name this rank does not hold (another pipeline stage's block) is left to its holder."""
    params = dict(model.named_parameters())
    tp, rank = (groups.dims.tp, groups.tp_rank) if groups is not None else (1, 0)
    copied = []
    with torch.no_grad():
        for name, held in without_extra_state(model.state_dict()).items():
            if name not in tensors:
                continue
            like = params.get(name, held)  # a parameter carries the TP tags; a buffer is whole on every rank
            if tuple(full_shape(like, tp)) != tuple(tensors[name].shape):
                raise ValueError(f"{name}: {list(tensors[name].shape)} does not fit this rank's "
                                 f"{list(held.shape)} (tp={tp})")
            local(held).copy_(local_piece(shard(tensors[name], like, rank, tp), held))
            copied.append(name)
    return copied


def start_from(path: str | Path, cfg: DiTConfig, modules: list[nn.Module], groups: ParallelGroups | None) -> str:
    """Fill every module of `modules` (this rank's parts of models of `cfg`: the model and its EMA) with the weights
    at `path` that fit; returns the line that says what was taken. ConfigError when none fits."""
    source = read_source(path)
    with torch.device("meta"):  # the one-device model's names and shapes; nothing is allocated
        model = build(cfg)
    tensors = model.upgrade_state_dict(dict(source.tensors))  # an export of an earlier ditcore: today's names
    found = match(tensors, {k: v.shape for k, v in without_extra_state(model.state_dict()).items()},
                  plan_for(model).pipeline.layers)
    if not found.taken:
        example = next(iter(found.fresh.items()))
        raise ConfigError(KEY, str(path), f"weights that share tensors with this model: none of the source's "
                                          f"{len(tensors)} tensors has the name and shape of one of this model's "
                                          f"{len(found.fresh)} (e.g. {example[0]}: {example[1]}) — it is another "
                                          "architecture or width; start from fresh weights (unset model.init_from)")
    taken = {k: tensors[k] for k in found.taken}
    for module in modules:
        copy_in(module, taken, groups)
    return found.summary(source.path)


def _group(name: str, layers: str) -> tuple[str, int | None]:
    """('blocks', 7) for a tensor of layer 7 of `layers`, ('x_embedder', None) for one of another module."""
    m = re.match(rf"^{re.escape(layers)}\.(\d+)\.", name)
    return (layers, int(m.group(1))) if m else (name.split(".")[0], None)


def _names(groups: list[tuple[str, int | None]], layers: dict[str, int]) -> str:
    """Modules by name, the layers of a numbered list as ranges: 'x_embedder, blocks 0-3 of 4, final'."""
    out, ids = [], {}
    for module, layer in groups:
        if layer is None:
            out.append(module)
        else:
            if module not in ids:
                out.append(module)  # its place in the list, filled below
            ids.setdefault(module, []).append(layer)
    for module, numbers in ids.items():
        of = f" of {layers[module]}" if layers.get(module) else ""
        out[out.index(module)] = f"{module} {_ranges(sorted(numbers))}{of}"
    return ", ".join(out)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2, 5'."""
    out, start = [], None
    for i, n in enumerate(ids):
        if start is None:
            start = n
        if i + 1 == len(ids) or ids[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
