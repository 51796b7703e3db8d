"""Weights & Biases as a Fabric logger (logging.wandb): the scalars as logged to the CSV and TensorBoard logs (same
names, same steps), the validation samples (dit_train.media_log) and the resolved config.

Only the job's first process (global rank 0) starts a W&B run and writes to it, when the logger is made: a missing
login or an unreachable server stops the job before anything is built. A run that continues a checkpoint continues
the W&B run too: its id is kept in RUN_DIR/wandb/run.json (--overwrite removes RUN_DIR/wandb, and the next run gets
a new id). W&B takes a run's steps in increasing order only: where a resume repeats steps the W&B run already has
(after a crash past the last checkpoint, or a branch), W&B drops them; the CSV and TensorBoard logs keep both, one
segment each.

wandb is imported here only, when a run starts: with logging.wandb.project unset nothing imports it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lightning_fabric.loggers.logger import Logger

from dit_train.config import WandB
from dit_train.media_log import SHEET, clip_name
from dit_train.rundir import first_process
from dit_train.validation import Samples
from ditcore import durable, runs

RUN_FILE = "run.json"  # {"id": the W&B run id}


class WandBUnavailable(RuntimeError):
    """W&B could not start a run: no login, no network, or a folder it cannot write."""


class WandBLogger(Logger):
    """`resuming`: whether this training run continues a checkpoint (then it logs into the W&B run recorded in the
    run dir, where there is one)."""

    def __init__(self, cfg: WandB, run_dir: Path, config: dict, resuming: bool):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run = start(cfg, self.run_dir, config, resuming) if first_process() else None
        self.run_id = self.run.id if self.run is not None else None  # kept after the run finishes

    @property
    def name(self) -> str:
        return self.cfg.project

    @property
    def version(self) -> str | None:
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        if self.run is not None:
            self.run.config.update(params if isinstance(params, dict) else vars(params), allow_val_change=True)

    def log_samples(self, samples: Samples) -> None:
        """The contact sheet as an image and each clip as a video, from its mp4 (wandb.Video encodes frames only
        through moviepy, which nothing else here needs)."""
        if self.run is None:
            return
        import wandb

        media = {}
        if samples.sheet is not None:
            media[SHEET] = wandb.Image(samples.sheet, caption=f"step {samples.step}: prompts x seeds")
        for clip in samples.clips:
            media[clip_name(clip)] = wandb.Video(str(clip.path), caption=clip.prompt)
        if media:
            self.run.log(media, step=samples.step)

    def finalize(self, status: str) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None  # train() finalizes every logger once, whatever ended the run
        run.finish(exit_code=0 if status == "success" else 1)
        if self.cfg.mode == "offline":  # each segment of a resumed run is a folder: wandb syncs them in order
            folder = Path(run.settings.sync_dir).parent
            print(f"W&B: run {run.id} is offline, in {folder} — upload it with `wandb sync "
                  f"{folder}/offline-run-*-{run.id}`", file=sys.stderr, flush=True)


def start(cfg: WandB, run_dir: Path, config: dict, resuming: bool):
    """wandb.init in RUN_DIR/wandb, quiet; WandBUnavailable in one line if it cannot."""
    # before wandb is imported, which reads them: its banners and hints would interleave with the progress bar, and
    # wandb-core reports its own crashes over the network, which an offline run must not use (a user's own setting
    # of either wins)
    os.environ.setdefault("WANDB_SILENT", "true")
    if cfg.mode == "offline":
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    import wandb

    folder = run_dir / runs.WANDB  # W&B's own files (wandb.init(dir=RUN_DIR)) and RUN_FILE
    known = recorded_id(folder) if resuming else None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir), config=config,
                         # known: continue that W&B run ("allow": it may not be on the server, offline and not
                         # synced yet); None: a new W&B run, whose id is recorded below
                         id=known, resume="allow" if known else None, name=run_dir.resolve().name,
                         # console off: the run's stdout and stderr stay the terminal's, not copied into W&B;
                         # allow_val_change: a resumed run may change a value (train.steps, say)
                         settings=wandb.Settings(silent=True, console="off", allow_val_change=True))
    except (wandb.errors.Error, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if cfg.mode == "offline":
            raise WandBUnavailable(f"W&B could not start an offline run in {folder}: {reason}") from None
        raise WandBUnavailable(f"W&B could not start a run (logging.wandb.mode=online): {reason} — set WANDB_API_KEY "
                               "(or run `wandb login`) and check the network, or set logging.wandb.mode=offline and "
                               f"upload the run from {folder} later with `wandb sync`") from None
    if run.id != known:
        record_id(folder, run.id)
    return run


def recorded_id(folder: Path) -> str | None:
    """The W&B run id RUN_DIR/wandb/run.json records; None if there is none (or it is unreadable: a new W&B run)."""
    try:
        value = json.loads((folder / RUN_FILE).read_text()).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def record_id(folder: Path, run_id: str) -> None:
    durable.replace_text(folder / RUN_FILE, json.dumps({"id": run_id}) + "\n")
