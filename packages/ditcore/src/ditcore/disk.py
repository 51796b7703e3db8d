"""Writes that run out of disk space end in one line that names the folder and what is free there.

Writers report a full disk in different ways: Python's own I/O raises OSError(ENOSPC), safetensors' Rust writer a
SafetensorError whose text ends in "(os error 28)", and ffmpeg prints to its stderr and exits with an error that
imageio never checks. Each writer turns its failure into `DiskFull` through the helpers here.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # out of blocks, or over the user's quota: the same advice


class DiskFull(OSError):
    """A write ran out of space; str() is the whole message for a person (no "[Errno 28]" in front)."""

    def __str__(self) -> str:
        return self.strerror


def is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in NO_SPACE:
        return True
    # Errors from Rust (safetensors) carry the errno only in their text: "... (os error 28)"
    return any(f"(os error {n})" in str(error) for n in NO_SPACE)


def free_bytes(path: str | Path) -> int:
    """Bytes free (to this user) on the file system that holds `path`, or its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def disk_full(what: str, path: str | Path, needed: int | None = None) -> DiskFull:
    """The error for `what` (e.g. "could not write the export") at `path`: the folder and the space free there."""
    folder = Path(path).absolute().parent
    need = f", {size_text(needed)} needed" if needed else ""
    return DiskFull(errno.ENOSPC, f"{what}: the disk is full ({size_text(free_bytes(folder))} free in {folder}{need})"
                                  " — free some space there or write somewhere else")


def check_space(what: str, path: str | Path, needed: int) -> None:
    """Refuse up front (DiskFull) when `needed` bytes cannot fit where `path` is to be written."""
    if free_bytes(Path(path).absolute().parent) < needed:
        raise disk_full(what, path, needed)


__all__ = ["DiskFull", "check_space", "disk_full", "free_bytes", "is_disk_full", "size_text"]
