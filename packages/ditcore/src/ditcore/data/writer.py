"""Writing a dataset: rank-sharded WebDataset tars, then Energon's index, then ditcore.json (last)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import webdataset as wds
import yaml

from ditcore import durable
from ditcore.data.schema import (
    CRUDE_CONFIG,
    HELDOUT_DIR,
    INFO_FILE,
    LATENT,
    META,
    TEXT,
    TYPED_CONFIG,
    DatasetInfo,
    to_record,
)

SHARD_PATTERN = "rank{rank}-%06d.tar"  # as the reference recipe: every rank writes its own shards
SHAPE_KEYS = 3  # sample keys recorded per latent shape (ditcore.json counts.latent_shape_keys)


def merge_shape_keys(parts) -> dict[str, list[str]]:
    """The shape → keys records of several writers (ranks) as one, still SHAPE_KEYS keys a shape at most."""
    merged: dict[str, list[str]] = {}
    for part in parts:
        for shape, keys in part.items():
            have = merged.setdefault(shape, [])
            have.extend(keys[:SHAPE_KEYS - len(have)])
    return merged


def start_dataset(root: Path, overwrite: bool) -> None:
    """Make `root` ready for writing. An existing dataset is replaced only with overwrite=True."""
    start_output(root, overwrite, "dataset", remove_dataset_files)


def start_output(root: Path, overwrite: bool, what: str, remove, refuse=None) -> None:
    """Make the folder `root` ready for writing a `what`: `remove(root)` clears what is there only with overwrite=True,
    after `refuse(root)` (if given) has raised for contents no overwrite may replace."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"output '{root}' is a file — choose a folder path for the {what}")
    if root.exists() and any(root.iterdir()):
        if refuse is not None:
            refuse(root)
        if not overwrite:
            raise FileExistsError(f"output '{root}' already exists and is not empty — choose another path "
                                  "or pass --overwrite")
        remove(root)
    try:
        durable.make_writable_dir(root)
    except OSError as e:
        raise PermissionError(f"output '{root}' cannot be written ({e.strerror}) — choose another path") from None


def remove_dataset_files(root: Path, rank: int | None = None) -> None:
    """Delete what dit-prepare writes into `root` (only that: other files in the folder stay).

    The completion marker goes first, so an interrupted removal never leaves something that passes for
    complete. With `rank`, only that rank's shards (each rank removes its own, rank 0 the shared files). A held-out
    split (root/val) goes with its training set: left behind, it would pass for the held-out part of a new one.
    """
    root = Path(root)
    heldout = root / HELDOUT_DIR
    if heldout.is_dir():
        remove_dataset_files(heldout, rank)
        if rank in (None, 0):
            with contextlib.suppress(OSError):  # kept if the user put other files there
                heldout.rmdir()
    shards = f"rank{rank}-*.tar*" if rank is not None else "rank*-*.tar*"
    shared = rank in (None, 0)
    if shared:
        (root / INFO_FILE).unlink(missing_ok=True)
        (root / f".{INFO_FILE}.tmp").unlink(missing_ok=True)
        shutil.rmtree(root / ".nv-meta", ignore_errors=True)
    for p in [*root.glob(shards), *(root.glob("codec_*") if shared else [])]:
        p.unlink(missing_ok=True)


@contextlib.contextmanager
def removed_on_failure(root: Path, created: bool, keep: bool = False, rank: int = 0):
    """Around writing a started dataset: on any failure or interrupt, remove this rank's partial output (and
    the folder, if `created` it), unless `keep`. The exception gets a note saying which happened."""
    try:
        yield
    except BaseException as e:
        if keep:
            e.add_note(f"kept the partial output '{root}' as asked; it is incomplete and will not load — rerun "
                       "with --overwrite")
            raise
        if Path(root).is_dir():
            remove_dataset_files(root, rank)
            if created and rank == 0:
                with contextlib.suppress(OSError):  # other ranks' shards may still be there; they remove their own
                    Path(root).rmdir()
        e.add_note(f"removed the partial output '{root}' (--keep-partial keeps it)")
        raise


class ShardWriter:
    """Append records to this rank's shards of a dataset directory."""

    def __init__(self, root: Path, rank: int = 0, max_count: int = 1000, max_size: float = 1e9):
        pattern = str(Path(root) / SHARD_PATTERN.format(rank=rank))
        self._writer = wds.ShardWriter(pattern, maxcount=max_count, maxsize=max_size, verbose=0)
        self.count = 0
        self.bytes = 0
        self.latent_shapes: Counter = Counter()  # "CxTxHxW" → samples; dit-train checks them against seq_length
        self.shape_keys: dict[str, list[str]] = {}  # "CxTxHxW" → its first samples' keys, which dit-train names

    def write(self, key: str, latent, text, meta: dict) -> None:
        record = to_record(key, latent, text, meta)
        shape = "x".join(map(str, latent.shape))
        self.latent_shapes[shape] += 1
        keys = self.shape_keys.setdefault(shape, [])
        if len(keys) < SHAPE_KEYS:
            keys.append(key)
        self.bytes += sum(len(v) for k, v in record.items() if k != "__key__")
        self._writer.write(record)
        self.count += 1

    def close(self) -> None:
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def energon_prepare(root: Path) -> None:
    """Index the shards with Energon (train split only), non-interactively, and write its two configs (schema.py)."""
    # --exclude "/": only the shards at the top, which dit-prepare writes; Energon would index those of the
    # held-out split in root/val too (it looks for **/*.tar), training on them
    cmd = [sys.executable, "-m", "megatron.energon.cli.main", "prepare", str(root), "--non-interactive",
           "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset", "--dataset-yaml-name", CRUDE_CONFIG,
           "--force-overwrite", "--no-progress", "--exclude", "/"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (Path(root) / ".nv-meta" / CRUDE_CONFIG).is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"energon prepare failed for '{root}': {tail[0]}")
    # `energon prepare` only knows Energon's own sample types, so the typed view is written here. Its sample type
    # is the one the loader's cooker makes, so both views read a sample identically.
    typed = {"sample_type": {"__module__": "ditcore.data.loader", "__class__": "LatentSample"},
             "field_map": {"latent": LATENT, "text": TEXT, "meta": META}}
    durable.write_text(Path(root) / ".nv-meta" / TYPED_CONFIG, yaml.safe_dump(typed, sort_keys=False))


def finish_dataset(root: Path, info: DatasetInfo) -> None:
    """Index the shards, then write ditcore.json: from this moment the dataset counts as complete."""
    energon_prepare(root)
    info.counts["shards"] = len(list(Path(root).glob("rank*-*.tar")))
    info.write(Path(root))
