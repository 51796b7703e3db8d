"""Writing samples: mp4 for clips, png for images (imageio; mp4 through imageio-ffmpeg's bundled ffmpeg)."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import numpy as np

from ditcore import disk


def write_sample(pixels, path: str | Path, fps: float = 8.0) -> Path:
    """(F, H, W, 3) uint8 → `path` with .mp4 (F > 1) or .png (F = 1) as suffix; returns the path written.

    Written under a temporary name and renamed, so an interrupted or failed write never leaves a truncated file;
    a full disk is `ditcore.disk.DiskFull`, another failure an OSError saying what the writer reported.
    """
    frames = np.asarray(pixels)
    path = Path(path).with_suffix(".png" if frames.shape[0] == 1 else ".mp4")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.partial{path.suffix}")  # keeps the suffix: ffmpeg picks the format by it
    try:
        if frames.shape[0] == 1:
            _write_png(frames[0], tmp)
        else:
            _write_mp4(frames, tmp, fps)
        os.replace(tmp, path)
    except OSError as e:
        if disk.is_disk_full(e):
            raise disk.disk_full(f"could not write {path}", path) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_png(image: np.ndarray, path: Path) -> None:
    """Encoded in memory, then written by Python: a write error is raised once, as an OSError. (imageio's pillow
    plugin, writing to the file itself, raises it and then once more from its destructor, as a printed traceback.)"""
    import imageio.v3 as iio

    data = iio.imwrite("<bytes>", image, extension=".png")
    with open(path, "wb") as f:
        f.write(data)


def _write_mp4(frames: np.ndarray, path: Path, fps: float) -> None:
    """H.264 through imageio-ffmpeg's bundled ffmpeg, run here rather than through imageio: imageio ignores ffmpeg's
    exit status (a full disk left a 0-byte file, reported as written) and lets it print to our stderr.

    yuv420p: plays in every browser; sizes are kept as they are (no resizing to a macro-block multiple)."""
    import imageio_ffmpeg

    H, W = frames.shape[1:3]
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-f", "rawvideo", "-pix_fmt", "rgb24",
               "-s", f"{W}x{H}", "-r", f"{fps:g}", "-i", "-", "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p",
               str(path)]
    done = subprocess.run(command, input=memoryview(np.ascontiguousarray(frames, np.uint8).reshape(-1)),
                          capture_output=True)
    if done.returncode or not path.is_file() or not path.stat().st_size:
        said = [line for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
        # the first line is the cause (the rest, how it spread); "@ 0x55b8…" addresses are noise to a reader
        reason = re.sub(r" @ 0x[0-9a-f]+", "", said[0]) if said else f"exit status {done.returncode}, nothing written"
        if any(os.strerror(n) in line for line in said for n in disk.NO_SPACE):
            raise OSError(errno.ENOSPC, reason)
        raise OSError(f"ffmpeg failed: {reason}")


def read_video(path: str | Path) -> np.ndarray:
    """(F, H, W, 3) uint8 frames of an mp4/gif/png."""
    import imageio.v3 as iio

    frames = iio.imread(path, index=None) if Path(path).suffix != ".png" else iio.imread(path)[None]
    return np.asarray(frames)[..., :3]


def contact_sheet(images, row_labels: list[str], column_labels: list[str], scale: int | None = None) -> np.ndarray:
    """A labelled grid of images (R, C, H, W, 3) uint8 → one (H', W', 3) uint8 image.

    Each image is enlarged `scale` times (nearest neighbour: pixels stay pixels; default: to about 128 pixels);
    row labels go on the left, column labels on top, in black on white.
    """
    from PIL import Image, ImageDraw, ImageFont

    images = np.asarray(images)
    if images.ndim != 5 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"contact_sheet takes images (rows, columns, H, W, 3) uint8, got {images.dtype} "
                         f"{tuple(images.shape)}")
    R, C, H, W, _ = images.shape
    scale = scale or max(1, 128 // max(H, W))
    if (len(row_labels), len(column_labels)) != (R, C):
        raise ValueError(f"{len(row_labels)} row and {len(column_labels)} column labels for a {R} x {C} grid")
    font = ImageFont.load_default(size=14)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    left = 12 + max((measure.textlength(s, font=font) for s in row_labels), default=0)
    top, gap, h, w = 24, 4, H * scale, W * scale
    sheet = Image.new("RGB", (int(left) + C * (w + gap), top + R * (h + gap)), "white")
    draw = ImageDraw.Draw(sheet)
    for c, label in enumerate(column_labels):
        draw.text((left + c * (w + gap) + w / 2, top / 2), label, fill="black", font=font, anchor="mm")
    for r, label in enumerate(row_labels):
        y = top + r * (h + gap)
        draw.text((6, y + h / 2), label, fill="black", font=font, anchor="lm")
        for c in range(C):
            tile = Image.fromarray(images[r, c]).resize((w, h), Image.NEAREST)
            sheet.paste(tile, (int(left) + c * (w + gap), y))
    return np.asarray(sheet)
