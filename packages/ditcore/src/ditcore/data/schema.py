"""The on-disk dataset: WebDataset shards of precomputed latents + text states, Energon metadata, ditcore.json.

One sample (one tar member group, key `__key__`):
    latent.safetensors   latent [C, T, H, W] (T = 1 for images), bf16, already normalised per channel to std
                         SIGMA_DATA (one tensor, named "latent")
    text.safetensors     text-encoder states [L, D], float16, UNPADDED (true length only; L may be 0), named "text"
    json                 {"caption", "height", "width", "frames", "fps", "source", optional "label"}

Tensors are safetensors and metadata JSON, so reading a dataset someone else wrote cannot run their code (a pickle
can). Datasets written before hold `latent.pth` / `text.pth` (torch.save): they are read with torch's weights-only
unpickler, which builds tensors and nothing else. No other member kind is ever decoded (`read_sample`).

`.nv-meta/` is Energon's index with two views of the same shards: `dataset.yaml`, typed (the loader's
`LatentSample`), is what Energon's own CLI reads (`energon info DIR`, `energon lint DIR`); `dataset_crude.yaml`
(`CrudeWebdataset`) is what the loader opens, cooking the samples itself. Next to it, `ditcore.json` records
how the latents were made: codec identity and parameters, latent statistics, text encoder, counts, and a
class-labelled dataset's class count and names. It is written last, atomically: a dataset without it is incomplete
and is refused.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from collections.abc import Container, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as read_safetensors
from safetensors.torch import save as write_safetensors

from ditcore import durable
from ditcore.safe_state import weights_only_load

log = logging.getLogger(__name__)

FORMAT = "ditcore-dataset/1"
INFO_FILE = "ditcore.json"
LATENT, TEXT, META = "latent.safetensors", "text.safetensors", "json"
LEGACY_LATENT, LEGACY_TEXT = "latent.pth", "text.pth"  # datasets written before safetensors members
TYPED_CONFIG, CRUDE_CONFIG = "dataset.yaml", "dataset_crude.yaml"  # in .nv-meta/; Energon's CLI reads dataset.yaml
HELDOUT_DIR = "val"  # dit-prepare --val-samples N: the held-out split, a dataset of its own inside the training set's


@dataclass
class DatasetInfo:
    """Contents of ditcore.json."""

    codec: dict  # the codec's save() config; parameter files live next to this file
    latent_stats: dict  # per-channel mean/std the latents were normalised with (LatentStats.to_dict())
    text_encoder: dict  # {"name": ..., "dim": ...}
    latent_channels: int
    spatial_factor: int
    temporal_factor: int
    counts: dict = field(default_factory=dict)  # samples, images, videos, shards, skipped: {reason: n}
    num_classes: int = 0  # > 0 for class-labelled datasets
    class_names: list[str] = field(default_factory=list)  # label i's name, for labels 0..len-1 (may be fewer)
    # a held-out split: the training set's {"heldout": "val", "samples": N, "chosen": how}; the held-out set's
    # {"heldout_of": "..", "samples": N, "chosen": how} (dit-prepare --val-samples)
    split: dict = field(default_factory=dict)
    # a blend's members (ditcore.data.blend): [{"name", "path", "weight", "subflavors", "latent_stats"}]
    blend: list = field(default_factory=list)
    format: str = FORMAT

    def write(self, root: Path) -> None:
        data = asdict(self)
        # a dataset without the optional fields keeps the file as before: older ditcores read it
        for optional in ("class_names", "split", "blend"):
            if not data[optional]:
                del data[optional]
        tmp = root / f".{INFO_FILE}.tmp"
        durable.write_text(tmp, json.dumps(data, indent=1))
        os.replace(tmp, root / INFO_FILE)  # atomic: the file is either absent or complete
        durable.fsync_dir(root)


class DatasetError(ValueError):
    """A dataset path that cannot be used, with what to do about it."""


def read_info(root: str | Path) -> DatasetInfo:
    root = Path(root)
    if root.is_file():
        raise DatasetError(f"dataset path '{root}' is a file; expected the folder dit-prepare wrote (with "
                           f"{INFO_FILE} and .nv-meta/)")
    if not root.is_dir():
        raise DatasetError(f"dataset path '{root}' does not exist — run dit-prepare first")
    if not (root / INFO_FILE).is_file() or not ((root / ".nv-meta").is_dir() or is_blend(root)):
        raise DatasetError(f"dataset path '{root}' has no {INFO_FILE} / .nv-meta/: it is not a finished "
                           "ditcore dataset (dit-prepare did not complete?) — run dit-prepare again with --overwrite")
    return parse_info(root / INFO_FILE, "dataset", "run dit-prepare again with --overwrite")


def is_blend(root: str | Path) -> bool:
    """A blend's folder (ditcore.data.blend) has a ditcore.json that lists its datasets, and no index of its own."""
    try:
        return bool(json.loads((Path(root) / INFO_FILE).read_text()).get("blend"))
    except (ValueError, AttributeError, OSError):
        return False


