"""Source → (fit codec) → latent statistics → encode → shards → Energon index → ditcore.json.

A source of latents (`encoded`, the mock source) skips fitting and encoding: its samples are written as they are.

Under torchrun every rank writes its own shards (`rank{r}-%06d.tar`) from every world-th sample; rank 0
indexes and writes ditcore.json once all ranks are done. The codec is fitted and the statistics measured on
the same first `fit_samples` samples on every rank, so all ranks agree without communicating.

With `val_samples` N, N samples evenly spread over the source's order (`heldout_indices`) are held out of the
training set and written as a dataset of their own at OUT/val (schema.HELDOUT_DIR): same codec, statistics and text
encoder, fitted on training samples only. Its ditcore.json is written before the training set's, and both go on
any failure, so a val/ never passes for complete beside an unfinished training set.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dit_prepare.sources import Fitted, Item, Latents, Skip, SourceError
from ditcore import stopping
from ditcore.codecs import Codec, DiffusersVAECodec, LatentStats, PatchPCACodec, PixelCodec, psnr
from ditcore.codecs.text import TextEncoder
from ditcore.data.schema import HELDOUT_DIR, DatasetInfo
from ditcore.data.writer import ShardWriter, finish_dataset, merge_shape_keys, removed_on_failure, start_dataset


@dataclass
class CodecChoice:
    name: str = "pca"  # pca | pixel | vae
    pca_channels: int = 16
    pca_patch: int = 8
    latent_norm: str = "channel"  # channel: each latent channel to std SIGMA_DATA; global: one scale for all
    pixel_factor: int = 2
    vae: str | None = None  # hub id or local folder
    vae_class: str = "AutoencoderKL"

    def spatial_factor(self) -> int:
        """Pixels per latent cell, known before any fitting (sources crop to multiples of it)."""
        if self.name == "pca":
            return self.pca_patch
        if self.name == "pixel":
            return self.pixel_factor
        return self.fixed.spatial_factor

    @functools.cached_property
    def fixed(self) -> Codec:
        """The pixel or VAE codec, built once (a VAE load is not cheap)."""
        if self.name == "pixel":
            return PixelCodec(self.pixel_factor)
        if self.name == "vae":
            return DiffusersVAECodec(self.vae, vae_class=self.vae_class)
        raise ValueError("the PCA codec is fitted, not built")


@dataclass
class Reframed:
    """The samples that framing changed in one way (enlarged, or cut by the crop): how many, the first SHOWN_FILES
    of them, and the one changed most (by `amount`: the scale, or the share cut)."""

    amount: str  # "scale" or "cut", a field of Fitted
    count: int = 0
    files: list = field(default_factory=list)
    most: Fitted | None = None

    def note(self, file: str, fitted: Fitted) -> None:
        self.count += 1
        if len(self.files) < SHOWN_FILES:
            self.files.append(file)
        self._keep_most(fitted)

    def add(self, other: Reframed) -> None:
        """Another rank's (or split's) into these."""
        self.count += other.count
        self.files.extend(other.files[:SHOWN_FILES - len(self.files)])
        if other.most is not None:
            self._keep_most(other.most)

    def _keep_most(self, fitted: Fitted) -> None:
        if self.most is None or getattr(fitted, self.amount) > getattr(self.most, self.amount):
            self.most = fitted

    def listed(self) -> str:
        """The files named, and how many more; the one changed most: WxH → WxH."""
        more = f" and {self.count - len(self.files)} more" if self.count > len(self.files) else ""
        (w, h), (w2, h2) = self.most.before, self.most.after
        return f"{w}x{h} → {w2}x{h2}): {', '.join(self.files)}{more}"


@dataclass
class Summary:
    samples: int = 0
    images: int = 0
    videos: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason → samples
    skipped_files: dict = field(default_factory=dict)  # reason → the first SHOWN_FILES files skipped for it
    latent_shapes: Counter = field(default_factory=Counter)
    shape_keys: dict = field(default_factory=dict)  # latent shape → a few sample keys (ShardWriter.shape_keys)
    seconds: float = 0.0
    fit_psnr: float | None = None
    heldout: int = 0  # samples written to the held-out split
    # what framing did that a user would not expect of their own images (sources.Fitted): both splits'
    upscaled: Reframed = field(default_factory=lambda: Reframed("scale"))
    cropped: Reframed = field(default_factory=lambda: Reframed("cut"))


    def lines(self) -> list[str]:
        rate = self.samples / self.seconds if self.seconds else 0.0
        out = [f"samples   {self.samples} ({self.images} images, {self.videos} clips) in {self.shards} shards, "
               f"{self.bytes / 2**20:.1f} MiB",
               f"time      {self.seconds:.1f} s ({rate:.1f} samples/s)"]
        if self.heldout:
            out.append(f"held out  {self.heldout} samples at {HELDOUT_DIR}/ (a dataset of their own: dit-train's "
                       "held-out loss)")
        if self.fit_psnr is not None:
            out.append(f"codec     round-trip PSNR {self.fit_psnr:.2f} dB on the fitting samples")
        out += self.reframed_lines()
        if not self.skipped:
            out.append("skipped   none")
        for n, (reason, count) in enumerate(self.skipped.most_common()):
            files = self.skipped_files.get(reason, [])
            more = f" and {count - len(files)} more" if count > len(files) else ""
            out.append(f"{'skipped' if n == 0 else '':9} {count} {reason}: {', '.join(files)}{more}")
        return out

    def reframed_lines(self) -> list[str]:
        """A line for the samples that were enlarged (they train blurry) and one for those the centre crop cut."""
        out = []
        if self.upscaled.count:
            out.append(f"upscaled  {self.upscaled.count} samples smaller than their frame, enlarged up to "
                       f"{self.upscaled.most.scale:.3g}x ({self.upscaled.listed()} — they train blurry: use larger "
                       "images or a smaller --size")
        if self.cropped.count:
            hint = " — --fit resize or buckets keeps their aspect" if self.cropped.most.fit == "crop" else ""
            out.append(f"cropped   {self.cropped.count} samples cut to their frame's shape by a centre crop, up to "
                       f"{self.cropped.most.cut:.0%} of a side ({self.cropped.listed()}{hint}")
        return out

    def reframe(self, item: Item | Latents) -> None:
        """Count what framing did to a sample about to be written (nothing, for a source of latents)."""
        fitted = getattr(item, "fitted", None)
        if fitted is None:
            return
        file = item.meta.get("source", item.key)
        if fitted.scale > 1:
            self.upscaled.note(file, fitted)
        if fitted.cut > 0:
            self.cropped.note(file, fitted)

    def skip(self, reason: str, file: str | None) -> None:
        self.skipped[reason] += 1
        shown = self.skipped_files.setdefault(reason, [])
        if file is not None and len(shown) < SHOWN_FILES:
            shown.append(file)

    def add(self, other: Summary) -> None:
        """Another rank's counts into these."""
        self.samples += other.samples
        self.images += other.images
        self.videos += other.videos
        self.bytes += other.bytes
        self.latent_shapes += other.latent_shapes
        self.upscaled.add(other.upscaled)
        self.cropped.add(other.cropped)
        for reason, count in other.skipped.items():
            self.skipped[reason] += count
            shown = self.skipped_files.setdefault(reason, [])
            shown.extend(other.skipped_files.get(reason, [])[:SHOWN_FILES - len(shown)])


