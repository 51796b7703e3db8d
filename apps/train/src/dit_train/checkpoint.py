"""When to save and what to resume: dit-train's orchestration of its checkpoints, whose files ditcore.runs owns
(names, writing, reading, manifest and lineage) and whose tensors ditcore.parallel.dist_checkpoint gives as layout-free
views of the live state.

A checkpoint is written into `.tmp-step-XXXXXXX/`: every rank writes its pieces of the model, EMA and optimizer
state (torch.distributed.checkpoint, in parallel), its RNG states, and one rank per data-parallel rank the data
loader's position; each rank fsyncs and measures its own files, rank 0 adds the `COMPLETE` manifest (the layout,
size and CRC-32 of every file), fsyncs the folder and renames it into place. So a folder named step-XXXXXXX is
complete whenever it exists, even after kill -9 or a power loss, and a file damaged later (truncated,
overwritten) is detected before it is loaded.

Any layout resumes from any other (TP, CP, DP, FSDP, number of processes): weights, EMA, optimizer state, schedule
and step exactly. The data loader's position is restored when the loader is built alike (data-parallel size, the
loader's settings) over the same data (the dataset's fingerprint, kept in the checkpoint); otherwise the loader starts
a fresh pass over the data, and a note says so. RNG states are restored when the layout is the same. The config may
change between runs as dit_train.resume_config rules: the new optimizer hyper-parameters, schedule, loader settings
apply (one line names them); another model or batch is refused in one line, and the model's tensors must match the
checkpoint's exactly.

`--resume auto` takes the newest checkpoint that verifies and loads; a damaged one is reported in one line
and the previous one is used instead. It never silently starts over.

Lineage (ditcore.runs): "newest" is the checkpoint written last, not the highest step, and "previous" is the one
it continued from. A run resumed from an older checkpoint (`--resume RUN/checkpoints/step-0000010` where
step-0000020 exists) branches off: its checkpoints continue step-0000010's trajectory, `--resume auto` follows
them from then on, and a step the other trajectory has already is written as step-XXXXXXX-2. Rotation (`keep`)
counts and deletes only checkpoints of the current trajectory, oldest first, never the one just written: another
trajectory's checkpoints (the abandoned branch) are never deleted by dit-train, only reported when it branches.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dit_train import resume_config
from ditcore import disk, durable, runs
from ditcore.data.loader import blend_note, compare_fingerprints
from ditcore.parallel import dist_checkpoint
from ditcore.runs import CheckpointError


def resolve_resume(run_dir: Path, resume: str) -> list[Path]:
    """Checkpoints to try, in order: --resume auto → the one written last, then those it continued from (its
    trajectory; another trajectory's never); none → []; else that one."""
    if resume == "none":
        return []
    if resume == "auto":  # the last written, then the checkpoints it continued from
        newest = runs.newest(run_dir)
        return runs.trajectory(run_dir, newest) if newest else []
    path = Path(resume)
    if not runs.is_complete(path):
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {runs.MARKER} marker) — pass a "
                                "RUN_DIR/checkpoints/step-XXXXXXX folder, 'auto' or 'none'")
    return [path]


def blend_order(run_dir: Path, resume: str) -> tuple[str, ...]:
    """The datasets of a blend that the checkpoint a resume would load read, in its loader's order: that of the first
    candidate whose values read (an unreadable one is skipped, as --resume auto skips it); () when there is none or
    it read no blend. Read before the loader is built, which keeps them in that order (build_loader's `first`)."""
    try:
        candidates = resolve_resume(run_dir, resume)
    except (OSError, ValueError):  # the resume itself says what is wrong
        return ()
    for ckpt in candidates:
        try:
            data = runs.read_values(ckpt).get("dataset")
        except (Exception, CheckpointException):  # damaged; DCP's CheckpointException is no Exception
            continue
        return tuple(m["name"] for m in data["blend"]) if isinstance(data, dict) and "blend" in data else ()
    return ()


def layout(fabric) -> dict:
    """The job's layout, as the manifest records it."""
    dims = fabric.strategy.groups.dims
    return {"world_size": fabric.world_size, "tp": dims.tp, "cp": dims.cp, "pp": dims.pp, "dp": dims.dp,
            "fsdp": bool(fabric.strategy.fsdp)}


