"""Where raw samples come from. A source is random-access (`len`, `load(i)`), so rank-sharded writing, worker
pools and the codec's fitting subset all see the same samples; `load` returns pixels (F, H, W, 3) uint8
already resized/cropped to what the codec can encode, or raises Skip with a reason.
"""

from __future__ import annotations

import io
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp"}
VIDEO_EXTS = {".mp4", ".webm", ".gif"}
BUTTERFLY_HUB_ID = "huggan/smithsonian_butterflies_subset"


class Skip(Exception):
    """This raw sample cannot be used; the message is the reason counted in the summary."""


class SourceError(Exception):
    """The source as a whole cannot be read: one clear line for the user."""


@dataclass
class Item:
    key: str
    pixels: np.ndarray  # (F, H, W, 3) uint8
    caption: str
    fps: float = 0.0
    meta: dict = field(default_factory=dict)  # extra JSON metadata (source id, label, ...)


def fit_frame(img, size: int, factor: int) -> np.ndarray:
    """PIL image → (H, W, 3) uint8: short side resized to `size`, then centre-cropped to multiples of `factor`."""
    from PIL import Image

    img = img.convert("RGB")
    w, h = img.size
    scale = size / min(w, h)
    w2, h2 = max(factor, round(w * scale)), max(factor, round(h * scale))
    img = img.resize((w2, h2), Image.Resampling.BICUBIC)
    cw, ch = w2 - w2 % factor, h2 - h2 % factor
    left, top = (w2 - cw) // 2, (h2 - ch) // 2
    return np.asarray(img.crop((left, top, left + cw, top + ch)))


def frame_count_for(frames: int, temporal_factor: int) -> int:
    """Largest count <= frames that a codec with this temporal factor encodes (1 + k·factor)."""
    return 1 + (frames - 1) // temporal_factor * temporal_factor


class SyntheticSource:
    """Procedurally drawn butterflies (ditcore.data.synthetic): deterministic per (index, seed)."""

    def __init__(self, num: int, size: int, frames: int, video_ratio: float, seed: int, fps: float,
                 temporal_factor: int = 1, simple: bool = False):
        self.num, self.size, self.video_ratio, self.seed, self.fps = num, size, video_ratio, seed, fps
        self.simple = simple
        self.frames = frame_count_for(frames, temporal_factor)

    def __len__(self) -> int:
        return self.num

    def load(self, i: int) -> Item:
        from ditcore.data.synthetic import generate

        pixels, caption, meta = generate(i, self.seed, self.size, self.frames, self.video_ratio, self.simple)
        info = {"source": f"synthetic:{self.seed}:{i}", "colour": meta["colour"], "video": meta["video"]}
        return Item(f"{i:08d}", pixels, caption, self.fps if meta["video"] else 0.0, info)


class ButterflySource:
    """The Smithsonian butterflies (columns `image`, `name` as caption), from the hub or a local parquet copy."""

    def __init__(self, size: int, factor: int, from_path: Path | None = None, hub_id: str = BUTTERFLY_HUB_ID,
                 limit: int | None = None):
        self.size, self.factor = size, factor
        self.rows = _load_parquet(from_path) if from_path else _load_hub(hub_id)
        self.num = len(self.rows) if limit is None else min(limit, len(self.rows))

    def __len__(self) -> int:
        return self.num

    def load(self, i: int) -> Item:
        from PIL import Image, UnidentifiedImageError

        row = self.rows[i]
        image, name = row["image"], row.get("name")
        if isinstance(image, dict):  # parquet without the datasets Image feature: {"bytes", "path"}
            try:
                image = Image.open(io.BytesIO(image["bytes"]))
            except (UnidentifiedImageError, TypeError, OSError) as e:
                raise Skip(f"unreadable image ({type(e).__name__})") from None
        if not name:
            raise Skip("no caption (empty name)")
        return Item(f"{i:08d}", fit_frame(image, self.size, self.factor)[None], str(name), 0.0,
                    {"source": f"butterfly:{i}"})


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connect to the hub endpoint: without it `datasets` retries for half a minute before failing."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def _load_hub(hub_id: str):
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    error = None
    if offline or not _hub_reachable():
        error = "offline" if offline else "the hub is unreachable"
    else:
        try:
            import datasets

            datasets.logging.set_verbosity_error()
            datasets.logging.disable_progress_bar()
            return datasets.load_dataset(hub_id, split="train")
        except Exception as e:  # any hub / network failure ends the same way for the user
            error = type(e).__name__
    raise SourceError(
        f"could not load '{hub_id}' from the Hugging Face hub ({error}) — use a local copy with --from PATH "
        "(a parquet file or folder in the same schema: image, name), or run `dit-prepare synthetic` for the "
        "embedded synthetic butterflies")