SHOWN_FILES = 5  # files named per skip reason in the summary; the rest are counted


def dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _load(source, i: int) -> Item | Skip:
    try:
        return source.load(i)
    except Skip as e:
        return e


def _load_chunk(source, chunk: list[int]) -> list[Item | Skip]:
    return [_load(source, i) for i in chunk]


CHUNK = 4  # samples per task handed to a worker
AHEAD = 4  # tasks queued per worker


def iterate(source, indices, workers: int):
    """(index, Item or Skip) in index order; `workers` processes load/render in parallel. A signal stops it before
    the next sample, or within POLL_S while it waits for one (ditcore.stopping); the workers then finish the sample
    in hand and are joined, so none outlives the command."""
    if workers <= 1:
        for i in indices:
            stopping.check()
            yield i, _load(source, i)
        return
    chunks = iter([indices[k:k + CHUNK] for k in range(0, len(indices), CHUNK)])
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_worker_start)
    try:
        pending = deque((c, pool.submit(_load_chunk, source, c)) for c in itertools.islice(chunks, AHEAD * workers))
        while pending:
            chunk, future = pending.popleft()
            yield from zip(chunk, _result(future), strict=True)
            pending.extend((c, pool.submit(_load_chunk, source, c)) for c in itertools.islice(chunks, 1))
    finally:
        _stop(pool)


