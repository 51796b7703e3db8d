"""The run directory's folders: where each checkpoint, the export and the validation samples go, and which
checkpoints are complete (a step-XXXXXXX folder with its COMPLETE manifest)."""

from __future__ import annotations

import re
from pathlib import Path

from ditcore import durable
from ditcore.export import WEIGHTS

CHECKPOINTS, EXPORT, SAMPLES = "checkpoints", "export", "samples"
CSV, TENSORBOARD, WANDB = "csv", "tensorboard", "wandb"  # the log folders (wandb: logging.wandb's)
LOSS_PLOT = "loss.png"
HELDOUT_PLOT = "heldout.png"  # the held-out loss per noise level over the steps (dit_train.heldout)
SHEET = "grid.png"  # the contact sheet of validation samples: prompts × seeds
MARKER = "COMPLETE"  # the manifest (ditcore.runs.manifest): its presence is what makes a checkpoint complete
TMP_PREFIX = ".tmp-"
LOCK_FILE = ".lock"  # held by the training run that writes in the run dir (dit_train.rundir)
# what dit-train writes in a run dir, and all --overwrite removes
OUTPUTS = (CHECKPOINTS, EXPORT, SAMPLES, CSV, TENSORBOARD, WANDB, LOSS_PLOT, HELDOUT_PLOT)
_STEP = re.compile(r"^step-(\d{7})(?:-(\d+))?$")  # -N: the N-th checkpoint of that step in the folder (a branch)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, with what to do about it."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


def tmp_dir(final: Path) -> Path:
    """Where a checkpoint is written before it is published as `final`."""
    return final.with_name(f"{TMP_PREFIX}{final.name}")


def step_of(ckpt: Path) -> int | None:
    match = _STEP.match(Path(ckpt).name)
    return int(match.group(1)) if match else None


def is_complete(ckpt: str | Path) -> bool:
    return step_of(Path(ckpt)) is not None and (Path(ckpt) / MARKER).is_file()


def step_and_copy(ckpt: Path) -> tuple[int, int]:
    """A checkpoint folder's place among those of its run dir by name: (step, 1 for step-X, N for step-X-N)."""
    match = _STEP.match(Path(ckpt).name)
    return int(match.group(1)), int(match.group(2) or 1)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, by step (step-XXXXXXX before step-XXXXXXX-2)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=step_and_copy)


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


def begin_step(run_dir: str | Path, step: int) -> Path:
    """Make the folder a new checkpoint of `step` is written into (its tmp_dir), once what an interrupted save left
    behind is removed; returns the folder it will be published as."""
    root = Path(run_dir) / CHECKPOINTS
    durable.remove_leftovers(root, (TMP_PREFIX, durable.TRASH_PREFIX))
    final = free_step_dir(run_dir, step)
    tmp_dir(final).mkdir(parents=True)
    return final


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


def find_sampleable(path: str | Path) -> Path:
    """What dit-sample samples for `path`: an export folder; a complete training checkpoint (its EMA weights); a run
    directory's export/, else its newest complete checkpoint (the one written last, which --resume auto continues).
    FileNotFoundError says what `path` is not; CheckpointError names an incomplete checkpoint and what to sample."""
    from ditcore.runs.manifest import newest  # manifest builds on this module's names

    path = Path(path)
    if (path / WEIGHTS).is_file() or (export_dir(path) / WEIGHTS).is_file():
        return find_export(path)
    if is_complete(path):
        return path
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    if step_of(path) is not None or path.name.startswith(TMP_PREFIX):
        run = path.parent.parent
        latest = newest(run)
        instead = (f"sample a complete one: --checkpoint {latest} (or --checkpoint {run}, the newest)" if latest else
                   f"no checkpoint of {run} is complete yet: wait for the next one (checkpoint.every steps)")
        raise CheckpointError(f"checkpoint '{path}' is incomplete (no {MARKER} manifest: its save was interrupted or "
                              f"is still under way) — {instead}")
    latest = newest(path)
    if latest is not None:
        return latest
    if (path / CHECKPOINTS).is_dir():
        raise FileNotFoundError(f"run directory '{path}' has no {EXPORT}/ and no complete checkpoint yet — dit-train "
                                "writes one every checkpoint.every steps (and when stopped), and export/ at the end")
    raise FileNotFoundError(f"'{path}' is neither an export ({WEIGHTS}), a training checkpoint ({CHECKPOINTS}/"
                            f"step-XXXXXXX with its {MARKER} manifest) nor a run directory with {EXPORT}/ or one of "
                            f"those — dit-train writes a checkpoint every checkpoint.every steps and RUN_DIR/{EXPORT}/ "
                            "at the end of training")
