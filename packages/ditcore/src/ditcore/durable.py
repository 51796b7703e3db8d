"""Publishing files and folders so that a crash (kill -9, power loss) never leaves a half-written one in place.

The recipe (as in SQLite's and PostgreSQL's notes on POSIX durability): write everything under a temporary
name, fsync each file, fsync the folder that holds them, rename into place (atomic on POSIX), then fsync the
parent so the rename itself is on disk. A folder that is replaced or deleted is first renamed aside, so no
reader ever sees a partly deleted one under its real name.
"""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from pathlib import Path

TRASH_PREFIX = ".trash-"


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make the folder's entries (creations, renames) durable; Linux fsyncs a folder opened read-only."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without setting it (os.umask can only set it: a thread creating a file meanwhile
    would get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (macOS): set and restore at once
    os.umask(mask)
    return mask


def mode_as_umask(path: str | Path) -> None:
    """Give a file the mode open() gives a new one: 0666 less the umask (0644 under the usual 022). For writers that
    create their file otherwise: safetensors' save_file writes a temporary file of mode 0600 and renames it, which
    another user of the group, or a serving container, then cannot read."""
    os.chmod(path, 0o666 & ~umask())


def make_writable_dir(path: str | Path) -> None:
    """Create the folder (and parents) and prove a file can be written in it; OSError saying why not.

    Checked up front so a long job does not find out at its first checkpoint (os.access is not enough: it
    says yes to root on a read-only file system).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it is a file", str(path))
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-test-{os.getpid()}"
    probe.touch()
    probe.unlink()


def write_text(path: str | Path, text: str) -> None:
    """Write a small file and fsync it (its folder is fsynced by whoever publishes the folder)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_text(path: str | Path, text: str) -> None:
    """Write a small file whole: under a temporary name beside it, fsynced, renamed over `path`, the folder fsynced.
    A reader sees the old file or the new one, never part of either; a crash leaves at most a stray .tmp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_text(tmp, text)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def digest(path: str | Path, chunk: int = 1 << 24) -> dict:
    """Size and CRC-32 of a file: enough to tell a truncated or corrupted file from the one written."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def verify(path: str | Path, expected: dict) -> str | None:
    """None if `path` still has the size and CRC it was written with, else what is wrong (for a message)."""
    path = Path(path)
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path.name} has {size} bytes, {expected['bytes']} were written (truncated or overwritten)"
    if digest(path)["crc32"] != expected["crc32"]:
        return f"{path.name} is corrupted (CRC-32 differs from the one recorded when it was written)"
    return None


def remove_dir(path: str | Path) -> None:
    """Rename aside, make the rename durable, then delete: the folder is never seen half deleted."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def publish_dir(tmp: str | Path, final: str | Path) -> None:
    """Move a fully written folder `tmp` (files already fsynced) to `final`, replacing any folder there."""
    tmp, final = Path(tmp), Path(final)
    fsync_dir(tmp)
    remove_dir(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def remove_leftovers(folder: str | Path, prefixes: tuple[str, ...]) -> None:
    """Delete what an interrupted writer left behind (temporary and trash folders)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if not p.name.startswith(prefixes):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:  # a file, or a link (planted, say), which goes itself: what it points to is not ours to delete
            p.unlink(missing_ok=True)