def _result(future):
    """The task's result, waited for in slices of POLL_S with a look at the signals between them."""
    while True:
        stopping.check()
        try:
            return future.result(timeout=stopping.POLL_S)
        except TimeoutError:
            pass


WORKERS_STOP_S = 30.0  # how long the workers may take to finish the samples in hand before they are killed


def _stop(pool: ProcessPoolExecutor) -> None:
    """Drop the queued tasks, let the workers finish the ones in hand (a worker killed while it sends a result
    leaves half a message that the executor's thread then waits on for ever, and Python's exit with it) and join
    them; kill any that does not end in WORKERS_STOP_S."""
    workers = list((pool._processes or {}).values())  # no public handle on them before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + WORKERS_STOP_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join()


def _worker_start() -> None:
    """Workers leave Ctrl-C, SIGTERM and a closed terminal (signals a terminal, `timeout` or `docker stop` send the
    whole process group) to the main process, which stops them when it is done with them (no traceback per
    worker, no result cut in half); and a worker whose main process is gone (killed) ends by itself."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def to_tensor(pixels: np.ndarray) -> torch.Tensor:
    """(F, H, W, 3) uint8 → (1, 3, F, H, W) float in [-1, 1].

    Converted to float in NumPy: that copy is needed anyway and is writable, whereas the pixels may be a read-only
    view of a PIL image (np.asarray), which torch.from_numpy would share and warn about."""
    return torch.from_numpy(pixels.astype(np.float32)).permute(3, 0, 1, 2)[None] / 127.5 - 1.0


def fit_codec(choice: CodecChoice, items: list[Item]) -> tuple[Codec, float | None]:
    pixels = [to_tensor(it.pixels) for it in items]
    if choice.name == "pca":
        codec = PatchPCACodec.fit(pixels, patch=choice.pca_patch, channels=choice.pca_channels)
    else:
        codec = choice.fixed
    quality = float(np.mean([psnr(codec.decode(codec.encode(p)), p) for p in pixels[:64]])) if pixels else None
    return codec, quality


HELDOUT_CHOICE = "evenly spread: index (2k+1)·M // 2N of the source's M, for k < N"


def heldout_indices(total: int, n: int) -> list[int]:
    """The source indices held out (HELDOUT_CHOICE): spread over the whole order, so that a source sorted by class
    or folder gives a held-out set of every part of it, and the same for the same source and n."""
    if n and not n < total:
        raise ValueError(f"--val-samples {n} leaves no training samples of the source's {total}: hold out fewer")
    return [(2 * k + 1) * total // (2 * n) for k in range(n)]


def prepare(source, out: Path, *, codec: CodecChoice | None = None, text_encoder: TextEncoder | None = None,
            fit_samples: int = 256, workers: int = 0, shard_size: int = 1000, overwrite: bool = False,
            progress: bool = True, num_classes: int = 0, class_names: list[str] | None = None,
            keep_partial: bool = False, val_samples: int = 0) -> Summary:
    """Write the dataset (and its held-out split of `val_samples` at out/val). On any failure or interrupt the
    partial output is removed unless keep_partial.

    codec and text_encoder: how a source of pixels is encoded (a source of latents needs neither).
    num_classes, class_names: recorded in ditcore.json for a source whose samples carry a "label"."""
    heldout = heldout_indices(len(source), val_samples)  # refused before anything is written
    rank, world = dist_env()
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    created = not Path(out).exists()
    if rank == 0:
        start_dataset(out, overwrite)  # refuses a non-empty folder without overwrite: nothing of the user's is lost
    _barrier(world)
    with removed_on_failure(out, created, keep_partial, rank):
        return _prepare(source, out, codec=codec, text_encoder=text_encoder, fit_samples=fit_samples,
                        workers=workers, shard_size=shard_size, progress=progress, num_classes=num_classes,
                        class_names=list(class_names or []), heldout=heldout)


def _prepare(source, out: Path, *, codec: CodecChoice | None, text_encoder: TextEncoder | None, fit_samples: int,
             workers: int, shard_size: int, progress: bool, num_classes: int, class_names: list[str],
             heldout: list[int]) -> Summary:
    rank, world = dist_env()
    t0 = time.perf_counter()
    summary, val_summary = Summary(), Summary()
    held = set(heldout)
    training = [i for i in range(len(source)) if i not in held]

    # 1. Fit the codec (PCA) and measure latent statistics on the first fit_samples samples. They are kept for
    #    step 2, so no sample is loaded (a video decoded) twice. A source of latents has nothing to fit.
    if getattr(source, "encoded", False):
        loaded, encode, describe = {}, (lambda samples: samples), (lambda out: source.info())
    else:
        loaded, encoder = _fit(source, codec, text_encoder, training[:fit_samples], workers, summary)
        encode, describe = encoder, encoder.info

    # 2. Encode and write this rank's samples (and its share of the held-out ones, into out/val).
    if heldout:
        _write_samples(source, heldout[rank::world], {}, encode, Path(out) / HELDOUT_DIR, rank, world, shard_size,
                       workers, False, val_summary)
    _write_samples(source, training[rank::world], loaded, encode, out, rank, world, shard_size, workers, progress,
                   summary)

    # 3. Every rank done → rank 0 indexes and marks the dataset complete: the held-out split first, so that the
    #    training set is complete only with it.
    totals = _sum_over_ranks(summary, world)
    val_totals = _sum_over_ranks(val_summary, world) if heldout else val_summary
    if rank == 0:
        split = {}
        if heldout:
            _finish(Path(out) / HELDOUT_DIR, describe, val_totals, num_classes, class_names,
                    {"heldout_of": "..", "samples": val_totals.samples, "chosen": HELDOUT_CHOICE})
            split = {"heldout": HELDOUT_DIR, "samples": val_totals.samples, "chosen": HELDOUT_CHOICE}
        _finish(out, describe, totals, num_classes, class_names, split)
    _barrier(world)
    totals.seconds = time.perf_counter() - t0
    totals.fit_psnr = summary.fit_psnr
    totals.heldout = val_totals.samples
    if heldout:  # the summary names the user's reframed images, in whichever split they are
        totals.upscaled.add(val_totals.upscaled)
        totals.cropped.add(val_totals.cropped)
    return totals


def _write_samples(source, mine: list[int], loaded: dict, encode, out: Path, rank: int, world: int,
                   shard_size: int, workers: int, progress: bool, summary: Summary) -> None:
    """Encode and write the samples `mine` of the source into this rank's shards of `out`; `loaded`: those of
    them loaded already (the fitting samples), which are taken from it."""
    Path(out).mkdir(exist_ok=True)
    loaded = {i: it for i, it in loaded.items() if i in set(mine)}  # the fitting samples this rank writes
    # the fitting samples come first in index order (they are the first ones), then the rest are loaded: by a pool,
    # stopped and joined however the loop ends
    rest = contextlib.closing(iterate(source, [i for i in mine if i not in loaded], workers))
    # the bar is closed however the loop ends too, so an error message starts on its own line, not after the bar
    with tqdm(total=len(mine), desc=f"rank {rank} encoding" if world > 1 else "encoding", unit="sample",
              disable=not progress or rank != 0) as bar, ShardWriter(out, rank=rank, max_count=shard_size) as writer, \
            rest as others:
        pending: list[Item | Latents] = []
        for _, item in itertools.chain(((i, loaded.pop(i)) for i in list(loaded)), others):
            stopping.check()  # the fitting samples too, which iterate() does not see again
            bar.update()
            if isinstance(item, Skip):
                summary.skip(str(item), item.file)
                continue
            summary.reframe(item)
            pending.append(item)
            if len(pending) >= 32:
                _write(encode(pending), writer, summary)
                pending = []
        _write(encode(pending), writer, summary)
        summary.bytes, summary.latent_shapes = writer.bytes, writer.latent_shapes
        summary.shape_keys = writer.shape_keys


def _finish(out: Path, describe, totals: Summary, num_classes: int, class_names: list[str], split: dict) -> None:
    info = DatasetInfo(
        **describe(out), num_classes=num_classes, class_names=class_names, split=split,
        counts={"samples": totals.samples, "images": totals.images, "videos": totals.videos,
                "skipped": dict(totals.skipped), "latent_shapes": dict(totals.latent_shapes)},
    )
    info.counts["latent_shape_keys"] = totals.shape_keys  # dit-train names the samples it will skip
    finish_dataset(out, info)
    totals.shards = info.counts["shards"]


def _fit(source, choice: CodecChoice, text_encoder: TextEncoder, indices: list[int], workers: int,
         summary: Summary) -> tuple[dict, Encoder]:
    """The samples `indices` (index → Item or Skip: the first training samples) and the encoder fitted and
    measured on them."""
    loaded = dict(iterate(source, indices, workers))
    fit_items = [it for it in loaded.values() if isinstance(it, Item)]
    if not fit_items:
        raise SourceError(f"none of the first {len(indices)} samples could be read (unreadable "
                          "files or missing captions): nothing to fit the codec on — check the input")
    codec, summary.fit_psnr = fit_codec(choice, fit_items)
    stats = LatentStats.measure(codec.encode(to_tensor(it.pixels)) for it in fit_items)
    if choice.latent_norm == "global":
        stats = stats.pooled()
    return loaded, Encoder(codec, stats, text_encoder)


class CaptionCache:
    """Text states per distinct caption: captions repeat (the synthetic set has a few hundred), encoding doesn't."""

    def __init__(self, encoder: TextEncoder):
        self.encoder, self.states = encoder, {}

    def __call__(self, captions: list[str]) -> list[torch.Tensor]:
        new = list(dict.fromkeys(c for c in captions if c not in self.states))
        if new:
            self.states.update(zip(new, self.encoder.encode(new), strict=True))
        return [self.states[c] for c in captions]


