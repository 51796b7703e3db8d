"""Reference statistics (mean and covariance of the features of real images), computed once and cached.

A reference is one of:
- a ditcore dataset folder: its latents decoded by the dataset's own codec, the decoder the samples go through too
  (so FID measures the model, not the codec's reconstruction loss: a lossy codec costs both sides the same). Image
  samples only, of one size (default: the dataset's most common image size); video samples are left out (FID is an
  image figure). Cached as DATA/eval/fid-<features>-<H>x<W>-<n>.safetensors with a JSON of what it is, reused while
  the features, size, count and the dataset's fingerprint match, rebuilt otherwise;
- a blend's folder (ditcore.data.blend): the mixture of its datasets' images by the blend's weights, what training
  draws from — each dataset's statistics as above (decoded with its own latent statistics, cached in its own
  folder), at the first dataset's image size, mixed: μ = Σ w_d μ_d, Σ = Σ w_d (Σ_d + (μ_d − μ)(μ_d − μ)ᵀ);
- a statistics file that ditcore wrote (that .safetensors, its JSON beside it);
- an ADM-style .npz with `mu` and `sigma` (the reference batches of OpenAI's guided-diffusion evaluator, Inception
  pool3 features), read with allow_pickle=False.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ditcore import durable

FORMAT = "ditcore-fid-reference/1"
CACHE_DIR = "eval"
NOMINAL_COUNT = 50_000  # an .npz records mean and covariance only: any count ≥ 2 gives them back exactly


class ReferenceError(ValueError):
    """A reference that cannot be used, with what to pass instead."""


@dataclass
class ReferenceStats:
    mu: torch.Tensor  # (D,) float64
    sigma: torch.Tensor  # (D, D) float64
    n: int
    features: str  # FeatureNet.name
    height: int | None = None  # pixels of the reference images; None where unknown (an .npz)
    width: int | None = None
    source: str = ""
    meta: dict = field(default_factory=dict)  # what a cache is checked against: dataset fingerprint, ...

    @classmethod
    def of_sums(cls, total: torch.Tensor, outer: torch.Tensor, n: int, **kwargs) -> ReferenceStats:
        """From the metric's sums: mean, and the unbiased covariance (divided by n − 1, as torchmetrics does)."""
        mu = total.double().cpu() / n
        sigma = (outer.double().cpu() - n * torch.outer(mu, mu)) / (n - 1)
        return cls(mu, sigma, n, **kwargs)

    def load_into(self, metric, real: bool = True) -> None:
        """Make these the sums of one side of the metric (the reference: real): Σx = n·μ, Σxxᵀ = (n − 1)·Σ + n·μμᵀ,
        what its compute() inverts."""
        side = "real" if real else "fake"
        if self.mu.shape[0] != metric.real_features_sum.shape[0]:
            raise ReferenceError(f"the reference '{self.source}' has {self.mu.shape[0]} features per image, the "
                                 f"feature network gives {metric.real_features_sum.shape[0]}: use a reference made "
                                 "with the same features")
        device = metric.real_features_sum.device
        setattr(metric, f"{side}_features_sum", (self.n * self.mu).to(device))
        setattr(metric, f"{side}_features_cov_sum",
                ((self.n - 1) * self.sigma + self.n * torch.outer(self.mu, self.mu)).to(device))
        setattr(metric, f"{side}_features_num_samples", torch.tensor(self.n, device=device))

    def describe(self) -> dict:
        return {"format": FORMAT, "features": self.features, "height": self.height, "width": self.width,
                "n": self.n, "source": self.source, **self.meta}

    def write(self, path: Path) -> None:
        """The tensors, then the JSON that says what they are, each written to a temporary name, fsynced and renamed:
        a cache is complete or absent (a crash leaves at most a stray temporary file)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        save_file({"mu": self.mu.contiguous(), "sigma": self.sigma.contiguous()}, str(tmp))
        durable.fsync_file(tmp)
        os.replace(tmp, path)
        durable.replace_text(path.with_suffix(".json"), json.dumps(self.describe(), indent=1))

    @classmethod
    def read(cls, path: Path) -> ReferenceStats:
        info = path.with_suffix(".json")
        try:
            meta = json.loads(info.read_text())
            tensors = load_file(str(path))
            mu, sigma = tensors["mu"].double(), tensors["sigma"].double()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError, KeyError) as e:
            raise ReferenceError(f"'{path}' is not a statistics file that ditcore wrote ({type(e).__name__}: {e}) "
                                 f"— it needs mu and sigma and {info.name} beside it; pass a dataset folder to "
                                 "compute them again") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ReferenceError(f"'{info}' does not describe ditcore reference statistics (format "
                                 f"{meta.get('format') if isinstance(meta, dict) else meta!r}, expected {FORMAT})")
        known = {"format", "features", "height", "width", "n", "source"}
        return cls(mu, sigma, int(meta["n"]), meta["features"], meta.get("height"), meta.get("width"),
                   meta.get("source", str(path)), {k: v for k, v in meta.items() if k not in known})


def read_npz(path: Path) -> ReferenceStats:
    """ADM's reference batch: mu (D,) and sigma (D, D) of Inception pool3 features (its images, arr_0, unused)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            mu, sigma = data["mu"], data["sigma"]
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise ReferenceError(f"'{path}' is not an .npz with mu and sigma (as ADM's reference batches): "
                             f"{type(e).__name__}: {e}") from None
    if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
        raise ReferenceError(f"'{path}': mu has shape {mu.shape} and sigma {sigma.shape}: expected (D,) and (D, D)")
    return ReferenceStats(torch.from_numpy(mu).double(), torch.from_numpy(sigma).double(), NOMINAL_COUNT,
                          "inception", source=str(path))