def save(fabric, run_dir: Path, step: int, state: dict, loader, config_yaml: str, keep: int,
         describe: Callable[[Path], list[str]] | None = None) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder. `describe` (rank 0): writes what the
    export would record beside the weights into the folder (ditcore.export.describe), so that dit-sample samples the
    checkpoint's EMA weights before the run has an export."""
    rank = fabric.global_rank
    name = None
    if rank == 0:
        name = runs.begin_step(run_dir, step).name
    final = Path(run_dir) / runs.CHECKPOINTS / all_ranks(fabric, name)[0]  # rank 0's choice, once its folder exists
    tmp = runs.tmp_dir(final)
    values = _values(state) | {"skipped": dict(dp_total(fabric, state["skipped"])),
                               "drawn": dict(dp_total(fabric, state["drawn"])),
                               "dataset": getattr(loader, "fingerprint", None)}
    try:
        runs.save_tensors(tmp, _tensors(fabric, state), values)  # each rank its pieces, fsynced
        mine = _write_rank_files(tmp, fabric, loader)
    # e.g. the disk filled up: every rank must hear of it, or the others would wait forever. DCP's own failures
    # (CheckpointException, a BaseException) reach every rank at once.
    except (OSError, CheckpointException) as e:
        mine = _write_failed(rank, final, tmp, e)
    parts = all_ranks(fabric, mine)
    problem = next((p for p in parts if isinstance(p, str)), None)
    if problem:
        if rank == 0:  # what was written of it would only keep the disk full
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{problem} — nothing was published; the newest complete checkpoint is kept")
    files = {k: v for part in parts for k, v in part.items()}
    if rank == 0:
        files |= runs.seal(tmp, [runs.write_config(tmp, config_yaml), *(describe(tmp) if describe else [])])
        # state["lineage"] is current on rank 0 only, the one rank that writes it
        state["lineage"] = runs.publish(tmp, final, step, layout(fabric), files, state.get("lineage"))
        rotate(run_dir, final, keep)
    fabric.barrier()
    return final


def rotate(run_dir: Path, newest: Path, keep: int) -> list[Path]:
    """Delete the checkpoints of `newest`'s trajectory older than its `keep` newest (`newest` itself never); other
    trajectories' are left alone. Returns those deleted."""
    old = runs.trajectory(run_dir, newest)[max(keep, 1):]
    for ckpt in old:
        durable.remove_dir(ckpt)
    return old


def _write_failed(rank: int, final: Path, tmp: Path, e: BaseException) -> str:
    """Why this rank could not write its part of a checkpoint, in one line: a full disk by its folder and free space."""
    what = f"rank {rank} could not write its part of checkpoint {final}"
    # DCP's CheckpointException holds every rank's failure, and its text is their tracebacks: look at the failures
    causes = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    if any(disk.is_disk_full(c) for c in causes):
        return str(disk.disk_full(what, tmp))
    return f"{what}: {_first_line(causes[0] if causes else e)}"


def _write_rank_files(tmp: Path, fabric, loader) -> dict[str, dict]:
    """This rank's RNG states (and, for one rank per data-parallel rank, the loader's position), beside its DCP
    file; every one fsynced and measured: {file name: its size and CRC-32}."""
    groups, rank = fabric.strategy.groups, fabric.global_rank
    mine = [*runs.files_of_rank(tmp, rank), runs.write_rng(tmp, rank)]
    if groups.tp_rank == groups.cp_rank == groups.pp_rank == 0:  # one writer per data-parallel rank: its peers read it
        mine.append(runs.write_loader_state(tmp, groups.dp_rank, loader.save_state_rank()))
    return runs.seal(tmp, mine)  # every rank makes its own files durable and measures them, in parallel