class Encoder:
    """Items → Latents: pixels through the fitted codec and the latent statistics, captions through the text
    encoder."""

    def __init__(self, codec: Codec, stats: LatentStats, text_encoder: TextEncoder):
        self.codec, self.stats, self.text_encoder = codec, stats, text_encoder
        self.texts = CaptionCache(text_encoder)

    def __call__(self, items: list[Item]) -> list[Latents]:
        if not items:
            return []
        samples = []
        for item, text in zip(items, self.texts([it.caption for it in items]), strict=True):
            latent = self.stats.normalize(self.codec.encode(to_tensor(item.pixels)))[0]  # (C, T', H', W')
            frames, height, width = item.pixels.shape[:3]
            meta = {"caption": item.caption, "height": height, "width": width, "frames": frames, "fps": item.fps,
                    **item.meta}
            samples.append(Latents(item.key, latent, text, meta, video=frames > 1))
        return samples

    def info(self, out: Path) -> dict:
        """The DatasetInfo fields that describe the latents; saves the codec (a PCA basis) into `out`."""
        return {"codec": self.codec.save(out), "latent_stats": self.stats.to_dict(),
                "text_encoder": {"name": self.text_encoder.name, "dim": self.text_encoder.dim},
                "latent_channels": self.codec.latent_channels, "spatial_factor": self.codec.spatial_factor,
                "temporal_factor": self.codec.temporal_factor}


def _write(samples: list[Latents], writer: ShardWriter, summary: Summary) -> None:
    for sample in samples:
        writer.write(sample.key, sample.latent, sample.text, sample.meta)
        summary.samples += 1
        if sample.video:
            summary.videos += 1
        else:
            summary.images += 1


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _sum_over_ranks(summary: Summary, world: int) -> Summary:
    if world == 1:
        return summary
    import torch.distributed as dist

    parts = [None] * world
    dist.all_gather_object(parts, summary)
    total = Summary()
    for s in parts:
        total.add(s)
    total.shape_keys = merge_shape_keys(s.shape_keys for s in parts)
    return total
