"""Where raw samples come from. A source is random-access (`len`, `load(i)`), so rank-sharded writing, worker
pools and the codec's fitting subset all see the same samples; `load` returns pixels (F, H, W, 3) uint8
already resized/cropped to what the codec can encode, or raises Skip with a reason.

A source whose samples are latents already (`encoded = True`: the mock source) returns `Latents` from `load`
and describes them with `info()`; the pipeline then fits and encodes nothing and writes them as they are.
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp"}
VIDEO_EXTS = {".mp4", ".webm", ".gif"}
BUTTERFLY_HUB_ID = "huggan/smithsonian_butterflies_subset"


class Skip(Exception):
    """This raw sample cannot be used; the message is the reason counted in the summary, `file` the file it names."""

    def __init__(self, reason: str, file: str | None = None):
        super().__init__(reason)
        self.file = file


class SourceError(Exception):
    """The source as a whole cannot be read: one clear line for the user."""


@dataclass(frozen=True)
class Fitted:
    """What framing did to a sample (Framing.fitted), for the summary: its frames' (width, height) before and after,
    the resize's scale (> 1: enlarged, so the model learns blur) and the share of a side the centre crop cut away."""

    fit: str  # the --fit that framed it
    before: tuple[int, int]
    after: tuple[int, int]
    scale: float
    cut: float


@dataclass
class Item:
    key: str
    pixels: np.ndarray  # (F, H, W, 3) uint8
    caption: str
    fps: float = 0.0
    meta: dict = field(default_factory=dict)  # extra JSON metadata (source id, label, ...)
    fitted: Fitted | None = None  # how its frames were framed (the folder source); not written


@dataclass
class Latents:
    """A sample as it is written: latents and text states (what the pipeline encodes an Item into)."""

    key: str
    latent: torch.Tensor  # (C, T, H, W), std SIGMA_DATA
    text: torch.Tensor  # (L, D) text states
    meta: dict  # the sample's JSON metadata: caption, frames, fps, source, ...
    video: bool  # counted as a clip, not an image


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


FITS = ("crop", "resize", "buckets")
# Width/height ratios of the --fit buckets: portrait and landscape photo and video formats, and square.
BUCKET_RATIOS = (1 / 2, 9 / 16, 2 / 3, 3 / 4, 1, 4 / 3, 3 / 2, 16 / 9, 2)


