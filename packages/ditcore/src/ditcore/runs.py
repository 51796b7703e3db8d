"""The run directory and its checkpoints: the one place that names their files and reads them.

    RUN_DIR/
      checkpoints/step-XXXXXXX/    a complete training checkpoint (written as .tmp-step-XXXXXXX/, then renamed)
        model_parallel_rank_XX.pt  one per tensor-parallel shard: model, optimizer, EMA, scheduler, step, history
        rank-XXXXX.pt              one per process: its data loader state and RNG states
        config.yaml                the resolved training config
        COMPLETE                   JSON manifest, written last: step, world size, {file: {bytes, crc32}}
      export/                      consolidated EMA weights for sampling on one device (ditcore.export)
      samples/step-XXXXXXX/        validation samples
      csv/  tensorboard/  loss.png logs

dit-train writes checkpoints (saving and resuming go through Lightning Fabric, in dit_train.checkpoint); dit-sample
finds the export and the checkpoints and loads a checkpoint's EMA weights, consolidated, on one device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ditcore import durable
from ditcore.export import WEIGHTS
from ditcore.parallel.consolidate import consolidate_shards
from ditcore.parallel.plan import DIT_PLAN, Plan

CHECKPOINTS, EXPORT, SAMPLES = "checkpoints", "export", "samples"
LOSS_PLOT = "loss.png"
MARKER = "COMPLETE"
CONFIG_FILE = "config.yaml"
TMP_PREFIX = ".tmp-"
MODEL, EMA = "model", "ema"  # keys of the one-device state dicts inside a shard file
_STEP = re.compile(r"^step-(\d{7})$")
_SHARD = "model_parallel_rank_{tp:02d}.pt"
_RANK = "rank-{rank:05d}.pt"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, with what to do about it."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


def tmp_dir(final: Path) -> Path:
    """Where a checkpoint is written before it is published as `final`."""
    return final.with_name(f"{TMP_PREFIX}{final.name}")


def shard_file(tp_rank: int) -> str:
    return _SHARD.format(tp=tp_rank)


def rank_file(rank: int) -> str:
    return _RANK.format(rank=rank)


def step_of(ckpt: Path) -> int | None:
    match = _STEP.match(Path(ckpt).name)
    return int(match.group(1)) if match else None


def is_complete(ckpt: str | Path) -> bool:
    return step_of(Path(ckpt)) is not None and (Path(ckpt) / MARKER).is_file()


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_of)


def write_manifest(ckpt: Path, step: int, world_size: int, files: dict[str, dict]) -> None:
    """The COMPLETE marker: written (fsynced) last, after every file it lists is durable."""
    manifest = {"step": step, "world_size": world_size, "files": dict(sorted(files.items()))}
    durable.write_text(ckpt / MARKER, json.dumps(manifest, indent=1) + "\n")


def read_manifest(ckpt: Path) -> dict:
    """The manifest, or {} for a marker from before manifests (then loading is the only check)."""
    try:
        manifest = json.loads((Path(ckpt) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def verify(ckpt: Path, name: str, manifest: dict) -> str | None:
    """What is wrong with one file of a checkpoint (missing from the manifest, size or CRC-32), or None."""
    files = manifest.get("files", {})
    if not files:
        return None
    if name not in files:
        return f"checkpoint {ckpt} is damaged: its manifest does not list {name}"
    wrong = durable.verify(Path(ckpt) / name, files[name])
    return f"checkpoint {ckpt} is damaged: {wrong}" if wrong else None


def shard_files(ckpt: Path) -> list[Path]:
    """The tensor-parallel shard files of a checkpoint, in rank order."""
    return sorted(Path(ckpt).glob(_SHARD.replace("{tp:02d}", "[0-9][0-9]")))


def load_weights(ckpt: str | Path, key: str = EMA, plan: Plan = DIT_PLAN) -> dict[str, torch.Tensor]:
    """A checkpoint's one-device weights (EMA by default), consolidated from its TP shards, verified first."""
    ckpt = Path(ckpt)
    if not is_complete(ckpt):
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {MARKER} marker in a step-XXXXXXX folder)")
    manifest = read_manifest(ckpt)
    listed = sorted(n for n in manifest.get("files", {}) if n.startswith(_SHARD.split("{")[0]))
    names = listed or [f.name for f in shard_files(ckpt)]
    if not names or names != [shard_file(r) for r in range(len(names))]:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: its shard files are {names or 'missing'}, expected "
                              f"{shard_file(0)} .. in tensor-parallel rank order")
    shards = []
    for name in names:
        problem = verify(ckpt, name, manifest) if (ckpt / name).is_file() else f"checkpoint {ckpt} has lost {name}"
        if problem:
            raise CheckpointError(problem)
        try:
            shards.append(torch.load(ckpt / name, map_location="cpu", weights_only=False, mmap=True)[key])
        except Exception as e:  # verified, yet unreadable (another version, or no `key` in it)
            raise CheckpointError(f"checkpoint {ckpt} does not load: {name}: {type(e).__name__}: {e}") from None
    return consolidate_shards(shards, plan)


def export_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / EXPORT


def samples_dir(run_dir: str | Path, step: int) -> Path:
    """Where training writes the validation samples of a step."""
    return Path(run_dir) / SAMPLES / f"step-{step:07d}"


def find_export(path: str | Path) -> Path:
    """An export folder, or a run directory's export/; FileNotFoundError says which it is not."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    if (export_dir(path) / WEIGHTS).is_file():
        return export_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    raise FileNotFoundError(f"'{path}' is neither an export ({WEIGHTS}) nor a run directory with "
                            f"{EXPORT}/ — dit-train writes RUN_DIR/{EXPORT}/ at the end of training")
