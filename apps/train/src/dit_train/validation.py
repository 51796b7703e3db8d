"""Validation samples: the validation prompts sampled with the EMA weights during and at the end of training,
written one file each and as a contact sheet (prompts x seeds) under RUN_DIR/samples/; and the check, before the
first step, that the model can sample the validation sizes at all."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dit_train.config import TrainConfig
from ditcore import runs
from ditcore.codecs import LatentStats, load_codec
from ditcore.codecs.text import load_text_encoder
from ditcore.errors import ConfigError
from ditcore.media import contact_sheet, write_sample
from ditcore.models import DiTConfig
from ditcore.parallel import ParallelGroups
from ditcore.parallel.pipeline import PipelinedModel
from ditcore.sampling import sample, step_bar, token_grid


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
        if not self.enabled:
            return
        self.codec = load_codec(info.codec, Path(cfg.data.path))
        check_validation(cfg.validation, self.codec, model_cfg)
        self.stats = stats or LatentStats.from_dict(info.latent_stats)
        self.states = self.labels = None
        if model_cfg.text_dim:
            self.states = load_text_encoder(info.text_encoder["name"]).encode(list(self.cfg.prompts))
        elif model_cfg.num_classes:
            self.labels = list(range(min(model_cfg.num_classes, len(self.cfg.prompts))))

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
