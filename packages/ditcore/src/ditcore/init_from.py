"""A new run's first weights taken from another model (dit-train's `model.init_from`): every tensor whose one-device
name and shape match is copied in, every other one keeps its fresh initial value.

The source is a training checkpoint (its EMA weights, consolidated from the pieces of whatever layout wrote it:
ditcore.runs.load_weights), a run directory (its newest complete checkpoint, else its export/) or an export folder
(ditcore.export: safetensors, read without running any code) — or one of the field's DiT checkpoints
(ditcore.interop: an original DiT file, a diffusers DiTTransformer2DModel or pipeline folder). A foreign source brings
its architecture (`Source.cfg`), the DDPM schedule it was trained with (`Source.vp`: it is fine-tuned under VP
preconditioning) and the latent scale it was trained on (`Source.latent_stats`: mean 0, std σ_data/scaling_factor,
the VAE's scaling_factor, 0.18215 as DiT's); a ditcore run fine-tuned that way records the last two beside its
weights, and a source read from it brings them too. A Wan (a WanTransformer3DModel or WanPipeline folder) brings its
objective, flow, and time shift (`Source.objective`, `Source.shift`) and its VAE's per-channel latent units.

Every rank reads the one-device tensors on the host and copies in the piece it holds — its tensor-parallel shard
along the parameter's `partition_dim`, of that its FSDP piece (Shard(0) over DP×CP), a pipeline stage only its own
blocks — exactly as `materialize` fills a fresh model, so every layout starts from the same weights and no collective
is needed.

Which tensors match is decided on the one-device model (built on the meta device), the same on every rank, so the
line that says what was taken describes the whole model whatever the layout.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ditcore import interop, runs, tensorfile
from ditcore.codecs import LatentStats
from ditcore.data.schema import INFO_FILE
from ditcore.diffusion.vp import DiscreteVP
from ditcore.errors import ConfigError
from ditcore.export import CONFIG, WEIGHTS, recorded_objective, shift_of, vp_of
from ditcore.models import DiTConfig, build, plan_for
from ditcore.models.wan import WanConfig
from ditcore.parallel.consolidate import without_extra_state
from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.fsdp import local, local_piece
from ditcore.parallel.tensor_parallel import full_shape, shard

KEY = "model.init_from"
NOT_IN_SOURCE = "not in the source"
KINDS = (f"a training checkpoint (RUN_DIR/{runs.CHECKPOINTS}/step-XXXXXXX with its {runs.MARKER} marker), a run "
         f"directory that has one or an {runs.EXPORT}/, an export folder ({WEIGHTS} + {CONFIG}), or {interop.KINDS}")
# The SD VAE's latent scale, which DiT was trained with (its train.py: x = vae.encode(x).latent_dist.sample() * 0.18215)
DIT_SCALING_FACTOR = 0.18215


@dataclass(frozen=True)
class Source:
    """The one-device weights read from `path`: a checkpoint's EMA weights, an export's, or a foreign DiT's."""

    path: Path  # the checkpoint or export folder (or foreign checkpoint) they come from
    tensors: dict[str, torch.Tensor]
    cfg: DiTConfig | None = None  # a foreign checkpoint's architecture, inferred from its weights; None: ditcore's
    vp: DiscreteVP | None = None  # the DDPM schedule the network was trained with: VP preconditioning; None: EDM's
    latent_stats: LatentStats | None = None  # what its latents were normalised by (its units); None: the dataset's
    kind: str = "ditcore"  # or ditcore.interop.Imported.kind
    objective: str = "edm"  # what it was trained with (ditcore.choices.OBJECTIVES)
    shift: object = None  # a flow network's timestep shift (ditcore.diffusion.flow.TimeShift); None under EDM

    def recorded(self) -> dict:
        """How the network is preconditioned, as an export's model.json and a checkpoint's values record it (and
        `read_source` reads it back): {"precond": "vp", "vp": {...}} under VP, {"objective": "flow", "shift": {...}}
        under flow, "latent_stats" where the network works in units of its own; {} for EDM in the dataset's."""
        return recorded(self.vp, self.latent_stats, self.objective, self.shift)


def recorded(vp: DiscreteVP | None, latent_stats: LatentStats | None, objective: str = "edm", shift=None) -> dict:
    """See Source.recorded."""
    stats = {} if latent_stats is None else {"latent_stats": latent_stats.to_dict()}
    precond = {} if vp is None else {"precond": "vp", "vp": vp.to_dict()}
    return recorded_objective(objective, shift) | precond | stats


def read_source(path: str | Path, num_heads: int | None = None) -> Source:
    """The weights `path` holds (a checkpoint, a run directory, an export, or a foreign DiT checkpoint: `num_heads`
    for an original DiT file of a width the paper has no size for); ConfigError in one line when it is none of these,
    cannot be read, or holds NaN/Inf."""
    given = Path(path)
    if not given.exists():
        raise ConfigError(KEY, str(given), f"an existing path: {KINDS}")
    if runs.is_complete(given) or (given / WEIGHTS).is_file():
        folder = given
    elif runs.newest(given):
        folder = runs.newest(given)  # the one written last: where the run stands (after a branch, not the top step)
    elif (runs.export_dir(given) / WEIGHTS).is_file():
        folder = runs.export_dir(given)
    elif interop.is_foreign(given):
        return read_foreign(given, num_heads)
    else:
        raise ConfigError(KEY, str(given), KINDS)
    try:
        if runs.is_complete(folder):
            tensors = runs.load_weights(folder)  # verified against its manifest, then consolidated
            meta = runs.read_values(folder)
        else:
            tensors = tensorfile.load(folder / WEIGHTS, f"export the source run again, or set {KEY} to one of its "
                                                        "checkpoints")
            meta = _json(folder / CONFIG) | {"latent_stats": _json(folder / INFO_FILE).get("latent_stats")}
    except (runs.CheckpointError, tensorfile.DamagedFile) as e:
        raise ConfigError(KEY, str(given), f"weights that load: {e}") from None
    bad = tensorfile.non_finite(tensors)
    if bad:
        raise ConfigError(KEY, str(given), f"finite weights: {folder} holds NaN/Inf in {len(bad)} tensors (e.g. "
                                           f"{bad[0]}), its run had diverged — take an earlier checkpoint of it "
                                           f"({runs.CHECKPOINTS}/step-XXXXXXX)")
    vp = vp_of(meta)  # a checkpoint's values and an export's model.json record it alike
    objective = {"objective": meta.get("objective", "edm"), "shift": shift_of(meta)}
    stats = meta.get("latent_stats")
    if vp is None and objective["shift"] is None:  # EDM's: the network works in the dataset's units, whatever they are
        return Source(folder, tensors)
    return Source(folder, tensors, vp=vp, latent_stats=LatentStats.from_dict(stats) if stats else None, **objective)