def parse_info(path: Path, what: str = "dataset", fix: str = "run dit-prepare again with --overwrite") -> DatasetInfo:
    """A ditcore.json file (of a dataset, or copied into an export), with its format checked."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        info = DatasetInfo(**data)
    except (ValueError, TypeError) as e:  # not JSON, or JSON of another shape
        raise DatasetError(f"{what} '{Path(path).parent}' has an unreadable {INFO_FILE} ({_first_line(e)}) — "
                           f"{fix}") from None
    if info.format != FORMAT:
        raise DatasetError(f"{what} '{Path(path).parent}' has format {info.format!r}; this ditcore reads {FORMAT!r}")
    names = info.class_names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) > info.num_classes:
        raise DatasetError(f"{what} '{Path(path).parent}' has class_names {str(names)[:80]} for num_classes "
                           f"{info.num_classes}: expected at most that many names (strings) — {fix}")
    return info


def crude_config(root: Path) -> str:
    """The Energon config the loader opens. Datasets prepared before dataset.yaml became the typed view have the
    crude config there (and the typed one as dataset-typed.yaml): they load exactly as before, with a warning."""
    if (Path(root) / ".nv-meta" / CRUDE_CONFIG).is_file():
        return CRUDE_CONFIG
    log.warning("dataset '%s' was prepared by an older ditcore: it loads as before, but Energon's CLI needs "
                "`--dataset-config dataset-typed.yaml` on it (rerun dit-prepare with --overwrite to drop that)", root)
    return "dataset.yaml"  # the old layout's crude config


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def tensor_bytes(t: torch.Tensor, name: str) -> bytes:
    """One tensor as a safetensors blob (a JSON header, then the raw bytes: nothing in it is executable)."""
    return write_safetensors({name: t.contiguous()})


def read_sample(sample: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Latent, text states and metadata of one crude sample ({member name: raw bytes}), decoded by ditcore alone.

    safetensors members, or torch.save'd `.pth` members of older datasets through torch's weights-only unpickler;
    a sample without them (e.g. a `.pkl` or `.pyd` member in their place) is refused with a ValueError, its other
    members never decoded. The loader counts it as an unreadable sample.
    """
    latent = _member_tensor(sample, "latent", LATENT, LEGACY_LATENT)
    text = _member_tensor(sample, "text", TEXT, LEGACY_TEXT)
    if META not in sample:
        raise ValueError(f"sample {sample.get('__key__')} has no {META} member")
    meta = json.loads(sample[META])
    if not isinstance(meta, dict):
        raise ValueError(f"sample {sample.get('__key__')}: its {META} is a {type(meta).__name__}, not an object")
    return latent, text, meta


def shard_keys(path: Path) -> set[str]:
    """The sample keys of a shard, from its tar headers alone (the payloads are seeked over, not read)."""
    with tarfile.open(path, mode="r:") as tar:
        return {m.name.partition(".")[0] for m in tar if m.isfile()}


def shard_metas(path: Path) -> Iterator[dict | None]:
    """The decoded json member of each sample of a shard, in the shard's order (None where it is not JSON): only
    those members are read, the latents and text states seeked over. For reading captions before training."""
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if member.isfile() and member.name.partition(".")[2] == META:
                try:
                    yield json.loads(tar.extractfile(member).read())
                except ValueError:
                    yield None


def shard_samples(path: Path, keys: Container[str] | None = None) -> Iterator[dict]:
    """A shard's crude samples ({member name: raw bytes, '__key__': key}, for read_sample) in the shard's order,
    members grouped by the name before the first dot as WebDataset groups them; with `keys`, only those samples (the
    other members' payloads are never read). Outside the loader: for the few samples scoring reads in a fixed order."""
    sample: dict = {}
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            key, _, kind = member.name.partition(".")
            if not member.isfile() or (keys is not None and key not in keys):
                continue
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            sample["__key__"] = key
            sample[kind] = tar.extractfile(member).read()
    if sample:
        yield sample


def _member_tensor(sample: dict, name: str, member: str, legacy: str) -> torch.Tensor:
    if member in sample:
        tensors = read_safetensors(bytes(sample[member]))
        if list(tensors) != [name]:
            raise ValueError(f"sample {sample.get('__key__')}: {member} holds {sorted(tensors)}, expected one '{name}'")
        return tensors[name]
    if legacy in sample:
        t = weights_only_load(sample[legacy], what=f"sample {sample.get('__key__')}: {legacy}",
                              fix="rerun dit-prepare on the source data to rewrite the dataset")
        if not torch.is_tensor(t):
            raise ValueError(f"sample {sample.get('__key__')}: {legacy} holds a {type(t).__name__}, not a tensor")
        return t
    found = sorted(k for k in sample if not k.startswith("__"))
    raise ValueError(f"sample {sample.get('__key__')} has no {member} (or {legacy}) member; it has {found}")


def to_record(key: str, latent: torch.Tensor, text: torch.Tensor, meta: dict) -> dict:
    """One WebDataset record from a normalised latent [C, T, H, W], text states [L, D] and metadata."""
    if latent.ndim != 4:
        raise ValueError(f"latent of sample {key} has shape {tuple(latent.shape)}; expected [C, T, H, W]")
    return {
        "__key__": key,
        LATENT: tensor_bytes(latent.to(torch.bfloat16), "latent"),
        TEXT: tensor_bytes(text.to(torch.float16), "text"),
        META: json.dumps(meta).encode(),
    }
