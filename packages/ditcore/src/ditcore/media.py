"""Writing samples: mp4 for clips, png for images (imageio; mp4 through imageio-ffmpeg's bundled ffmpeg)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def write_sample(pixels, path: str | Path, fps: float = 8.0) -> Path:
    """(F, H, W, 3) uint8 → `path` with .mp4 (F > 1) or .png (F = 1) as suffix; returns the path written.

    Written under a temporary name and renamed, so an interrupted write never leaves a truncated file.
    """
    import imageio.v3 as iio

    frames = np.asarray(pixels)
    path = Path(path).with_suffix(".png" if frames.shape[0] == 1 else ".mp4")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.partial{path.suffix}")  # keeps the suffix: imageio picks the format by it
    try:
        if frames.shape[0] == 1:
            iio.imwrite(tmp, frames[0])
        else:
            # yuv420p: plays in every browser; macro_block_size=1: keep small sizes as they are (no resizing)
            iio.imwrite(tmp, frames, extension=".mp4", fps=fps, codec="libx264", pixelformat="yuv420p",
                        macro_block_size=1)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