@dataclass(frozen=True)
class Framing:
    """How a frame of any shape becomes one the model trains on, every side a multiple of `unit` pixels.

    crop: centre crop to size x size (every sample the same token count: rows pack evenly); resize: the short side
    to `size`, aspect kept, each side then cropped to a multiple of `unit`; buckets: the nearest of a few aspect
    ratios, each about size² pixels (so about the same tokens per sample), every side a multiple of `unit`.
    """

    fit: str
    size: int
    unit: int

    def buckets(self) -> list[tuple[int, int]]:
        """(width, height) of each bucket, the ratios of BUCKET_RATIOS rounded to the unit (duplicates merged)."""
        sides = {}
        for r in BUCKET_RATIOS:
            w, h = (max(self.unit, round(self.size * f / self.unit) * self.unit) for f in (r**0.5, r**-0.5))
            sides[w, h] = None
        return list(sides)

    def target(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a width x height frame becomes."""
        if self.fit == "crop":
            return self.size, self.size
        if self.fit == "resize":
            scale = self.size / min(width, height)
            return tuple(max(self.unit, round(side * scale) // self.unit * self.unit) for side in (width, height))
        ratio = math.log(width / height)
        return min(self.buckets(), key=lambda wh: abs(math.log(wh[0] / wh[1]) - ratio))

    def __call__(self, img) -> np.ndarray:
        """PIL image → (H, W, 3) uint8 of the target size: resized to cover it, aspect kept, then centre-cropped."""
        return cover(img, *self.target(*img.size))

    def fitted(self, width: int, height: int) -> Fitted:
        """What __call__ does to a width x height frame."""
        target = self.target(width, height)
        scale, (w2, h2) = covering(width, height, *target)
        return Fitted(self.fit, (width, height), target, scale, max(1 - target[0] / w2, 1 - target[1] / h2))


def covering(w: int, h: int, width: int, height: int) -> tuple[float, tuple[int, int]]:
    """The scale (aspect kept) at which a w x h frame covers width x height, and its size then."""
    scale = max(width / w, height / h)
    return scale, (max(width, round(w * scale)), max(height, round(h * scale)))


def cover(img, width: int, height: int) -> np.ndarray:
    """PIL image → (height, width, 3) uint8: scaled (aspect kept) to cover width x height, centre-cropped to it."""
    from PIL import Image

    img = img.convert("RGB")
    _, (w2, h2) = covering(*img.size, width, height)
    img = img.resize((w2, h2), Image.Resampling.BICUBIC)
    left, top = (w2 - width) // 2, (h2 - height) // 2
    return np.asarray(img.crop((left, top, left + width, top + height)))


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


class MockSource:
    """Random latents and text states of given shapes, for throughput work: nothing to fit, encode or decode.

    The samples are one stream drawn from torch.Generator(seed), as `dit-prepare mock` has always written them.
    `load(i)` moves the stream on to sample i, drawing and dropping the samples in between, and starts it again
    only when asked for an earlier sample: reading in index order (one process, or a rank's every world-th
    sample) costs one pass. (Worker pools would restart it per task: mock has no --workers.)
    """

    encoded = True

    def __init__(self, num: int, image_shape: tuple[int, ...], video_shape: tuple[int, ...], video_ratio: float,
                 text_len: int, text_dim: int, seed: int):
        self.num, self.shapes, self.video_ratio, self.seed = num, (image_shape, video_shape), video_ratio, seed
        self.text_shape = (text_len if text_dim else 0, text_dim)
        self._stream, self._next = None, 0  # the generator and the index of the sample it draws next

    def __len__(self) -> int:
        return self.num

    def load(self, i: int) -> Latents:
        import torch

        if self._stream is None or i < self._next:
            self._stream, self._next = torch.Generator().manual_seed(self.seed), 0
        while self._next <= i:
            sample = self._draw(self._next)
            self._next += 1
        return sample

    def _draw(self, i: int) -> Latents:
        import torch

        from ditcore.layout import SIGMA_DATA

        video = bool(torch.rand((), generator=self._stream) < self.video_ratio)
        shape = self.shapes[video]
        latent = torch.randn(shape, generator=self._stream) * SIGMA_DATA
        text = torch.randn(self.text_shape, generator=self._stream)
        meta = {"caption": f"mock sample {i}", "frames": shape[1], "fps": 8.0 if video else 0.0,
                "source": f"mock:{self.seed}:{i}"}
        return Latents(f"{i:08d}", latent, text, meta, video)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_stream": None, "_next": 0}  # a generator does not pickle: a copy starts afresh

    def info(self) -> dict:
        """The DatasetInfo fields that describe these latents (ditcore.data.schema)."""
        channels = self.shapes[0][0]
        return {"codec": {"kind": "none", "note": "mock data: random latents, nothing to decode"},
                "latent_stats": {"mean": [0.0] * channels, "std": [1.0] * channels},
                "text_encoder": {"name": "mock", "dim": self.text_shape[1]},
                "latent_channels": channels, "spatial_factor": 1, "temporal_factor": 1}


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


def _load_hub(hub_id: str):
    from ditcore.codecs.hub import offline

    # without a connection `datasets` retries for half a minute before failing: ditcore's probe says so at once
    error = "offline: HF_DATASETS_OFFLINE is set" if os.environ.get("HF_DATASETS_OFFLINE") == "1" else None
    if error is None and (why := offline()):
        error = f"offline: {why}"
    if error is None:
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
    """A folder of images and videos; captions from sidecar .txt files or a captions.jsonl ({"file", "caption"}).

    Every frame is shaped by `framing` (Framing). A file that cannot be used (not a regular file, no caption or
    one that is not UTF-8, an unreadable or oversized image, a short video) is a Skip naming the file.

    labels="subfolders" reads ImageNet's layout, ROOT/CLASS/file: a file's label is the index of its first-level
    folder among ROOT's folders sorted by name, as torchvision's ImageFolder numbers them (so ImageNet's synset
    folders give DiT's classes 0..999). `classes` names them in label order; `num_classes` (the model's class count,
    at least len(classes)) defaults to their number. A file without a caption is captioned by its class's name; a
    file directly in ROOT has no class and is a Skip.
    """

    classes: list[str]  # label i's folder name; [] without labels
    num_classes: int  # 0 without labels

    def __init__(self, root: Path, framing: Framing, frames: int, fps: float, temporal_factor: int = 1,
                 limit: int | None = None, labels: str = "none", num_classes: int | None = None):
        root = Path(root)
        if not root.is_dir():
            raise SourceError(f"input folder '{root}' does not exist or is not a folder")
        self.root, self.framing, self.fps = root, framing, fps
        self.frames = frame_count_for(frames, temporal_factor)
        self.files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTS | VIDEO_EXTS)
        if limit is not None:
            self.files = self.files[:limit]
        if not self.files:
            raise SourceError(f"input folder '{root}' has no images ({', '.join(sorted(IMAGE_EXTS))}) or videos "
                              f"({', '.join(sorted(VIDEO_EXTS))})")
        self.classes, self.num_classes = self._classes(labels, num_classes)
        self._label = {name: i for i, name in enumerate(self.classes)}
        self.captions = {}
        jsonl = root / "captions.jsonl"
        if jsonl.is_file():
            try:
                lines = jsonl.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError as e:
                raise SourceError(f"{jsonl}: not UTF-8 text (byte {e.start}) — save it as UTF-8") from None
            for n, line in enumerate(lines, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                        self.captions[str(rec["file"])] = str(rec["caption"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise SourceError(f"{jsonl}:{n}: expected a JSON object with 'file' and 'caption'") from None

    def _classes(self, labels: str, num_classes: int | None) -> tuple[list[str], int]:
        if labels == "none":
            if num_classes is not None:
                raise SourceError(f"--num-classes {num_classes} needs --labels subfolders (the labels it counts)")
            return [], 0
        if labels != "subfolders":
            raise SourceError(f"--labels {labels!r} is unknown: expected none or subfolders")
        # every folder, as ImageFolder's find_classes: a folder's index does not depend on what is inside it
        classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        for name in classes:
            try:
                name.encode("utf-8")  # a name that is not UTF-8 holds surrogates: no caption or JSON can carry it
            except UnicodeEncodeError:
                raise SourceError(f"--labels subfolders: the class folder {os.fsencode(name)!r} of '{self.root}' is "
                                  "not named in UTF-8 text (its name is the class's name and caption): rename "
                                  "it") from None
        if not any(len(p.relative_to(self.root).parts) > 1 for p in self.files):
            raise SourceError(f"--labels subfolders: input folder '{self.root}' has no images or videos in "
                              "subfolders — put each class's files in ROOT/CLASS_NAME/ (ImageNet's layout)")
        if num_classes is None:
            return classes, len(classes)
        if num_classes < len(classes):
            raise SourceError(f"--num-classes {num_classes} is fewer than the {len(classes)} class subfolders of "
                              f"'{self.root}' ({_listed(classes)}): give at least {len(classes)}, or leave it out")
        return classes, num_classes

    def __len__(self) -> int:
        return len(self.files)

    def caption_of(self, path: Path) -> str | None:
        """The file's caption from captions.jsonl or its sidecar .txt; None when it has neither."""
        rel = str(path.relative_to(self.root))
        if rel in self.captions:
            return self.captions[rel]
        sidecar = path.with_suffix(".txt")
        if sidecar.is_file():
            try:
                return sidecar.read_bytes().decode("utf-8-sig").strip()
            except UnicodeDecodeError:
                raise Skip("caption is not UTF-8 text", str(sidecar.relative_to(self.root))) from None
        return None

    def load(self, i: int) -> Item:
        path = self.files[i]
        rel = str(path.relative_to(self.root))
        if not path.is_file():  # a FIFO or device named like an image would block the first read forever
            raise Skip("not a regular file", rel)
        meta = {"source": rel}
        if self.num_classes:
            folder, *inside = path.relative_to(self.root).parts
            if not inside:
                raise Skip("not in a class subfolder (--labels subfolders)", rel)
            meta["label"] = self._label[folder]
            caption = self.caption_of(path) or folder  # captions are optional: the class's name stands in
        else:
            caption = self.caption_of(path)
        if caption is None:
            raise Skip("no caption (no sidecar .txt and not in captions.jsonl)", rel)
        if not caption:
            raise Skip("empty caption", rel)
        if path.suffix.lower() in IMAGE_EXTS:
            pixels, fitted = self._read_image(path, rel)
            return Item(f"{i:08d}", pixels[None], caption, 0.0, meta, fitted)
        pixels, fps, fitted = self._read_video(path, rel)
        return Item(f"{i:08d}", pixels, caption, fps, meta, fitted)

    def _read_image(self, path: Path, rel: str) -> tuple[np.ndarray, Fitted]:
        from PIL import Image, UnidentifiedImageError

        # Pillow warns between MAX_IMAGE_PIXELS and twice that, and raises above: both are a file to skip, not a
        # multi-gigabyte decode (a 15000x15000 PNG header alone claims 675 MB of pixels).
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                with Image.open(path) as img:
                    return self.framing(img), self.framing.fitted(*img.size)
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                raise Skip(f"image over Pillow's limit of {Image.MAX_IMAGE_PIXELS} pixels", rel) from None
            except (UnidentifiedImageError, OSError) as e:
                raise Skip(f"unreadable image ({type(e).__name__})", rel) from None

    def _read_video(self, path: Path, rel: str) -> tuple[np.ndarray, float, Fitted]:
        """`frames` frames sampled at `fps` (or every frame when fps is 0) from the start of the video.

        Frames are decoded one at a time and decoding stops at the last one needed: memory is a few frames whatever
        the video's length, and a long video costs no more time than its first seconds.
        """
        import imageio.v3 as iio
        from PIL import Image

        picked, seen, fitted = [], 0, None
        try:
            with iio.imopen(path, "r") as video:
                meta = video.metadata()
                src_fps = float(meta.get("fps") or (1000.0 / meta["duration"] if meta.get("duration") else 0) or 0)
                step = max(1, round(src_fps / self.fps)) if self.fps and src_fps else 1
                for frame in video.iter():
                    if seen % step == 0:
                        picked.append(self.framing(Image.fromarray(frame[..., :3])))
                        fitted = fitted or self.framing.fitted(frame.shape[1], frame.shape[0])
                    seen += 1
                    if len(picked) == self.frames:
                        break
        except Exception as e:  # any decoder failure ends the same way: this file is skipped, named
            raise Skip(f"unreadable video ({type(e).__name__})", rel) from None
        if len(picked) < self.frames:
            raise Skip(f"video too short (need {self.frames} frames at step {step})", rel)
        return np.stack(picked), (src_fps / step if src_fps else self.fps), fitted


def _listed(names: list[str], shown: int = 5) -> str:
    """'a, b, c' — the first `shown` names and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
