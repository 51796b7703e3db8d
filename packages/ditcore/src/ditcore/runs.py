"""The run directory and its checkpoints: the one place that names their files and reads them.

    RUN_DIR/
      .lock                        held by the training run that writes here (dit_train.rundir): one at a time
      checkpoints/step-XXXXXXX/    a complete training checkpoint (written as .tmp-step-XXXXXXX/, then renamed);
                                   step-XXXXXXX-2 (-3 …): another trajectory's checkpoint of the same step
        .metadata  __R_0.distcp    torch.distributed.checkpoint, one file per process R: model, EMA and AdamW
                                   state under their one-device names, each rank writing its own pieces (any
                                   layout resumes from it: ditcore.parallel.dist_checkpoint); step, loss
                                   history, learning-rate schedule
        loader-dpXXXXX.json        one per data-parallel rank: its data loader's position (older: .pkl, pickled)
        rng-XXXXX.pt               one per process: its RNG states
        config.yaml                the resolved training config
        COMPLETE                   JSON manifest, written last: step, layout, lineage, {file: {bytes, crc32}}
      export/                      consolidated EMA weights for sampling on one device (ditcore.export)
      samples/step-XXXXXXX/        validation samples
      csv/  tensorboard/  loss.png logs

dit-train writes checkpoints (dit_train.checkpoint); dit-sample finds the export and the checkpoints and loads a
checkpoint's EMA weights, consolidated, on one device. Nothing in a checkpoint is read in a way that could run code:
tensors through safetensors or torch's weights-only unpickler, state as JSON, and DCP's index and older checkpoints'
pickles through restricted unpicklers (ditcore.safe_state).

Lineage: each manifest records the training run the checkpoint belongs to (`run`: an id made when a run starts
from scratch, kept by every resume), its place in the order checkpoints were written in this folder (`seq`) and
the checkpoint it continued from (`parent`: the previous save of the same process, or the one it resumed from).
Step numbers alone cannot order a folder in which a run went back to an older checkpoint (a branch): its new
checkpoints have lower steps than the abandoned ones. So "the newest checkpoint" is the last one written, and "its
trajectory" is it and its ancestors. Checkpoints of an older dit-train (no lineage) were written one run after
another in step order, so they count as written before any with a lineage, and each continues the one before it.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path

import torch

from ditcore import durable
from ditcore.export import WEIGHTS
from ditcore.parallel import dist_checkpoint

CHECKPOINTS, EXPORT, SAMPLES = "checkpoints", "export", "samples"
CSV, TENSORBOARD = "csv", "tensorboard"  # the log folders
LOSS_PLOT = "loss.png"
SHEET = "grid.png"  # the contact sheet of validation samples: prompts × seeds
MARKER = "COMPLETE"
CONFIG_FILE = "config.yaml"
TMP_PREFIX = ".tmp-"
MODEL, EMA = dist_checkpoint.MODEL, dist_checkpoint.EMA  # prefixes of the one-device tensors in a checkpoint
_STEP = re.compile(r"^step-(\d{7})(?:-(\d+))?$")  # -N: the N-th checkpoint of that step in the folder (a branch)
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


def _step_and_copy(ckpt: Path) -> tuple[int, int]:
    match = _STEP.match(Path(ckpt).name)
    return int(match.group(1)), int(match.group(2) or 1)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, by step (step-XXXXXXX before step-XXXXXXX-2)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=_step_and_copy)


def free_step_dir(run_dir: str | Path, step: int) -> Path:
    """Where a new checkpoint of `step` goes: step-XXXXXXX, or step-XXXXXXX-2, -3 … where a complete checkpoint of
    that step is there already (another trajectory's: a branch never replaces it). An incomplete folder of the name
    is not a checkpoint, and is replaced."""
    final = step_dir(run_dir, step)
    copy = 1
    while is_complete(final):
        copy += 1
        final = final.with_name(f"step-{step:07d}-{copy}")
    return final


def write_manifest(ckpt: Path, step: int, layout: dict, files: dict[str, dict], lineage: dict | None = None) -> None:
    """The COMPLETE marker: written (fsynced) last, after every file it lists is durable. layout: world_size, tp, cp,
    pp, dp, fsdp of the job that wrote it; lineage: see the module's docstring."""
    manifest = {"step": step, "layout": layout} | ({"lineage": lineage} if lineage else {})
    manifest["files"] = dict(sorted(files.items()))
    durable.write_text(ckpt / MARKER, json.dumps(manifest, indent=1) + "\n")


def read_manifest(ckpt: Path) -> dict:
    """The manifest, or {} for a marker from before manifests (then loading is the only check)."""
    try:
        manifest = json.loads((Path(ckpt) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def new_run_id() -> str:
    """The id of a training run that starts from scratch: when it started, and 6 random hex digits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def lineage(ckpt: str | Path) -> dict:
    """A checkpoint's lineage {run, seq, written, parent}; {} for one of an older dit-train."""
    value = read_manifest(Path(ckpt)).get("lineage")
    return value if isinstance(value, dict) and isinstance(value.get("seq"), int) else {}


def parent_ref(ckpt: Path) -> dict:
    """How a checkpoint that continues `ckpt` names it (name, run, seq; where it was)."""
    mine = lineage(ckpt)
    return {"name": Path(ckpt).name, "run": mine.get("run"), "seq": mine.get("seq"), "path": str(Path(ckpt).absolute())}


def next_seq(run_dir: str | Path) -> int:
    """The write sequence of the next checkpoint in run_dir: after every one there."""
    return 1 + max((lineage(p).get("seq", 0) for p in complete_checkpoints(run_dir)), default=0)


def by_write_order(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, the last written last (those of an older dit-train first, by step)."""
    return sorted(complete_checkpoints(run_dir), key=lambda p: (lineage(p).get("seq", 0), _step_and_copy(p)))


def newest(run_dir: str | Path) -> Path | None:
    """The complete checkpoint written last, or None."""
    ordered = by_write_order(run_dir)
    return ordered[-1] if ordered else None


def trajectory(run_dir: str | Path, ckpt: Path) -> list[Path]:
    """`ckpt` and the checkpoints in run_dir it continued from, newest first: parent after parent, as far as they
    are still there."""
    found = {p.name: (p, lineage(p)) for p in complete_checkpoints(run_dir)}
    chain, seen = [Path(ckpt)], {Path(ckpt).name}
    while (parent := _parent(chain[-1], found)) is not None and parent.name not in seen:
        chain.append(parent)
        seen.add(parent.name)
    return chain


def _parent(ckpt: Path, found: dict[str, tuple[Path, dict]]) -> Path | None:
    mine = lineage(ckpt)  # read again: a checkpoint elsewhere may have the name of one here
    if not mine:  # an older dit-train's: it continued the one of the highest step below its own
        older = [p for p, theirs in found.values() if not theirs and _step_and_copy(p) < _step_and_copy(ckpt)]
        return max(older, key=_step_and_copy, default=None)
    ref = mine.get("parent")
    if not isinstance(ref, dict) or ref.get("name") not in found:
        return None
    candidate, theirs = found[ref["name"]]
    if ref.get("seq") is None:  # it resumed from an older dit-train's checkpoint
        return candidate if not theirs else None
    return candidate if (theirs.get("run"), theirs.get("seq")) == (ref.get("run"), ref["seq"]) else None


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
