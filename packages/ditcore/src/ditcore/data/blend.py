"""A blend: several dit-prepare datasets trained on as one, each drawn by its weight (`dit-prepare blend`).

A blend's folder holds two files and no samples:
    blend.yaml      Energon's metadataset (MetadatasetV2) over the member datasets: each one's path (relative to the
                    folder where it can be), weight and subflavors. Energon's loader reads it as it is
                    (`get_train_dataset`); `energon info`/`lint` apply to each member dataset, not to the blend.
    ditcore.json    the latents the blend holds, as a dataset's (ditcore.data.schema.DatasetInfo): codec, latent
                    statistics, text encoder, classes, with the members' counts summed, and `blend`: one entry per
                    member, {"name", "path", "weight", "subflavors", "latent_stats"}. Written last, atomically.
    codec_*         the codec's parameter files, copied from the first member (identical in every member).

Every member holds the same codec, text encoder and text width, and the same classes: a sample's latent and text
then mean the same to the network whichever dataset it came from. A member's latent statistics may differ (datasets
encoded with one VAE are normalised with their own measured statistics): its samples are mapped into the blend's
units, the first member's, as they are read (`Member.latent_map`: per channel, the same affine map
ditcore.training.LatentMap applies between a dataset and a network).

Subflavors travel with every sample to the task encoder (Energon's `__subflavors__`): `dataset`, the member's name,
always (the per-dataset counts and held-out losses are by it), and what the member's spec sets (SUBFLAVORS):
`cfg_drop`, the probability that a sample of this dataset is trained without its caption (and other conditions),
instead of the run's edm.cfg_dropout.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ditcore import durable
from ditcore.data.schema import INFO_FILE, DatasetError, DatasetInfo, crude_config, is_blend, read_info
from ditcore.data.writer import start_output
from ditcore.layout import SIGMA_DATA

BLEND_FILE = "blend.yaml"
NAME_KEY = "dataset"  # the subflavor that names a sample's dataset
# subflavors a member may set, and what each must be: the task encoder reads them (ditcore.data.loader)
SUBFLAVORS = {"cfg_drop": "a probability in [0, 1]"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a metrics column / TensorBoard tag as it is


@dataclass
class Member:
    """One dataset of a blend."""

    name: str
    root: Path  # resolved
    weight: float
    subflavors: dict = field(default_factory=dict)  # of SUBFLAVORS
    latent_stats: dict = field(default_factory=dict)  # its own statistics (LatentStats.to_dict()), {} if none

    @property
    def cfg_drop(self) -> float | None:
        return self.subflavors.get("cfg_drop")

    def latent_map(self, blend_stats: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale, shift) per channel, float32, that take this member's latents into the blend's units: x' = scale·x +
        shift with scale = std/std', shift = (mean − mean')/std'·σ_d (mean, std: the member's; mean', std': the
        blend's; both normalised to SIGMA_DATA, as ditcore.training.LatentMap maps a dataset to a network, in float64
        then rounded); None where the units are the same (no arithmetic: the samples stay bit for bit)."""
        if not self.latent_stats or not blend_stats or self.latent_stats == blend_stats:
            return None
        mine, blend = ({k: torch.tensor(stats[k], dtype=torch.float64) for k in ("mean", "std")}
                       for stats in (self.latent_stats, blend_stats))
        if mine["mean"].shape != blend["mean"].shape:
            raise DatasetError(f"dataset '{self.name}' has latent statistics of {len(mine['mean'])} channels, the "
                               f"blend's {len(blend['mean'])}")
        scale = mine["std"] / blend["std"]
        shift = (mine["mean"] - blend["mean"]) / blend["std"] * SIGMA_DATA
        return scale.float(), shift.float()

    def entry(self, folder: Path) -> dict:
        """Its ditcore.json entry, the path relative to the blend's folder where it can be (the two move together)."""
        return {"name": self.name, "path": _relative(self.root, folder), "weight": self.weight,
                "subflavors": self.subflavors, "latent_stats": self.latent_stats}