def resume(fabric, run_dir: Path, resume_arg: str, state: dict, loader, cfg) -> Path | None:
    """Restore `state` in place from the first checkpoint that verifies and loads; None: start fresh.

    All ranks agree on the checkpoint. With --resume auto a damaged checkpoint is reported (one line naming
    the file) and the previous one is tried; if none loads, or an explicitly named one is damaged, this
    raises CheckpointError rather than starting over. A checkpoint that cannot continue as `cfg` asks (another
    model, another batch, a damaged dataset: dit_train.resume_config) raises CheckpointError at once; changes that
    apply are named in one line.
    """
    candidates = resolve_resume(run_dir, resume_arg)
    newest_problem = None
    for i, ckpt in enumerate(candidates):
        problem = _agree(fabric, _verify(fabric, ckpt))  # before loading, which is collective
        if problem is None:
            changes = resume_config.compare(runs.read_config(ckpt), cfg, ckpt)
            refusal = _agree(fabric, _refusal(fabric, ckpt, changes, state, loader, cfg))
            if refusal:  # not damage: an older checkpoint of the same run would be refused alike
                raise CheckpointError(refusal)
            if fabric.global_rank == 0 and changes.summary():
                print(changes.summary(), file=sys.stderr, flush=True)
            problem = _agree(fabric, _load(fabric, ckpt, state, loader, changes, cfg))
        if problem is None:
            state["lineage"] = runs.next_lineage(ckpt)
            if fabric.global_rank == 0:
                note_branch(run_dir, ckpt)
            return ckpt
        if resume_arg != "auto":
            raise CheckpointError(f"{problem} — pick another checkpoint, or --resume auto")
        newest_problem = newest_problem or problem
        then = f"trying {candidates[i + 1].name} instead" if i + 1 < len(candidates) else "no older checkpoint left"
        if fabric.global_rank == 0:
            print(f"warning: {problem}; {then}", file=sys.stderr, flush=True)
    if candidates:
        where = Path(run_dir) / runs.CHECKPOINTS
        raise CheckpointError(f"none of the {len(candidates)} complete checkpoints in {where} "
                              f"loads (newest: {newest_problem}) — restore them from a copy, or pass --resume none "
                              "--overwrite to start over (deleting them)")
    state["lineage"] = runs.next_lineage(None)
    return None


def note_branch(run_dir: Path, ckpt: Path) -> None:
    """Say so when a resume does not continue the newest checkpoint of the run dir: it starts a branch."""
    newest = runs.newest(run_dir)
    if newest is None or newest.absolute() == ckpt.absolute():
        return
    mine = {p.absolute() for p in runs.trajectory(run_dir, ckpt)}
    others = [p.name for p in runs.by_write_order(run_dir) if p.absolute() not in mine]
    print(f"note: resumed from {ckpt}, not from {newest.name}, the newest checkpoint in {newest.parent}: this run "
          f"branches off, and --resume auto continues the branch from now on; the other trajectory's checkpoints "
          f"({', '.join(others)}) are kept, never rotated away — delete them when you no longer need them",
          file=sys.stderr, flush=True)


def _verify(fabric, ckpt: Path) -> str | None:
    """Check the checkpoint's files against its manifest, each file by one rank (all in parallel)."""
    manifest = runs.read_manifest(ckpt)
    files = sorted(manifest.get("files") or {})
    if not files:
        return f"checkpoint {ckpt} is damaged: its {runs.MARKER} manifest does not list its files"
    if runs.METADATA not in files:
        return (f"checkpoint {ckpt} was written by an older dit-train (per-shard files, no "
                f"{runs.METADATA}): start a new run from that run's export/")
    try:
        for name in files[fabric.global_rank::fabric.world_size]:
            problem = runs.verify(ckpt, name, manifest)
            if problem:
                return problem
    except OSError as e:  # unreadable: a problem like any other, which every rank must hear of
        return f"checkpoint {ckpt} is damaged: {e}"
    return None


def _refusal(fabric, ckpt: Path, changes: resume_config.Comparison, state: dict, loader, cfg) -> str | None:
    """Collective: why this run cannot continue from `ckpt` as `cfg` asks, in one line; None if it can. Reads only
    the checkpoint's config, DCP index and values, before anything is loaded."""
    refusal = changes.refusal()
    if refusal:
        return refusal
    wanted = {}  # the one-device shapes of every tensor the model wants (a pipeline stage holds its own blocks)
    for part in all_ranks(fabric, {k: tuple(v.shape) for k, v in _tensors(fabric, state).items()}):
        wanted |= part
    try:
        stored = runs.stored_shapes(ckpt)
        saved_data = runs.read_values(ckpt).get("dataset")
    except Exception:  # unreadable: _load reports it as damage, and --resume auto tries an older checkpoint
        return None
    mismatch = runs.model_mismatch(stored, wanted)
    if mismatch:
        return (f"checkpoint {ckpt} holds another model than this config and dataset build: {mismatch} — resume "
                f"with the config and dataset it was trained with (its {runs.CONFIG_FILE}), or start a new run in "
                f"another train.run_dir {resume_config.init_from_hint(ckpt)}")
    damage, _ = compare_fingerprints(saved_data, getattr(loader, "fingerprint", None), Path(cfg.data.path))
    return damage