def load_reference(path: str | Path, features: str, **dataset_kwargs) -> ReferenceStats:
    """A dataset folder (dataset_reference: computed or read from its cache), a statistics file or an .npz;
    refused unless its features are `features` (a FeatureNet name)."""
    path = Path(path)
    if not path.exists():
        raise ReferenceError(f"reference '{path}' does not exist — pass a ditcore dataset folder, a statistics "
                             ".safetensors that ditcore wrote, or an ADM-style .npz with mu and sigma")
    if path.is_dir():
        return dataset_reference(path, **dataset_kwargs)
    dataset_kwargs.pop("progress", None)
    if path.suffix == ".npz":
        stats = read_npz(path)
    elif path.suffix == ".safetensors":
        stats = ReferenceStats.read(path)
    else:
        raise ReferenceError(f"reference '{path}' is neither a dataset folder, a .safetensors of statistics nor an "
                             ".npz")
    if stats.features != features and stats.features.split(":")[0] != features.split(":")[0]:
        raise ReferenceError(f"reference '{path}' holds statistics of {stats.features} features, and the score "
                             f"asked for {features} — pass --features {stats.features.split(':')[0]} or another "
                             "reference")
    return stats


def dataset_reference(root: str | Path, *, net, height: int | None = None, width: int | None = None,
                      limit: int | None = None, batch: int = 32, device: str | torch.device = "cpu",
                      progress: Callable[[int], None] | None = None) -> ReferenceStats:
    """The statistics of a dataset's images under `net` (a FeatureNet), from DATA/eval/ when a cache there
    matches, else computed (and cached, where the folder is writable). limit: at most this many images (a blend's:
    of each dataset)."""
    from ditcore.codecs import LatentStats, load_codec
    from ditcore.data.loader import dataset_fingerprint
    from ditcore.data.schema import read_info
    from ditcore.eval.frechet import FrechetDistance
    from ditcore.sampling import to_uint8

    root = Path(root)
    info = read_info(root)  # DatasetError: no dataset there, or an unfinished one
    if info.blend:
        return blend_reference(root, info, net=net, height=height, width=width, limit=limit, batch=batch,
                               device=device, progress=progress)
    if info.codec.get("kind") == "none":
        raise ReferenceError(f"dataset '{root}' holds random latents (dit-prepare mock): there are no images to "
                             "score against — use a dataset of images")
    factor = info.spatial_factor
    size = image_size(root, info, height, width)
    count = _images_of_size(info, size[0] // factor, size[1] // factor)
    n = min(count, limit) if count and limit else (count or limit)
    fingerprint = dataset_fingerprint(root, {})["digest"]
    wanted = {"features": net.name, "height": size[0], "width": size[1], "dataset": fingerprint}
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", net.name)
    cache = root / CACHE_DIR / f"fid-{slug}-{size[0]}x{size[1]}-{n or 'all'}.safetensors"
    if cache.is_file() and cache.with_suffix(".json").is_file():
        try:
            stats = ReferenceStats.read(cache)
            if {k: stats.describe().get(k) for k in wanted} == wanted:
                return stats
        except ReferenceError:
            pass  # unreadable: computed again below and replaced
    codec = load_codec(info.codec, root)
    latent_stats = LatentStats.from_dict(info.latent_stats)
    score = FrechetDistance(net, device=device)
    seen = 0
    for latents in _image_latents(root, size[0] // factor, size[1] // factor, batch, n):
        pixels = codec.decode(latent_stats.denormalize(latents.float()))  # (B, 3, 1, H, W) in [-1, 1]
        score.add(to_uint8(pixels[:, :, 0]), real=True)
        seen += latents.shape[0]
        if progress is not None:
            progress(latents.shape[0])
    if seen < 2:
        raise ReferenceError(f"dataset '{root}' has {seen} image(s) of {size[0]}x{size[1]} pixels: the reference "
                             "needs at least 2 (a covariance) — pass another size or dataset")
    total, outer, _ = score.sums(real=True)
    stats = ReferenceStats.of_sums(total, outer, seen, features=net.name, height=size[0], width=size[1],
                                   source=str(root), meta={"dataset": fingerprint})
    try:
        durable.make_writable_dir(cache.parent)
        stats.write(cache)
    except OSError:
        pass  # a read-only dataset: scored all the same, computed again next time
    return stats


def blend_reference(root: Path, info, *, net, height: int | None = None, width: int | None = None,
                    **kwargs) -> ReferenceStats:
    """A blend's images: the mixture of its datasets' (dataset_reference each, the later ones at the first one's
    size) by their weights. Its count, nominal, is theirs summed (load_into gives μ and Σ back for any count)."""
    from ditcore.data.blend import members

    parts = []
    for member in members(root, info):
        stats = dataset_reference(member.root, net=net, height=height, width=width, **kwargs)
        height, width = stats.height, stats.width
        parts.append((member.weight, stats))
    total = sum(w for w, _ in parts)
    mu = sum(w / total * s.mu for w, s in parts)
    sigma = sum(w / total * (s.sigma + torch.outer(s.mu - mu, s.mu - mu)) for w, s in parts)
    return ReferenceStats(mu, sigma, sum(s.n for _, s in parts), net.name, height, width, source=str(root))


def image_size(root: Path, info, height: int | None, width: int | None) -> tuple[int, int]:
    """(H, W) pixels: the one asked for, else the dataset's most common image size (by dit-prepare's record)."""
    from ditcore.data.fit import latent_shapes

    images = Counter({(h, w): n for (_, t, h, w), n in latent_shapes(info).items() if t == 1})
    if height is not None or width is not None:
        return (height or width, width or height)
    if images:
        h, w = images.most_common(1)[0][0]
        return h * info.spatial_factor, w * info.spatial_factor
    for latents in _image_latents(root, None, None, 1, 1):  # an older dataset without the record: its first image
        return latents.shape[-2] * info.spatial_factor, latents.shape[-1] * info.spatial_factor
    raise ReferenceError(f"dataset '{root}' has no images (only video clips): FID scores images — pass a dataset "
                         "of images as the reference")


def _images_of_size(info, h: int, w: int) -> int | None:
    from ditcore.data.fit import latent_shapes

    shapes = latent_shapes(info)
    return sum(n for (_, t, hh, ww), n in shapes.items() if t == 1 and (hh, ww) == (h, w)) if shapes else None


def _image_latents(root: Path, h: int | None, w: int | None, batch: int, limit: int | None) -> Iterator[torch.Tensor]:
    """Batches (B, C, 1, h, w) of the dataset's image latents of that latent size (None: any), in shard order."""
    from ditcore.data.schema import read_sample, shard_samples

    shards = sorted(json.loads((root / ".nv-meta" / ".info.json").read_text()).get("shard_counts", {}))
    taken, pending = 0, []
    for name in shards:
        for sample in shard_samples(root / name):
            try:
                latent, _, _ = read_sample(sample)
            except ValueError:
                continue  # unreadable: the loader skips it too
            if latent.ndim != 4 or latent.shape[1] != 1 or (h is not None and tuple(latent.shape[-2:]) != (h, w)):
                continue
            pending.append(latent)
            taken += 1
            if len(pending) == batch or taken == limit:
                yield torch.stack(pending)
                pending = []
            if taken == limit:
                return
    if pending:
        yield torch.stack(pending)