def to_blend_units(latent: torch.Tensor, latent_map: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """A dataset's latent (C, T, H, W) in its blend's units, by the dataset's `Member.latent_map`; as it is for None."""
    if latent_map is None:
        return latent
    scale, shift = (v[:, None, None, None] for v in latent_map)
    return latent.float() * scale + shift


def _relative(path: Path, folder: Path) -> str:
    try:  # from the folder's real place, as members() resolves it (a symlink in `folder` would skew a lexical path)
        return os.path.relpath(path, Path(folder).resolve())
    except ValueError:  # another drive
        return str(path)


def members(root: str | Path, info: DatasetInfo | None = None) -> list[Member]:
    """The members of the blend at `root`, each checked to exist and be a finished dataset; [] for a dataset."""
    root = Path(root)
    info = info or read_info(root)
    out = []
    for entry in info.blend:
        path = Path(entry["path"])
        path = (root / path).resolve() if not path.is_absolute() else path
        member = Member(entry["name"], path, float(entry["weight"]), dict(entry.get("subflavors") or {}),
                        dict(entry.get("latent_stats") or {}))
        try:
            read_info(path)
        except DatasetError as e:
            raise DatasetError(f"dataset '{member.name}' of blend '{root}' cannot be read: {e}") from None
        out.append(member)
    return out


def datasets(root: str | Path, info: DatasetInfo) -> list[tuple[str, Path, DatasetInfo]]:
    """(name, folder, info) of each dataset data.path names: a blend's members, or the dataset itself (name "")."""
    if not info.blend:
        return [("", Path(root), info)]
    return [(m.name, m.root, read_info(m.root)) for m in members(root, info)]


def parse_spec(spec: str) -> tuple[Path, float, dict, str | None]:
    """`PATH[:WEIGHT[:KEY=VALUE...]]` → (path, weight, subflavors, name or None). `name=` names the member (default:
    its folder's name); the other keys are SUBFLAVORS. ValueError in one line for what is wrong."""
    path, _, rest = spec.partition(":")
    if not path:
        raise ValueError(f"--dataset {spec!r}: no path — give PATH[:WEIGHT[:KEY=VALUE...]]")
    parts = rest.split(":") if rest else []
    weight = 1.0
    if parts:
        try:
            weight = float(parts[0])
        except ValueError:
            raise ValueError(f"--dataset {spec!r}: weight {parts[0]!r} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"--dataset {spec!r}: weight {parts[0]} must be a positive number")
    subflavors, name = {}, None
    for kv in parts[1:]:
        key, eq, value = kv.partition("=")
        if not eq:
            raise ValueError(f"--dataset {spec!r}: {kv!r} is not KEY=VALUE")
        if key in subflavors or (key == "name" and name is not None):
            raise ValueError(f"--dataset {spec!r}: {key}= is given twice")
        if key == "name":
            if not value:
                raise ValueError(f"--dataset {spec!r}: name= is empty — give the name the metrics show, e.g. "
                                 "name=photos")
            name = value
        elif key in SUBFLAVORS:
            subflavors[key] = _subflavor(key, value, spec)
        else:
            raise ValueError(f"--dataset {spec!r}: unknown key {key!r}; a member sets name= or "
                             f"{', '.join(f'{k}= ({v})' for k, v in SUBFLAVORS.items())}")
    return Path(path), weight, subflavors, name


def _subflavor(key: str, value: str, spec: str) -> float:
    try:
        p = float(value)
    except ValueError:
        p = float("nan")
    if not 0 <= p <= 1:  # also NaN
        raise ValueError(f"--dataset {spec!r}: {key}={value} must be {SUBFLAVORS[key]}")
    return p


def check_compatible(infos: dict[str, DatasetInfo]) -> None:
    """Refuse, in one line naming the dataset and the difference, members whose samples mean different things to the
    network: another codec (or its parameters), text encoder or width, latent shape factors, or classes. Latent
    statistics may differ (mapped as the samples are read)."""
    (first, ref), *rest = infos.items()
    for name, info in rest:
        for what in ("codec", "text_encoder", "latent_channels", "spatial_factor", "temporal_factor", "num_classes",
                     "class_names"):
            mine, theirs = getattr(info, what), getattr(ref, what)
            if mine != theirs:
                raise DatasetError(f"dataset '{name}' has {what} {_short(mine)}, dataset '{first}' {_short(theirs)}: "
                                   "a blend's datasets must be prepared with the same codec and text encoder "
                                   f"(dit-prepare ... with the same --codec/--text-encoder options)")


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _codec_files(info: DatasetInfo) -> list[str]:
    """The codec's parameter files (a fitted codec's; none for pixel and VAE codecs), by name in its folder."""
    return [v for k, v in info.codec.items() if k == "file" and isinstance(v, str)]


def _check_codec_files(roots: dict[str, Path], info: DatasetInfo) -> None:
    digests = {}
    for name, root in roots.items():
        for f in _codec_files(info):
            if not (root / f).is_file():
                raise DatasetError(f"dataset '{name}' ({root}) has no {f}, its codec's parameters — run dit-prepare "
                                   "on it again with --overwrite")
            digests.setdefault(f, {})[name] = hashlib.sha256((root / f).read_bytes()).hexdigest()
    for f, by_member in digests.items():
        (first, ref), *rest = by_member.items()
        for name, digest in rest:
            if digest != ref:
                raise DatasetError(f"dataset '{name}' has another {f} than dataset '{first}': its codec was fitted "
                                   "on other data, so the same latent means another image — a blend's datasets need "
                                   "one codec (a VAE or pixel codec, or the same fitted one)")


def write_blend(out: Path, specs: list[tuple[Path, float, dict, str | None]], overwrite: bool = False) -> DatasetInfo:
    """Validate the member datasets, then write the blend's folder `out` (ditcore.json last). Returns its info."""
    out = Path(out)
    if len(specs) < 2:
        raise DatasetError(f"a blend needs at least two datasets (--dataset PATH[:WEIGHT[:KEY=VALUE...]] each), got "
                           f"{len(specs)}" + (" — train on a single dataset by pointing data.path at it"
                                              if specs else ""))
    infos, roots = {}, {}
    for path, _, _, name in specs:
        name = name or Path(path).resolve().name
        if not _NAME.match(name):
            raise DatasetError(f"dataset name {name!r} (of {path}) must be letters, digits, '_', '.' or '-': it names "
                               "metrics columns — give one with PATH:WEIGHT:name=NAME")
        if name in infos:
            raise DatasetError(f"two datasets are named {name!r} — name one with PATH:WEIGHT:name=NAME")
        if is_blend(path):
            raise DatasetError(f"dataset '{path}' is a blend itself: list its datasets instead")
        infos[name], roots[name] = read_info(path), Path(path).resolve()
    if out.resolve() in roots.values():
        raise DatasetError(f"output '{out}' is one of the blend's datasets — choose another folder")
    check_compatible(infos)
    first = next(iter(infos.values()))
    _check_codec_files(roots, first)
    total = sum(w for _, w, _, _ in specs)
    blend = [Member(name, roots[name], w / total, sub, infos[name].latent_stats)
             for name, (_, w, sub, _) in zip(infos, specs, strict=True)]
    # a dataset there is refused before the advice to pass --overwrite, which would not replace it either
    start_output(out, overwrite, "blend", _remove_blend, refuse=_refuse_dataset)
    for f in _codec_files(first):
        shutil.copyfile(roots[blend[0].name] / f, out / f)
    durable.write_text(out / BLEND_FILE, yaml.safe_dump(metadataset(blend, out), sort_keys=False))
    info = DatasetInfo(codec=first.codec, latent_stats=first.latent_stats, text_encoder=first.text_encoder,
                       latent_channels=first.latent_channels, spatial_factor=first.spatial_factor,
                       temporal_factor=first.temporal_factor, counts=_summed_counts(infos),
                       num_classes=first.num_classes, class_names=first.class_names,
                       blend=[m.entry(out) for m in blend])
    info.write(out)
    return info


def _summed_counts(infos: dict[str, DatasetInfo]) -> dict:
    """The members' counts as one dataset's: numbers summed, and the tallies by kind (latent_shapes, skipped) summed
    per kind: dit-train's fit report reads latent_shapes (ditcore.data.fit). The example keys of a latent shape
    (latent_shape_keys) are named NAME/KEY, as keys repeat across datasets."""
    from ditcore.data.writer import SHAPE_KEYS

    counts: dict = {}
    for name, info in infos.items():
        for key, value in info.counts.items():
            if isinstance(value, int) and not isinstance(value, bool):
                counts[key] = counts.get(key, 0) + value
            elif key == "latent_shape_keys" and isinstance(value, dict):
                tally = counts.setdefault(key, {})
                for shape, keys in value.items():
                    tally[shape] = (tally.get(shape, []) + [f"{name}/{k}" for k in keys])[:SHAPE_KEYS]
            elif isinstance(value, dict) and all(isinstance(n, int) for n in value.values()):
                tally = counts.setdefault(key, {})
                for kind, n in value.items():
                    tally[kind] = tally.get(kind, 0) + n
    return counts


def _refuse_dataset(out: Path) -> None:
    if (out / ".nv-meta").is_dir() or any(out.glob("*.tar")):
        raise FileExistsError(f"output '{out}' holds a dataset, not a blend — choose another folder")


def _remove_blend(out: Path) -> None:
    """What write_blend writes, ditcore.json first (a half-removed blend never passes for one)."""
    _refuse_dataset(out)
    (out / INFO_FILE).unlink(missing_ok=True)
    for p in [out / BLEND_FILE, *out.glob("codec_*"), *out.glob(".blend-*.yaml")]:
        p.unlink(missing_ok=True)


def metadataset(blend: list[Member], folder: Path | None, dataset_configs: dict[str, dict] | None = None) -> dict:
    """Energon's MetadatasetV2 over `blend`, in its order: each member's path (relative to `folder`, absolute
    without), weight, subflavors (NAME_KEY and its own) and the dataset config ditcore's loader opens (its crude
    view; `dataset_configs`: other settings by member name, e.g. a split config without broken shards)."""
    entries = []
    for m in blend:
        entry = {"weight": m.weight, "path": _relative(m.root, folder) if folder else str(m.root),
                 "dataset_config": crude_config(m.root), "subflavors": {NAME_KEY: m.name, **m.subflavors}}
        entries.append(entry | (dataset_configs or {}).get(m.name, {}))
    return {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": {"blend": entries}}}