def _load(fabric, ckpt: Path, state: dict, loader, changes: resume_config.Comparison, cfg) -> str | None:
    """Collective: load the checkpoint into `state` and the loader; what went wrong, or None."""
    try:
        values = runs.load_tensors(ckpt, _tensors(fabric, state))
        state["step"], state["history"] = values["step"], values["history"]
        state["heldout"] = values.get("heldout", [])  # [step, held-out losses] (dit_train.heldout)
        # the run's total goes to one rank, so that adding every data-parallel rank's counts keeps it
        state["skipped"] = Counter(values.get("skipped", {}) if fabric.global_rank == 0 else {})
        state["drawn"] = Counter(values.get("drawn", {}) if fabric.global_rank == 0 else {})
        _restore_schedule(state["optimizer"], state["scheduler"], values["scheduler"])
    except (Exception, CheckpointException) as e:  # verified, yet unreadable; DCP's is no Exception
        return f"checkpoint {ckpt} does not load: {runs.checkpoint_error(e)}"
    written, now = runs.read_manifest(ckpt).get("layout", {}), layout(fabric)
    groups, rank = fabric.strategy.groups, fabric.global_rank
    # The loader's saved position fits only a loader like the one that saved it, over the same data
    fresh = [f"checkpoint {ckpt.name} was written with {written.get('dp')} data-parallel ranks, this job has "
             f"{now['dp']}"] if written.get("dp") != now["dp"] else []
    fresh += [str(c) for c in changes.loader_changes]
    _, other_data = compare_fingerprints(values.get("dataset"), getattr(loader, "fingerprint", None),
                                         Path(cfg.data.path))
    fresh += [other_data] if other_data else []
    try:
        if not fresh:
            loader.restore_state_rank(runs.read_loader_state(ckpt, groups.dp_rank))
            note = blend_note(values.get("dataset"), getattr(loader, "fingerprint", None))
            if note and rank == 0:
                print(note, file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"note: {'; '.join(fresh)}: weights, EMA, optimizer state and step resume exactly, but the data "
                  "loader's saved position does not carry over, so it starts a fresh pass over the data (samples "
                  "of the current pass may be seen twice)", file=sys.stderr, flush=True)
        if written == now:
            runs.restore_rng(ckpt, rank)
    except Exception as e:
        return f"checkpoint {ckpt} does not load: {_first_line(e)}"
    return None


def _restore_schedule(optimizer, scheduler, saved: dict) -> None:
    """The checkpoint's place in the learning-rate schedule, with this config's hyper-parameters: the optimizer was
    built from the config (its lr, betas, weight decay and eps are the new ones), and the schedule's base rates
    follow its lr. Unchanged, this gives the learning rate an uninterrupted run has, bit for bit."""
    scheduler.load_state_dict(saved)  # the step count; also the checkpoint's base rates, replaced here
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    scheduler.last_epoch -= 1
    scheduler.step()  # the learning rate of the restored step, from the new base rates (as LambdaLR computes it)


def _tensors(fabric, state: dict) -> dict[str, torch.Tensor]:
    model = state[runs.MODEL]
    return runs.checkpoint_tensors(*dist_checkpoint.state_tensors(
        getattr(model, "module", model), state[runs.EMA], state["optimizer"], fabric.strategy.groups,
        fabric.device.type))


def _values(state: dict) -> dict:
    return {"step": state["step"], "history": state["history"], "heldout": state.get("heldout", []),
            "scheduler": state["scheduler"].state_dict(),
            "optim_groups": runs.optimizer_hyperparameters(state["optimizer"]), **state.get("network", {})}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def dp_total(fabric, mine: Counter) -> Counter:
    """Collective: the sum of every data-parallel rank's counts of what its loader read. Each counts once: its
    TP/CP/PP peers load the same samples and their counts are left out."""
    groups = fabric.strategy.groups
    reader = groups.tp_rank == groups.cp_rank == groups.pp_rank == 0
    return sum((Counter(part) for part in all_ranks(fabric, mine if reader else {})), Counter())


def all_ranks(fabric, value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if fabric.world_size == 1:
        return [value]
    parts = [None] * fabric.world_size
    dist.all_gather_object(parts, value)
    return parts


def _agree(fabric, problem: str | None) -> str | None:
    """Every rank's verdict on the same checkpoint: the first problem found, or None."""
    return next((p for p in all_ranks(fabric, problem) if p is not None), None)
