"""Validation samples: the validation prompts sampled with the EMA weights during and at the end of training,
written one file each and as a contact sheet (prompts x seeds) under RUN_DIR/samples/; the prompts and size as the
dataset gives them (`resolve_validation`: its captions or classes, its image size); and the checks, before the first
step, that the model can sample the validation sizes at all and that the prompts speak of what the dataset shows."""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dit_train.config import FROM_DATASET, TrainConfig
from ditcore import runs
from ditcore.codecs import LatentStats, load_codec
from ditcore.codecs.text import load_text_encoder
from ditcore.data import blend
from ditcore.data.fit import latent_shapes
from ditcore.data.schema import DatasetInfo, shard_metas
from ditcore.errors import ConfigError
from ditcore.media import contact_sheet, write_sample
from ditcore.models import DiTConfig
from ditcore.parallel import ParallelGroups
from ditcore.parallel.pipeline import PipelinedModel
from ditcore.sampling import sample, step_bar, token_grid

MAX_CLASSES = 16  # a class-conditional run validates classes 0..15 at most: one contact sheet that stays readable
CAPTIONS_READ = 2000  # captions read of each dataset (its first samples, shards in name order): a second or two
# words that say nothing of what a picture shows: "a red butterfly" and "a grey stone" share none of the others
STOPWORDS = frozenset(["a", "an", "the", "of", "on", "in", "at", "to", "with", "and", "or", "by", "for", "from", "is",
                       "are", "this", "that", "its"])


@dataclass
class Clip:
    """A validation clip (an mp4 under samples/step-*/)."""

    name: str  # its file's name, without the suffix: 00-a-red-butterfly-8f
    prompt: str
    frames: np.ndarray  # (F, H, W, 3) uint8
    path: Path  # the mp4


@dataclass
class Samples:
    """What one validation made: the files written, and the contact sheet and clips as arrays too, for the loggers
    that show media (dit_train.media_log). Filled on global rank 0; empty on the other ranks, which write nothing."""

    step: int
    paths: list[Path] = field(default_factory=list)
    sheet: np.ndarray | None = None  # (H, W, 3) uint8, as in samples/grid.png
    clips: list[Clip] = field(default_factory=list)


