"""The manifest of a checkpoint (its COMPLETE file), what it proves, and the lineage it records.

The manifest is written last, after every file it lists is durable: the step, the layout that wrote it (world_size,
tp, cp, pp, dp, fsdp), the lineage, and {file: {bytes, crc32}}; each file is verified against it before it is
loaded.

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
import secrets
import time
from pathlib import Path

from ditcore import durable
from ditcore.runs.folders import MARKER, complete_checkpoints, step_and_copy


def write_manifest(ckpt: Path, step: int, layout: dict, files: dict[str, dict], lineage: dict | None = None) -> None:
    """The COMPLETE marker: written (fsynced) last, after every file it lists is durable. layout: world_size, tp, cp,
    pp, dp, fsdp of the job that wrote it; lineage: see the module's docstring."""
    manifest = {"step": step, "layout": layout} | ({"lineage": lineage} if lineage else {})
    manifest["files"] = dict(sorted(files.items()))
    durable.write_text(ckpt / MARKER, json.dumps(manifest, indent=1) + "\n")


def seal(ckpt: Path, names: list[str]) -> dict[str, dict]:
    """Make files of a checkpoint durable (fsynced) and measure them for its manifest: {name: {bytes, crc32}}.
    Each rank seals its own files, in parallel."""
    for name in names:
        durable.fsync_file(Path(ckpt) / name)
    return {name: durable.digest(Path(ckpt) / name) for name in names}


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
    return sorted(complete_checkpoints(run_dir), key=lambda p: (lineage(p).get("seq", 0), step_and_copy(p)))


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
        older = [p for p, theirs in found.values() if not theirs and step_and_copy(p) < step_and_copy(ckpt)]
        return max(older, key=step_and_copy, default=None)
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


def next_lineage(ckpt: Path | None) -> dict:
    """The run and parent that the next checkpoint records, when it continues `ckpt` (None: a run from scratch)."""
    if ckpt is None:
        return {"run": new_run_id(), "parent": None}
    return {"run": lineage(ckpt).get("run") or new_run_id(), "parent": parent_ref(ckpt)}


def publish(tmp: Path, final: Path, step: int, layout: dict, files: dict[str, dict], continues: dict | None) -> dict:
    """Complete a checkpoint written into `tmp` (every file in `files` durable): its manifest, with its place in the
    run dir's write order, then the folder renamed to `final`. `continues`: the lineage the checkpoint carries on
    (next_lineage; None: a run from scratch). Returns the lineage of the save after it."""
    mine = (continues or next_lineage(None)) | {"seq": next_seq(final.parent.parent),
                                                 "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_manifest(tmp, step, layout, files, mine)
    durable.publish_dir(tmp, final)
    return next_lineage(final)
