"""Saving and resuming training checkpoints with Lightning Fabric (the layout: ditcore.runs).

A checkpoint is written into `.tmp-step-XXXXXXX/`; every file is fsynced by the rank that wrote it, rank 0
adds the `COMPLETE` manifest (size and CRC-32 of every file), fsyncs the folder and renames it into place.
So a folder named step-XXXXXXX is complete whenever it exists, even after kill -9 or a power loss, and a
file damaged later (truncated, overwritten) is detected before it is loaded.

`--resume auto` takes the newest checkpoint that verifies and loads; a damaged one is reported in one line
and the previous one is used instead. It never silently starts over.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ditcore import durable, runs
from ditcore.runs import CheckpointError


def resolve_resume(run_dir: Path, resume: str) -> list[Path]:
    """Checkpoints to try, in order: --resume auto → every complete one, newest first; none → []; else that one."""
    if resume == "none":
        return []
    if resume == "auto":
        return runs.complete_checkpoints(run_dir)[::-1]
    path = Path(resume)
    if not runs.is_complete(path):
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {runs.MARKER} marker) — pass a "
                                "RUN_DIR/checkpoints/step-XXXXXXX folder, 'auto' or 'none'")
    return [path]


def save(fabric, run_dir: Path, step: int, state: dict, loader, config_yaml: str, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder."""
    final = runs.step_dir(run_dir, step)
    tmp = runs.tmp_dir(final)
    if fabric.global_rank == 0:
        durable.remove_leftovers(final.parent, (runs.TMP_PREFIX, durable.TRASH_PREFIX))  # from an interrupted save
        tmp.mkdir(parents=True)
    fabric.barrier()
    fabric.save(tmp, state)  # the strategy writes one file per model-parallel shard, then waits for all
    rank_state = {
        "loader": pickle.dumps(loader.save_state_rank()),  # bytes: loads with weights_only
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    torch.save(rank_state, tmp / runs.rank_file(fabric.global_rank))
    # Every rank makes its own files durable and measures them (in parallel); rank 0 records them all.
    mine = [runs.rank_file(fabric.global_rank)]
    if fabric.strategy.groups.is_model_parallel_writer:
        mine.append(_shard_file(fabric))
    for name in mine:
        durable.fsync_file(tmp / name)
    files = {k: v for part in _all_ranks(fabric, {n: durable.digest(tmp / n) for n in mine}) for k, v in part.items()}
    if fabric.global_rank == 0:
        durable.write_text(tmp / runs.CONFIG_FILE, config_yaml)
        files[runs.CONFIG_FILE] = durable.digest(tmp / runs.CONFIG_FILE)
        runs.write_manifest(tmp, step, fabric.world_size, files)
        durable.publish_dir(tmp, final)
        for old in runs.complete_checkpoints(run_dir)[:-keep]:
            durable.remove_dir(old)
    fabric.barrier()
    return final


def resume(fabric, run_dir: Path, resume_arg: str, state: dict, loader) -> Path | None:
    """Restore `state` in place from the first checkpoint that verifies and loads; None: start fresh.

    All ranks agree on the checkpoint. With --resume auto a damaged checkpoint is reported (one line naming
    the file) and the previous one is tried; if none loads, or an explicitly named one is damaged, this
    raises CheckpointError rather than starting over.
    """
    candidates = resolve_resume(run_dir, resume_arg)
    newest_problem = None
    for i, ckpt in enumerate(candidates):
        problem, fatal = _agree(fabric, _load(fabric, ckpt, state, loader))
        if problem is None:
            return ckpt
        if fatal or resume_arg != "auto":
            raise CheckpointError(problem if fatal else f"{problem} — pick another checkpoint, or --resume auto")
        newest_problem = newest_problem or problem
        then = f"trying {candidates[i + 1].name} instead" if i + 1 < len(candidates) else "no older checkpoint left"
        if fabric.global_rank == 0:
            print(f"warning: {problem}; {then}", file=sys.stderr, flush=True)
    if candidates:
        where = Path(run_dir) / runs.CHECKPOINTS
        raise CheckpointError(f"none of the {len(candidates)} complete checkpoints in {where} "
                              f"loads (newest: {newest_problem}) — restore them from a copy, or pass --resume none "
                              "to start over")
    return None


def _load(fabric, ckpt: Path, state: dict, loader) -> tuple[str | None, bool]:
    """Verify this rank's files against the manifest, then load them: (what went wrong or None, fatal?).

    Fatal problems are about the job, not the files (another number of processes): an older checkpoint
    would not help.
    """
    ckpt = Path(ckpt)
    manifest = runs.read_manifest(ckpt)
    written_by = manifest.get("world_size")
    shard, mine = _shard_file(fabric), runs.rank_file(fabric.global_rank)
    if not (ckpt / mine).is_file() or written_by not in (None, fabric.world_size):
        return (f"checkpoint {ckpt} was written by {written_by or 'another number of'} processes, this job has "
                f"{fabric.world_size}: resume with the same number, or start a new run from its export"), True
    for name in (shard, mine):
        problem = runs.verify(ckpt, name, manifest)
        if problem:
            return problem, False
    try:
        fabric.load(ckpt, state)
    except Exception as e:  # verified, yet unreadable (e.g. written by another version): try the previous one
        return f"checkpoint {ckpt} does not load: {shard}: {_first_line(e)}", False
    try:
        rank_state = torch.load(ckpt / mine, weights_only=True)
        loader.restore_state_rank(pickle.loads(rank_state["loader"]))
    except Exception as e:
        return f"checkpoint {ckpt} does not load: {mine}: {_first_line(e)}", False
    torch.set_rng_state(rank_state["torch_rng"])
    if torch.cuda.is_available() and rank_state["cuda_rng"]:
        torch.cuda.set_rng_state_all(rank_state["cuda_rng"])
    return None, False


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _shard_file(fabric) -> str:
    return runs.shard_file(fabric.strategy.groups.tp_rank)


def _all_ranks(fabric, value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if fabric.world_size == 1:
        return [value]
    parts = [None] * fabric.world_size
    dist.all_gather_object(parts, value)
    return parts


def _agree(fabric, verdict: tuple[str | None, bool]) -> tuple[str | None, bool]:
    """Every rank's verdict on the same checkpoint: a fatal problem first, then any problem, else (None, False)."""
    return min(_all_ranks(fabric, verdict), key=lambda v: (not v[1], v[0] is None))