def _load_parquet(path: Path):
    import datasets

    path = Path(path)
    files = sorted(path.glob("**/*.parquet")) if path.is_dir() else [path]
    if not path.exists() or not files:
        raise SourceError(f"--from {path}: no parquet file there — expected a .parquet file or a folder of them")
    try:
        ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    except Exception as e:
        raise SourceError(f"--from {path}: not readable as parquet ({type(e).__name__}: {e})") from None
    missing = {"image", "name"} - set(ds.column_names)
    if missing:
        raise SourceError(f"--from {path}: columns {sorted(missing)} are missing (found {ds.column_names}); "
                          "expected the butterfly schema: image, name")
    return ds


class FolderSource:
    """A folder of images and videos; captions from sidecar .txt files or a captions.jsonl ({"file", "caption"})."""

    def __init__(self, root: Path, size: int, factor: int, frames: int, fps: float, temporal_factor: int = 1,
                 limit: int | None = None):
        root = Path(root)
        if not root.is_dir():
            raise SourceError(f"input folder '{root}' does not exist or is not a folder")
        self.root, self.size, self.factor, self.fps = root, size, factor, fps
        self.frames = frame_count_for(frames, temporal_factor)
        self.files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS | VIDEO_EXTS)
        if limit is not None:
            self.files = self.files[:limit]
        if not self.files:
            raise SourceError(f"input folder '{root}' has no images ({', '.join(sorted(IMAGE_EXTS))}) or videos "
                              f"({', '.join(sorted(VIDEO_EXTS))})")
        self.captions = {}
        jsonl = root / "captions.jsonl"
        if jsonl.is_file():
            for n, line in enumerate(jsonl.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                        self.captions[str(rec["file"])] = str(rec["caption"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise SourceError(f"{jsonl}:{n}: expected a JSON object with 'file' and 'caption'") from None

    def __len__(self) -> int:
        return len(self.files)

    def caption_of(self, path: Path) -> str:
        rel = str(path.relative_to(self.root))
        if rel in self.captions:
            return self.captions[rel]
        sidecar = path.with_suffix(".txt")
        if sidecar.is_file():
            return sidecar.read_text().strip()
        raise Skip("no caption (no sidecar .txt and not in captions.jsonl)")

    def load(self, i: int) -> Item:
        path = self.files[i]
        caption = self.caption_of(path)
        if not caption:
            raise Skip("empty caption")
        rel = str(path.relative_to(self.root))
        if path.suffix.lower() in IMAGE_EXTS:
            from PIL import Image, UnidentifiedImageError

            try:
                with Image.open(path) as img:
                    pixels = fit_frame(img, self.size, self.factor)[None]
            except (UnidentifiedImageError, OSError) as e:
                raise Skip(f"unreadable image ({type(e).__name__})") from None
            return Item(f"{i:08d}", pixels, caption, 0.0, {"source": rel})
        pixels, fps = self._read_video(path)
        return Item(f"{i:08d}", pixels, caption, fps, {"source": rel})

    def _read_video(self, path: Path) -> tuple[np.ndarray, float]:
        """`frames` frames sampled at `fps` (or every frame when fps is 0) from the start of the video."""
        import imageio.v3 as iio
        from PIL import Image

        try:
            meta = iio.immeta(path)
            src_fps = float(meta.get("fps") or (1000.0 / meta["duration"] if meta.get("duration") else 0) or 0)
            frames = list(iio.imiter(path))
        except Exception as e:
            raise Skip(f"unreadable video ({type(e).__name__})") from None
        step = max(1, round(src_fps / self.fps)) if self.fps and src_fps else 1
        picked = frames[::step][:self.frames]
        if len(picked) < self.frames:
            raise Skip(f"video too short ({len(frames)} frames, need {self.frames} at step {step})")
        out = np.stack([fit_frame(Image.fromarray(f[..., :3]), self.size, self.factor) for f in picked])
        return out, (src_fps / step if src_fps else self.fps)