def read_foreign(path: Path, num_heads: int | None = None) -> Source:
    """A foreign DiT (ditcore.interop.read) as a source: its architecture, schedule and latent scale."""
    try:
        got = interop.read(path, num_heads)
    except interop.ConversionError as e:
        raise ConfigError(KEY, str(path), f"a checkpoint that converts: {e}") from None
    stats = got.latent_stats  # a Wan pipeline's VAE's, or a ditcore export's recorded units
    if stats is None and isinstance(got.cfg, WanConfig):  # Wan's units are its VAE's per channel: nothing to assume
        raise ConfigError(KEY, str(path), f"a Wan whose latent units are known: a bare {got.kind} folder does not "
                                          "say them — give its WanPipeline folder (vae/config.json holds "
                                          "latents_mean and latents_std)")
    stats = stats or trained_units(got.vae, got.cfg.in_channels)
    return Source(path, got.tensors, cfg=got.cfg, vp=got.vp, latent_stats=stats, kind=got.kind,
                  objective=got.objective, shift=got.shift)


def trained_units(vae: Path | None, channels: int) -> LatentStats:
    """The latent statistics of what a foreign network was trained on, (z − shift_factor)·scaling_factor of its VAE's
    latents z (DiT: 0.18215 z): ditcore's (z − mean)/std·σ_d with mean = shift_factor, std = σ_d/scaling_factor. The
    factors are its pipeline VAE's where the import has one (config.json), else DiT's."""
    config = _json(vae / "config.json") if vae is not None else {}
    scale, shift = config.get("scaling_factor", DIT_SCALING_FACTOR), config.get("shift_factor") or 0.0
    for name, value in (("scaling_factor", scale), ("shift_factor", shift)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or \
                (name == "scaling_factor" and not value > 0):
            raise ConfigError(KEY, str(vae), f"a VAE config whose {name} is a finite number (> 0 for the scale; it "
                                             f"says {value!r})")
    return LatentStats.of_vae(channels, scale, shift)


def _json(path: Path) -> dict:
    """A JSON object from `path`, {} when the file is absent; ConfigError when it is not one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(KEY, str(path), f"a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(KEY, str(path), "a JSON object")
    return data


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
        counts = self._counts()
        layers = {}  # how many layers each numbered list has: 'blocks 0-1 of 3'
        for module, layer in counts:
            layers[module] = layers.get(module, 0) + (layer is not None)
        whole = [g for g, (_, fresh) in counts.items() if not fresh]
        part = [g for g, (taken, fresh) in counts.items() if taken and fresh]
        line = (f"init_from {source}: {len(self.taken)} of {len(self.taken) + len(self.fresh)} tensors "
                f"({_names(whole, layers)}" + (f"; in part: {_names(part, layers)}" if part else "") + ")")
        if self.fresh:
            line += "; fresh: " + self._fresh(counts, layers)
        if self.unused:
            line += (f"; not used: {len(self.unused)} of the source's tensors "
                     f"({_names(list(dict.fromkeys(_group(k, self.layers) for k in self.unused)), {})})")
        return line

    def _counts(self) -> dict[tuple[str, int | None], list[int]]:
        """(module, layer) → [tensors taken, tensors fresh]."""
        counts: dict[tuple[str, int | None], list[int]] = {}
        for i, names in enumerate((self.taken, self.fresh)):
            for name in names:
                counts.setdefault(_group(name, self.layers), [0, 0])[i] += 1
        return counts

    def _fresh(self, counts: dict[tuple[str, int | None], list[int]], layers: dict[str, int]) -> str:
        """The fresh tensors: whole groups the source lacks entirely, then up to three single tensors."""
        untouched = {g for g, (taken, _) in counts.items() if not taken}
        missing = [g for g in untouched if all(why == NOT_IN_SOURCE for k, why in self.fresh.items()
                                               if _group(k, self.layers) == g)]
        singles = [f"{k} ({why})" for k, why in self.fresh.items() if _group(k, self.layers) not in missing]
        parts = ([f"{_names(missing, layers)} ({NOT_IN_SOURCE})"] if missing else []) + singles[:3]
        parts += [f"and {len(singles) - 3} more tensors"] if len(singles) > 3 else []
        return ", ".join(parts)


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


def start_from(path: str | Path, cfg: DiTConfig, modules: list[nn.Module], groups: ParallelGroups | None,
               source: Source | None = None) -> str:
    """Fill every module of `modules` (this rank's parts of models of `cfg`: the model and its EMA) with the weights
    at `path` (or of `source`, read from it already) that fit; returns the line that says what was taken. ConfigError
    when none fits."""
    source = source or read_source(path)
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
