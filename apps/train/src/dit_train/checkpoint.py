"""Training checkpoints: RUN_DIR/checkpoints/step-XXXXXXX/, written atomically, newest K kept.

A checkpoint is written into `.tmp-step-XXXXXXX/` and renamed only after every rank has written its part
and rank 0 has added the `COMPLETE` marker, so a folder without the marker (a crash mid-save) is never
resumed from. Contents:
    model_parallel_rank_XX.pt   one per tensor-parallel shard (MegatronStrategy): model, optimizer, EMA,
                                scheduler, step, loss history
    rank-XXXXX.pt               one per process: its data loader state and RNG states
    config.yaml                 the resolved training config
    COMPLETE                    written last
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import torch

MARKER = "COMPLETE"
PATTERN = re.compile(r"^step-(\d{7})$")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if PATTERN.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """--resume auto → the newest complete checkpoint (or None: a fresh run); none → None; else a path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {MARKER} marker) — pass a "
                                "RUN_DIR/checkpoints/step-XXXXXXX folder, 'auto' or 'none'")
    return path


def save(fabric, run_dir: Path, step: int, state: dict, loader, config_yaml: str, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if fabric.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    fabric.barrier()
    fabric.save(tmp, state)  # the strategy writes one file per model-parallel shard, then waits for all
    rank_state = {
        "loader": pickle.dumps(loader.save_state_rank()),  # bytes: loads with weights_only
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    torch.save(rank_state, tmp / f"rank-{fabric.global_rank:05d}.pt")
    fabric.barrier()
    if fabric.global_rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / MARKER).write_text(f"step {step}\nworld_size {fabric.world_size}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    fabric.barrier()
    return final


def load(fabric, path: Path, state: dict, loader) -> None:
    """Restore `state` in place, and this rank's loader (before it is iterated) and RNG states."""
    rank_file = Path(path) / f"rank-{fabric.global_rank:05d}.pt"
    marker = (Path(path) / MARKER).read_text()
    if not rank_file.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no state for rank {fabric.global_rank} ({marker.strip()}): "
                                "resume with the same number of processes it was written with")
    fabric.load(path, state)
    rank_state = torch.load(rank_file, weights_only=True)
    loader.restore_state_rank(pickle.loads(rank_state["loader"]))
    torch.set_rng_state(rank_state["torch_rng"])
    if torch.cuda.is_available() and rank_state["cuda_rng"]:
        torch.cuda.set_rng_state_all(rank_state["cuda_rng"])