class Validator:
    """Samples the validation prompts with the EMA weights and writes mp4/png under RUN_DIR/samples/: as `network`
    says the network samples (its objective, prediction, DDPM schedule under VP, flow's shift: Recipe.sampling),
    decoding latents normalised by `stats` (the network's: default, the dataset's)."""

    def __init__(self, cfg: TrainConfig, info, model_cfg, fabric, groups: ParallelGroups, network: dict | None = None,
                 stats: LatentStats | None = None):
        self.cfg, self.fabric, self.run_dir = cfg.validation, fabric, Path(cfg.train.run_dir)
        self.network = network or {}  # what ditcore.sampling.sample needs to know of the network (Recipe.sampling)
        self.groups = groups
        self.enabled = info.codec.get("kind") != "none"  # mock data has nothing to decode
        if cfg.validation.prompts == FROM_DATASET or cfg.validation.size is None:
            raise ValueError("Validator takes a config whose validation prompts and size are resolved: "
                             "dit_train.validation.resolve_validation(cfg, info, model_cfg) first")
        if not self.enabled:
            return
        self.codec = load_codec(info.codec, Path(cfg.data.path))
        check_validation(cfg.validation, self.codec, model_cfg)
        self.stats = stats or LatentStats.from_dict(info.latent_stats)
        self.states = self.labels = None
        if model_cfg.text_dim:
            self.states = load_text_encoder(info.text_encoder["name"]).encode(list(self.cfg.prompts))
            # before the first step: samples of what the dataset never shows would say nothing of the training
            if warning := unshared_words(self.cfg.prompts, read_captions(cfg.data.path, info), cfg.data.path):
                fabric.print(warning)
        elif model_cfg.num_classes:  # the prompts are the classes' names (resolve_validation)
            self.labels = class_labels(self.cfg.prompts, info.class_names, model_cfg.num_classes)

    def run(self, model, step: int) -> Samples:
        if not self.enabled:
            return Samples(step)
        v = self.cfg
        calls = v.seeds + (1 if v.clip_frames else 0)  # sample() calls of _sample, v.steps steps each
        with step_bar(calls * v.steps, f"validation samples, step {step}", disable=self.fabric.global_rank != 0,
                      leave=False) as bar:
            return self._sample(model, step, bar)

    def _sample(self, model, step: int, bar) -> Samples:
        """Sample every prompt as an image with `seeds` seeds (and as a clip with the first); write the first seed's
        samples one file each and a contact sheet of the images (prompts × seeds) to the step's folder and to
        samples/grid.png."""
        v = self.cfg
        made, sheet = Samples(step), []
        if self.groups.dims.pp > 1:  # every stage runs the sampler; the hidden states go through the stages
            model = PipelinedModel(model, self.groups)
        for frames in [v.frames] + ([v.clip_frames] if v.clip_frames else []):
            for k in range(v.seeds if frames == v.frames else 1):  # the sheet shows images; one seed of clips
                result = sample(model, self.codec, self.stats, text_states=self.states, class_labels=self.labels,
                                num=len(v.prompts), frames=frames, height=v.size, width=v.size, steps=v.steps,
                                guidance=v.guidance, solver=v.solver, seed=v.seed + k, fps=v.fps,
                                callback=bar, **self.network)
                if self.fabric.global_rank != 0:
                    continue
                if frames == v.frames:
                    sheet.append(result.pixels[:, 0].numpy())  # (prompts, H, W, 3): one column of the sheet
                if k:
                    continue
                for i, (pixels, prompt) in enumerate(zip(result.pixels, v.prompts, strict=False)):
                    slug = "".join(c if c.isalnum() else "-" for c in prompt.lower())[:48].strip("-")
                    name = f"{i:02d}-{slug}" + (f"-{frames}f" if frames > 1 else "")
                    pixels = pixels.numpy()
                    path = write_sample(pixels, runs.samples_dir(self.run_dir, step) / name, fps=v.fps)
                    made.paths.append(path)
                    if frames > 1:
                        made.clips.append(Clip(name, prompt, pixels, path))
        if sheet:
            grid = contact_sheet(np.stack(sheet, 1), list(v.prompts)[:len(sheet[0])],
                                 [f"seed {v.seed + k}" for k in range(v.seeds)])
            for path in (runs.samples_dir(self.run_dir, step) / runs.SHEET, self.run_dir / runs.SAMPLES / runs.SHEET):
                made.paths.append(write_sample(grid[None], path))
            made.sheet = grid
        return made


def check_validation(v, codec, model_cfg: DiTConfig) -> None:
    """Refuse validation sizes the sampler cannot take, before training rather than after its last step (which
    would end the run with no export)."""
    for frames_key in ("frames", "clip_frames"):
        frames = getattr(v, frames_key)
        if not frames:  # clip_frames 0: no clips
            continue
        try:
            token_grid(model_cfg, codec, frames, v.size, v.size)
        except ValueError as e:
            key, value = (f"validation.{frames_key}", frames) if "frames" in str(e) else ("validation.size", v.size)
            raise ConfigError(key, value, f"a size the model can sample: {e}") from None


# --------------------------------------------------------------------------------------------------
# The prompts and size as the dataset gives them


def resolve_validation(cfg: TrainConfig, info: DatasetInfo, model_cfg: DiTConfig) -> TrainConfig:
    """`cfg` with validation.prompts and validation.size resolved from the dataset. Before the run's config is saved,
    so that its config.yaml, the export's prompts (dit-sample's examples) and FID's prompts are the ones sampled.

    size null: the shorter side of the dataset's most common image shape. Prompts: for a class-conditional model,
    the names of the classes sampled (`class_prompts`); otherwise from_dataset draws captions (`draw_captions`)."""
    v, data = cfg.validation, cfg.data.path
    changes = {}
    if v.size is None:
        changes["size"] = dataset_size(info, data)
    if model_cfg.num_classes:
        changes["prompts"] = class_prompts(v.prompts, info.class_names, model_cfg.num_classes)
    elif v.prompts == FROM_DATASET:
        changes["prompts"] = draw_captions(read_captions(data, info), v.dataset_prompts, v.seed, data)
    return cfg.model_copy(update={"validation": v.model_copy(update=changes)})


