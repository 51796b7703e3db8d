"""The run directory and its checkpoints: the one place that names their files and reads them.

    RUN_DIR/
      checkpoints/step-XXXXXXX/    a complete training checkpoint (written as .tmp-step-XXXXXXX/, then renamed)
        .metadata  __R_0.distcp    torch.distributed.checkpoint, one file per process R: model, EMA and AdamW
                                   state under their one-device names, each rank writing its own pieces (any
                                   layout resumes from it: ditcore.parallel.dist_checkpoint); step, loss
                                   history, learning-rate schedule
        loader-dpXXXXX.json        one per data-parallel rank: its data loader's position (older: .pkl, pickled)
        rng-XXXXX.pt               one per process: its RNG states
        config.yaml                the resolved training config
        COMPLETE                   JSON manifest, written last: step, layout, {file: {bytes, crc32}}
      export/                      consolidated EMA weights for sampling on one device (ditcore.export)
      samples/step-XXXXXXX/        validation samples
      csv/  tensorboard/  loss.png logs

dit-train writes checkpoints (dit_train.checkpoint); dit-sample finds the export and the checkpoints and loads a
checkpoint's EMA weights, consolidated, on one device. Nothing in a checkpoint is read in a way that could run code:
tensors through safetensors or torch's weights-only unpickler, state as JSON, and DCP's index and older checkpoints'
pickles through restricted unpicklers (ditcore.safe_state).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ditcore import durable
from ditcore.export import WEIGHTS
from ditcore.parallel import dist_checkpoint

CHECKPOINTS, EXPORT, SAMPLES = "checkpoints", "export", "samples"
LOSS_PLOT = "loss.png"
SHEET = "grid.png"  # the contact sheet of validation samples: prompts × seeds
MARKER = "COMPLETE"
CONFIG_FILE = "config.yaml"
TMP_PREFIX = ".tmp-"
MODEL, EMA = dist_checkpoint.MODEL, dist_checkpoint.EMA  # prefixes of the one-device tensors in a checkpoint
_STEP = re.compile(r"^step-(\d{7})$")
_LOADER = "loader-dp{dp:05d}.json"
_LEGACY_LOADER = "loader-dp{dp:05d}.pkl"  # checkpoints from before JSON loader state
_RNG = "rng-{rank:05d}.pt"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, with what to do about it."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


def tmp_dir(final: Path) -> Path:
    """Where a checkpoint is written before it is published as `final`."""
    return final.with_name(f"{TMP_PREFIX}{final.name}")


def loader_file(dp_rank: int) -> str:
    return _LOADER.format(dp=dp_rank)


def rng_file(rank: int) -> str:
    return _RNG.format(rank=rank)


def read_loader_state(ckpt: Path, dp_rank: int):
    """A data-parallel rank's loader position from a checkpoint, for `loader.restore_state_rank`."""
    from ditcore.data import loader_state

    path = Path(ckpt) / loader_file(dp_rank)
    legacy = Path(ckpt) / _LEGACY_LOADER.format(dp=dp_rank)
    if not path.is_file() and legacy.is_file():
        return loader_state.state_from_pickle(legacy.read_bytes(), what=str(legacy))
    return loader_state.state_from_json(path.read_bytes(), what=str(path))


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


def write_manifest(ckpt: Path, step: int, layout: dict, files: dict[str, dict]) -> None:
    """The COMPLETE marker: written (fsynced) last, after every file it lists is durable. layout: world_size, tp, cp,
    pp, dp, fsdp of the job that wrote it."""
    manifest = {"step": step, "layout": layout, "files": dict(sorted(files.items()))}
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


def load_weights(ckpt: str | Path, key: str = EMA) -> dict[str, torch.Tensor]:
    """A checkpoint's one-device weights (EMA by default), consolidated from the pieces of any layout, verified
    first."""
    ckpt = Path(ckpt)
    if not is_complete(ckpt):
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {MARKER} marker in a step-XXXXXXX folder)")
    manifest = read_manifest(ckpt)
    files = manifest.get("files") or {}
    if dist_checkpoint.METADATA not in files:
        raise CheckpointError(f"checkpoint {ckpt} was written by an older dit-train (no {dist_checkpoint.METADATA} "
                              "in its manifest): sample from that run's export/ instead")
    for name in files:
        problem = verify(ckpt, name, manifest) if (ckpt / name).is_file() else f"checkpoint {ckpt} has lost {name}"
        if problem:
            raise CheckpointError(problem)
    try:
        return dist_checkpoint.read_full(ckpt, key)
    except Exception as e:  # verified, yet unreadable (another version, or no `key` in it)
        raise CheckpointError(f"checkpoint {ckpt} does not load: {type(e).__name__}: {e}") from None


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
