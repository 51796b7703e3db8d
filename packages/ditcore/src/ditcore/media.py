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