def dataset_size(info: DatasetInfo, data: str) -> int:
    """Pixels per side of the dataset's most common image shape (its clips' where it has no images), the shorter
    side: a square the model has trained on along both axes."""
    shapes = latent_shapes(info)
    images = {shape: n for shape, n in shapes.items() if shape[1] == 1} or shapes
    if not images:
        raise ConfigError("validation.size", None, f"an integer: dataset {data} records no sample shapes (an "
                                                   "older dit-prepare wrote it) to take the size from")
    (_, _, h, w), _ = max(images.items(), key=lambda item: (item[1], item[0]))  # most samples; ties: the larger
    return min(h, w) * info.spatial_factor


def class_name(label: int, names: list[str]) -> str:
    """Label i's name in the dataset (its class folder's), or "class i" beyond the names it records."""
    return names[label] if label < len(names) else f"class {label}"


def class_prompts(prompts: list[str] | str, names: list[str], num_classes: int) -> list[str]:
    """The names of the classes a class-conditional run validates: those the prompts name, if every one of them
    names a class; else (text prompts, which the model cannot read, or from_dataset) classes 0, 1, ... up to
    MAX_CLASSES."""
    every = [class_name(i, names) for i in range(num_classes)]
    if prompts != FROM_DATASET and all(p in every for p in prompts):
        return list(prompts)
    return every[:MAX_CLASSES]


def class_labels(prompts: list[str], names: list[str], num_classes: int) -> list[int]:
    """The labels of classes named as class_prompts names them."""
    every = {class_name(i, names): i for i in range(num_classes)}
    unknown = [p for p in prompts if p not in every]
    if unknown:
        raise ConfigError("validation.prompts", unknown[0], f"a class name of the dataset ({', '.join(names[:8])}"
                                                            f"{', ...' if len(names) > 8 else ''}) or 'class N'")
    return [every[p] for p in prompts]


def read_captions(data: str, info: DatasetInfo, limit: int = CAPTIONS_READ) -> list[str]:
    """Captions of the first `limit` samples of the dataset (of each dataset of a blend), shards in name order: only
    their json members are read, the latents and text states seeked over. A sample whose json is unreadable has none
    here (the loader skips it as it trains). Read once per process and set of shards (resolve_validation draws the
    prompts from them, the Validator checks the prompts against them)."""
    captions = []
    for _, root, _ in blend.datasets(data, info):
        shards = tuple((str(shard), shard.stat().st_mtime_ns, shard.stat().st_size)
                       for shard in sorted(Path(root).glob("rank*-*.tar")))
        captions += _shard_captions(shards, limit)
    return captions


@functools.lru_cache(maxsize=8)
def _shard_captions(shards: tuple[tuple[str, int, int], ...], limit: int) -> tuple[str, ...]:
    """The captions of the first `limit` samples of these shards (path, mtime, size: a rewritten shard is read
    again)."""
    metas = (meta for path, _, _ in shards for meta in shard_metas(Path(path)))
    captions = []
    for _, meta in zip(range(limit), metas, strict=False):
        caption = meta.get("caption") if isinstance(meta, dict) else None
        if isinstance(caption, str) and caption.strip():
            captions.append(caption.strip())
    return tuple(captions)


def draw_captions(captions: list[str], n: int, seed: int, data: str) -> list[str]:
    """n distinct captions (all of them, if fewer), drawn with `seed`: the same prompts at every run and resume."""
    distinct = list(dict.fromkeys(captions))  # in the dataset's order, so that the draw depends on the seed alone
    if not distinct:
        raise ConfigError("validation.prompts", FROM_DATASET, f"a list of prompts: dataset {data} has no captions "
                                                              "to draw from")
    return random.Random(seed).sample(distinct, min(n, len(distinct)))


def words(text: str) -> set[str]:
    return set(re.findall(r"[^\W_]+", text.lower())) - STOPWORDS


def unshared_words(prompts: list[str], captions: list[str], data: str) -> str | None:
    """A one-line warning when no validation prompt shares a word (but a, the, of, ...) with the captions: samples of
    things the dataset never shows say nothing of how training goes (the demo's butterflies on a dataset of
    circles and squares)."""
    seen = set().union(*map(words, captions)) if captions else set()
    if not captions or any(words(p) & seen for p in prompts):
        return None
    shown = ", ".join(repr(p) for p in prompts[:3]) + (", ..." if len(prompts) > 3 else "")
    return (f"warning: validation.prompts ({shown}) share no word with the captions of {data} (e.g. "
            f"{captions[0]!r}): set validation.prompts=from_dataset, or prompts in the captions' words")
